"""Lion, the optimizer added as one file: its update, its flags, its sweeps, its record.

Lion (Chen et al. 2023) moves every coordinate by the learning rate in the
direction of `sign(beta1 * m + (1 - beta1) * g)`, then keeps
`m = beta2 * m + (1 - beta2) * g`; its decoupled weight decay subtracts
`lr * weight_decay * w` from the matrices and embeddings only.
"""

import jax
import numpy as np
import pytest

from helpers.cli import SHORT_FLAGS, TINY_FLAGS, final, refusal, run_cli
from purejax.cli import train
from purejax.optimizers import lion
from purejax.optimizers import optim
from purejax.training.pure import sweep

LION = optim.OptimizerConfig(learning_rate=0.1, schedule="constant",
                             settings=lion.Lion(beta1=0.8, beta2=0.95, weight_decay=0.5))


def reference_lion(params, grads_per_step, lr, beta1, beta2, weight_decay, decays):
  """Lion's paper (Algorithm 2), in numpy, over dicts of arrays."""
  params = {k: np.array(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in params.items()}
  for grads in grads_per_step:
    for k in params:
      g = np.asarray(grads[k], np.float64)
      update = np.sign(beta1 * m[k] + (1 - beta1) * g)
      if decays[k]:
        update = update + weight_decay * params[k]
      params[k] = params[k] - lr * update
      m[k] = beta2 * m[k] + (1 - beta2) * g
  return params


def test_lion_steps_as_its_paper_writes_decaying_only_matrices_and_embeddings():
  key = jax.random.PRNGKey(0)
  params = {"w": jax.random.normal(key, (4, 3)), "b": jax.random.normal(key, (3,))}
  optimizer = optim.make_optimizer(
      LION, decay_mask_fn=lambda p: {"w": True, "b": False})
  state = optimizer.init(params)
  grads_per_step = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.PRNGKey(i),
                                                                   p.shape), params)
                    for i in range(1, 4)]
  ours = params
  for grads in grads_per_step:
    updates, state = optimizer.update(grads, state, ours)
    ours = jax.tree.map(lambda p, u: p + u, ours, updates)
  expected = reference_lion(params, grads_per_step, 0.1, 0.8, 0.95, 0.5,
                            decays={"w": True, "b": False})
  for name in params:
    np.testing.assert_allclose(ours[name], expected[name], rtol=1e-5, atol=1e-6)


def test_lion_is_a_name_a_flat_record_and_a_sweepable_setting():
  assert optim.named("lion").settings == lion.Lion()
  record = optim.to_saved(LION)
  assert (record["lion_beta1"], record["lion_beta2"], record["lion_weight_decay"]) == (
      0.8, 0.95, 0.5)
  assert optim.from_saved(record) == LION
  assert set(optim.hyperparams_used(LION)) == {"learning_rate", "lion_beta1", "lion_beta2",
                                               "lion_weight_decay"}
  runs = sweep.expand(LION, seed=0, grid={"lion_weight_decay": (0.0, 1.0)})
  assert [r.opt_config.settings.weight_decay for r in runs] == [0.0, 1.0]
  assert optim.describe(LION).startswith("lion, lr 0.1, betas 0.8, 0.95, weight decay 0.5")


def test_lion_flags_name_their_optimizer_and_are_refused_without_it(capsys):
  assert refusal(capsys, train, "--lion_weight_decay=1") == (
      "error: --lion_weight_decay has no effect on --optimizer=adamw; add --optimizer=lion "
      "or drop --lion_weight_decay.")
  assert refusal(capsys, train, "--optimizer=lion", "--weight_decay=0.1").startswith(
      "error: --weight_decay has no effect on --optimizer=lion; add --optimizer=adamw")


def test_a_setting_the_optimizer_lacks_is_accepted_at_a_value_that_changes_nothing(capsys):
  # JAX's MNIST recipe passes `--optimizer=sgd --weight_decay=0`: SGD has no decay, and a
  # decay of 0 asks for none. The run goes on to its next check (the layer sizes).
  assert refusal(capsys, train, "--model=mlp", "--optimizer=sgd", "--weight_decay=0",
                 "--layer_sizes=784,x,10") == "error: --layer_sizes must be integers, got " \
      "['784', 'x', '10']."
  assert refusal(capsys, train, "--model=mlp", "--optimizer=sgd", "--weight_decay=0.1") == (
      "error: --weight_decay has no effect on --optimizer=sgd; add --optimizer=adamw or "
      "drop --weight_decay.")


@pytest.mark.slow  # a command line that trains
def test_python_m_train_with_lion_lowers_the_loss(tmp_path):
  text = tmp_path / "plays.txt"
  text.write_text("to be or not to be, that is the question. " * 200)
  process = run_cli(train, *TINY_FLAGS, *SHORT_FLAGS, "--max_iters=40", "--optimizer=lion",
                    "--learning_rate=3e-3", "--lion_weight_decay=0.1", f"--dataset={text}",
                    f"--out_dir={tmp_path / 'run'}")
  first = [float(l.split("val loss ")[1].split()[0]) for l in process.stdout.splitlines()
           if "val loss " in l][0]  # step 0's, the untrained model's
  assert "optimizer: lion, lr 0.003" in process.stdout
  assert final(process)["val_loss"] < first - 0.5, (first, final(process))

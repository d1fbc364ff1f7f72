"""Muon (`--optimizer=muon`): the blocks' hidden matrices orthogonalised layer by
layer, AdamW on the rest, and runs that resume and sweep exactly."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers.cli import TINY_FLAGS, TINY_GPT
from helpers.models import RTOL, TINY
from helpers.runs import newest, step_losses, train_run
from purejax import checkpoint
from purejax import gpt
from purejax import lora
from purejax import mlp
from purejax.cli import train as train_cli
from purejax.optimizers import muon
from purejax.optimizers import optim
from purejax.training.effects import monitor

MUON = optim.from_flat(name="muon", learning_rate=1e-3, schedule="constant",
                             weight_decay=0.1, muon_learning_rate=0.02,
                             muon_weight_decay=0.1)


def random_like(tree, seed):
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for x, k in
                                      zip(leaves, keys)])


def test_a_stacked_weight_is_orthogonalised_one_layer_at_a_time():
  matrices = muon.muon_matrices(learning_rate=1.0, momentum=0.95, weight_decay=0.0)
  stacked = {"w": jnp.zeros((3, 16, 32))}
  grads = random_like(stacked, 0)
  update, _ = jax.jit(matrices.update)(grads, matrices.init(stacked), stacked)
  for layer in range(3):
    alone = {"w": stacked["w"][layer]}
    expected, _ = jax.jit(matrices.update)({"w": grads["w"][layer]}, matrices.init(alone),
                                           alone)
    chex.assert_trees_all_close(update["w"][layer], expected["w"], rtol=1e-5, atol=1e-6)
    # Newton-Schulz leaves every singular value near 1 (0.5-1.5 by design), times
    # sqrt(max(1, out / in)) = sqrt(2); the step descends (-lr).
    singular = np.linalg.svd(-np.asarray(update["w"][layer]) / np.sqrt(2), compute_uv=False)
    assert 0.4 < singular.min() and singular.max() < 1.6, singular


def reference_newton_schulz(x, steps=muon.MUON_NS_STEPS, coeffs="keller"):
  """Keller Jordan's iteration as written (each step's quintic from `coeffs`), on
  each matrix, in float64."""
  x = np.asarray(x, np.float64)
  tall = x.shape[-2] > x.shape[-1]
  x = np.swapaxes(x, -1, -2) if tall else x
  x = x / (np.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-7)
  for a, b, c in muon.ns_coefficients(coeffs, steps):
    gram = x @ np.swapaxes(x, -1, -2)
    x = a * x + (b * gram + c * gram @ gram) @ x
  return np.swapaxes(x, -1, -2) if tall else x


def matrices_with_singular_values(shape, singular, seed=0):
  """`[batch, m, n]` matrices whose singular values are `singular` (`min(m, n)` of them)."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  m = min(shape[1:])
  u = jnp.linalg.qr(jax.random.normal(k1, shape[:2] + shape[1:2]))[0][..., :m]
  v = jnp.linalg.qr(jax.random.normal(k2, shape[:1] + shape[2:] * 2))[0][..., :m]
  return (u * singular) @ jnp.swapaxes(v, 1, 2)


@pytest.mark.parametrize("coeffs", ["keller", "minimax"])
@pytest.mark.parametrize("shape", [(2, 16, 48), (2, 48, 16), (2, 16, 16)])
def test_newton_schulz_is_the_reference_iteration(shape, coeffs):
  # Wide matrices run in the Gram space: the same iteration, to within 3e-4 on
  # singular values from 1e-3 to 1 (the reference's own bf16 runs are 4e-2 off).
  x = matrices_with_singular_values(shape, jnp.logspace(-3, 0, min(shape[1:])))
  quintics = muon.ns_coefficients(coeffs, 5)
  np.testing.assert_allclose(
      jax.jit(functools.partial(muon.newton_schulz, coeffs=quintics))(x),
      reference_newton_schulz(x, coeffs=coeffs), atol=3e-4 if max(shape) >= 2 * 16 else 1e-5)


def test_minimax_quintics_are_their_derivation_and_orthogonalise_in_fewer_steps():
  # The table is the greedy minimax construction's output, to its 4 decimals.
  np.testing.assert_allclose(muon.minimax_coefficients(5, 3e-3), muon.MINIMAX_NS_COEFFS,
                             atol=2e-3)
  # Singular values from 0.006 to 1: from 3.2e-3 to 0.53 after the normalisation.
  x = matrices_with_singular_values((1, 32, 96), jnp.geomspace(0.006, 1, 32), seed=1)
  def ends(coeffs, steps):
    out = muon.newton_schulz(x, steps, coeffs=muon.ns_coefficients(coeffs, steps))
    s = np.linalg.svd(np.asarray(out[0]), compute_uv=False)
    return s.min(), s.max()
  # Within [3e-3, 1], 4 minimax steps reach [0.8, 1.2]; Keller Jordan's quintic
  # needs 5 for [0.68, 1.2], and 4 leave the smallest near 0.44.
  lo, hi = ends("minimax", 4)
  assert 0.79 < lo and hi < 1.21, (lo, hi)
  lo, hi = ends("keller", 5)
  assert 0.67 < lo and hi < 1.21, (lo, hi)
  lo, _ = ends("keller", 4)
  assert lo < 0.45, lo
  # Past the table, the classical quintic holds them near 1.
  lo, hi = ends("minimax", 7)
  assert 0.99 < lo and hi < 1.01, (lo, hi)
  with pytest.raises(ValueError, match="unknown `muon_ns_coeffs` 'polar'"):
    optim.replace(MUON, muon_ns_coeffs="polar")


def test_the_blocks_matrices_take_muon_and_everything_else_adamw():
  config = dataclasses.replace(TINY, bias=True)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  labels = muon.muon_labels(params)
  muon_paths = sorted(".".join(str(k.key) for k in path) for path, label in
                      jax.tree_util.tree_leaves_with_path(labels) if label == "muon")
  assert muon_paths == ["blocks.attn.proj.w", "blocks.attn.qkv.w", "blocks.mlp.fc.w",
                        "blocks.mlp.proj.w"]
  # The AdamW group is AdamW with the run's own numbers (decay on embeddings only).
  optimizer = optim.make_optimizer(MUON)
  grads = random_like(params, 1)
  update, _ = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
  adamw = optax.adamw(MUON.learning_rate, b1=MUON.setting("beta1"), b2=MUON.setting("beta2"),
                      weight_decay=MUON.setting("weight_decay"), mask=optim.decay_mask)
  expected, _ = jax.jit(adamw.update)(grads, adamw.init(params), params)
  rest = lambda tree: jax.tree.map(lambda x, l: x if l == "adamw" else jnp.zeros(()),
                                   tree, labels)
  chex.assert_trees_all_close(rest(update), rest(expected), rtol=1e-6)
  # The Muon group steps at its own rate, on Muon's scale: each of a [16, 48] qkv
  # layer's [16, 16] query, key and value matrices has an orthogonal update, RMS
  # sqrt(1 / 16).
  qkv = update["blocks"]["attn"]["qkv"]["w"][0]
  rms = float(jnp.sqrt(jnp.mean(qkv ** 2)))
  assert 0.5 < rms / (MUON.setting("muon_learning_rate") * np.sqrt(1 / 16)) < 1.5, rms

@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
def test_lora_trains_only_the_adapters_and_their_factors_take_muon():
  params = gpt.init_params(TINY, jax.random.PRNGKey(0))
  adapters = lora.init(params, rank=2, targets=lora.ATTENTION_AND_MLP,
                       key=jax.random.PRNGKey(1))
  trainable = lora.trainable(params, adapters)
  assert set(jax.tree.leaves(muon.muon_labels(adapters))) == {"muon"}
  optimizer = optim.RunOptimizer(MUON, frozen_base=True)()
  grads = random_like(trainable, 2)
  update, _ = jax.jit(optimizer.update)(grads, optimizer.init(trainable), trainable)
  assert all(not jnp.any(u) for u in jax.tree.leaves(update["base"]))
  assert all(jnp.any(u) for u in jax.tree.leaves(update["adapters"]))


def first_muon_update(config, params, grads, name):
  """The Muon group's first update of the `name` weight of the blocks (`attn.qkv`, ...)."""
  optimizer = optim.make_optimizer(config)
  update = jax.jit(optimizer.update)(grads, optimizer.init(params), params)[0]
  group, layer = name.split(".")
  return update["blocks"][group][layer]["w"]


def test_the_number_of_newton_schulz_steps_is_the_configs():
  params = gpt.init_params(TINY, jax.random.PRNGKey(0))
  grads = random_like(params, 3)
  two = optim.replace(MUON, muon_ns_steps=2, muon_weight_decay=0.0)
  # Nesterov's first step is the gradient itself (times 1 + beta, which the
  # orthogonalisation's normalisation removes); the rate and Muon's shape scale follow.
  fc = grads["blocks"]["mlp"]["fc"]["w"]  # [n_layer, 16, 64]
  expected = reference_newton_schulz(fc, steps=2) * (-two.setting("muon_learning_rate") * np.sqrt(4))
  update = lambda config: first_muon_update(config, params, grads, "mlp.fc")
  np.testing.assert_allclose(update(two), expected, atol=1e-5)
  assert not np.allclose(update(optim.replace(two, muon_ns_steps=5)), expected, atol=1e-3)
  with pytest.raises(ValueError, match="`muon_ns_steps` must be an integer >= 1, got 0"):
    optim.replace(MUON, muon_ns_steps=0)


@pytest.mark.parametrize("n_kv_head", [None, 1])
def test_the_fused_qkv_weight_is_orthogonalised_as_its_query_key_and_value(n_kv_head):
  # nanochat's and modded-nanogpt's projections are separate matrices, and Muon
  # orthogonalises each: so does purejax with its fused [d, d + 2 kv] weight.
  config = dataclasses.replace(TINY, n_head=2, n_kv_head=n_kv_head)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  grads = random_like(params, 4)
  g = np.asarray(grads["blocks"]["attn"]["qkv"]["w"])  # [n_layer, 16, 16 + 2 kv]
  kv = (g.shape[-1] - 16) // 2
  opt = optim.replace(MUON, muon_weight_decay=0.0)
  # Each part is square or tall ([16, kv]), so Muon's shape scale is 1.
  parts = np.split(g, (16, 16 + kv), axis=-1)
  expected = np.concatenate([reference_newton_schulz(p) for p in parts], axis=-1)
  np.testing.assert_allclose(first_muon_update(opt, params, grads, "attn.qkv"),
                             -opt.setting("muon_learning_rate") * expected, atol=2e-5)
  # `muon_split_qkv=False`: one [16, 16 + 2 kv] matrix, scaled by sqrt(out / in).
  fused = optim.replace(opt, muon_split_qkv=False)
  expected = reference_newton_schulz(g) * np.sqrt(g.shape[-1] / 16)
  np.testing.assert_allclose(first_muon_update(fused, params, grads, "attn.qkv"),
                             -opt.setting("muon_learning_rate") * expected, atol=2e-5)


def test_queries_wider_than_the_model_are_split_at_their_own_width():
  """A head size apart from the width (Gemma: 4 heads of 256 in a 640-wide model): the
  queries are `n_head * head_size` wide, read from the output projection, and each part
  takes Keller Jordan's scale, sqrt(out / in) for the wide queries."""
  config = dataclasses.replace(TINY, n_head=2, n_kv_head=1, head_size=16)  # q 32, kv 16
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  grads = random_like(params, 4)
  g = np.asarray(grads["blocks"]["attn"]["qkv"]["w"])  # [n_layer, 16, 32 + 2 * 16]
  opt = optim.replace(MUON, muon_weight_decay=0.0)
  q, k, v = np.split(g, (32, 48), axis=-1)
  expected = np.concatenate([reference_newton_schulz(q) * np.sqrt(2),
                             reference_newton_schulz(k), reference_newton_schulz(v)], axis=-1)
  np.testing.assert_allclose(first_muon_update(opt, params, grads, "attn.qkv"),
                             -opt.setting("muon_learning_rate") * expected, atol=2e-5)


def test_the_momentum_warms_up_from_its_start_as_modded_nanogpts():
  grads = [{"w": jnp.full((2, 3), float(t + 1))} for t in range(4)]
  warmed = muon.nesterov_warmed_trace(momentum=0.95, warmup_iters=2, start=0.85)
  state, buffer = warmed.init(grads[0]), 0.0
  for t, g in enumerate(grads):
    update, state = jax.jit(warmed.update)(g, state)
    decay = 0.85 + min(t / 2, 1.0) * (0.95 - 0.85)  # 0.85, 0.90, 0.95, 0.95
    buffer = (t + 1) + decay * buffer
    np.testing.assert_allclose(update["w"], (t + 1) + decay * buffer, rtol=1e-6)
  # Without a warmup, Muon's momentum is optax's Nesterov trace (the state of old runs).
  plain = muon.muon_matrices(learning_rate=1.0, momentum=0.95, weight_decay=0.0)
  assert isinstance(plain.init({"w": jnp.zeros((2, 3))})[0], optax.TraceState)
  with pytest.raises(ValueError, match="`muon_momentum_warmup_iters` must be >= 0"):
    optim.replace(MUON, muon_momentum_warmup_iters=-1)


def test_muon_refuses_a_model_without_blocks():
  params = mlp.init_network_params([4, 8, 2], jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="found no hidden matrices"):
    optim.make_optimizer(MUON).init(params)


# ----------------------------------------------------------------------------
# Runs of the command line, in this process

RUN = [*TINY_FLAGS, "--optimizer=muon", "--max_iters=20", "--eval_interval=10",
       "--log_interval=5", "--steps_per_call=5", "--lr_decay_iters=20",
       "--grad_accum_steps=2"]


def train(out_dir, text_file, *flags):
  code = train_cli.run(["train", *RUN, f"--dataset={text_file}", f"--out_dir={out_dir}",
                        *flags])
  assert code == 0


def final_arrays(out_dir):
  return checkpoint.read(checkpoint.list_checkpoints(str(out_dir))[0][1])[0]


@pytest.mark.slow
def test_a_muon_run_resumes_and_sweeps_bit_identically(tmp_path, text_file, capsys):
  # A sweep of Muon's own numbers: on a CPU each run trains in the program it has
  # alone, so run 0.02 is the run alone, which stops at step 10 and resumes,
  # half way through its momentum warmup.
  # The speedrun recipe's Newton-Schulz: 3 steps of the minimax quintics.
  warmup = ["--muon_momentum_warmup_iters=15", "--muon_ns_steps=3", "--muon_ns_coeffs=minimax"]
  train(tmp_path / "sweep", text_file, "--sweep=muon_learning_rate=0.01,0.02", *warmup)
  train(tmp_path / "resumed", text_file, "--max_iters=10", *warmup)
  assert ("muon (lr 0.02, momentum 0.95, 3 Newton-Schulz steps, minimax quintics, momentum "
          "from 0.85 over 15 steps) on the blocks' matrices") in capsys.readouterr().out
  train(tmp_path / "resumed", text_file, "--resume", *warmup)
  whole = final_arrays(tmp_path / "sweep" / "muon_learning_rate=0.02_seed=0")
  resumed = final_arrays(tmp_path / "resumed")
  assert any("mu" in name for name in whole)  # Muon's momentum is in the checkpoint
  assert sorted(whole) == sorted(resumed)
  for name, value in whole.items():
    np.testing.assert_array_equal(resumed[name], value, err_msg=name)
  evals = [r for r in monitor.read_metrics(tmp_path / "resumed") if r["kind"] == "eval"]
  assert [r["step"] for r in evals] == [0, 10, 20] and all(r["val_bpb"] > 0 for r in evals)


@pytest.mark.budget(25)
@pytest.mark.slow
def test_muon_with_fsdp_and_accumulation_on_two_devices_matches_one(tmp_path, text_file):
  # Each device holds a slice of every matrix along its largest side, the side the
  # Newton-Schulz Gram products X X^T contract over: XLA all-reduces those
  # [n_layer, d, d] partial products instead of gathering the matrices.
  flags = [*TINY_GPT, "--optimizer=muon", f"--dataset={text_file}"]
  train_run(tmp_path / "one", *flags)
  train_run(tmp_path / "two", *flags, "--fsdp", "--grad_accum_steps=2", "--cpu_devices=2",
            num_devices=2)
  np.testing.assert_allclose(step_losses(tmp_path / "two"), step_losses(tmp_path / "one"),
                             rtol=RTOL)
  # The orthogonalisation maps a rounding difference of the gradient's sums to
  # a full-size one of its direction: params agree to 1e-4, not AdamW's 2e-5.
  (two, _), (one, _) = newest(tmp_path / "two"), newest(tmp_path / "one")
  for name, value in one.items():
    if "['params']" in name:
      np.testing.assert_allclose(two[name], value, rtol=1e-4, atol=1e-4, err_msg=name)

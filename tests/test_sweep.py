"""sweep: many runs in one vmapped step, each equal to the run trained alone."""

import dataclasses

import chex
import jax
import numpy as np
import pytest

from purejax import checkpoint
from purejax import gpt
from purejax.data import batches
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.effects import runs as runs_lib
from purejax.training.loops import sweep_loop
from purejax.training.pure import steps
from purejax.training.pure import sweep
from purejax.training.pure.state import TrainState
from helpers.models import TINY, random_tokens, stacked_sweep_state

# Batching the runs' matmuls may add in another order, so a run of a sweep
# equals its solo run to float rounding: after 20 steps (learning rates up to
# 1e-2) losses agree to this relative tolerance, and params to this absolute
# one. Adam divides by sqrt(v), so where a gradient is near zero a rounding
# difference moves that entry by a fraction of the step: 1e-4 is 1 % of one
# step at 1e-2.
LOSS_RTOL = 2e-5
PARAMS_ATOL = 1e-4
BASE = optim.from_flat(learning_rate=1e-2, warmup_iters=2, decay_iters=20, min_lr=1e-4,
                             weight_decay=0.1, grad_clip=1.0, beta2=0.99)


def assert_params_equal_to_rounding(params, solo_params, config: gpt.GPTConfig) -> None:
  """`params` equal `solo_params` within `PARAMS_ATOL`, the keys' bias aside.

  The keys' bias has a zero gradient in exact arithmetic: it adds `q . b` to
  every score of a query, and the softmax ignores a shift shared by all its
  scores. What gradient it gets is rounding, which Adam scales to a step of
  the learning rate's size in whichever direction the rounding fell, so two
  programs that round differently move it apart by whole steps (1.2e-4 on a
  CPU without AVX-512). It is left out of the comparison.
  """
  q_width, k_width = config.n_head * config.head_dim, config.kv_heads * config.head_dim

  def without_key_bias(tree):
    qkv = tree["blocks"]["attn"]["qkv"]
    if "b" not in qkv:
      return tree
    b = np.array(qkv["b"])
    b[..., q_width:q_width + k_width] = 0.0
    attn = {**tree["blocks"]["attn"], "qkv": {**qkv, "b": b}}
    return {**tree, "blocks": {**tree["blocks"], "attn": attn}}

  chex.assert_trees_all_close(without_key_bias(params), without_key_bias(solo_params),
                              atol=PARAMS_ATOL, rtol=0)


def test_parse_grid_and_expand_name_every_run():
  grid = sweep.parse_grid("learning_rate=3e-4,1e-3; weight_decay=0,0.1")
  assert grid == {"learning_rate": (3e-4, 1e-3), "weight_decay": (0.0, 0.1)}
  runs = sweep.expand(BASE, seed=5, grid=grid, num_seeds=2)
  assert len(runs) == 8
  assert runs[0].name == "learning_rate=0.0003_weight_decay=0_seed=5"
  assert [r.seed for r in runs[:2]] == [5, 6]
  assert runs[7].opt_config == optim.replace(BASE, learning_rate=1e-3, weight_decay=0.1)
  assert sweep.expand(BASE, seed=0, grid={}, num_seeds=3)[2].name == "seed=2"


def test_a_runs_name_is_its_settings_so_any_order_of_the_grid_names_the_same_runs():
  forward = sweep.parse_grid("learning_rate=3e-4,1e-3;weight_decay=0,0.1")
  backward = sweep.parse_grid("weight_decay=0.1,0;learning_rate=1e-3,3e-4")
  names = {r.name: r.opt_config for r in sweep.expand(BASE, seed=0, grid=forward)}
  assert {r.name: r.opt_config for r in sweep.expand(BASE, seed=0, grid=backward)} == names
  with pytest.raises(ValueError, match="twice"):
    sweep.expand(BASE, seed=0, grid={"learning_rate": (1e-3, 1e-3)})


def test_a_sweep_resumes_from_the_newest_step_every_run_saved(tmp_path):
  """Killed between its runs' writes of step 30: the first run holds it, the second not."""
  members = [runs_lib.RunConfig(str(tmp_path / name), resume=True) for name in ("a", "b")]
  state = {"w": np.zeros(2)}
  for step in (10, 20, 30):
    checkpoint.save(members[0].out_dir, step, state, {}, keep=4)
  for step in (10, 20):
    checkpoint.save(members[1].out_dir, step, state, {}, keep=4)
  lines = []
  assert sweep_loop.common_step(members[0], members, lines.append) == 20
  assert "a at 30" in lines[0]
  # a run with no checkpoint yet (killed in the first writes): every run starts anew
  empty = runs_lib.RunConfig(str(tmp_path / "c"), resume=True)
  assert sweep_loop.common_step(empty, members + [empty], lines.append) == -1
  # runs that share no step are refused, not restarted
  checkpoint.prune(members[1].out_dir, 1)
  checkpoint.prune(members[0].out_dir, 1)
  checkpoint.save(members[1].out_dir, 40, state, {}, keep=1)
  with pytest.raises(ValueError, match="no step in common"):
    sweep_loop.common_step(members[0], members, lines.append)


def test_a_sweep_folder_of_an_earlier_version_is_found_by_its_settings(tmp_path):
  (tmp_path / "run2_learning_rate=0.001_seed=0").mkdir()
  assert sweep_loop.run_dir(str(tmp_path), "learning_rate=0.001_seed=0").name == (
      "run2_learning_rate=0.001_seed=0")
  assert sweep_loop.run_dir(str(tmp_path), "learning_rate=0.003_seed=0").name == (
      "learning_rate=0.003_seed=0")


@pytest.mark.parametrize("spec, message", [
    ("learning_rate", "is not NAME=V1,V2"),
    ("batch_size=8,16", "cannot be swept"),
    ("learning_rate=fast", "must be numbers"),
    ("learning_rate=1e-3;learning_rate=1e-2", "given twice"),
])
def test_bad_sweeps_are_refused_with_the_fix(spec, message):
  with pytest.raises(ValueError, match=message):
    sweep.parse_grid(spec)


def test_dropout_is_swept_as_a_model_number():
  grid = sweep.parse_grid("dropout=0,0.1;learning_rate=1e-3,3e-3")
  assert grid == {"dropout": (0.0, 0.1), "learning_rate": (1e-3, 3e-3)}
  runs = sweep.expand(BASE, seed=0, grid=grid)
  assert [r.name for r in runs] == [
      "dropout=0_learning_rate=0.001_seed=0", "dropout=0_learning_rate=0.003_seed=0",
      "dropout=0.1_learning_rate=0.001_seed=0", "dropout=0.1_learning_rate=0.003_seed=0"]
  assert runs[3].opt_config == dataclasses.replace(BASE, learning_rate=3e-3)
  hyper = sweep.hyperparams(runs)
  np.testing.assert_allclose(hyper["dropout"], [0.0, 0.0, 0.1, 0.1])
  np.testing.assert_allclose(hyper["learning_rate"], [1e-3, 3e-3, 1e-3, 3e-3])
  # each run's model is the shared config at the run's rate
  config = dataclasses.replace(TINY, dropout=0.3)
  assert runs[2].model_config(config) == dataclasses.replace(TINY, dropout=0.1)
  unswept = sweep.expand(BASE, seed=0, grid={"learning_rate": (1e-3,)})[0]
  assert unswept.model_config(config) is config
  with pytest.raises(ValueError, match="some runs sweep dropout and others do not"):
    sweep.hyperparams(runs[:1] + [unswept])


@pytest.mark.parametrize("value", ["1.0", "-0.1", "1.5"])
def test_a_dropout_outside_0_1_is_refused(value):
  with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got " + value.rstrip(".0")):
    sweep.parse_grid(f"dropout=0.1,{value}")
  with pytest.raises(ValueError, match=r"sweep run dropout=.*_seed=0: dropout must be in"):
    sweep.expand(BASE, seed=0, grid={"dropout": (float(value),)})


def test_a_run_the_optimizer_would_refuse_is_named():
  with pytest.raises(ValueError, match="sweep run learning_rate=1e-05_seed=0: `min_lr`"):
    sweep.expand(BASE, seed=0, grid={"learning_rate": (1e-5,)})


def _solo(config, data, spec, num_steps):
  """The run trained alone, as `purejax.train` trains it."""
  keys = jax.random.split(jax.random.PRNGKey(spec.seed))
  params = gpt.init_params(config, keys[0])
  optimizer = optim.make_optimizer(spec.opt_config)
  state, metrics = steps.train_steps(
      TrainState(params, optimizer.init(params), {"train": keys[1]}),
      batches.DeviceTokens(data), 0, config=config, optimizer=optimizer, batch_size=4,
      num_steps=num_steps, forms=kernels.select("cpu"))
  return state.params, metrics.loss


@pytest.mark.budget(35)
@pytest.mark.slow  # ~10 s each; the full suite runs them
@pytest.mark.parametrize("dropout, sweep_batch", [(0.0, 1), (0.1, 1), (0.1, 0)])
def test_each_run_of_a_sweep_equals_the_run_trained_alone(dropout, sweep_batch):
  """One run at a time inside the program (the CPU's form) or all vmapped at once."""
  config = dataclasses.replace(TINY, dropout=dropout)
  forms = kernels.select("cpu")
  data = random_tokens(jax.random.PRNGKey(0), (600,))
  runs = sweep.expand(BASE, seed=0, grid={"learning_rate": (3e-3, 1e-2),
                                          "weight_decay": (0.0, 0.1)}, num_seeds=1)
  runs = runs[:2] + sweep.expand(BASE, seed=7, grid={"learning_rate": (1e-2,)})  # another seed
  make = optim.RunOptimizer(BASE)
  state = stacked_sweep_state(config, runs, make)
  hyper, tokens = sweep.hyperparams(runs), batches.DeviceTokens(data)
  # 20 steps in two calls, as a loop would run them
  state, first = sweep.train_steps(state, tokens, 0, hyper, config=config,
                                   make_optimizer=make, batch_size=4, num_steps=10,
                                   forms=forms, sweep_batch=sweep_batch)
  state, second = sweep.train_steps(state, tokens, 10, hyper, config=config,
                                    make_optimizer=make, batch_size=4, num_steps=10,
                                    forms=forms, sweep_batch=sweep_batch)
  p = state.params
  losses = np.concatenate([first.loss, second.loss], axis=1)
  chex.assert_shape(losses, (3, 20))
  for i, spec in enumerate(runs):
    solo_params, solo_losses = _solo(config, data, spec, 20)
    np.testing.assert_allclose(losses[i], solo_losses, rtol=LOSS_RTOL)
    assert_params_equal_to_rounding(sweep.unstack(p, i), solo_params, config)
  # the runs really differ (different settings and seeds train differently)
  assert len({round(float(l), 4) for l in losses[:, -1]}) == 3


@pytest.mark.budget(60)
@pytest.mark.slow  # ~1 min: 300 steps, four runs and their solos
def test_vmapped_runs_stay_within_1e_4_of_the_runs_alone_over_300_steps():
  """The README's figure for `--sweep_batch` above 1 (measured: 4.4e-5 on the CPU)."""
  config = dataclasses.replace(TINY, dropout=0.1)
  base = dataclasses.replace(BASE, decay_iters=300)
  data = batches.DeviceTokens(random_tokens(jax.random.PRNGKey(0), (600,)))
  runs = sweep.expand(base, seed=0, grid={"learning_rate": (3e-3, 1e-2),
                                          "weight_decay": (0.0, 0.1)})
  make = optim.RunOptimizer(base)
  state = stacked_sweep_state(config, runs, make)
  _, metrics = sweep.train_steps(state, data, 0, sweep.hyperparams(runs), config=config,
                                 make_optimizer=make, batch_size=4, num_steps=300,
                                 forms=kernels.select("cpu"), sweep_batch=0)
  alone = np.stack([_solo(config, data.ids, spec, 300)[1] for spec in runs])
  np.testing.assert_allclose(metrics.loss, alone, rtol=1e-4)
  assert not np.array_equal(metrics.loss, alone)  # rounding does differ: the figure is real


@pytest.mark.budget(30)
@pytest.mark.slow  # three programs compile
def test_a_sweep_over_dropout_trains_each_run_at_its_rate():
  """Both runs vmapped at once (the GPU's form): the rate is a batched array."""
  data = random_tokens(jax.random.PRNGKey(0), (600,))
  runs = sweep.expand(BASE, seed=3, grid={"dropout": (0.0, 0.2)})
  make = optim.RunOptimizer(BASE)
  state = stacked_sweep_state(TINY, runs, make)
  # the shared config's dropout (0.5) is not the runs': the grid's rates win
  config = dataclasses.replace(TINY, dropout=0.5)
  state, metrics = sweep.train_steps(state, batches.DeviceTokens(data), 0,
                                     sweep.hyperparams(runs), config=config,
                                     make_optimizer=make, batch_size=4, num_steps=20,
                                     forms=kernels.select("cpu"), sweep_batch=0)
  for i, spec in enumerate(runs):
    solo_params, solo_losses = _solo(spec.model_config(config), data, spec, 20)
    np.testing.assert_allclose(metrics.loss[i], solo_losses, rtol=LOSS_RTOL)
    assert_params_equal_to_rounding(sweep.unstack(state.params, i), solo_params, config)
  # the same seed at two rates trains differently
  assert not np.allclose(metrics.loss[0], metrics.loss[1])


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
def test_evaluate_gives_each_runs_own_loss():
  data = random_tokens(jax.random.PRNGKey(0), (300,))
  params = sweep.stack([gpt.init_params(TINY, jax.random.PRNGKey(s)) for s in range(2)])
  keys = sweep.stack([jax.random.PRNGKey(10 + s) for s in range(2)])
  tokens = batches.DeviceTokens(data)
  forms = kernels.select("cpu")
  losses = sweep.evaluate(params, tokens, keys, config=TINY, batch_size=4, num_batches=3,
                          forms=forms)
  for i in range(2):
    alone = steps.evaluate(sweep.unstack(params, i), tokens, keys[i], config=TINY,
                           batch_size=4, num_batches=3, forms=forms)
    np.testing.assert_allclose(losses[i], alone, rtol=LOSS_RTOL)
  assert sweep.best_run(np.array([np.nan, 2.0, 1.5])) == 2


def _tiny_sweep(num_runs):
  runs = sweep.expand(BASE, seed=0, grid={"learning_rate": (3e-3, 1e-2)},
                      num_seeds=(num_runs + 1) // 2)[:num_runs]
  params = sweep.stack([gpt.init_params(TINY, jax.random.PRNGKey(r.seed)) for r in runs])
  make = optim.RunOptimizer(BASE)
  state = TrainState(params, jax.vmap(lambda p: make().init(p))(params),
                     {"train": sweep.stack([jax.random.PRNGKey(9 + r.seed) for r in runs])})
  return state, sweep.hyperparams(runs), make


def test_the_cpu_runs_a_sweep_one_run_at_a_time_and_the_gpu_all_at_once():
  assert sweep.choose_sweep_batch("cpu") == 1
  assert sweep.choose_sweep_batch("gpu") is None
  assert sweep.choose_sweep_batch("cpu", 0) is None  # 0: vmap them all
  assert sweep.choose_sweep_batch("gpu", 2) == 2  # a given number wins
  with pytest.raises(ValueError, match="`sweep_batch` must be None or a non-negative integer"):
    sweep.choose_sweep_batch("cpu", -1)


@pytest.mark.slow  # over 5 s: the full suite runs it
@pytest.mark.budget(25)
def test_how_many_runs_are_vmapped_together_does_not_change_the_sweep():
  tokens = batches.DeviceTokens(random_tokens(jax.random.PRNGKey(0), (300,)))
  results = []
  for sweep_batch in (0, 1, 2):  # all at once; one at a time; pairs and a remainder
    state, hyper, make = _tiny_sweep(3)
    state, metrics = sweep.train_steps(
        state, tokens, 0, hyper, config=TINY, make_optimizer=make, batch_size=4,
        num_steps=3, forms=kernels.select("cpu"), sweep_batch=sweep_batch)
    chex.assert_shape(metrics.loss, (3, 3))
    results.append((state.params, metrics.loss))
  for params, loss in results[1:]:
    np.testing.assert_allclose(loss, results[0][1], rtol=LOSS_RTOL)
    assert_params_equal_to_rounding(params, results[0][0], TINY)


@pytest.mark.slow  # over 5 s: the full suite runs it
def test_one_run_at_a_time_needs_one_runs_scratch_memory():
  """Why the CPU maps the runs: vmapping N runs needs N runs' scratch memory."""
  state, hyper, make = _tiny_sweep(4)
  tokens = batches.DeviceTokens(random_tokens(jax.random.PRNGKey(0), (300,)))

  def scratch(sweep_batch):
    lowered = sweep.train_steps.lower(
        state, tokens, 0, hyper, config=TINY, make_optimizer=make, batch_size=4,
        num_steps=2, forms=kernels.select("cpu"), sweep_batch=sweep_batch)
    return lowered.compile().memory_analysis().temp_size_in_bytes

  assert scratch(1) < scratch(0) / 2

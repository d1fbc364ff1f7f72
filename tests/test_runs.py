"""runs: the run's life as library calls, with explicit arguments (no flags)."""

import signal

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from purejax.training import checkpoint
from purejax.training import optim
from purejax.training import runs


def test_nonfinite_message_names_the_last_good_checkpoint():
  with pytest.raises(runs.NonFiniteLoss, match=r"loss is inf at step 12.*ckpt_000000010.npz, "
                     r"is intact: resume from it with --resume"):
    runs.check_finite(np.array([1.0, 2.0, np.inf]), 10, "out/ckpt_000000010.npz")
  runs.check_finite(np.array([1.0, 2.0]), 10, None)  # finite: no error
  # Skipping only warns.
  runs.check_finite(np.array([np.nan]), 10, None, skip=True)


def test_skip_nonfinite_leaves_params_unchanged_on_a_nan_gradient():
  optimizer = runs.skip_nonfinite_updates(
      optim.make_optimizer(optim.OptimizerConfig(learning_rate=0.1, decay_iters=10)))
  params = {"w": jnp.ones((2, 2))}
  state = optimizer.init(params)
  updates, state = optimizer.update({"w": jnp.full((2, 2), jnp.nan)}, state, params)
  assert bool(jnp.all(optax.apply_updates(params, updates)["w"] == 1.0))
  updates, state = optimizer.update({"w": jnp.ones((2, 2))}, state, params)
  assert bool(jnp.all(optax.apply_updates(params, updates)["w"] < 1.0))  # finite: applied


def test_start_or_resume_refuses_to_overwrite_and_checks_identity(tmp_path):
  template = {"params": {"w": jnp.zeros((2,))}}
  meta = {"model": "m", "config": {"width": 2, "added_later": 0}, "seed": 0}
  fresh = runs.RunConfig(out_dir=str(tmp_path))
  state, step, saved = runs.start_or_resume(fresh, template, meta)
  assert step == 0 and saved == {} and state is template
  old_meta = {"model": "m", "config": {"width": 2}, "seed": 0}  # before a field existed
  runs.save_checkpoint(fresh, 5, {"params": {"w": jnp.ones((2,))}}, old_meta)
  with pytest.raises(ValueError, match="pass --resume"):
    runs.start_or_resume(fresh, template, meta)
  resume = runs.RunConfig(out_dir=str(tmp_path), resume=True)
  with pytest.raises(checkpoint.CheckpointError, match="config"):
    runs.start_or_resume(resume, template, meta)  # the saved config lacks the new field
  state, step, saved = runs.start_or_resume(
      resume, template, meta, saved_defaults={"config": {"added_later": 0}})
  assert step == 5 and float(state["params"]["w"][0]) == 1.0
  with pytest.raises(checkpoint.CheckpointError, match="seed"):
    runs.start_or_resume(resume, template, {**meta, "seed": 1},
                         saved_defaults={"config": {"added_later": 0}})


def test_a_signal_is_noted_until_the_loop_asks():
  runs.catch_stop_signals()
  try:
    assert not runs.stop_requested()
    signal.raise_signal(signal.SIGTERM)  # noted, not fatal
    assert runs.stop_requested()
    with pytest.raises(runs.Interrupted) as e:
      runs.raise_if_stopped(True)
    assert e.value.signum == signal.SIGTERM
  finally:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.parametrize("step, intervals, last, boundary", [
    (0, (250, 50, 250), 2000, 50), (40, (250, 50), 2000, 50), (1990, (250, 50), 2000, 2000),
    (10, (7,), 100, 14)])
def test_next_boundary(step, intervals, last, boundary):
  assert runs.next_boundary(step, intervals, last) == boundary


def test_keep_checkpoints_must_be_positive():
  with pytest.raises(ValueError, match="--keep_checkpoints must be a positive integer"):
    runs.RunConfig(out_dir="x", keep_checkpoints=0)

"""runs: the run's life as library calls, with explicit arguments (no flags)."""

import signal

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from purejax import checkpoint
from purejax.optimizers import optim
from purejax.training.effects import nonfinite
from purejax.training.effects import runs
from purejax.training.effects import signals
from purejax.training.pure.state import TrainState


def test_nonfinite_message_names_the_last_good_checkpoint():
  with pytest.raises(nonfinite.NonFiniteLoss,
                     match=r"loss is inf at step 12.*ckpt_000000010.npz, "
                     r"is intact: resume from it \(`resume`\)"):
    nonfinite.check_finite(np.array([1.0, 2.0, np.inf]), 10, "out/ckpt_000000010.npz")
  nonfinite.check_finite(np.array([1.0, 2.0]), 10, None)  # finite: no error
  # Skipping only warns.
  warnings = []
  nonfinite.check_finite(np.array([np.nan]), 10, None, skip=True, log=warnings.append)
  assert warnings == ["warning: loss is nan at step 10; skipping non-finite updates "
                      "(`skip_nonfinite`)"]


def test_skip_nonfinite_leaves_params_unchanged_on_a_nan_gradient():
  optimizer = optim.skip_nonfinite_updates(
      optim.make_optimizer(optim.OptimizerConfig(learning_rate=0.1, decay_iters=10)))
  params = {"w": jnp.ones((2, 2))}
  state = optimizer.init(params)
  updates, state = optimizer.update({"w": jnp.full((2, 2), jnp.nan)}, state, params)
  assert bool(jnp.all(optax.apply_updates(params, updates)["w"] == 1.0))
  updates, state = optimizer.update({"w": jnp.ones((2, 2))}, state, params)
  assert bool(jnp.all(optax.apply_updates(params, updates)["w"] < 1.0))  # finite: applied


def test_start_or_resume_refuses_to_overwrite_and_checks_identity(tmp_path):
  template = TrainState({"w": jnp.zeros((2,))}, (), {"train": jnp.zeros((2,), jnp.uint32)})
  meta = {"model": "m", "config": {"width": 2, "added_later": 0}, "seed": 0}
  fresh = runs.RunConfig(out_dir=str(tmp_path))
  state, step, saved = runs.start_or_resume(fresh, template, meta)
  assert step == 0 and saved == {} and state is template
  old_meta = {"model": "m", "config": {"width": 2}, "seed": 0}  # before a field existed
  runs.save_checkpoint(fresh, 5, template._replace(params={"w": jnp.ones((2,))}), old_meta)
  with pytest.raises(ValueError, match="pass `resume=True`"):
    runs.start_or_resume(fresh, template, meta)
  resume = runs.RunConfig(out_dir=str(tmp_path), resume=True)
  with pytest.raises(checkpoint.CheckpointError, match="config"):
    runs.start_or_resume(resume, template, meta)  # the saved config lacks the new field
  state, step, saved = runs.start_or_resume(
      resume, template, meta, saved_defaults={"config": {"added_later": 0}})
  assert step == 5 and float(state.params["w"][0]) == 1.0
  with pytest.raises(checkpoint.CheckpointError, match="seed"):
    runs.start_or_resume(resume, template, {**meta, "seed": 1},
                         saved_defaults={"config": {"added_later": 0}})


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_an_optimizer_saved_before_a_field_existed_resumes_as_it_trained(tmp_path, name):
  # Muon runs saved before `muon_split_qkv` orthogonalised qkv as one matrix, which
  # is no longer the default: they resume only as that; AdamW's never read it.
  template = TrainState({"w": jnp.zeros((2,))}, (), {"train": jnp.zeros((2,), jnp.uint32)})
  asked = optim.to_saved(optim.named(name))
  # the record of that version: no muon_split_qkv, muon_ns_coeffs, nor Lion's settings
  old = {k: v for k, v in asked.items()
         if k not in ("muon_split_qkv", "muon_ns_coeffs") and not k.startswith("lion_")}
  runs.save_checkpoint(runs.RunConfig(out_dir=str(tmp_path)), 5, template, {"optimizer": old})
  resume = runs.RunConfig(out_dir=str(tmp_path), resume=True)
  if name == "muon":
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.muon_split_qkv=False, this "
                       "run has optimizer.muon_split_qkv=True"):
      runs.start_or_resume(resume, template, {"optimizer": asked})
    asked = {**asked, "muon_split_qkv": False}
  _, step, saved = runs.start_or_resume(resume, template, {"optimizer": asked})
  assert step == 5 and optim.from_saved(saved["optimizer"]) == optim.from_saved(asked)


def test_a_record_holds_its_own_optimizer_and_an_older_one_with_every_optimizer_resumes(
    tmp_path):
  # Earlier versions recorded every registered optimizer's settings (the others at their
  # defaults); a checkpoint now records its own optimizer's, and either resumes.
  config = optim.named("lion", learning_rate=0.01)
  asked = optim.to_saved(config)
  assert set(asked) == set(optim.SHARED_FIELDS) | set(optim.settings_names("lion"))
  older = {**optim.all_settings(), **asked}
  assert "muon_ns_steps" in older and "beta2" in older
  template = TrainState({"w": jnp.zeros((2,))}, (), {"train": jnp.zeros((2,), jnp.uint32)})
  runs.save_checkpoint(runs.RunConfig(out_dir=str(tmp_path)), 3, template, {"optimizer": older})
  resume = runs.RunConfig(out_dir=str(tmp_path), resume=True)
  _, step, saved = runs.start_or_resume(resume, template, {"optimizer": asked})
  assert step == 3 and optim.from_saved(saved["optimizer"]) == config
  # A setting of its own that differs is still refused.
  changed = optim.to_saved(optim.replace(config, lion_beta2=0.9))
  with pytest.raises(checkpoint.CheckpointError, match="optimizer.lion_beta2=0.99, this run "
                     "has optimizer.lion_beta2=0.9"):
    runs.start_or_resume(resume, template, {"optimizer": changed})


def test_a_signal_is_noted_until_the_loop_asks_and_handlers_are_restored():
  before = signal.getsignal(signal.SIGTERM)
  with signals.StopSignals() as stop_signals:
    assert not stop_signals.stop_requested()
    signal.raise_signal(signal.SIGTERM)  # noted, not fatal
    assert stop_signals.stop_requested()
    with pytest.raises(signals.Interrupted) as e:
      stop_signals.raise_if(True)
    assert e.value.signum == signal.SIGTERM
  assert signal.getsignal(signal.SIGTERM) is before


def test_checkpoints_of_earlier_versions_restore_into_a_train_state(tmp_path):
  # Before TrainState, the MLP's state was {"params", "opt_state", "data_key"}.
  params, key = {"w": jnp.arange(3.0)}, jnp.array([0, 7], jnp.uint32)
  meta = {"model": "mlp", "seed": 0}
  checkpoint.save(str(tmp_path), 4, {"params": params, "opt_state": (), "data_key": key},
                  meta)
  template = TrainState({"w": jnp.zeros(3)}, (), {"data": jnp.zeros(2, jnp.uint32)})
  state, step, _ = runs.start_or_resume(runs.RunConfig(str(tmp_path), resume=True),
                                        template, meta, identity=("model",))
  assert step == 4 and isinstance(state, TrainState)
  np.testing.assert_array_equal(state.params["w"], [0.0, 1.0, 2.0])
  np.testing.assert_array_equal(state.keys["data"], [0, 7])


@pytest.mark.parametrize("step, intervals, last, boundary", [
    (0, (250, 50, 250), 2000, 50), (40, (250, 50), 2000, 50), (1990, (250, 50), 2000, 2000),
    (10, (7,), 100, 14)])
def test_next_boundary(step, intervals, last, boundary):
  assert runs.next_boundary(step, intervals, last) == boundary


def test_keep_checkpoints_must_be_positive():
  with pytest.raises(ValueError, match="`RunConfig.keep_checkpoints` must be a positive integer"):
    runs.RunConfig(out_dir="x", keep_checkpoints=0)

"""Exact resume: a run killed at any moment and resumed ends bit-identical.

A run that is killed or signalled is `python -m purejax.train` in a subprocess
on a tiny GPT, as a user's run would be killed. Checkpoint writes are held open
for a moment (tests/slow_writes.py runs the CLI so) so kills can land inside
them. Runs with no kill in their story (the references, resumes, refusals) run
the command line in-process (`run_cli`).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers.cli import run_cli
from helpers.data import REPO_ROOT, require_test_data, tinyshakespeare_dir
from helpers.suite import built_once
from purejax import checkpoint
from purejax.cli import train as train_cli

pytestmark = pytest.mark.slow

MANIFEST = checkpoint._MANIFEST  # pylint: disable=protected-access
SLOW_WRITES = REPO_ROOT / "tests" / "slow_writes.py"

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4",
        "--max_iters=60", "--warmup_iters=5", "--eval_interval=20", "--eval_iters=2",
        "--log_interval=10", "--steps_per_call=5", "--checkpoint_every=10",
        "--sample_tokens=0", "--dropout=0.1"]


@pytest.fixture(scope="session")
def data_flags(tfds_data_dir):
  text_dir = tinyshakespeare_dir()
  return [f"--tfds_manual_dir={text_dir}", f"--tfds_data_dir={tfds_data_dir}"]


def train(*args, write_delay):
  """`python -m purejax.train args` in a subprocess, each write held open `write_delay` s."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO_ROOT))
  return subprocess.Popen(
      [sys.executable, str(SLOW_WRITES), str(write_delay), *args], cwd=REPO_ROOT, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start(out_dir, data_flags, *extra, write_delay=0.5):
  return train(*TINY, *data_flags, f"--out_dir={out_dir}", *extra, write_delay=write_delay)


def finish(process, timeout=600):
  out, err = process.communicate(timeout=timeout)
  return process.returncode, out, err


def run_here(out_dir, data_flags, *extra):
  """The run in this process, for runs that are not killed: (exit code, stdout, stderr)."""
  done = run_cli(train_cli, *TINY, *data_flags, f"--out_dir={out_dir}", *extra)
  return done.returncode, done.stdout, done.stderr


def wait_for(predicate, process, timeout=300):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert process.poll() is None, "the run ended before the kill point"
    assert time.monotonic() < deadline, "timed out waiting for the kill point"
    time.sleep(0.02)


def final_arrays(out_dir):
  steps = checkpoint.list_checkpoints(str(out_dir))
  assert steps and steps[0][0] == 60, steps
  return checkpoint.read(steps[0][1])[0]


@pytest.fixture(scope="session")
def uninterrupted(data_flags):
  """The final arrays of the run that nothing stops, trained once per test run."""

  def train_through(folder):
    code, out, err = run_here(folder, data_flags)
    assert code == 0, err[-2000:]

  return final_arrays(built_once("uninterrupted", train_through))


def assert_bit_identical(a, b):
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def has_checkpoint(out_dir, step):
  return lambda: checkpoint.checkpoint_path(str(out_dir), step).exists()


def writing(out_dir):
  return lambda: any(p.name.endswith(".tmp") for p in pathlib.Path(out_dir).iterdir())


@pytest.mark.parametrize("kill_point", ["before_any_checkpoint", "between_checkpoints",
                                        "during_a_checkpoint_write"])
@pytest.mark.budget(25)
def test_sigkill_then_resume_is_bit_identical(tmp_path, data_flags, uninterrupted,
                                              kill_point):
  out_dir = tmp_path / "run"
  process = start(out_dir, data_flags)
  if kill_point == "before_any_checkpoint":
    wait_for(lambda: out_dir.exists(), process)
  elif kill_point == "between_checkpoints":
    wait_for(has_checkpoint(out_dir, 10), process)
  else:
    wait_for(has_checkpoint(out_dir, 20), process)
    wait_for(writing(out_dir), process)  # the write of step 30 is under way
  process.send_signal(signal.SIGKILL)
  process.wait()
  if kill_point == "during_a_checkpoint_write":
    # The interrupted write left only a temp file; the newest valid checkpoint is 20.
    assert checkpoint.list_checkpoints(str(out_dir))[0][0] == 20
  code, out, err = run_here(out_dir, data_flags, "--resume")
  assert code == 0, err[-2000:]
  assert_bit_identical(final_arrays(out_dir), uninterrupted)


@pytest.mark.budget(25)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_and_exits_cleanly_then_resumes(tmp_path, data_flags, uninterrupted,
                                                     signum):
  out_dir = tmp_path / "run"
  process = start(out_dir, data_flags)
  wait_for(has_checkpoint(out_dir, 10), process)
  process.send_signal(signum)
  code, out, err = finish(process)
  assert code == 128 + signum, err[-2000:]
  assert f"stopped by {signal.Signals(signum).name}" in out
  stopped_at = checkpoint.list_checkpoints(str(out_dir))[0][0]
  assert 10 <= stopped_at <= 60
  code, out, err = run_here(out_dir, data_flags, "--resume")
  assert code == 0, err[-2000:]
  assert "resumed from" in out and f"at step {stopped_at}" in out
  assert_bit_identical(final_arrays(out_dir), uninterrupted)


@pytest.mark.budget(25)
def test_resume_skips_a_corrupted_newest_checkpoint(tmp_path, data_flags, uninterrupted):
  out_dir = tmp_path / "run"
  process = start(out_dir, data_flags)
  wait_for(has_checkpoint(out_dir, 20), process)
  process.send_signal(signal.SIGKILL)
  process.wait()
  newest = checkpoint.list_checkpoints(str(out_dir))[0][1]
  newest.write_bytes(newest.read_bytes()[:100])  # truncate it
  code, out, err = run_here(out_dir, data_flags, "--resume")
  assert code == 0, err[-2000:]
  assert "warning: skipping" in out and newest.name in out
  assert_bit_identical(final_arrays(out_dir), uninterrupted)


def test_resume_with_other_flags_is_refused(tmp_path, data_flags):
  out_dir = tmp_path / "run"
  code, _, err = run_here(out_dir, data_flags, "--max_iters=10")
  assert code == 0, err[-2000:]
  code, _, err = run_here(out_dir, data_flags, "--max_iters=10", "--n_embd=32", "--resume")
  assert code == 1 and "resume with the original settings" in err
  code, _, err = run_here(out_dir, data_flags, "--max_iters=10")
  assert code == 1 and "pass --resume" in err  # never silently overwrites a run


def test_checkpoint_from_before_a_new_config_field_resumes(tmp_path, data_flags):
  # A checkpoint's config may lack a field added since (it was trained with
  # the field's default) or hold execution options that configs held before
  # they moved to kernels.Forms; both still resume.
  out_dir = tmp_path / "run"
  decay = "--lr_decay_iters=30"  # the schedule must not change with --max_iters
  code, _, err = run_here(out_dir, data_flags, "--max_iters=10", decay)
  assert code == 0, err[-2000:]
  path = checkpoint.list_checkpoints(str(out_dir))[0][1]
  with np.load(path) as npz:
    payload = {name: npz[name] for name in npz.files}
  manifest = json.loads(payload[MANIFEST].tobytes().decode())
  del manifest["meta"]["config"]["param_dtype"]
  manifest["meta"]["config"].update(remat="auto", attn_block=32, attention="auto",
                                    scan_layers=True)
  payload[MANIFEST] = np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8)
  with open(path, "wb") as f:
    np.savez(f, **payload)
  code, out, err = run_here(out_dir, data_flags, "--max_iters=20", decay, "--resume")
  assert code == 0, err[-2000:]
  assert "resumed from" in out
  code, _, err = run_here(out_dir, data_flags, "--max_iters=30", decay, "--resume",
                          "--dtype=bfloat16")
  assert code == 1 and "compute_dtype" in err  # the model's math still has to match


def resumed_with(out_dir, data_flags, forms_flags, *extra):
  """A run to step 60 that changes its forms at step 30."""
  schedule = "--lr_decay_iters=60"  # as the 60-step runs resolve it
  code, _, err = run_here(out_dir, data_flags, "--max_iters=30", schedule, *extra)
  assert code == 0, err[-2000:]
  code, out, err = run_here(out_dir, data_flags, "--resume", *forms_flags, *extra)
  assert code == 0, err[-2000:]
  assert "resumed from" in out
  return final_arrays(out_dir)


@pytest.mark.xla_defaults  # XLA's older CPU emitters give other bits unrolled
def test_resume_with_unrolled_layers_is_bit_identical(tmp_path, data_flags, uninterrupted):
  # Forms are how the model runs, not what it computes: not part of the run's
  # identity. Unrolling the scanned layers changes no float operation.
  assert_bit_identical(resumed_with(tmp_path / "run", data_flags, ["--scan_layers=false"]),
                       uninterrupted)


def test_resume_with_other_remat_and_attention_continues_the_run(tmp_path, data_flags):
  # Another remat policy and attention form reorder float32 sums, so the
  # run continues to within rounding (30 AdamW steps: 1e-6). Without
  # dropout: the blocked form draws its attention masks per query block.
  no_dropout = "--dropout=0"
  whole = tmp_path / "whole"
  code, _, err = run_here(whole, data_flags, no_dropout)
  assert code == 0, err[-2000:]
  resumed = resumed_with(tmp_path / "run", data_flags, ["--remat=full", "--attention=plain"],
                         no_dropout)
  reference = final_arrays(whole)
  assert sorted(resumed) == sorted(reference)
  for name in reference:
    np.testing.assert_allclose(resumed[name], reference[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_nonfinite_loss_stops_and_names_the_step(tmp_path, data_flags):
  out_dir = tmp_path / "run"
  code, _, err = run_here(out_dir, data_flags, "--learning_rate=1e30", "--grad_clip=0")
  assert code == 2, err[-2000:]
  assert "loss is nan at step" in err and "no checkpoint was saved" in err
  assert "Traceback" not in err
  assert not checkpoint.list_checkpoints(str(out_dir))


MLP_FLAGS = ["--model=mlp", "--layer_sizes=784,32,10", "--epochs=4", "--batch_size=256"]


@pytest.mark.budget(45)
def test_mlp_sigkill_then_resume_is_bit_identical(tmp_path, tfds_data_dir):
  mnist_dir = require_test_data("mnist")
  flags = MLP_FLAGS + [f"--tfds_manual_dir={mnist_dir}", f"--tfds_data_dir={tfds_data_dir}"]
  whole = tmp_path / "whole"
  done = run_cli(train_cli, *flags, f"--out_dir={whole}")
  assert done.returncode == 0, done.stderr[-2000:]
  killed = tmp_path / "killed"
  process = train(*flags, f"--out_dir={killed}", write_delay=0.5)
  wait_for(has_checkpoint(killed, 2), process)
  process.send_signal(signal.SIGKILL)
  process.wait()
  done = run_cli(train_cli, *flags, f"--out_dir={killed}", "--resume")
  assert done.returncode == 0, done.stderr[-2000:]
  assert "resumed from" in done.stdout
  a = checkpoint.read(checkpoint.checkpoint_path(str(whole), 4))[0]
  b = checkpoint.read(checkpoint.checkpoint_path(str(killed), 4))[0]
  assert_bit_identical(a, b)

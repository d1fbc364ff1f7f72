"""A sweep, and a LoRA fine-tune, killed at any moment and resumed end bit-identical.

The runs that are killed are `python -m purejax.train` subprocesses on a tiny
GPT with every checkpoint write held open a moment (tests/slow_writes.py), so
that a SIGKILL can land between the runs' writes of one step, or inside one.
What needs no process of its own (the references, the last resume, refusals)
runs the command line in-process (`run_cli`).
"""

import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers.cli import TINY_FLAGS, final, one_line_error, run_cli
from helpers.data import CHAR_GPT_TEXT, REPO_ROOT
from helpers.suite import built_once
from purejax import checkpoint
from purejax.cli import train as train_cli

pytestmark = pytest.mark.slow

SLOW_WRITES = REPO_ROOT / "tests" / "slow_writes.py"
STEPS = ["--max_iters=60", "--eval_interval=20", "--log_interval=5", "--steps_per_call=5",
         "--checkpoint_every=5", "--dropout=0.1"]
SWEEP = ["--sweep=learning_rate=1e-3,3e-3"]
RUNS = ["learning_rate=0.001_seed=0", "learning_rate=0.003_seed=0"]


def train(*args, write_delay):
  """`python -m purejax.train args` in a subprocess, each write held open `write_delay` s."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO_ROOT))
  return subprocess.Popen([sys.executable, str(SLOW_WRITES), str(write_delay), *args],
                          cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def wait_for(predicate, process, timeout=300):
  """Waits until `predicate()`; False if the process ended first."""
  deadline = time.monotonic() + timeout
  while not predicate():
    if process.poll() is not None:
      return False
    assert time.monotonic() < deadline, "timed out waiting for the kill point"
    time.sleep(0.01)
  return True


def kill(process):
  process.send_signal(signal.SIGKILL)
  process.communicate()


def newest(run_dir):
  found = checkpoint.list_checkpoints(str(run_dir))
  return found[0][0] if found else 0


def writing(run_dir):
  return lambda: pathlib.Path(run_dir).is_dir() and any(
      p.name.endswith(".tmp") for p in pathlib.Path(run_dir).iterdir())


def final_arrays(run_dir, step=60):
  found = checkpoint.list_checkpoints(str(run_dir))
  assert found and found[0][0] == step, found
  return checkpoint.read(found[0][1])[0]


def assert_bit_identical(a, b):
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(scope="session")
def args(tmp_path_factory):
  text = tmp_path_factory.mktemp("sweep_text") / "plays.txt"
  text.write_text(CHAR_GPT_TEXT)
  return [*TINY_FLAGS, *STEPS, f"--dataset={text}"]


@pytest.fixture(scope="session")
def uninterrupted_sweep(args):
  """The sweep's runs' final arrays, the sweep trained once per test run (`built_once`)."""
  out_dir = built_once("uninterrupted_sweep", lambda folder: final(
      run_cli(train_cli, *args, *SWEEP, f"--out_dir={folder / 'sweep'}"))) / "sweep"
  return {name: final_arrays(out_dir / name) for name in RUNS}


@pytest.mark.budget(25)
def test_a_sweep_killed_between_its_runs_writes_resumes_bit_identically(
    tmp_path, args, uninterrupted_sweep):
  out_dir = tmp_path / "sweep"
  first, second = (out_dir / name for name in RUNS)
  process = train(*args, *SWEEP, f"--out_dir={out_dir}", write_delay=0.5)
  # the first run has saved step 20, the second's write of it is under way
  assert wait_for(lambda: newest(first) == 20 and writing(second)(), process)
  kill(process)
  assert (newest(first), newest(second)) == (20, 15)  # 15: the step both runs hold
  resumed = run_cli(train_cli, *args, *SWEEP, f"--out_dir={out_dir}", "--resume")
  final(resumed)
  assert "from step 15, the newest all of them saved" in resumed.stdout
  for name in RUNS:
    assert_bit_identical(final_arrays(out_dir / name), uninterrupted_sweep[name])


def kill_loop(command, run_dirs, kills, seed):
  """Runs `command` (then with `--resume`) killing it `kills` times at random moments, every
  other kill inside a checkpoint write, of each run in turn; then lets it finish (in-process).
  Returns how many kills landed."""
  rng = random.Random(seed)
  resume, landed = [], 0
  for k in range(kills):
    process = train(*command, *resume, write_delay=0.2)
    resume = ["--resume"]
    before = max(newest(d) for d in run_dirs)
    if k % 2:  # inside a write: of each run in turn, at any of its moments
      target = run_dirs[(k // 2) % len(run_dirs)]
      ready = wait_for(writing(target), process)
      time.sleep(rng.uniform(0, 0.15))
    else:  # anywhere after some progress: mid-step, between writes
      ready = wait_for(lambda: max(newest(d) for d in run_dirs) > before, process)
      time.sleep(rng.uniform(0, 0.4))
    if not ready or process.poll() is not None:
      break  # it finished before this kill
    kill(process)
    landed += 1
  final(run_cli(train_cli, *command, *resume))
  return landed


@pytest.mark.budget(60)
def test_a_sweep_killed_six_times_at_random_ends_bit_identical(tmp_path, args,
                                                               uninterrupted_sweep):
  # Six kills: three anywhere after progress, three inside a write (the first
  # run's, the second's, the first's again).
  out_dir = tmp_path / "sweep"
  assert kill_loop([*args, *SWEEP, f"--out_dir={out_dir}"], [out_dir / n for n in RUNS],
                   kills=6, seed=0) == 6
  for name in RUNS:
    assert_bit_identical(final_arrays(out_dir / name), uninterrupted_sweep[name])


LORA = ["--lora_rank=2", "--lora_alpha=4", "--learning_rate=1e-2"]


@pytest.fixture(scope="session")
def lora_args(args, char_gpt_run):
  """A fine-tune of the shared char GPT (its architecture comes from its weights)."""
  dataset = [a for a in args if a.startswith("--dataset=")]
  return ["--batch_size=4", "--eval_iters=2", "--sample_tokens=0", "--warmup_iters=2", *STEPS,
          *LORA, *dataset, f"--init_from={char_gpt_run}"]


@pytest.mark.budget(40)
def test_a_lora_run_killed_six_times_at_random_ends_bit_identical(tmp_path, lora_args):
  alone = tmp_path / "alone"
  final(run_cli(train_cli, *lora_args, f"--out_dir={alone}"))
  killed = tmp_path / "killed"
  assert kill_loop([*lora_args, f"--out_dir={killed}"], [killed], kills=6, seed=1) == 6
  assert_bit_identical(final_arrays(killed), final_arrays(alone))


@pytest.mark.parametrize("changed, named", [
    ("--lora_alpha=8", "lora.alpha=4.0, this run has lora.alpha=8.0"),
    ("--lora_rank=4", "lora.rank=2, this run has lora.rank=4"),
    ("--lora_targets=*attn*", "lora.targets="),
])
def test_a_lora_run_resumed_with_other_adapters_is_refused(tmp_path, lora_args, changed,
                                                           named):
  short = [*lora_args, "--max_iters=5", f"--out_dir={tmp_path}"]
  final(run_cli(train_cli, *short))
  one_line_error(run_cli(train_cli, *short, changed, "--resume"), named,
                 "resume with the original settings")


def test_a_sweep_resumes_with_its_grid_in_any_order_and_refuses_another(tmp_path, text_file):
  args = [*TINY_FLAGS, "--max_iters=5", "--eval_interval=5", "--steps_per_call=5",
          f"--dataset={text_file}", f"--out_dir={tmp_path}"]
  final(run_cli(train_cli, *args, "--sweep=learning_rate=1e-3,3e-3;dropout=0,0.1"))
  assert {p.name for p in tmp_path.iterdir() if p.is_dir()} == {
      f"dropout={d}_learning_rate={lr}_seed=0" for d in ("0", "0.1") for lr in ("0.001", "0.003")}
  resumed = final(run_cli(train_cli, *args, "--max_iters=10", "--resume",
                             "--sweep=dropout=0.1,0;learning_rate=3e-3,1e-3"))
  assert [r["step"] for r in resumed["runs"]] == [10] * 4
  assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 4  # the same runs went on
  one_line_error(run_cli(train_cli, *args, "--max_iters=15", "--resume",
                            "--sweep=dropout=0,0.1;learning_rate=1e-3,1e-2"),
                 "adds dropout=0.1_learning_rate=0.01_seed=0", "drops", "another --out_dir")

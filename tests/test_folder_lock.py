"""One writer per run folder (`training.effects.folder_lock`): a second writer is
refused before it touches anything; a killed holder never blocks."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

from helpers.cli import TINY_FLAGS, final, one_line_error, run_cli
from helpers.data import REPO_ROOT, need
from purejax import _files
from purejax import checkpoint
from purejax.cli import train
from purejax.training.effects import folder_lock

# Holds the run lock of each folder named, says so, then waits to be killed.
HOLDER = """
import sys, time
from purejax.training.effects import folder_lock
with folder_lock.hold(sys.argv[1:], log=lambda line: None):
  print("held", flush=True)
  time.sleep(600)
"""


@pytest.fixture
def holder():
  """Starts a process that holds the lock of the folders given."""
  started = []

  def start(*folders):
    process = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, folders)],
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    started.append(process)
    return process

  yield start
  for process in started:
    process.kill()
    process.wait()


def test_the_lock_file_names_its_holder_and_nests_in_one_process(tmp_path):
  with folder_lock.hold(str(tmp_path)):
    record = json.loads((tmp_path / folder_lock.RUN_LOCK).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with folder_lock.hold([str(tmp_path)]):  # the loop inside the command line
      assert folder_lock.holds(str(tmp_path))
    assert folder_lock.holds(str(tmp_path))
  assert not folder_lock.holds(str(tmp_path))
  assert not (tmp_path / folder_lock.RUN_LOCK).exists()  # removed as it let go


def test_a_second_process_is_refused_naming_the_holder(tmp_path, holder):
  first = holder(tmp_path)
  with pytest.raises(folder_lock.FolderBusy, match=rf"process {first.pid} on .* pass another "
                                                   rf"`out_dir`"):
    with folder_lock.hold(str(tmp_path)):
      pass
  assert not folder_lock.holds(str(tmp_path))


def test_no_folder_is_held_when_one_of_several_is_busy(tmp_path, holder):
  free, busy = tmp_path / "a", tmp_path / "b"
  holder(busy)
  with pytest.raises(folder_lock.FolderBusy):
    with folder_lock.hold([str(free), str(busy)]):
      pass
  assert not folder_lock.holds(str(free))


def test_a_killed_holder_never_blocks(tmp_path, holder):
  first = holder(tmp_path)
  first.send_signal(signal.SIGKILL)
  first.wait()
  with folder_lock.hold(str(tmp_path)):  # at once: the OS ended the lock with the process
    assert json.loads((tmp_path / folder_lock.RUN_LOCK).read_text())["pid"] == os.getpid()


def test_taking_the_lock_removes_what_killed_writers_left(tmp_path):
  process = subprocess.Popen([sys.executable, "-c", "pass"])
  process.wait()
  left = tmp_path / f".ckpt_20.npz.{_files._host_tag()}-{process.pid}-abc123.tmp"
  left.write_bytes(b"half a checkpoint")
  lines = []
  with folder_lock.hold(str(tmp_path), log=lines.append):
    assert not left.exists()
  assert lines == [f"removed {left.name}, left by a writer that was killed"]


def snapshot(folder: pathlib.Path) -> dict:
  return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.slow
@pytest.mark.budget(30)
def test_a_second_trainer_is_refused_and_a_kill_then_resume_works(tmp_path, text_file):
  out_dir = tmp_path / "run"
  flags = [*TINY_FLAGS, "--max_iters=60", "--eval_interval=10", "--log_interval=5",
           "--steps_per_call=5", f"--dataset={text_file}", f"--out_dir={out_dir}"]
  first = subprocess.Popen([sys.executable, "-m", "purejax.train", *flags], cwd=REPO_ROOT,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    while not checkpoint.list_checkpoints(str(out_dir)):
      assert first.poll() is None, "the first trainer ended before its first checkpoint"
    first.send_signal(signal.SIGSTOP)  # frozen: the folder changes only if the second writes
    before = snapshot(out_dir)
    one_line_error(run_cli(train, *flags, "--resume"),
                   f"is being written by process {first.pid}", "pass another --out_dir")
    assert snapshot(out_dir) == before  # its checkpoints and metrics untouched
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait()
  metrics = final(run_cli(train, *flags, "--resume"))  # at once after the kill
  assert metrics["step"] == 60


@pytest.mark.slow
def test_a_sweep_is_refused_while_one_of_its_runs_trains_alone(tmp_path, text_file, holder):
  run_name = "learning_rate=0.01_seed=0"
  holder(tmp_path / run_name)
  one_line_error(run_cli(train, *TINY_FLAGS, "--max_iters=5", f"--dataset={text_file}",
                         f"--out_dir={tmp_path}", "--sweep=learning_rate=1e-3,1e-2"),
                 f"{tmp_path / run_name} is being written by process")
  assert not list(tmp_path.glob("*/ckpt_*")) and not (tmp_path / "sweep.json").exists()


@pytest.mark.slow
def test_a_busy_folder_is_refused_before_a_wandb_run_starts_in_it(tmp_path, text_file, holder,
                                                                   monkeypatch):
  # The loop takes the lock as the run starts; the W&B run (which writes into
  # out_dir/wandb) is made only once the folder is held.
  need("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  out = tmp_path / "run"
  first = holder(out)
  one_line_error(run_cli(train, *TINY_FLAGS, "--max_iters=5", f"--dataset={text_file}",
                         f"--out_dir={out}", "--wandb_log"),
                 f"is being written by process {first.pid}")
  assert sorted(p.name for p in out.iterdir()) == [folder_lock.RUN_LOCK]

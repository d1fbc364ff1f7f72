"""Running the command lines as a user would, in this process or in another, and reading
what they printed and wrote (metrics, TensorBoard, W&B)."""

import contextlib
import io
import json
import os
import pathlib
import re
import struct
import subprocess
import sys
import time
import types
from helpers.data import REPO_ROOT




def run_module(module: str, *args: str, timeout: float = 900,
               env: dict = None) -> subprocess.CompletedProcess:
  """Runs `python -m module args...` as a user would; returns the finished process.

  `env` adds to (or overrides) this process's environment.
  """
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
  process = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                           text=True, timeout=timeout, cwd=REPO_ROOT, env=env)
  process.stderr = without_cuda_probe_lines(process.stderr)
  return process


# Where CUDA's packages are installed without a GPU (CI installs JAX's CUDA plugin
# and ptxas for the compiled-GPU-program tests), TensorFlow's import logs that it
# found no driver, before its log level applies. That is the environment's line,
# not purejax's: the tests of what purejax prints leave it out.
CUDA_PROBE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written "
    r"to STDERR|I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers "
    r"on your machine, GPU will not be used\.)\n?", re.M)


def without_cuda_probe_lines(stderr: str) -> str:
  return CUDA_PROBE.sub("", stderr)


def run_cli(command, *argv: str) -> subprocess.CompletedProcess:
  """Runs a command line (`purejax.cli.<name>`, e.g. `train`) in this process with
  `argv`, as `python -m` runs it: its exit code and what it printed.

  For runs whose story needs no process of their own (no kill or signal, no
  other device count, no hidden module): the interpreter, JAX and the
  compiled programs are already here, so a tiny run takes a second or two
  instead of a process's start. `run_module` runs the few true end-to-end ones.
  """
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = command.run([command.__name__, *argv])
  return subprocess.CompletedProcess([command.__name__, *argv], code, out.getvalue(),
                                     err.getvalue())


def final(process):
  """The metrics a finished `purejax.train` printed last (`final {...}`)."""
  assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-3000:]
  line = [l for l in process.stdout.splitlines() if l.startswith("final ")][-1]
  return json.loads(line[len("final "):])


def one_line_error(process, *fragments):
  """Asserts the process stopped with exit 1 and one `error: ` line holding `fragments`."""
  assert process.returncode == 1, process.stdout[-1000:] + process.stderr[-2000:]
  assert "Traceback" not in process.stderr
  error = [l for l in process.stderr.splitlines() if l.startswith("error: ")]
  assert len(error) == 1, process.stderr[-2000:]
  for fragment in fragments:
    assert fragment in error[0], error[0]


def refusal(capsys, command, *argv: str) -> str:
  """The one `error: ` line a command line (`purejax.cli.<name>`) printed when it
  refused `argv` in-process, with exit code 1 and nothing else on stderr."""
  capsys.readouterr()  # what the test printed before is not the command line's
  code = command.run([command.__name__, *argv])
  out, err = capsys.readouterr()
  assert code == 1, out[-1000:] + err[-2000:]
  lines = err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
  return lines[0]


def tensorboard_scalars(out_dir) -> dict:
  """`{tag: [(step, value)]}` as TensorBoard's own reader shows `out_dir`.

  TensorBoard reads event files through TensorFlow where TensorFlow is
  installed (a 10 s import) and through its bundled stand-in otherwise. A
  module named `tensorboard.compat.notf` is TensorBoard's own switch to the
  stand-in (its `no_tensorflow` build); the reader, restarts included, is the same.
  """
  sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  accumulator = event_accumulator.EventAccumulator(str(out_dir))
  accumulator.Reload()
  return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
          for tag in accumulator.Tags()["scalars"]}


def _wandb_records(path: pathlib.Path):
  """The whole protobuf `Record`s of a `.wandb` file so far (a record still being written
  is left out).

  The file is a short header then LevelDB's log format (32 KiB blocks of
  records: crc32 (4), length (2), type (1), data), each record one protobuf
  `Record`.
  """
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  data, pos, pending, records = path.read_bytes(), 7, b"", []
  block = 32768
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if length == 0 and kind == 0 or pos + 7 + length > len(data):
      break
    pending += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # a whole record, or the last piece of one
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      pending = b""
      records.append(record)
  return records


def read_wandb_offline_history(out_dir: pathlib.Path, timeout: float = 120.0):
  """The history rows of the offline W&B run under `out_dir/wandb`, without wandb's API.

  wandb's own process writes the file, and may still be writing it when
  the run's `finish()` has returned; this waits (up to `timeout` seconds,
  then fails) for the run's last record, its `exit`, so a loaded machine
  reads the whole run rather than a prefix of it.
  """
  deadline, records = time.monotonic() + timeout, []
  while True:
    paths = list(pathlib.Path(out_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(paths) <= 1, paths
    records = _wandb_records(paths[0]) if paths else []
    if any(r.WhichOneof("record_type") == "exit" for r in records):
      break
    assert time.monotonic() < deadline, (
        f"the offline W&B run under {out_dir} has no exit record after {timeout} s: "
        f"{paths}, {[r.WhichOneof('record_type') for r in records]}")
    time.sleep(0.1)
  return [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
           for item in r.history.item}
          for r in records if r.WhichOneof("record_type") == "history"]


# Flags of tiny `purejax.train` runs: a 1-layer model, and a short schedule.
TINY_FLAGS = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4",
              "--eval_iters=2", "--sample_tokens=0", "--warmup_iters=2"]


SHORT_FLAGS = ["--max_iters=20", "--eval_interval=10", "--log_interval=5", "--steps_per_call=5"]


# A 2-layer run of 20 steps that logs every step's loss and checkpoints at 10.
TINY_GPT = ["--n_layer=2", "--n_head=4", "--n_embd=32", "--block_size=16",
            "--batch_size=8", "--max_iters=20", "--lr_decay_iters=20", "--warmup_iters=5",
            "--eval_interval=10", "--eval_iters=2", "--log_interval=1",
            "--steps_per_call=5", "--checkpoint_every=10", "--sample_tokens=0"]

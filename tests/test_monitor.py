"""monitor, progress and flops: metrics.jsonl, TensorBoard scalars, the progress bar and MFU.

The crash and terminal tests run small scripts (tests/monitor_worker.py) in
subprocesses: one is SIGKILLed while it writes, one runs under a
pseudo-terminal and under a pipe.
"""

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import time
import types

import pytest

from helpers.cli import tensorboard_scalars
from helpers.data import REPO_ROOT, need
from purejax.training.effects import monitor
from purejax.training.effects import progress as progress_lib
from purejax.training.pure import flops as flops_lib

WORKER = REPO_ROOT / "tests" / "monitor_worker.py"


class FakeClock:
  """Wall time that moves only when a test says so."""

  def __init__(self, now=1000.0):
    self.now = now

  def __call__(self):
    return self.now


def lines_of(out_dir):
  return (out_dir / "metrics.jsonl").read_text().splitlines()


# ----------------------------------------------------------------------------
# metrics.jsonl


def test_every_log_and_eval_point_is_one_json_line(tmp_path):
  clock = FakeClock()
  with monitor.Monitor(tmp_path, clock=clock, tensorboard=False) as mon:
    clock.now += 1.5
    mon.log_train(10, loss=2.5, lr=1e-3, grad_norm=0.75, tokens_per_s=12345.6, mfu=None)
    clock.now += 1.0
    mon.log_eval(10, train_loss=2.4, val_loss=2.6)
  assert [json.loads(line) for line in lines_of(tmp_path)] == [
      # mfu=None (an unknown device) is left out.
      {"step": 10, "time": 1.5, "kind": "train", "loss": 2.5, "lr": 1e-3, "grad_norm": 0.75,
       "tokens_per_s": 12345.6},
      {"step": 10, "time": 2.5, "kind": "eval", "train_loss": 2.4, "val_loss": 2.6},
  ]
  assert monitor.read_metrics(tmp_path) == monitor.read_metrics(tmp_path / "metrics.jsonl")


def test_numpy_and_jax_scalars_are_written_as_numbers_and_nan_as_null(tmp_path):
  np = pytest.importorskip("numpy")
  jnp = pytest.importorskip("jax.numpy")
  with monitor.Monitor(tmp_path, tensorboard=False) as mon:
    record = mon.log_train(1, loss=jnp.float32(0.5), tokens=np.int64(4096),
                           skipped=np.bool_(False), lr=float("nan"), grad_norm=float("inf"))
  assert record["loss"] == 0.5 and record["tokens"] == 4096 and record["skipped"] is False
  # Strict JSON has no NaN/Infinity: the line must parse without Python's extensions.
  line = lines_of(tmp_path)[0]
  assert json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}")) == {
      "step": 1, "time": record["time"], "kind": "train", "loss": 0.5, "tokens": 4096,
      "skipped": False, "lr": None, "grad_norm": None}


def test_a_truncated_last_line_is_dropped_when_the_run_resumes(tmp_path):
  with monitor.Monitor(tmp_path, tensorboard=False) as mon:
    for step in (10, 20, 30):
      mon.log_train(step, loss=1.0)
  # A kill in the middle of writing the next line leaves half of it.
  half_line = b'{"step": 40, "time": 1.0, "ki'
  with open(tmp_path / "metrics.jsonl", "ab") as f:
    f.write(half_line)

  warnings = []
  with monitor.Monitor(tmp_path, resume_step=30, tensorboard=False, log=warnings.append) as mon:
    mon.log_train(40, loss=0.5)
  assert [json.loads(line)["step"] for line in lines_of(tmp_path)] == [10, 20, 30, 40]
  assert warnings == [f"warning: dropped 1 incomplete or unreadable line(s) from "
                      f"{tmp_path / 'metrics.jsonl'} (a run killed while writing)"]


def test_resume_drops_later_steps_and_the_run_continues_without_duplicates(tmp_path):
  clock = FakeClock()
  # The first attempt logs steps 10 to 50 and is killed; the newest checkpoint
  # that restores is the one at step 20.
  with monitor.Monitor(tmp_path, clock=clock, tensorboard=False) as mon:
    for step in (10, 20, 30, 40, 50):
      clock.now += 10
      mon.log_train(step, loss=1.0 / step)
      if step % 20 == 0:
        mon.log_eval(step, val_loss=2.0 / step)

  clock.now += 3600  # the run is down for an hour: not training time
  warnings = []
  with monitor.Monitor(tmp_path, resume_step=20, clock=clock, tensorboard=False,
                       log=warnings.append) as mon:
    assert mon.metrics.last_step == {"train": 20, "eval": 20}
    # The loop must not evaluate step 20 again: its record was kept.
    with pytest.raises(ValueError, match="eval step 20 is not after the last eval step 20"):
      mon.log_eval(20, val_loss=0.1)
    for step in (30, 40):
      clock.now += 10
      mon.log_train(step, loss=1.0 / step)
    mon.log_eval(40, val_loss=2.0 / 40)

  assert warnings == [f"warning: dropped 4 record(s) after step 20 from "
                      f"{tmp_path / 'metrics.jsonl'}; the run resumes from step 20"]
  records = monitor.read_metrics(tmp_path)
  train = [r for r in records if r["kind"] == "train"]
  evals = [r for r in records if r["kind"] == "eval"]
  assert [r["step"] for r in train] == [10, 20, 30, 40]
  assert [r["step"] for r in evals] == [20, 40]
  # Time continues from the last kept record (20 s at step 20), without the downtime.
  assert [r["time"] for r in train] == [10.0, 20.0, 30.0, 40.0]
  assert not list(tmp_path.glob("*.tmp")), "the atomic rewrite left its temp file"


def test_a_fresh_run_replaces_an_old_runs_file(tmp_path):
  with monitor.Monitor(tmp_path, tensorboard=False) as mon:
    mon.log_train(100, loss=1.0)
  warnings = []
  with monitor.Monitor(tmp_path, tensorboard=False, log=warnings.append) as mon:
    mon.log_train(1, loss=3.0)
  assert [r["step"] for r in monitor.read_metrics(tmp_path)] == [1]
  assert len(warnings) == 1 and "replacing" in warnings[0]


def test_steps_must_increase_and_names_are_checked(tmp_path):
  with monitor.Monitor(tmp_path, tensorboard=False) as mon:
    mon.log_train(5, loss=1.0)
    mon.log_eval(5, val_loss=1.0)  # train and eval count separately
    with pytest.raises(ValueError, match="train step 5 is not after"):
      mon.log_train(5, loss=1.0)
    with pytest.raises(ValueError, match="reserved"):
      mon.log_train(6, time=1.0)
    with pytest.raises(TypeError, match="metric loss=.* is not a number"):
      mon.log_train(6, loss=[1.0, 2.0])
  assert len(lines_of(tmp_path)) == 2


def test_a_sigkill_while_writing_leaves_only_complete_valid_lines(tmp_path):
  # Started from a pipe so we know when 100 lines are in; killed a moment later,
  # most likely inside one of its 16 KiB writes.
  writer = subprocess.Popen([sys.executable, str(WORKER), "metrics", str(tmp_path)],
                            stdout=subprocess.PIPE, cwd=REPO_ROOT)
  try:
    assert writer.stdout.readline() == b"ready\n"
    time.sleep(0.02)  # let it run on in its loop
  finally:
    writer.send_signal(signal.SIGKILL)
    writer.wait()
  data = (tmp_path / "metrics.jsonl").read_bytes()
  *complete, tail = data.split(b"\n")
  assert len(complete) >= 100
  steps = [json.loads(line)["step"] for line in complete]  # each one parses
  assert steps == list(range(len(steps)))
  # The reader skips a line cut short (if the kill landed in a write); a
  # resumed run drops it and appends after the last complete line.
  assert [r["step"] for r in monitor.read_metrics(tmp_path)] == steps
  with monitor.Monitor(tmp_path, resume_step=steps[-1], tensorboard=False, log=print) as mon:
    mon.log_train(steps[-1] + 1, loss=0.0)
  assert [r["step"] for r in monitor.read_metrics(tmp_path)] == steps + [steps[-1] + 1]
  assert (tmp_path / "metrics.jsonl").read_bytes().startswith(b"\n".join(complete))
  print(f"killed after {len(steps)} lines; {len(tail)} bytes of a partial line")


def test_disabled_monitor_writes_nothing(tmp_path):
  with monitor.Monitor(tmp_path / "run", enabled=False) as mon:
    record = mon.log_train(1, loss=2.0)
    mon.log_eval(1, val_loss=2.0)
  assert record["loss"] == 2.0 and record["kind"] == "train"
  assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------
# TensorBoard


def read_tensorboard(out_dir):
  need("tensorboard")
  return tensorboard_scalars(out_dir)


def test_tensorboard_gets_the_same_scalars(tmp_path):
  with monitor.Monitor(tmp_path) as mon:
    assert mon.scalars is not None, "tensorboardX should be installed"
    for step in (10, 20):
      mon.log_train(step, loss=3.0 / step, lr=1e-3 * step, grad_norm=0.5, tokens_per_s=9000.0,
                    mfu=0.25, note="text is not a scalar")
    mon.log_eval(20, train_loss=0.125, val_loss=0.25)
  scalars = read_tensorboard(tmp_path)
  assert sorted(scalars) == ["eval/train_loss", "eval/val_loss", "train/grad_norm", "train/loss",
                             "train/lr", "train/mfu", "train/tokens_per_s"]
  # Event files store float32.
  assert scalars["train/loss"] == [(10, pytest.approx(0.3)), (20, pytest.approx(0.15))]
  assert scalars["train/lr"] == [(10, pytest.approx(0.01)), (20, pytest.approx(0.02))]
  assert scalars["train/tokens_per_s"] == [(10, 9000.0), (20, 9000.0)]
  assert scalars["eval/val_loss"] == [(20, 0.25)]
  assert scalars["eval/train_loss"] == [(20, 0.125)]


def test_tensorboard_hides_the_steps_a_resumed_run_redoes(tmp_path):
  need("tensorboard")  # the restart logic is TensorBoard's reader's
  with monitor.Monitor(tmp_path) as mon:
    for step in (10, 20, 30):
      mon.log_train(step, loss=1.0)
  with monitor.Monitor(tmp_path, resume_step=10) as mon:
    for step in (20, 30, 40):
      mon.log_train(step, loss=0.5)
  assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
  assert read_tensorboard(tmp_path)["train/loss"] == [(10, 1.0), (20, 0.5), (30, 0.5), (40, 0.5)]
  # A fresh run in the same directory hides the old run entirely.
  with monitor.Monitor(tmp_path) as mon:
    mon.log_train(5, loss=2.0)
  assert read_tensorboard(tmp_path)["train/loss"] == [(5, 2.0)]


def test_without_tensorboardx_one_warning_and_metrics_still_written(tmp_path, monkeypatch):
  def missing():
    raise ModuleNotFoundError("No module named 'tensorboardX'")
  monkeypatch.setattr(monitor, "_import_tensorboardx", missing)
  warnings = []
  with monitor.Monitor(tmp_path, log=warnings.append) as mon:
    mon.log_train(1, loss=1.0)
  assert warnings == ["warning: no TensorBoard files: tensorboardX failed to import "
                      "(ModuleNotFoundError: No module named 'tensorboardX'); "
                      "pip install tensorboardX"]
  assert len(monitor.read_metrics(tmp_path)) == 1
  assert not list(tmp_path.glob("events.*"))


@pytest.mark.slow  # a subprocess or a long one; the full suite runs it
def test_importing_tensorboardx_does_not_import_torch():
  # torch (if installed) costs seconds to import; tensorboardX would pull it in.
  code = ("import sys; from purejax.training.effects import monitor; monitor._import_tensorboardx(); "
          "print('torch' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=REPO_ROOT, check=True).stdout
  assert out == "False\n"


# ----------------------------------------------------------------------------
# Progress bar


def run_under_terminal(args, columns=100):
  """Runs `args` with stdout and stderr on a pseudo-terminal; returns what it printed."""
  leader, follower = os.openpty()
  # A real terminal has a size; tqdm fits the bar to it.
  fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
  # Keep "\n" as is (a terminal sends "\r\n"), so any "\r" seen is the bar's.
  attributes = termios.tcgetattr(follower)
  attributes[1] &= ~termios.ONLCR
  termios.tcsetattr(follower, termios.TCSANOW, attributes)
  child = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, cwd=REPO_ROOT)
  os.close(follower)
  chunks = []
  while True:
    try:
      chunk = os.read(leader, 65536)
    except OSError:  # EIO: the child closed the terminal
      break
    if not chunk:
      break
    chunks.append(chunk)
  os.close(leader)
  assert child.wait(timeout=60) == 0
  return b"".join(chunks).decode()


EXPECTED_LOG_LINES = [f"step {step:3d} | loss {4.0 / step:.4f}" for step in (5, 10, 15, 20)]


@pytest.mark.slow  # a subprocess or a long one; the full suite runs it
def test_progress_draws_a_live_bar_on_a_terminal():
  output = run_under_terminal([sys.executable, str(WORKER), "progress", "20"])
  assert "\r" in output  # the bar redraws itself in place
  final = output.rsplit("\r", 1)[-1]
  assert "20/20" in final and "100%" in final  # it ends at the total
  assert "loss=0.2" in final and "tok_s=123k" in final
  # The log lines came through whole, each on its own line above the bar.
  lines = [line.rsplit("\r", 1)[-1].strip() for line in output.split("\n")]
  for expected in EXPECTED_LOG_LINES:
    assert expected in lines


@pytest.mark.slow  # a subprocess or a long one; the full suite runs it
def test_progress_without_a_terminal_prints_only_the_log_lines():
  result = subprocess.run([sys.executable, str(WORKER), "progress", "20"], capture_output=True,
                          text=True, cwd=REPO_ROOT, check=True)
  assert "\r" not in result.stdout + result.stderr
  assert result.stdout.splitlines() == EXPECTED_LOG_LINES


def test_progress_counts_and_stops_at_the_total(capsys):
  progress = progress_lib.Progress(total=10, initial=4)  # pytest's capture is no terminal
  assert not progress.live
  progress.update(3)
  progress.update_to(9)
  progress.update(5)  # a last chunk of steps past the end
  assert progress.n == 10
  progress.write("a log line")
  progress.close()
  progress_lib.Progress(total=10, enabled=False).write("from another process")
  assert capsys.readouterr().out == "a log line\n"


# ----------------------------------------------------------------------------
# MFU


def test_flops_per_token_matches_nanogpt_for_gpt2_124m():
  # nanoGPT's GPT-2 (124M) prints "number of parameters: 123.65M" (no position
  # embeddings): 124,439,808 - 1024 * 768 = 123,653,376.
  n_params = 124_439_808 - 1024 * 768
  flops = flops_lib.transformer_flops_per_token(n_params, n_layer=12, n_head=12, head_dim=64,
                                                block_size=1024)
  assert flops == 6 * 123_653_376 + 12 * 12 * 12 * 64 * 1024 == 855_166_464
  # nanoGPT's estimate_mfu: its train.py batch (12 x 1024 tokens, 40 accumulation
  # steps) in 1 s per iteration on an A100 in bf16 is ~1.35 PFLOP/s, 134% of
  # 312 TFLOP/s; scale the time to reach 40%.
  tokens_per_iter = 12 * 1024 * 40
  a100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-40GB")
  peak = flops_lib.device_peak_flops(a100, "bfloat16")
  assert peak == 312e12
  seconds = flops * tokens_per_iter / (0.4 * peak)
  assert flops_lib.mfu(flops, tokens_per_iter / seconds, peak) == pytest.approx(0.4)
  assert flops_lib.mfu(flops, 1000.0, None) is None


def device(kind, platform="gpu"):
  return types.SimpleNamespace(platform=platform, device_kind=kind)


@pytest.mark.parametrize("kind, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
    ("NVIDIA H100 80GB HBM3", "float16", 989e12),
    # fp32 matmuls: JAX's default precision runs them on TF32 tensor cores.
    ("NVIDIA H100 80GB HBM3", "float32", 494.5e12),
    ("NVIDIA H200", "bfloat16", 989e12),  # SXM
    ("NVIDIA H200 NVL", "bfloat16", 835.5e12),  # the PCIe card: lower clocks and power
    ("NVIDIA H200 NVL", "float32", 417.5e12),
    ("NVIDIA B200", "bfloat16", 2.25e15),
    ("NVIDIA B200", "float32", 1.1e15),
    ("NVIDIA GB200", "bfloat16", 2.5e15),  # not the HGX B200's figure
    ("NVIDIA L40S", "bfloat16", 362.05e12),
    ("NVIDIA L40S", "float32", 183e12),
    ("NVIDIA L40", "bfloat16", None),  # not an L40S, and not in the table
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA A100-SXM4-80GB", "float32", 156e12),
    ("NVIDIA A100 80GB PCIe", "bfloat16", 312e12),
    ("NVIDIA H20", "bfloat16", None),  # not an H200, and not in the table
    ("Tesla V100-SXM2-16GB", "bfloat16", None),
    ("NVIDIA H100 80GB HBM3", "int8", None),
])
def test_gpu_peaks(kind, dtype, expected):
  assert flops_lib.device_peak_flops(device(kind), dtype, matmul_precision=None) == expected


@pytest.mark.parametrize("kind, dtype, precision, expected", [
    ("TPU v4", "bfloat16", None, 275e12),
    ("TPU v5 lite", "bfloat16", None, 197e12),
    ("TPU v5p", "bfloat16", None, 459e12),
    ("TPU v5", "bfloat16", None, 459e12),
    ("TPU v6 lite", "bfloat16", None, 918e12),
    ("TPU v3", "bfloat16", None, 61.5e12),  # a JAX device is one of a chip's 2 cores
    # fp32 on a TPU: one bf16 pass by default, 3 at "high", 6 at "highest".
    ("TPU v4", "float32", None, 275e12),
    ("TPU v4", "float32", "high", 275e12 / 3),
    ("TPU v4", "float32", "highest", 275e12 / 6),
])
def test_tpu_peaks(kind, dtype, precision, expected):
  assert flops_lib.device_peak_flops(device(kind, "tpu"), dtype,
                                     matmul_precision=precision) == expected


def test_peak_follows_the_runs_matmul_precision_and_the_override():
  jax = pytest.importorskip("jax")
  jnp = pytest.importorskip("jax.numpy")
  h100 = device("NVIDIA H100 80GB HBM3")
  assert flops_lib.device_peak_flops(h100, jnp.float32) == 494.5e12
  assert flops_lib.device_peak_flops(h100, jnp.bfloat16) == 989e12
  with jax.default_matmul_precision("highest"):
    assert flops_lib.device_peak_flops(h100, jnp.float32) == 67e12
  assert flops_lib.device_peak_flops(jax.devices("cpu")[0], "float32") is None
  assert flops_lib.device_peak_flops(jax.devices("cpu")[0], "float32", override=1e12) == 1e12

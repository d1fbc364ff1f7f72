"""`python -m purejax.train` across devices and processes, as a user runs it.

Each run is a subprocess with 4 (or 2 per process) CPU devices from
`XLA_FLAGS=--xla_force_host_platform_device_count`. The run's metrics.jsonl
holds every step's loss (`--log_interval=1`) and the checkpoint's meta the
evaluation history, which the tests compare with a one-device run of the
same flags, trained in-process (`one_device_gpt_run`, and the MLP's own).
"""

import os
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from helpers.cli import TINY_GPT, final, run_cli, run_module
from helpers.data import REPO_ROOT, require_test_data
from helpers.models import RTOL
from helpers.runs import assert_same_run, host_devices, newest, tiny_shakespeare_flags, train_run
from purejax import checkpoint
from purejax.cli import train
from purejax.training.effects import monitor

pytestmark = pytest.mark.slow

@pytest.fixture(scope="session")
def text_flags(tfds_data_dir):
  return tiny_shakespeare_flags(tfds_data_dir)


@pytest.mark.budget(30)
def test_fsdp_on_four_devices_matches_one_device_and_resumes_on_one(
    tmp_path, text_flags, one_device_gpt_run):
  four = tmp_path / "four"
  process = train_run(four, *TINY_GPT, *text_flags, "--fsdp", num_devices=4)
  assert "4 device(s)" in process.stdout and "split (FSDP)" in process.stdout
  assert_same_run(four, one_device_gpt_run)

  # The step-10 checkpoint of the 4-device FSDP run resumes on 1 device.
  resumed = tmp_path / "resumed"
  resumed.mkdir()
  shutil.copy(checkpoint.checkpoint_path(str(four), 10), resumed)
  shutil.copy(four / monitor.METRICS_FILE, resumed)
  process = train_run(resumed, *TINY_GPT, *text_flags, "--resume", num_devices=1)
  assert "resumed from" in process.stdout and "1 device(s)" in process.stdout
  assert_same_run(resumed, one_device_gpt_run)


def test_accumulated_microbatches_on_four_devices_match_one_device(
    tmp_path, text_flags, one_device_gpt_run):
  train_run(tmp_path, *TINY_GPT, *text_flags, "--grad_accum_steps=2", num_devices=4)
  assert_same_run(tmp_path, one_device_gpt_run)


def test_cpu_devices_flag_splits_the_host_and_matches_one_device(
    tmp_path, text_flags, one_device_gpt_run):
  # XLA_FLAGS asks for 1 device here; --cpu_devices overrides it.
  process = train_run(tmp_path, *TINY_GPT, *text_flags, "--cpu_devices=2", num_devices=1)
  assert "2 device(s)" in process.stdout and "2 devices x 1 microbatches x 4" in process.stdout
  assert_same_run(tmp_path, one_device_gpt_run)


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.budget(30)
def test_two_processes_on_localhost_match_one_process(tmp_path, text_flags, one_device_gpt_run):
  out_dir = tmp_path / "two_processes"
  flags = [*TINY_GPT, *text_flags, f"--out_dir={out_dir}",
           f"--coordinator_address=localhost:{_free_port()}", "--num_processes=2"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **host_devices(2))  # 2 x 2 = 4 devices
  workers = [subprocess.Popen([sys.executable, "-m", "purejax.train", *flags,
                               f"--process_id={i}"], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
  outputs = []
  try:
    for worker in workers:
      outputs.append(worker.communicate(timeout=600))
  finally:
    for worker in workers:
      worker.kill()
  for worker, (out, err) in zip(workers, outputs):
    assert worker.returncode == 0, out[-2000:] + err[-3000:]
  assert "4 device(s) (cpu, 2 process(es))" in outputs[0][0]
  # Only process 0 logs and writes checkpoints. Gloo prints its connection messages
  # on both processes from its own threads, interleaved mid-line, so look for our
  # log lines in process 1's output rather than for an empty output.
  for our_line in ("device(s)", "model: ", "step ", "saved ", "final {"):
    assert our_line in outputs[0][0], our_line
    assert our_line not in outputs[1][0], outputs[1][0][-2000:]
  assert_same_run(out_dir, one_device_gpt_run)


def test_processes_started_with_different_flags_are_refused(tmp_path, text_flags):
  flags = [*TINY_GPT, *text_flags, f"--out_dir={tmp_path}",
           f"--coordinator_address=localhost:{_free_port()}", "--num_processes=2"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  workers = [subprocess.Popen([sys.executable, "-m", "purejax.train", *flags,
                               f"--process_id={i}", *extra], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, extra in enumerate([[], ["--fsdp"]])]
  try:
    errors = [worker.communicate(timeout=300)[1] for worker in workers]
  finally:
    for worker in workers:
      worker.kill()
  for worker, err in zip(workers, errors):
    assert worker.returncode == 1
    assert "started with different settings" in err


@pytest.mark.parametrize("flags, message", [
    (["--batch_size=10"], "--batch_size=10 must be a multiple of the 4 devices"),
    (["--batch_size=8", "--grad_accum_steps=4"], r"try --batch_size=16"),
    (["--num_devices=5"], r"--num_devices=5 must be in \[1, 4\]"),
    (["--process_id=1"], "could not join the multi-process run"),
    (["--num_processes=2", "--process_id=2", "--coordinator_address=localhost:1"],
     r"--process_id must be in \[0, --num_processes=2\)"),
])
def test_bad_scale_out_flags_fail_with_a_clear_message(tmp_path, text_flags, flags, message):
  process = run_module("purejax.train", *TINY_GPT, *text_flags, f"--out_dir={tmp_path}",
                       *flags, timeout=300, env=host_devices(4))
  assert process.returncode == 1, process.stderr[-2000:]
  assert "Traceback" not in process.stderr
  assert re.search(message, process.stderr), process.stderr[-2000:]


@pytest.mark.budget(40)
def test_mlp_on_mnist_fsdp_four_devices_matches_one(tmp_path, tfds_data_dir):
  mnist_dir = require_test_data("mnist")
  # 60000 / 3000 = 20 steps in one epoch.
  flags = ["--model=mlp", "--epochs=1", "--batch_size=3000", f"--tfds_data_dir={tfds_data_dir}",
           f"--tfds_manual_dir={mnist_dir}"]
  final(run_cli(train, *flags, f"--out_dir={tmp_path / 'one'}"))  # this process: 1 device
  train_run(tmp_path / "four", *flags, "--fsdp", "--grad_accum_steps=2", num_devices=4)
  (one_arrays, one_meta), (four_arrays, four_meta) = newest(tmp_path / "one"), newest(
      tmp_path / "four")
  one_metrics, four_metrics = one_meta["history"][-1], four_meta["history"][-1]
  np.testing.assert_allclose(four_metrics["train_loss"], one_metrics["train_loss"], rtol=RTOL)
  assert abs(four_metrics["test_acc"] - one_metrics["test_acc"]) <= 2e-4  # <= 2 of 10000
  # Weights of rarely-lit border pixels and of dead ReLU units get gradients
  # that are mostly rounding noise, which Adam scales up to steps of the
  # learning rate; so single entries differ, and each layer as a whole agrees.
  for name, value in one_arrays.items():
    if "['params']" in name:
      difference = np.linalg.norm(four_arrays[name] - value)
      assert difference <= 1e-3 * np.linalg.norm(value), (name, difference)


@pytest.mark.budget(25)
def test_sigterm_to_one_process_saves_and_stops_all(tmp_path, text_flags):
  import signal
  import time
  flags = [*TINY_GPT, *text_flags, f"--out_dir={tmp_path}", "--max_iters=100000",
           "--lr_decay_iters=100000", "--log_interval=10",
           f"--coordinator_address=localhost:{_free_port()}",
           "--num_processes=2"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  workers = [subprocess.Popen([sys.executable, "-m", "purejax.train", *flags,
                               f"--process_id={i}"], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
  try:
    deadline = time.monotonic() + 300
    while not checkpoint.list_checkpoints(str(tmp_path)):
      assert all(w.poll() is None for w in workers), "a process ended early"
      assert time.monotonic() < deadline, "no checkpoint within 300 s"
      time.sleep(0.1)
    workers[1].send_signal(signal.SIGTERM)  # process 1 only
    outputs = [worker.communicate(timeout=300) for worker in workers]
  finally:
    for worker in workers:
      worker.kill()
  assert [w.returncode for w in workers] == [143, 143], [o[1][-2000:] for o in outputs]
  assert "stopped by SIGTERM" in outputs[0][0]
  newest_step = checkpoint.list_checkpoints(str(tmp_path))[0][0]
  assert newest_step > 0 and newest_step % 5 == 0  # a step boundary (--steps_per_call=5)

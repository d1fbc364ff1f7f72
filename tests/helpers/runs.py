"""Trained runs the tests share, built once per test run, and what compares two runs."""

import os
import re

import numpy as np
import pytest

from purejax import checkpoint
from purejax.cli import train as train_cli
from purejax.training.effects import monitor
from helpers.cli import SHORT_FLAGS, TINY_FLAGS, TINY_GPT, final, run_cli, run_module
from helpers.data import CHAR_GPT_TEXT, tinyshakespeare_dir
from helpers.models import RTOL


@pytest.fixture(scope="session")
def char_gpt_run(tmp_path_factory):
  """A tiny char-level GPT (`TINY_FLAGS`) trained 100 steps on `CHAR_GPT_TEXT`: a
  base to fine-tune or resume from; its newest checkpoint is step 100's."""
  folder = tmp_path_factory.mktemp("char_gpt")
  text = folder / "plays.txt"
  text.write_text(CHAR_GPT_TEXT)
  final(run_cli(train_cli, *TINY_FLAGS, *SHORT_FLAGS, "--max_iters=100", "--learning_rate=1e-2",
                f"--dataset={text}", f"--out_dir={folder / 'run'}"))
  return folder / "run"


def tiny_shakespeare_flags(tfds_data_dir):
  """Flags of a run on TFDS's tiny_shakespeare, prepared from the test data."""
  return [f"--tfds_manual_dir={tinyshakespeare_dir()}",
          f"--tfds_data_dir={tfds_data_dir}"]


@pytest.fixture(scope="session")
def one_device_gpt_run(tmp_path_factory, tfds_data_dir):
  """`TINY_GPT` on one device, on tiny_shakespeare: what the runs across devices and
  processes must match (`assert_same_run`)."""
  out_dir = tmp_path_factory.mktemp("gpt_1dev")
  final(run_cli(train_cli, *TINY_GPT, *tiny_shakespeare_flags(tfds_data_dir),
                f"--out_dir={out_dir}"))
  return out_dir


def long_run_env() -> dict:
  """The environment of a command line that trains for hundreds of steps: XLA's own CPU
  code generation (its fusion emitters) at LLVM's level 1, which runs nanoGPT's CPU recipe
  as fast as XLA's default level 2 (368 against 352 ms per 10 steps), 3.3x faster than
  the suite's compile-fast `SUITE_XLA_FLAGS` (1229 ms), and gives level 2's bits."""
  flags = os.environ.get("XLA_FLAGS", "")
  for name in ("xla_backend_optimization_level", "xla_cpu_use_fusion_emitters",
               "xla_llvm_disable_expensive_passes"):
    flags = re.sub(rf"\s*--{name}=\S*", "", flags)
  return {"XLA_FLAGS": (flags + " --xla_backend_optimization_level=1").strip()}


def host_devices(n):
  """The environment of a process that splits the CPU into `n` devices (with the suite's
  other XLA flags)."""
  return {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") +
                       f" --xla_force_host_platform_device_count={n}"}


def train_run(out_dir, *flags, num_devices=1):
  process = run_module("purejax.train", *flags, f"--out_dir={out_dir}", timeout=600,
                       env=host_devices(num_devices))
  assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-3000:]
  return process


def newest(out_dir):
  """`(arrays, meta)` of the newest checkpoint in `out_dir`."""
  return checkpoint.latest_meta(str(out_dir))


def step_losses(out_dir):
  """Every step's loss, from the run's metrics.jsonl (`--log_interval=1`)."""
  return [r["loss"] for r in monitor.read_metrics(out_dir) if r["kind"] == "train"]


def assert_same_run(out_dir, reference_dir):
  arrays, _ = newest(out_dir)
  ref_arrays, _ = newest(reference_dir)
  np.testing.assert_allclose(step_losses(out_dir), step_losses(reference_dir), rtol=RTOL)
  assert len(step_losses(out_dir)) == 20
  for name, value in ref_arrays.items():
    if "['params']" in name:
      np.testing.assert_allclose(arrays[name], value, rtol=1e-4, atol=2e-5, err_msg=name)


def saved_model(folder, config, tokenizer, seed=0):
  """`folder` holding one checkpoint of fresh params of `config` with `tokenizer`'s spec:
  a run directory a command line can start from (`--init_from`), made in-process."""
  import dataclasses
  import jax
  from purejax import gpt
  from purejax.training.effects import runs
  from purejax.training.pure.state import TrainState
  state = TrainState(gpt.init_params(config, jax.random.PRNGKey(seed)), (), {})
  meta = {"model": "gpt", "config": dataclasses.asdict(config),
          "tokenizer": tokenizer.spec().to_dict()}
  runs.save_checkpoint(runs.RunConfig(str(folder)), 1, state, meta, log=lambda _: None)
  return folder

"""Shared test fixtures and the test tiers.

Integration tests read the original data from the folder named by the
`PUREJAX_TEST_DATA` environment variable: `mnist/` with MNIST's four
original `.gz` files, and `tinyshakespeare/input.txt`. Without it the MNIST
tests skip, except under `CI=true`, where missing data is a failure, not a
skip; the Tiny Shakespeare tests read the copy the package ships.

Tiers: `pytest -m "not slow" tests` runs the fast tier (unit tests of every
module, in-process); `pytest tests` runs everything. Tests that train through
subprocesses, several devices or the real data are marked `slow`.
"""

import base64
import collections
import contextlib
import fcntl
import io
import json
import os
import pathlib
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import checkpoint
from purejax import gpt
from purejax.cli import train as train_cli
from purejax.data import batches
from purejax.data import datasets
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.effects import monitor
from purejax.training.pure import steps
from purejax.training.pure.state import TrainState

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TEST_DATA = os.environ.get("PUREJAX_TEST_DATA")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


# The install that brings every optional dependency of the suite (torch,
# transformers, peft, wandb, tensorboard, matplotlib): setup.cfg's `test` extra.
TEST_EXTRA = 'pip install -e ".[test]"'


def need(module: str):
  """`module` imported, or the test skipped with the install that brings it."""
  return pytest.importorskip(module, reason=f"{module} is not installed: {TEST_EXTRA}")


DATA_FILES = {"mnist": "MNIST's four original .gz files",
              "tinyshakespeare": "Tiny Shakespeare's input.txt"}


def require_test_data(name: str) -> pathlib.Path:
  """Path of `$PUREJAX_TEST_DATA/<name>`; skips outside CI if absent, fails in CI."""
  path = pathlib.Path(TEST_DATA or "<PUREJAX_TEST_DATA unset>") / name
  if not path.is_dir():
    message = (f"{path} not found: set PUREJAX_TEST_DATA to a folder holding {name}/ "
               f"({DATA_FILES[name]})")
    if IN_CI:
      pytest.fail(message + "; integration tests must run under CI=true.")
    pytest.skip(message)
  return path


def tinyshakespeare_dir() -> pathlib.Path:
  """Tiny Shakespeare's folder: the test data's where `PUREJAX_TEST_DATA` is set, else
  the copy the package ships (the same file), so its tests run on any machine."""
  if TEST_DATA:
    return require_test_data("tinyshakespeare")
  return datasets.EMBEDDED_SHAKESPEARE_DIR


# Tiny Shakespeare as the package ships it: the tests' text for tokenizers and corpora.
SHAKESPEARE = (datasets.EMBEDDED_SHAKESPEARE_DIR / "input.txt").read_text(encoding="utf-8")
# The text of `text_file` and of the shared char GPT (`char_gpt_run`).
CHAR_GPT_TEXT = SHAKESPEARE[:40_000]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
  """A 40,000-character `.txt` corpus, as a user's own text file."""
  path = tmp_path_factory.mktemp("text") / "plays.txt"
  path.write_text(CHAR_GPT_TEXT)
  return path


@pytest.fixture(scope="session")
def tfds_data_dir() -> str:
  """A TFDS data dir holding tiny_shakespeare and mnist, prepared from the test data once
  per test run (`built_once`; TFDS's own preparation of mnist takes ~25 s)."""

  def prepare(folder):
    for name, manual_dir, splits in (
        ("tiny_shakespeare", tinyshakespeare_dir(), ("train",)),
        ("mnist", pathlib.Path(TEST_DATA or "<unset>") / "mnist", ("train", "test"))):
      if manual_dir.is_dir():  # where it is not, the tests that need it skip or fail
        datasets.load_tfds_splits(name, splits, data_dir=str(folder),
                                  manual_dir=str(manual_dir))

  return str(built_once("tfds", prepare, computed=False))


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


# ----------------------------------------------------------------------------
# Tiny models and data the tests share

# A GPT small enough to compile in a second: 2 layers, 2 heads, 16 wide.
TINY = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
# How the tests' models run: the CPU's forms, as `kernels.select` chooses them.
CPU_FORMS = kernels.select("cpu")


def random_tokens(key, shape, vocab=TINY.vocab_size):
  return jax.random.randint(key, shape, 0, vocab)


def sharpened_params(config, seed=0):
  """Random params scaled up, so logits have clear winners (no argmax ties)."""
  params = gpt.init_params(config, jax.random.PRNGKey(seed))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  return jax.tree.unflatten(
      tree, [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


# Merges of a tiny byte-level BPE encoding, in rank order: each joins two
# existing tokens.
MERGES = [(b"t", b"h"), (b"th", b"e"), (b" ", b"t"), (b" t", b"he"), (b"e", b"r"),
          (b"o", b"u"), (b"\n", b"\n"), (b" ", b"a"), (b"i", b"n"), (b"in", b"g")]


def gpt2_byte_order():
  """Byte values in the order GPT-2's data-gym format ranks them (printable first)."""
  printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
  return printable + [b for b in range(256) if b not in printable]


def tiny_ranks():
  """The tiny encoding's `{token bytes: rank}`: 256 byte tokens, then `MERGES`."""
  ranks = {bytes([b]): i for i, b in enumerate(gpt2_byte_order())}
  for left, right in MERGES:
    ranks[left + right] = len(ranks)
  return ranks


def write_tiktoken_file(path: pathlib.Path, ranks) -> pathlib.Path:
  """`ranks` in tiktoken's file format (base64 token and rank per line)."""
  lines = [base64.b64encode(t) + b" " + str(r).encode()
           for t, r in sorted(ranks.items(), key=lambda item: item[1])]
  path.write_bytes(b"\n".join(lines) + b"\n")
  return path


@pytest.fixture
def no_network(monkeypatch):
  """Fails the test if anything opens a socket connection or resolves a host."""
  attempts = []

  def refuse(*args, **kwargs):
    attempts.append(args[:1])
    raise OSError("network disabled in tests")

  monkeypatch.setattr(socket, "create_connection", refuse)
  monkeypatch.setattr(socket, "getaddrinfo", refuse)
  monkeypatch.setattr(socket.socket, "connect", refuse)
  yield
  assert not attempts, f"a test touched the network: {attempts}"


# ----------------------------------------------------------------------------
# Command-line runs and what they write


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


def train_tokenizer_json(folder: pathlib.Path, text: str, vocab_size: int = 300
                         ) -> pathlib.Path:
  """Trains a byte-level BPE on `text` and saves it as `folder/tokenizer.json`."""
  hf = pytest.importorskip("tokenizers")
  tokenizer = hf.Tokenizer(hf.models.BPE())
  tokenizer.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = hf.decoders.ByteLevel()
  trainer = hf.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                   initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator([text], trainer)
  folder.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(folder / "tokenizer.json"))
  return folder / "tokenizer.json"


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


# ----------------------------------------------------------------------------
# Tiny `purejax.train` runs, and runs across devices compared with one device

# Flags of tiny `purejax.train` runs: a 1-layer model, and a short schedule.
TINY_FLAGS = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4",
              "--eval_iters=2", "--sample_tokens=0", "--warmup_iters=2"]
SHORT_FLAGS = ["--max_iters=20", "--eval_interval=10", "--log_interval=5", "--steps_per_call=5"]
# A 2-layer run of 20 steps that logs every step's loss and checkpoints at 10.
TINY_GPT = ["--n_layer=2", "--n_head=4", "--n_embd=32", "--block_size=16",
            "--batch_size=8", "--max_iters=20", "--lr_decay_iters=20", "--warmup_iters=5",
            "--eval_interval=10", "--eval_iters=2", "--log_interval=1",
            "--steps_per_call=5", "--checkpoint_every=10", "--sample_tokens=0"]
RTOL = 1e-5


# ----------------------------------------------------------------------------
# Trained runs the tests share: one of each kind per test process (session
# scope), trained in-process. Each is read-only to the tests (a test that
# changes a run trains or copies its own). Under pytest-xdist each worker
# trains its own tiny runs: a second or two here, less than a lock across
# processes would cost the worker that waits. What takes tens of seconds is
# built once per test run instead (`built_once`).

def stacked_sweep_state(config, specs, make_optimizer) -> TrainState:
  """A sweep's start as the tests build it: a `TrainState` with a leading runs axis, each
  run's params and train key from `jax.random.split(PRNGKey(its seed))`, and its
  optimizer state from `make_optimizer()` (`sweep.RunOptimizer`)."""
  keys = [jax.random.split(jax.random.PRNGKey(spec.seed)) for spec in specs]
  params = jax.tree.map(lambda *xs: jnp.stack(xs), *[gpt.init_params(config, k[0]) for k in keys])
  return TrainState(params, jax.vmap(lambda p: make_optimizer().init(p))(params),
                    {"train": jnp.stack([k[1] for k in keys])})


def built_once(name: str, build, *, computed: bool = True) -> pathlib.Path:
  """The folder `name` in the test run's shared folder, built by `build(folder)` once per
  run: the first test process to ask builds it, the others (xdist's workers) wait on a
  file lock and read what it built.

  For what takes tens of seconds to make and the tests only read (a fine-tune of
  the real model, a whole sweep). A build that raised is redone by the next ask,
  which then fails in its own test. The folder goes with the run's shared folder.
  `computed=False` for what holds no result XLA computed (prepared data): the
  `xla_defaults` tests' process (`test_xla_defaults.py`), which shares the run's
  folder, reads it too; what XLA computed it builds again under its own code generation.
  """
  root = pathlib.Path(os.environ[_SHARED_DIR])
  if computed and not suite_codegen():
    name += "-xla-defaults"
  folder, done = root / name, root / f"{name}.built"
  with file_lock(root / f"{name}.lock"):
    if not done.exists():
      shutil.rmtree(folder, ignore_errors=True)  # what a build that raised left
      folder.mkdir()
      build(folder)
      done.touch()
  return folder


@contextlib.contextmanager
def file_lock(path: pathlib.Path):
  """Holds an exclusive lock on `path` (another process waits, then finds the work done)."""
  with open(path, "w") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


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
  for name in ("xla_backend_optimization_level", "xla_cpu_use_fusion_emitters"):
    flags = re.sub(rf"\s*--{name}=\S+", "", flags)
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


# ----------------------------------------------------------------------------
# GPT-2 124M lowered for CUDA from abstract inputs (nothing compiled or allocated)

GPT2 = gpt.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                     bias=False, compute_dtype="bfloat16")
GPT2_BATCH = 12
GPT2_OPTIMIZER = optim.make_optimizer(optim.from_flat(
    learning_rate=6e-4, warmup_iters=10, decay_iters=1000, min_lr=6e-5, beta2=0.95,
    weight_decay=0.1, grad_clip=1.0))
CUDNN_FORWARD, CUDNN_BACKWARD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"


@pytest.fixture
def cudnn_version(monkeypatch):
  """Stands in for JAX's query of the installed cuDNN (9.8), which needs CUDA."""
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)


def lower_for(traced, platform="cuda") -> str:
  """StableHLO text of a traced function lowered for `platform`."""
  try:
    return traced.lower(lowering_platforms=(platform,)).as_text()
  except ValueError as e:
    if "platform" in str(e).lower() and platform in str(e):
      pytest.skip(f"this JAX cannot lower for {platform} on a CPU host: {e}")
    raise


def custom_calls(hlo: str) -> collections.Counter:
  return collections.Counter(re.findall(r"custom_call @([\w$.]+)", hlo))


def square_faces(hlo: str, size: int) -> int:
  """Tensors with a `size x size` face: full attention scores over `size` positions."""
  return len(re.findall(rf"tensor<(?:\d+x)*{size}x{size}x", hlo))


def abstract_state(config):
  params = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  return params, jax.eval_shape(GPT2_OPTIMIZER.init, params)


ABSTRACT_KEY = jax.ShapeDtypeStruct((2,), jnp.uint32)
ABSTRACT_TOKENS = jax.ShapeDtypeStruct((1 << 20,), jnp.int32)


def train_step_hlo(forms, config=GPT2, batch=GPT2_BATCH, platform="cuda") -> str:
  params, opt_state = abstract_state(config)
  state = TrainState(params, opt_state, {"train": ABSTRACT_KEY})
  return lower_for(steps.train_steps.trace(
      state, batches.DeviceTokens(ABSTRACT_TOKENS), 0, config=config, optimizer=GPT2_OPTIMIZER,
      batch_size=batch, num_steps=2, forms=forms), platform)


# ----------------------------------------------------------------------------
# Tiers


# The full suite keeps one compilation cache per test run, on disk, shared by
# the run's pytest processes and every command line they start. A program is
# compiled once per run: a `python -m purejax.train` that compiles what an
# earlier run (in-process or not) compiled loads XLA's output for it (the
# cache's key holds the program, XLA's flags and the devices) in a fraction of
# a second instead of compiling it for seconds. The cache is removed with the
# run, so every test run compiles everything once, from scratch.
_COMPILE_CACHE = "JAX_COMPILATION_CACHE_DIR"
_SHARED_DIR = "PUREJAX_TESTS_SHARED_DIR"


# How the suite compiles for the CPU (docs/performance.md, "Where a tiny model's test
# spends its time"). Most of a tiny model's test is XLA's CPU compiler, and most of
# that is code generation: LLVM optimising each kernel, and XLA's MLIR fusion emitters,
# which build an MLIR context and its rewrite patterns for every fused kernel. The
# suite compiles without LLVM's optimisation (level 0; XLA's default is 2) and with
# XLA's older emitters, which write LLVM IR directly: the tests' tiny train step
# compiles in 0.5 s, against 1.4 s at level 0 alone and 2.2 s with XLA's defaults.
# The HLO program purejax builds is the same (XLA fuses it a little differently for
# the older emitters); the last bits of some results differ from XLA's defaults, the
# same in every process of the run, so comparing two runs of one program bit for bit
# holds. The few command lines that train for hundreds of steps run with XLA's own
# code generation (`long_run_env()`).
OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0", OLDER_EMITTERS)
# Some tests claim that two different programs (scanned and unrolled layers, a
# training step and its replay) give the same bits. That holds for XLA's own
# code generation, which users run; with the older emitters two of them got
# other bits (the same float operations, fused otherwise). Those tests are
# marked `xla_defaults`; where the suite's flags are in effect they run in one
# process of their own with XLA's code generation (`test_xla_defaults.py`).


def suite_codegen() -> bool:
  """Whether this run compiles with the suite's fast code generation (`SUITE_XLA_FLAGS`)."""
  return OLDER_EMITTERS in os.environ.get("XLA_FLAGS", "")


def _xla_accepts(flag: str) -> bool:
  """Whether this jaxlib's XLA knows `flag` (XLA aborts a process on an unknown flag)."""
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, timeout=120)
  return probe.returncode == 0


def pytest_configure(config):
  flags = os.environ.get("XLA_FLAGS", "")
  if not hasattr(config, "workerinput") and "xla_backend_optimization_level" not in flags:
    # Set by the first process (pytest, or xdist's controller) for all the others,
    # unless the user chose a level: then the suite compiles as the user asked.
    suite = [f for f in SUITE_XLA_FLAGS if f != OLDER_EMITTERS or _xla_accepts(f)]
    os.environ["XLA_FLAGS"] = " ".join([flags, *suite]).strip()
  if not hasattr(config, "workerinput") and _SHARED_DIR not in os.environ:
    # What the run's processes build once and share (`built_once`).
    config.purejax_shared_dir = tempfile.mkdtemp(prefix="purejax-tests-shared-")
    os.environ[_SHARED_DIR] = config.purejax_shared_dir
  if not hasattr(config, "workerinput") and _COMPILE_CACHE not in os.environ:
    # The first process (pytest, or xdist's controller) makes the cache; xdist's
    # workers and all subprocesses inherit the variables. Every program is
    # kept, however small (JAX keeps only those that compiled for a second).
    config.purejax_compile_cache = tempfile.mkdtemp(prefix="purejax-tests-xla-")
    os.environ.update({_COMPILE_CACHE: config.purejax_compile_cache,
                       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"})
  if _COMPILE_CACHE in os.environ:  # this process imported JAX before they were set
    jax.config.update("jax_compilation_cache_dir", os.environ[_COMPILE_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  _schedule_longest_first(config)


def pytest_unconfigure(config):
  for made in ("purejax_compile_cache", "purejax_shared_dir"):
    if getattr(config, made, None):
      shutil.rmtree(getattr(config, made), ignore_errors=True)


def _schedule_longest_first(config):
  # Under pytest-xdist (-n 2) each worker asks for one more test as it ends
  # one, in the order `pytest_collection_modifyitems` leaves (rather than
  # taking a quarter of the suite in a block at the start): with the longest
  # tests first, the two workers finish together.
  if (config.pluginmanager.hasplugin("xdist") and config.getoption("dist") == "load"
      and config.getoption("maxschedchunk") is None):
    config.option.maxschedchunk = 1


# The longest tests carry their time budget as a marker, `@pytest.mark.budget(seconds)`:
# seconds of one test on a quiet 2-core CPU inside the full suite (`pytest -n 2`;
# every parameter of a test has the budget). The suite runs them first, longest
# first, so the two workers end together.
def _budget(item) -> float:
  """A test's `@pytest.mark.budget(seconds)`: about how long it runs on 2 cores (0 if unmarked)."""
  marker = item.get_closest_marker("budget")
  return marker.args[0] if marker else 0


def pytest_collection_modifyitems(config, items):
  # Integration tests are slow tests too.
  for item in items:
    if item.get_closest_marker("integration"):
      item.add_marker(pytest.mark.slow)
  # Under the suite's code generation the `xla_defaults` tests run in their own
  # process (`test_xla_defaults.py`), the same tests, not here; without it they
  # run here, and the test that starts that process has nothing to run.
  marker = "xla_defaults" if suite_codegen() else "runs_xla_defaults"
  elsewhere = [item for item in items if item.get_closest_marker(marker)]
  if elsewhere:
    items[:] = [item for item in items if item not in elsewhere]
    config.hook.pytest_deselected(items=elsewhere)
  items.sort(key=lambda item: -_budget(item))  # stable: the rest keep their order


def dot_operand_dtypes(jaxpr):
  """Every dot_general's operand dtypes in `jaxpr`, nested jaxprs (checkpoint, custom VJP) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(tuple(v.aval.dtype.name for v in eqn.invars))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found += dot_operand_dtypes(inner)
  return found

"""Shared test fixtures and the test tiers.

Integration tests read the original data from the folder named by the
`PUREJAX_TEST_DATA` environment variable: `mnist/` with MNIST's four
original `.gz` files, and `tinyshakespeare/input.txt`. Without it they skip,
except under `CI=true`, where missing data is a failure, not a skip.

Tiers: `pytest -m "not slow" tests` runs the fast tier (unit tests of every
module, in-process); `pytest tests` runs everything. Tests that train through
subprocesses, several devices or the real data are marked `slow`.
"""

import base64
import json
import os
import pathlib
import socket
import struct
import subprocess
import sys

import jax
import pytest

from purejax import gpt

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TEST_DATA = os.environ.get("PUREJAX_TEST_DATA")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_test_data(name: str) -> pathlib.Path:
  """Path of `$PUREJAX_TEST_DATA/<name>`; skips outside CI if absent, fails in CI."""
  path = pathlib.Path(TEST_DATA or "<PUREJAX_TEST_DATA unset>") / name
  if not path.is_dir():
    message = f"{path} not found (set PUREJAX_TEST_DATA to the folder of the test data)"
    if IN_CI:
      pytest.fail(message + "; integration tests must run under CI=true.")
    pytest.skip(message)
  return path


@pytest.fixture(scope="session")
def tfds_data_dir(tmp_path_factory) -> str:
  """A TFDS data dir shared by the whole test session (prepared on first use)."""
  return str(tmp_path_factory.mktemp("tfds"))


def run_module(module: str, *args: str, timeout: float = 900,
               env: dict = None) -> subprocess.CompletedProcess:
  """Runs `python -m module args...` as a user would; returns the finished process.

  `env` adds to (or overrides) this process's environment.
  """
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                        text=True, timeout=timeout, cwd=REPO_ROOT, env=env)


# ----------------------------------------------------------------------------
# Tiny models and data the tests share

# A GPT small enough to compile in a second: 2 layers, 2 heads, 16 wide.
TINY = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)


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


def read_wandb_offline_history(out_dir: pathlib.Path):
  """The history rows of the offline W&B run under `out_dir/wandb`, without wandb's API.

  The `.wandb` file is a short header then LevelDB's log format (32 KiB
  blocks of records: crc32 (4), length (2), type (1), data), each record one
  protobuf `Record`.
  """
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  (path,) = pathlib.Path(out_dir).glob("wandb/offline-run-*/run-*.wandb")
  data, pos, pending, rows = path.read_bytes(), 7, b"", []
  block = 32768
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if length == 0 and kind == 0:
      break
    pending += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # a whole record, or the last piece of one
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      pending = b""
      if record.WhichOneof("record_type") == "history":
        rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item})
  return rows


# ----------------------------------------------------------------------------
# Tiers


def pytest_configure(config):
  # The fast tier (-m "not slow") is for quick feedback while editing: XLA
  # compiles its many small programs without its optimisation passes, which
  # halves the tier's time. The full suite (what CI runs) compiles as users do.
  if config.option.markexpr.replace(" ", "") == "notslow":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_backend_optimization_level=0").strip()


def pytest_collection_modifyitems(items):
  # Integration tests are slow tests too.
  for item in items:
    if item.get_closest_marker("integration"):
      item.add_marker(pytest.mark.slow)

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
import os
import pathlib
import socket
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

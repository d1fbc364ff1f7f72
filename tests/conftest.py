"""Shared test fixtures and the test tiers.

Integration tests read the original data from the folder named by the
`PUREJAX_TEST_DATA` environment variable: `mnist/` with MNIST's four
original `.gz` files, and `tinyshakespeare/input.txt`. Without it they skip,
except under `CI=true`, where missing data is a failure, not a skip.

Tiers: `pytest -m "not slow" tests` runs the fast tier (unit tests of every
module, in-process); `pytest tests` runs everything. Tests that train through
subprocesses, several devices or the real data are marked `slow`.
"""

import os
import pathlib
import subprocess
import sys

import pytest

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

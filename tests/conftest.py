"""Shared test fixtures.

Integration tests read the original data from `../shared/data` (beside the
repository; override with PUREJAX_SHARED_DATA). Under `CI=true` they must
run: missing data is a failure there, not a skip.
"""

import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = pathlib.Path(
    os.environ.get("PUREJAX_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_shared_data(name: str) -> pathlib.Path:
  """Path of `shared/data/<name>`; skips outside CI if absent, fails in CI."""
  path = SHARED_DATA / name
  if not path.is_dir():
    message = f"{path} not found (set PUREJAX_SHARED_DATA)"
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

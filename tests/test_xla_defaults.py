"""The tests that claim two different programs give the same bits, under XLA's own CPU
code generation.

The suite compiles with XLA's older CPU emitters at LLVM's level 0, which compile a
tiny model's programs three times faster (`SUITE_XLA_FLAGS` in `helpers/suite.py`). With
those emitters two different programs that run the same float operations (a step and
its replay, scanned and unrolled layers) did not always give the same bits, as they do
under XLA's own code generation. So those claims are checked where users run them:
under XLA's own code generation, in one process of their own. The tests are the ones
marked `xla_defaults`; this runs them.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from helpers.data import REPO_ROOT
from helpers.runs import long_run_env


@pytest.mark.budget(60)
@pytest.mark.slow
@pytest.mark.runs_xla_defaults
def test_the_bit_for_bit_claims_hold_under_xlas_own_code_generation():
  env = dict(os.environ, **long_run_env(), TF_CPP_MIN_LOG_LEVEL="2")
  # Only the files that mark such tests are collected (collecting the whole suite again
  # would cost that process seconds).
  here = pathlib.Path(__file__).resolve()
  marking = sorted(str(p.relative_to(REPO_ROOT)) for p in here.parent.glob("test_*.py")
                   if p != here and "mark.xla_defaults" in p.read_text())
  assert marking
  process = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
       "-m", "xla_defaults", *marking],
      capture_output=True, text=True, timeout=900, cwd=REPO_ROOT, env=env)
  # Exit code 5 (nothing collected) fails too: the marked tests must exist and run.
  assert process.returncode == 0, process.stdout[-4000:] + process.stderr[-2000:]
  assert " passed" in process.stdout, process.stdout[-2000:]

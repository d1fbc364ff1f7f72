"""The README's commands are the ones CI runs.

CI (`.ci/run`) must run the README's own setup line and test command, so
that a green CI means a new user's two lines pass too. These tests read the
README's first fenced block (the one under "On a fresh machine") and the
script, and fail when they drift apart.
"""

import re

from helpers.data import REPO_ROOT

README = REPO_ROOT / "README.md"
CI_RUN = REPO_ROOT / ".ci" / "run"


def fresh_machine_commands() -> list:
  """The command lines of the README's first ```bash block, without their comments."""
  block = re.search(r"^```bash\n(.*?)^```", README.read_text(), re.M | re.S)
  assert block, "README.md has no ```bash block"
  lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
  return [line for line in lines if line and not line.startswith("#")]


def ci_commands() -> list:
  """`.ci/run`'s lines, comments and blank lines left out."""
  lines = [line.strip() for line in CI_RUN.read_text().splitlines()]
  return [line for line in lines if line and not line.startswith("#")]


def test_the_readme_shows_setup_main_job_and_tests_in_that_order():
  setup, main_job, tests = fresh_machine_commands()
  assert "pip install" in setup and "venv" in setup
  assert main_job == "python -m purejax.train"
  assert "pytest" in tests


def test_ci_runs_the_readme_setup_line_then_its_test_command_word_for_word():
  setup, _, tests = fresh_machine_commands()
  ci = ci_commands()
  assert setup in ci, f"{CI_RUN} does not run the README's setup line {setup!r}"
  assert tests in ci, f"{CI_RUN} does not run the README's test command {tests!r}"
  assert ci.index(setup) < ci.index(tests)
  assert ci[-1] == tests, "the README's test command must be CI's last step (its exit code)"
  # No other pytest run: CI's verdict is the README's command's.
  assert [line for line in ci if "pytest" in line and "pip" not in line] == [tests]


def test_ci_adds_no_install_of_its_own_beyond_the_gpu_compiler():
  """What CI installs with pip past the README's line is only JAX's CUDA plugin (XLA's
  GPU compiler for the deviceless tests), which a machine without a GPU does not need
  (Debian's Chromium, for the chat page's browser test, comes from apt)."""
  setup, _, _ = fresh_machine_commands()
  installs = [line for line in ci_commands() if re.search(r"\bpip\b.*\binstall\b", line)
              and line != setup]
  assert all("jax-cuda12-plugin" in line for line in installs), installs

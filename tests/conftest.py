"""Shared test fixtures and the test tiers.

Integration tests read the original data from the folder named by the
`PUREJAX_TEST_DATA` environment variable: `mnist/` with MNIST's four
original `.gz` files, and `tinyshakespeare/input.txt`. Without it the MNIST
tests skip, except under `CI=true`, where missing data is a failure, not a
skip; the Tiny Shakespeare tests read the copy the package ships.

Tiers: `pytest -m "not slow" tests` runs the fast tier (unit tests of every
module, in-process); `pytest tests` runs everything. Tests that train through
subprocesses, several devices or the real data, and the few in-process ones that
compile for over 2 s, are marked `slow`.
"""

import os
import shutil
import tempfile

import jax
import pytest

from helpers.suite import (COMPILE_CACHE, OLDER_EMITTERS, SHARED_DIR, SUITE_XLA_FLAGS,
                           suite_codegen, xla_accepts)
# The shared fixtures live with their topic in helpers/; importing them here makes them
# every test's (pytest looks for fixtures in conftest.py's namespace).
from helpers.data import no_network, text_file, tfds_data_dir  # noqa: F401
from helpers.gpu import cudnn_version, h100  # noqa: F401
from helpers.runs import char_gpt_run, one_device_gpt_run  # noqa: F401


def pytest_configure(config):
  flags = os.environ.get("XLA_FLAGS", "")
  if not hasattr(config, "workerinput") and "xla_backend_optimization_level" not in flags:
    # Set by the first process (pytest, or xdist's controller) for all the others,
    # unless the user chose a level: then the suite compiles as the user asked.
    suite = [f for f in SUITE_XLA_FLAGS if f != OLDER_EMITTERS or xla_accepts(f)]
    os.environ["XLA_FLAGS"] = " ".join([flags, *suite]).strip()
  if not hasattr(config, "workerinput") and SHARED_DIR not in os.environ:
    # What the run's processes build once and share (`built_once`).
    config.purejax_shared_dir = tempfile.mkdtemp(prefix="purejax-tests-shared-")
    os.environ[SHARED_DIR] = config.purejax_shared_dir
  if not hasattr(config, "workerinput") and COMPILE_CACHE not in os.environ:
    # The first process (pytest, or xdist's controller) makes the cache; xdist's
    # workers and all subprocesses inherit the variables. Every program is
    # kept, however small (JAX keeps only those that compiled for a second).
    config.purejax_compile_cache = tempfile.mkdtemp(prefix="purejax-tests-xla-")
    os.environ.update({COMPILE_CACHE: config.purejax_compile_cache,
                       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"})
  # The tests' own processes keep no cache: only the subprocesses they start (commands
  # run twice, resumed, killed) share one. Serialising an executable into the cache
  # has crashed an xdist worker now and then (a segfault inside JAX's
  # `put_executable_and_time`), and in-process tests gained nothing from it.
  jax.config.update("jax_compilation_cache_dir", None)
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

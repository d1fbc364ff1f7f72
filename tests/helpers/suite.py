"""How the suite runs: how it compiles for the CPU, and what the run's processes build once and
share (`built_once`, under a file lock)."""

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys

from purejax import _files


# The full suite keeps one compilation cache per test run, on disk, shared by
# the run's pytest processes and every command line they start. A program is
# compiled once per run: a `python -m purejax.train` that compiles what an
# earlier run (in-process or not) compiled loads XLA's output for it (the
# cache's key holds the program, XLA's flags and the devices) in a fraction of
# a second instead of compiling it for seconds. The cache is removed with the
# run, so every test run compiles everything once, from scratch.
COMPILE_CACHE = "JAX_COMPILATION_CACHE_DIR"


SHARED_DIR = "PUREJAX_TESTSSHARED_DIR"


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
# holds. (Leaving out LLVM's expensive passes as well, as `jax_disable_most_optimizations`
# does, compiled the fast tier's kernel and Muon tests 5 % faster but ran the real
# model's tests 10-18 % slower: the full suite took 1200 s against 1093.) The few
# command lines that train for hundreds of steps run with XLA's own code generation
# (`long_run_env()`).
OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0", OLDER_EMITTERS)


def suite_codegen() -> bool:
  """Whether this run compiles with the suite's fast code generation (`SUITE_XLA_FLAGS`)."""
  return OLDER_EMITTERS in os.environ.get("XLA_FLAGS", "")


def xla_accepts(flag: str) -> bool:
  """Whether this jaxlib's XLA knows `flag` (XLA aborts a process on an unknown flag).

  Found by starting a process with the flag (a second of every test run's start), and
  kept per Python and jaxlib in the user's cache, so a machine asks once per install.
  """
  import jaxlib  # pylint: disable=import-outside-toplevel
  key = f"{sys.executable} jaxlib=={jaxlib.__version__} {flag}"
  known = pathlib.Path.home() / ".cache" / "purejax-tests" / "xla_flags.json"
  try:
    answers = json.loads(known.read_text())
  except (OSError, ValueError):
    answers = {}
  if key not in answers:
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, timeout=120)
    answers[key] = probe.returncode == 0
    try:
      known.parent.mkdir(parents=True, exist_ok=True)
      _files.atomic_write_bytes(known, json.dumps(answers, indent=1).encode())
    except OSError:
      pass  # a read-only home asks again next time
  return answers[key]


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
  root = pathlib.Path(os.environ[SHARED_DIR])
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

"""Runs model-written Python, one program per process, so that no program can harm the
evaluation or the machine beyond its own limits.

    outcome = sandbox.run_program(source, timeout=10.0)
    outcome.passed, outcome.status     # True, "passed" | False, "failed"/"timed out"/...

Each program runs in a fresh interpreter (`python -I`: no user site, no
PYTHON* variables) in a temporary working directory that is deleted after
it, with an environment of only `PATH` and `LANG` (no inherited secrets), no
standard input, and in a session of its own that is killed whole when it
ends or times out. The operating system caps its address space (memory),
CPU time, file sizes and, for users other than root, its processes. A
prologue first takes away what a program under test has no business doing:
forking, running other programs, signalling other processes, deleting or
renaming files, changing permissions. None of this is a security boundary
against a determined attacker (it is the same kind of guard OpenAI's
human-eval and lm-evaluation-harness use); run untrusted models' code in a
container or VM as well.
"""

import os
import signal
import subprocess
import sys
import tempfile
from typing import NamedTuple

# Run before the program: its limits (set here rather than between fork and exec,
# which a multithreaded parent such as JAX must not run Python in), then what a
# program under test must not do, disabled.
PROLOGUE = """\
import builtins as _b, os as _os, shutil as _sh, subprocess as _sp, faulthandler as _fh
try:
  import resource as _r
  for _l, _v in ((_r.RLIMIT_AS, {memory}), (_r.RLIMIT_CPU, {cpu}), (_r.RLIMIT_FSIZE, 16 << 20),
                 (_r.RLIMIT_CORE, 0), (_r.RLIMIT_NPROC, 64)):
    try:
      _r.setrlimit(_l, (_v, _v))
    except (ValueError, OSError):
      pass  # a cap the system will not lower this far; the others still hold
  del _r, _l, _v
except ImportError:
  pass
_fh.disable()
for _n in ("fork", "forkpty", "system", "popen", "kill", "killpg", "execv", "execve", "execvp",
           "execvpe", "execl", "execle", "execlp", "execlpe", "spawnl", "spawnle", "spawnlp",
           "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp",
           "putenv", "unsetenv", "remove", "removedirs", "rmdir", "unlink", "rename", "renames",
           "replace", "truncate", "chmod", "fchmod", "chown", "fchown", "lchown", "chroot",
           "setuid", "setgid", "setsid", "setpgid", "nice", "register_at_fork"):
  if hasattr(_os, _n):
    setattr(_os, _n, None)
for _n in ("rmtree", "move", "chown"):
  setattr(_sh, _n, None)
_sp.Popen = _sp.run = _sp.call = _sp.check_call = _sp.check_output = None
del _b, _os, _sh, _sp, _fh, _n
"""


class Outcome(NamedTuple):
  """How a program ended.

  Attributes:
    passed: it exited with status 0 within its limits.
    status: "passed", "failed" (an exception or a nonzero exit), "timed out",
      or "killed" (a signal: the memory or CPU cap, a crash).
    detail: the end of what it wrote to stderr, or why it was stopped.
  """
  passed: bool
  status: str
  detail: str


def run_program(source: str, *, timeout: float = 10.0, memory_bytes: int = 2 << 30
                ) -> Outcome:
  """Runs `source` (after `PROLOGUE`) in its own process and limits; see the module docs.

  Args:
    source: a whole Python program; it passes by exiting with status 0.
    timeout: wall-clock seconds before its whole session is killed.
    memory_bytes: its address-space cap.
  """
  with tempfile.TemporaryDirectory(prefix="purejax-sandbox-") as folder:
    path = os.path.join(folder, "program.py")
    with open(path, "w", encoding="utf-8") as f:
      f.write(PROLOGUE.format(memory=int(memory_bytes), cpu=int(timeout) + 1) + source)
    process = subprocess.Popen(
        [sys.executable, "-I", path], cwd=folder, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={"PATH": os.defpath, "LANG": "C.UTF-8"}, start_new_session=True)
    try:
      _, err = process.communicate(timeout=timeout)
      timed_out = False
    except subprocess.TimeoutExpired:
      timed_out = True
    finally:
      try:
        os.killpg(process.pid, signal.SIGKILL)  # the program and anything it started
      except (ProcessLookupError, PermissionError):
        pass
    if timed_out:
      process.communicate()
      return Outcome(False, "timed out", f"still running after {timeout:g} s")
  detail = err.decode("utf-8", "replace")[-500:]
  if process.returncode == 0:
    return Outcome(True, "passed", "")
  if process.returncode < 0:
    return Outcome(False, "killed", f"signal {-process.returncode}; {detail}".strip("; "))
  return Outcome(False, "failed", detail)

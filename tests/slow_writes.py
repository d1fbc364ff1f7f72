"""Runs `python -m purejax.train` with every crash-safe write held open a moment.

    PYTHONPATH=. python tests/slow_writes.py SECONDS [train flags ...]

Each write pauses SECONDS after its data and before its rename into place,
so a test's SIGKILL can land inside a checkpoint write (tests/test_resume.py).
The pause is patched into `purejax._files` here; the library has no such hook.
"""

import runpy
import sys
import time

from purejax import _files


def _held_open(write, seconds):
  def atomic_write(path, write_fn):
    def slow_write_fn(f):
      write_fn(f)
      f.flush()
      time.sleep(seconds)  # the data is in the temp file; the rename waits
    write(path, slow_write_fn)
  return atomic_write


if __name__ == "__main__":
  delay = float(sys.argv[1])
  _files.atomic_write = _held_open(_files.atomic_write, delay)
  sys.argv = ["purejax.train"] + sys.argv[2:]
  runpy.run_module("purejax.train", run_name="__main__", alter_sys=True)

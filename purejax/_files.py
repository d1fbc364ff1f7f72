"""Crash-safe file writes, shared by every module that saves something.

A file is written under a temporary name beside its target, flushed to the
disk and renamed into place, and the folder is flushed too: after a crash at
any moment the target holds either its old content or the new, never a mix.
"""

import os
import pathlib
import tempfile


def fsync(path: pathlib.Path) -> None:
  """Forces a file's data, or a folder's entries (renames into it), onto the disk."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def atomic_write(path: pathlib.Path, write_fn) -> None:
  """Calls `write_fn(file)` on a temp file beside `path`, then renames it to `path`.

  After a crash, `path` holds either its old content or the new content,
  never a mix. On any error the temp file is removed and `path` is untouched.
  """
  path = pathlib.Path(path)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      write_fn(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  fsync(path.parent)


def atomic_write_bytes(path: pathlib.Path, payload: bytes) -> None:
  """`atomic_write` of a bytes payload."""
  atomic_write(path, lambda f: f.write(payload))

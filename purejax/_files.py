"""Crash-safe file writes, shared by every module that saves something.

A file is written under a temporary name beside its target, flushed to the
disk and renamed into place, and the folder is flushed too: after a crash at
any moment the target holds either its old content or the new, never a mix.

A temporary name records its writer: `.TARGET.HOST-PID-RANDOM.tmp`, HOST a
short hash of the machine's name. A writer killed before its rename (SIGKILL,
a power cut) cannot remove its temporary file, so the next write beside it
does: `remove_dead_temps` deletes the temporary files of writers on this
machine that are no longer alive. A temporary file of another machine (a
shared network folder) is left alone, since its writer cannot be checked.
"""

import hashlib
import os
import pathlib
import re
import shutil
import socket
import tempfile
from typing import List, Optional

# `.TARGET.HOST-PID-RANDOM.tmp`; `.TARGET.HOST-PID-RANDOM.old` is a replaced
# folder moved aside (`publish_dir`).
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[a-z0-9_]+"
                        r"\.(?P<kind>tmp|old)$")


def fsync(path: pathlib.Path) -> None:
  """Forces a file's data, or a folder's entries (renames into it), onto the disk."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _host_tag() -> str:
  return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _alive(pid: int) -> bool:
  if pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's live process
    return True
  return True


def remove_dead_temps(folder: pathlib.Path) -> List[pathlib.Path]:
  """Removes the temporary files and folders in `folder` whose writer, on this
  machine, is dead; returns what it removed.

  A replaced folder moved aside (`.TARGET....old`) is removed only once its
  target is back in place: until then it is the only copy.
  """
  folder = pathlib.Path(folder)
  removed = []
  try:
    entries = list(os.scandir(folder))
  except OSError:
    return removed
  host = _host_tag()
  for entry in entries:
    match = _TEMP_NAME.match(entry.name)
    if not match or match["host"] != host or _alive(int(match["pid"])):
      continue
    if match["kind"] == "old" and not (folder / match["target"]).exists():
      continue
    path = pathlib.Path(entry.path)
    try:
      if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(path)
      else:
        path.unlink()
    except FileNotFoundError:
      continue  # another process cleaned it first
    removed.append(path)
  return removed


def make_temp(path: pathlib.Path, *, directory: bool = False, kind: str = "tmp"
              ) -> pathlib.Path:
  """A new temporary file (or folder) beside `path`, named for this writer, after
  removing the dead writers' temporaries there (`remove_dead_temps`)."""
  path = pathlib.Path(path)
  remove_dead_temps(path.parent)
  prefix, suffix = f".{path.name}.{_host_tag()}-{os.getpid()}-", f".{kind}"
  if directory:
    return pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=prefix, suffix=suffix))
  fd, name = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=suffix)
  os.close(fd)
  return pathlib.Path(name)


def atomic_write(path: pathlib.Path, write_fn) -> None:
  """Calls `write_fn(file)` on a temp file beside `path`, then renames it to `path`.

  After a crash, `path` holds either its old content or the new content,
  never a mix. On any error the temp file is removed and `path` is untouched;
  after a kill, the next write beside `path` removes it.
  """
  path = pathlib.Path(path)
  if path.exists() and not path.is_file():  # a rename would replace a device or a FIFO
    raise OSError(f"{path} exists and is not a regular file; write to a file path.")
  tmp = make_temp(path)
  try:
    with open(tmp, "wb") as f:
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


def publish_dir(tmp: pathlib.Path, out: pathlib.Path) -> None:
  """Renames the finished folder `tmp` (a `make_temp(out, directory=True)`) to `out`.

  An old non-empty `out` is first moved aside into a hidden folder beside it
  and deleted only once the new one is in place; a crash between the two
  renames leaves it there, whole (and the next write beside it, once `out`
  is back, removes it).
  """
  old: Optional[pathlib.Path] = None
  if out.is_dir() and any(out.iterdir()):
    old = make_temp(out, directory=True, kind="old")
    os.replace(out, old / out.name)
  elif out.is_dir():
    out.rmdir()
  os.replace(tmp, out)
  fsync(out.parent)
  if old is not None:
    shutil.rmtree(old)

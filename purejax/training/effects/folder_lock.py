"""One writer per run folder: an OS file lock held for the writer's whole life.

    with folder_lock.hold(run.out_dir):   # raises FolderBusy if another process writes it
      ...train, save checkpoints, append metrics...

The lock is `flock` on `RUN_LOCK` in the folder, which also records the holder
(PID, host, start time, command line) for the refusal message. The operating
system releases it when the holder ends in any way, SIGKILL included, so a
lock never outlives its process and `--resume` right after a kill works. The
holder removes the file as it lets go; after a kill the file stays, unlocked
and of no meaning, until the next writer takes it. Readers (sampling,
chat, conversion, replay, plots, TensorBoard) never take it and never wait.

The training loops take it as their run starts. Within one process the lock
is re-entrant (a caller may hold a folder around a loop that takes it too):
only the last release unlocks. With several processes only process 0 writes, so only it
locks (`parallel.is_main_process`).

On network filesystems `flock` is as strong as the filesystem makes it: NFSv4
and Lustre (mounted with `flock`) lock across machines; NFSv3 without a lock
daemon, and some FUSE filesystems, refuse locks, and then the run goes on
unlocked after one warning line.
"""

import contextlib
import datetime
import errno
import json
import os
import pathlib
import socket
import sys
from typing import Callable, Dict, Iterator, List, Sequence

from purejax import _files
from purejax.training.pure import parallel

try:
  import fcntl
except ImportError:  # Windows: no flock; runs go on unlocked
  fcntl = None

RUN_LOCK = ".run.lock"

# realpath -> [open lock file, holders in this process, its path]
_HELD: Dict[str, List] = {}


class FolderBusy(ValueError):
  """Another live process holds the run folder's lock."""


def _holder(path: pathlib.Path) -> str:
  """Who holds the lock, as its file says."""
  try:
    record = json.loads(path.read_text(encoding="utf-8"))
    return (f"process {record['pid']} on {record['host']} (started {record['started']}: "
            f"{record['command']})")
  except (OSError, ValueError, KeyError, TypeError):
    return "another process"


def _record() -> str:
  return json.dumps({
      "pid": os.getpid(), "host": socket.gethostname(),
      "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      "command": " ".join(sys.argv) or "python"})


def _open_locked(path: pathlib.Path, folder: pathlib.Path, log: Callable[[str], None]):
  """The lock file, opened and locked; raises FolderBusy if another process holds it."""
  while True:
    file = open(path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    if fcntl is None:
      return file
    try:
      fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      file.close()
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise FolderBusy(
            f"{folder} is being written by {_holder(path)}; wait for it to end or stop it "
            f"(its lock ends with it, even after a kill), or pass another `out_dir`.") from None
      log(f"warning: {folder} cannot be locked ({e.strerror}); nothing stops a second "
          f"process from writing this run at the same time")
      return open(path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    try:  # the holder before removes the file as it lets go: lock the file that is there
      if os.stat(path).st_ino == os.fstat(file.fileno()).st_ino:
        return file
    except FileNotFoundError:
      pass
    file.close()


def _acquire(folder: pathlib.Path, log: Callable[[str], None]) -> None:
  key = os.path.realpath(folder)
  if key in _HELD:
    _HELD[key][1] += 1
    return
  folder.mkdir(parents=True, exist_ok=True)
  path = folder / RUN_LOCK
  file = _open_locked(path, folder, log)
  file.seek(0)
  file.truncate()
  file.write(_record())
  file.flush()
  _HELD[key] = [file, 1, path]
  for removed in _files.remove_dead_temps(folder):
    log(f"removed {removed.name}, left by a writer that was killed")


def _release(folder: pathlib.Path) -> None:
  key = os.path.realpath(folder)
  held = _HELD[key]
  held[1] -= 1
  if held[1] == 0:
    del _HELD[key]
    if fcntl is not None:  # still locked: a process that opened it meanwhile retries
      held[2].unlink(missing_ok=True)
    held[0].close()  # closing the file releases the flock


def holds(folder: str) -> bool:
  """Whether this process holds `folder`'s lock."""
  return os.path.realpath(folder) in _HELD


@contextlib.contextmanager
def hold(folders: Sequence[str] | str, log: Callable[[str], None] = print) -> Iterator[None]:
  """Holds the run lock of each folder (created if missing) while the block runs.

  Only process 0 locks; other processes pass through. Taking the locks also
  removes the temporary files that killed writers left in the folders.

  Raises:
    FolderBusy: another live process holds one of the folders; none is held.
  """
  folders = [folders] if isinstance(folders, (str, os.PathLike)) else list(folders)
  if not parallel.is_main_process():
    yield
    return
  taken = []
  try:
    for folder in folders:
      _acquire(pathlib.Path(folder), log)
      taken.append(folder)
    yield
  finally:
    for folder in reversed(taken):
      _release(pathlib.Path(folder))

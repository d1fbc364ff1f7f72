"""Crash-safe writes (`purejax._files`): a kill mid-write leaves the target as it
was, and the next write beside it removes what the killed writer left."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from helpers.data import REPO_ROOT
from purejax import _files

# Writes half a file through atomic_write, says so, then waits to be killed.
KILLED_MID_WRITE = """
import pathlib, sys, time
from purejax import _files
kind, target = sys.argv[1], pathlib.Path(sys.argv[2])
if kind == "file":
  def write(f):
    f.write(b"half of the new")
    f.flush()
    print("writing", flush=True)
    time.sleep(600)
  _files.atomic_write(target, write)
else:
  tmp = _files.make_temp(target, directory=True)
  (tmp / "weights").write_bytes(b"half")
  print("writing", flush=True)
  time.sleep(600)
"""


def killed_mid_write(kind: str, target: pathlib.Path) -> None:
  process = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, kind, str(target)],
                             cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
  assert process.stdout.readline().strip() == "writing"
  process.send_signal(signal.SIGKILL)
  process.wait()


def temps(folder: pathlib.Path):
  return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def dead_pid() -> int:
  process = subprocess.Popen([sys.executable, "-c", "pass"])
  process.wait()  # reaped: its PID names no process now
  return process.pid


def test_a_killed_file_write_keeps_the_target_and_the_next_write_removes_its_temp(tmp_path):
  target = tmp_path / "ckpt_10.npz"
  target.write_bytes(b"old")
  killed_mid_write("file", target)
  assert target.read_bytes() == b"old"
  (left,) = temps(tmp_path)
  assert left.startswith(".ckpt_10.npz.") and left.endswith(".tmp")
  _files.atomic_write_bytes(target, b"new")
  assert target.read_bytes() == b"new" and temps(tmp_path) == []


def test_a_killed_folder_export_is_removed_by_the_next_one_beside_it(tmp_path):
  killed_mid_write("folder", tmp_path / "export")
  assert len(temps(tmp_path)) == 1 and not (tmp_path / "export").exists()
  tmp = _files.make_temp(tmp_path / "other", directory=True)  # any write in the folder
  assert temps(tmp_path) == [tmp.name]


def test_only_dead_writers_of_this_machine_lose_their_temps(tmp_path):
  host, dead = _files._host_tag(), dead_pid()
  names = {
      "dead": f".a.npz.{host}-{dead}-abc123.tmp",
      "alive": f".b.npz.{host}-{os.getppid()}-abc123.tmp",  # the test runner's parent
      "mine": f".c.npz.{host}-{os.getpid()}-abc123.tmp",
      "other_machine": f".d.npz.0123abcd-{dead}-abc123.tmp",
      "not_a_temp": ".e.npz.tmp",
  }
  if host == "0123abcd":
    pytest.skip("this machine's tag is the test's stand-in for another machine")
  for name in names.values():
    (tmp_path / name).write_bytes(b"x")
  removed = _files.remove_dead_temps(tmp_path)
  assert [p.name for p in removed] == [names["dead"]]
  assert temps(tmp_path) == sorted(n for k, n in names.items() if k != "dead")


def test_a_replaced_folder_moved_aside_stays_until_its_target_is_back(tmp_path):
  aside = tmp_path / f".model.{_files._host_tag()}-{dead_pid()}-abc123.old"
  (aside / "model").mkdir(parents=True)  # killed between publish_dir's two renames
  assert _files.remove_dead_temps(tmp_path) == []  # the only copy of `model`
  (tmp_path / "model").mkdir()
  assert _files.remove_dead_temps(tmp_path) == [aside]


def test_publish_dir_replaces_a_folder_whole(tmp_path):
  out = tmp_path / "model"
  out.mkdir()
  (out / "old.txt").write_text("old")
  tmp = _files.make_temp(out, directory=True)
  (tmp / "new.txt").write_text("new")
  _files.publish_dir(tmp, out)
  assert [p.name for p in out.iterdir()] == ["new.txt"] and temps(tmp_path) == []


def test_a_device_or_folder_is_never_replaced_by_a_rename(tmp_path):
  with pytest.raises(OSError, match="not a regular file"):
    _files.atomic_write_bytes(tmp_path, b"x")
  with pytest.raises(OSError, match="not a regular file"):
    _files.atomic_write_bytes(pathlib.Path(os.devnull), b"x")
  assert not pathlib.Path(os.devnull).is_file()

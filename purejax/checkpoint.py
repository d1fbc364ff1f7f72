"""Saving and loading params as `.npz` files with a JSON description.

A params pytree (nested dicts of arrays) is stored flat, one array per path,
e.g. `blocks/attn/qkv/w`, so a file can be opened with plain numpy and read
without purejax. Writes are atomic: a crash mid-save leaves the previous
file intact.
"""

import dataclasses
import json
import os
import pathlib
import tempfile
from typing import Any, Dict, Tuple

import numpy as np

PARAMS_FILE = "params.npz"
_SEP = "/"


class CheckpointError(RuntimeError):
  """A checkpoint is missing, unreadable or does not fit; the message says why."""


def flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, np.ndarray]:
  """`{"a": {"b": x}}` -> `{"a/b": x}` (arrays as numpy)."""
  flat = {}
  for name, value in tree.items():
    if _SEP in name:
      raise ValueError(f"param name {name!r} may not contain {_SEP!r}.")
    path = f"{prefix}{name}"
    if isinstance(value, dict):
      flat.update(flatten(value, path + _SEP))
    else:
      flat[path] = np.asarray(value)
  return flat


def unflatten(flat: Dict[str, np.ndarray]) -> Dict[str, Any]:
  """Inverse of `flatten`."""
  tree: Dict[str, Any] = {}
  for path, value in flat.items():
    node = tree
    *parents, leaf = path.split(_SEP)
    for name in parents:
      node = node.setdefault(name, {})
    node[leaf] = value
  return tree


def config_to_dict(config) -> Dict[str, Any]:
  return dataclasses.asdict(config)


def atomic_write(path: pathlib.Path, write_fn) -> None:
  """Calls `write_fn(file)` on a temp file next to `path`, then renames it.

  The data is fsynced before the rename and the directory after it, so after
  a crash `path` holds either the old or the new content, never a mix.
  """
  path.parent.mkdir(parents=True, exist_ok=True)
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
  dir_fd = os.open(path.parent, os.O_RDONLY)
  try:
    os.fsync(dir_fd)
  finally:
    os.close(dir_fd)


def save_params(out_dir: str, params: Dict[str, Any], meta: Dict[str, Any]) -> pathlib.Path:
  """Saves `params` and JSON-serialisable `meta` to `out_dir/params.npz`."""
  path = pathlib.Path(out_dir) / PARAMS_FILE
  arrays = flatten(params)
  arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
  try:
    atomic_write(path, lambda f: np.savez(f, **arrays))
  except OSError as e:
    raise CheckpointError(f"cannot write {path}: {e}; pass a writable --out_dir.") from e
  return path


def load_params(out_dir: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """Loads `(params, meta)` saved by `save_params`."""
  path = pathlib.Path(out_dir) / PARAMS_FILE
  if not path.is_file():
    raise CheckpointError(f"no {PARAMS_FILE} in {out_dir}; train first with "
                          f"`python -m purejax.train --out_dir={out_dir}`.")
  try:
    with np.load(path) as npz:
      flat = {name: npz[name] for name in npz.files}
  except Exception as e:  # zipfile/numpy raise many kinds for a damaged file
    raise CheckpointError(f"{path} is damaged or not a purejax checkpoint ({e}).") from e
  meta = json.loads(flat.pop("__meta__").tobytes().decode())
  return unflatten(flat), meta

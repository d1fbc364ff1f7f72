"""Checkpoints of a whole training state that survive crashes.

A checkpoint is one `.npz` file, `ckpt_<step>.npz`, in the run's `out_dir`:

* every leaf of the state pytree (params, optimizer state, PRNG keys, ...) is
  stored under its pytree path, e.g. `['params']['blocks']['attn']['qkv']['w']`,
  so it opens with plain `numpy.load`;
* a JSON manifest (`__manifest__`) holds the step, the caller's metadata
  (model, config, vocabulary, metrics history) and a SHA-256 over every
  array's path, dtype, shape and bytes.

Guarantees:

* **Atomic writes.** The file is written under a temporary name, fsynced,
  renamed into place, and the directory is fsynced. A crash at any moment
  leaves either the previous checkpoint set or the new one.
* **Verified reads.** A truncated or bit-flipped file fails the zip CRC or
  the SHA-256 and raises `CheckpointError`. `restore_latest` then falls
  back to the next older valid checkpoint.
* **Nothing valid is lost.** Older checkpoints beyond `keep` are deleted
  only after the new one is complete and renamed into place.
* **Structure checks.** Restoring against a template (the state a fresh run
  would start from) refuses a checkpoint whose paths, shapes or dtypes
  differ, e.g. one from another model or config.

Arrays that never change over a run (a LoRA run's frozen base: `frozen`) are
written once, to `frozen_<sha256>.npz` beside the checkpoints, named by the
SHA-256 of their contents; each checkpoint's manifest names that file and its
digest, and `read` verifies and joins it. A LoRA run's checkpoints then hold
the adapters and their optimizer state, not the whole model again each time.
A frozen file is deleted with the last checkpoint that names it. One missing
or damaged is taken from the template a run restores against where that
holds the same arrays (the base loaded again from its source), and written
again by the next save.
"""

import hashlib
import json
import pathlib
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from purejax import _files

FORMAT_VERSION = 1
_MANIFEST = "__manifest__"
_NAME = re.compile(r"^ckpt_(\d{9})\.npz$")
_FROZEN = re.compile(r"^frozen_[0-9a-f]{64}\.npz$")


class CheckpointError(RuntimeError):
  """A checkpoint is missing, damaged, or does not fit; the message says which."""


def checkpoint_path(out_dir: str, step: int) -> pathlib.Path:
  return pathlib.Path(out_dir) / f"ckpt_{step:09d}.npz"


def _flatten(state) -> Dict[str, Any]:
  """`{pytree path: leaf}`; leaves become numpy arrays (shape structs stay as they are)."""
  leaves = jax.tree_util.tree_leaves_with_path(state)
  return {jax.tree_util.keystr(path): leaf if isinstance(leaf, jax.ShapeDtypeStruct)
          else np.asarray(leaf) for path, leaf in leaves}


def _digest(arrays: Dict[str, np.ndarray]) -> str:
  sha = hashlib.sha256()
  for name in sorted(arrays):
    array = np.ascontiguousarray(arrays[name])
    sha.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
    sha.update(array.tobytes())
  return sha.hexdigest()


def _payload(arrays: Dict[str, np.ndarray], manifest: Dict[str, Any]
             ) -> Tuple[Dict[str, Any], str]:
  """What `np.savez` writes: the arrays, and the manifest with their digest; and the digest.

  npz has no bfloat16 (it would read back as raw 2-byte voids): such arrays are
  stored as their uint16 bits, named in the manifest, and viewed back on reading."""
  bf16 = sorted(name for name, a in arrays.items() if a.dtype == jnp.bfloat16)
  digest = _digest(arrays)
  manifest = {**manifest, "sha256": digest, **({"bfloat16": bf16} if bf16 else {})}
  payload = {name: a.view(np.uint16) if name in bf16 else a for name, a in arrays.items()}
  payload[_MANIFEST] = np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8)
  return payload, digest


def _frozen_names(arrays: Dict[str, np.ndarray], frozen: Sequence[str]) -> List[str]:
  return sorted(name for name in arrays if any(name.startswith(p) for p in frozen))


# Frozen files this process wrote or read back whole: trusted by later saves.
_CHECKED: Set[str] = set()


def _holds(frozen_path: pathlib.Path, digest: str) -> bool:
  """Whether `frozen_path` holds the frozen arrays of `digest`. A file this process has
  not written is read back once (a damaged one is then written again), not every save."""
  if str(frozen_path.resolve()) in _CHECKED:
    return frozen_path.exists()
  try:
    holds = frozen_path.exists() and _read_file(frozen_path)[1].get("sha256") == digest
  except CheckpointError:
    holds = False
  if holds:
    _CHECKED.add(str(frozen_path.resolve()))
  return holds


def _write(path: pathlib.Path, step: int, state: Any, meta: Dict[str, Any],
           frozen: Sequence[str] = ()) -> None:
  """Writes one checkpoint file atomically (see `atomic_write`); the arrays under the
  `frozen` path prefixes go to their own file, written only if it is not there yet."""
  arrays = _flatten(jax.device_get(state))
  manifest = {"format": FORMAT_VERSION, "step": int(step), "meta": meta}
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = _frozen_names(arrays, frozen)
    if names:
      shared = {name: arrays.pop(name) for name in names}
      payload, digest = _payload(shared, {"format": FORMAT_VERSION})
      frozen_path = path.parent / f"frozen_{digest}.npz"
      if not _holds(frozen_path, digest):
        _files.atomic_write(frozen_path, lambda f: np.savez(f, **payload))
        _CHECKED.add(str(frozen_path.resolve()))
      manifest["frozen"] = {"file": frozen_path.name, "sha256": digest,
                            "prefixes": sorted(frozen)}
    payload, _ = _payload(arrays, manifest)
    _files.atomic_write(path, lambda f: np.savez(f, **payload))
  except OSError as e:
    raise CheckpointError(
        f"could not write checkpoint {path}: {e.strerror or e}. The previous "
        f"checkpoints are intact; free disk space or pass a writable `out_dir`.") from e


def save(out_dir: str, step: int, state: Any, meta: Dict[str, Any], *, keep: int = 3,
         frozen: Sequence[str] = ()) -> pathlib.Path:
  """Writes `state` at `step` atomically, then prunes to the newest `keep`.

  Args:
    out_dir: the run's directory (created if missing).
    step: training step (or epoch) the state is at.
    state: pytree of arrays (dicts, lists, tuples, NamedTuples such as optax
      states).
    meta: JSON-serialisable metadata, returned by `restore`.
    keep: how many checkpoints to keep (>= 1).
    frozen: path prefixes (`jax.tree_util.keystr`'s, e.g. `"['params']['base']"`)
      of arrays that never change over the run: written once, to a file of their
      own that every checkpoint holding them names (see the module's docstring).

  Returns:
    The path written.

  Raises:
    CheckpointError: the directory is not writable or the disk is full. The
      previous checkpoints are left as they were.
  """
  if keep < 1:
    raise ValueError(f"keep must be >= 1, got {keep}.")
  path = checkpoint_path(out_dir, step)
  _write(path, step, state, meta, frozen)
  prune(out_dir, keep)
  return path


def prune(out_dir: str, keep: int) -> None:
  """Deletes all but the newest `keep` checkpoints of `out_dir` (a sweep prunes its
  runs only after every run's checkpoint of a step is written), then the frozen files
  no checkpoint left names."""
  for _, old in list_checkpoints(out_dir)[keep:]:
    old.unlink(missing_ok=True)
  directory = pathlib.Path(out_dir)
  frozen = [p for p in directory.iterdir() if _FROZEN.match(p.name)] if (
      directory.is_dir()) else []
  if not frozen:
    return
  named = set()
  for path in [p for _, p in list_checkpoints(out_dir)] + [best_path(out_dir)]:
    if not path.exists():
      continue
    try:
      named.add(_manifest(path).get("frozen", {}).get("file"))
    except CheckpointError:
      return  # a checkpoint whose manifest does not read: keep every frozen file
  for path in frozen:
    if path.name not in named:
      path.unlink(missing_ok=True)


def best_path(out_dir: str) -> pathlib.Path:
  """Where `save_best` keeps the run's best checkpoint (outside the keep-K rotation)."""
  return pathlib.Path(out_dir) / "ckpt_best.npz"


def save_best(out_dir: str, step: int, state: Any, meta: Dict[str, Any], *,
              frozen: Sequence[str] = ()) -> pathlib.Path:
  """Writes `state` as the run's best checkpoint, replacing the previous best atomically
  (`frozen` as `save`'s)."""
  path = best_path(out_dir)
  _write(path, step, state, meta, frozen)
  return path


def list_checkpoints(out_dir: str) -> List[Tuple[int, pathlib.Path]]:
  """`(step, path)` of every checkpoint file in `out_dir`, newest first."""
  directory = pathlib.Path(out_dir)
  if not directory.is_dir():
    return []
  found = []
  for path in directory.iterdir():
    match = _NAME.match(path.name)
    if match:
      found.append((int(match.group(1)), path))
  return sorted(found, reverse=True)


class Restored(NamedTuple):
  state: Any
  meta: Dict[str, Any]
  step: int
  path: pathlib.Path


def _manifest(path: pathlib.Path) -> Dict[str, Any]:
  """The manifest of a checkpoint file alone (its arrays are not read)."""
  try:
    with np.load(path, allow_pickle=False) as npz:
      return json.loads(npz[_MANIFEST].tobytes().decode())
  except Exception as e:  # zipfile, numpy, JSON and OS errors all mean "unreadable"
    raise CheckpointError(f"checkpoint {path} is damaged or truncated ({e}).") from e


def _read_file(path: pathlib.Path) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
  """One file's verified arrays and manifest."""
  try:
    with np.load(path, allow_pickle=False) as npz:
      arrays = {name: npz[name] for name in npz.files}
  except Exception as e:  # zipfile, numpy and OS errors all mean "unreadable"
    raise CheckpointError(f"checkpoint {path} is damaged or truncated ({e}).") from e
  if _MANIFEST not in arrays:
    raise CheckpointError(f"{path} is not a purejax checkpoint (no manifest).")
  try:
    manifest = json.loads(arrays.pop(_MANIFEST).tobytes().decode())
  except ValueError as e:
    raise CheckpointError(f"checkpoint {path} has a damaged manifest.") from e
  for name in manifest.get("bfloat16", ()):
    if name in arrays:
      arrays[name] = arrays[name].view(jnp.bfloat16)
  if _digest(arrays) != manifest.get("sha256"):
    raise CheckpointError(f"checkpoint {path} fails its checksum (corrupted on disk).")
  return arrays, manifest


def read(path: pathlib.Path, template: Any = None
         ) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
  """Reads and verifies one checkpoint file, with the frozen arrays it names:
  `(arrays by path, manifest)`.

  Where the frozen file is missing or damaged and `template` (the state a fresh run
  starts from) holds arrays of the same SHA-256 under the same paths (a LoRA run's
  base, loaded again from its source), those are used instead."""
  arrays, manifest = _read_file(path)
  if "frozen" not in manifest:
    return arrays, manifest
  frozen = manifest["frozen"]
  frozen_path = pathlib.Path(path).parent / frozen["file"]
  try:
    if not frozen_path.exists():
      raise CheckpointError(f"checkpoint {path} names {frozen_path.name}, which is not "
                            f"beside it; copy a run folder whole.")
    shared, shared_manifest = _read_file(frozen_path)
    if shared_manifest["sha256"] != frozen["sha256"]:
      raise CheckpointError(f"checkpoint {path} names {frozen_path.name}, which holds "
                            f"other arrays.")
    _CHECKED.add(str(frozen_path.resolve()))  # read whole: a save need not read it again
  except CheckpointError as e:
    shared = _frozen_from(template, frozen)
    if shared is None:
      raise
    manifest = {**manifest, "frozen": {**frozen, "taken_from_template": str(e)}}
    _CHECKED.discard(str(frozen_path.resolve()))  # the next save writes it again
  arrays.update(shared)
  return arrays, manifest


def _frozen_from(template: Any, frozen: Dict[str, Any]) -> Optional[Dict[str, np.ndarray]]:
  """`template`'s arrays under the frozen prefixes, if their SHA-256 is the checkpoint's."""
  if template is None or "prefixes" not in frozen:
    return None
  arrays = _flatten(jax.device_get(template))
  shared = {name: arrays[name] for name in _frozen_names(arrays, frozen["prefixes"])}
  return shared if shared and _digest(shared) == frozen["sha256"] else None


def restore(path: pathlib.Path, template: Any) -> Restored:
  """Loads `path` into the structure of `template`.

  Args:
    path: a checkpoint file.
    template: a pytree with the structure, shapes and dtypes expected (e.g.
      the freshly initialised state of the run being resumed).

  Returns:
    `Restored(state, meta, step, path)`; `state` has `template`'s structure.

  Raises:
    CheckpointError: damaged file, or a structure that does not match.
  """
  arrays, manifest = read(path, template)
  state = extract(arrays, template, path)
  return Restored(state, manifest["meta"], manifest["step"], path)


def extract(arrays: Dict[str, np.ndarray], template: Any, path="checkpoint", *,
            renamed: Optional[Dict[str, str]] = None) -> Any:
  """Builds `template`'s structure from `read`'s arrays (a subset is fine).

  `renamed` maps names that earlier files used to the names of today's
  arrays (`{"['data_key']": "['keys']['data']"}`), so those files restore.

  Raises:
    CheckpointError: a path of `template` is missing, or its shape or dtype differs.
  """
  for old, new in (renamed or {}).items():
    if old in arrays and new not in arrays:
      arrays = {**arrays, new: arrays[old]}
  expected = _flatten(jax.eval_shape(lambda: template))
  missing = sorted(set(expected) - set(arrays))
  if missing:
    raise CheckpointError(
        f"checkpoint {path} holds a different model/config: it lacks {missing[:3]}. "
        f"Use the settings it was trained with, or another `out_dir`.")
  for name, want in expected.items():
    got = arrays[name]
    if got.shape != tuple(want.shape) or got.dtype != want.dtype:
      raise CheckpointError(
          f"checkpoint {path} does not fit this model/config: {name} is "
          f"{got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}. "
          f"Use the settings it was trained with, or another `out_dir`.")
  leaves_with_paths = jax.tree_util.tree_leaves_with_path(template)
  treedef = jax.tree_util.tree_structure(template)
  leaves = [arrays[jax.tree_util.keystr(p)] for p, _ in leaves_with_paths]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def restore_latest(
    out_dir: str, template: Any,
    check_meta: Optional[Callable[[Dict[str, Any], pathlib.Path], None]] = None, *,
    renamed: Optional[Dict[str, str]] = None,
    at_most: Optional[int] = None,
) -> Tuple[Optional[Restored], List[str]]:
  """Restores the newest checkpoint in `out_dir` that reads and verifies.

  Damaged checkpoints are skipped (not deleted), each with a warning.
  A checkpoint that reads fine but does not fit `template` is an error: it
  means the flags differ from the run's, and falling back would hide that.

  Args:
    out_dir: the run directory.
    template: the state structure expected (see `restore`).
    check_meta: optional `f(meta, path)` that raises `CheckpointError` when
      the checkpoint belongs to another run; called before the structure check.
    renamed: old array names -> new ones (see `extract`).
    at_most: consider only checkpoints of this step or older (a sweep resumes
      every run from the newest step they all saved).

  Returns:
    `(restored or None if there is no valid checkpoint, warnings)`.
  """
  warnings = []
  for step, path in list_checkpoints(out_dir):
    if at_most is not None and step > at_most:
      continue
    try:
      arrays, manifest = read(path, template)
    except CheckpointError as e:
      warnings.append(f"skipping {e}")
      continue
    problem = manifest.get("frozen", {}).get("taken_from_template")
    if problem:
      warnings.append(f"{problem}: its arrays are the run's starting weights (the same "
                      f"SHA-256), taken from those; the next checkpoint writes the file again")
    if check_meta is not None:
      check_meta(manifest["meta"], path)
    return Restored(extract(arrays, template, path, renamed=renamed), manifest["meta"],
                    manifest["step"], path), warnings
  return None, warnings


def valid_steps(out_dir: str) -> List[int]:
  """Steps of the checkpoints in `out_dir` that read and verify, newest first."""
  found = []
  for step, path in list_checkpoints(out_dir):
    try:
      read(path)
    except CheckpointError:
      continue
    found.append(step)
  return found


def latest_meta(out_dir: str) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
  """Arrays and metadata of the newest valid checkpoint, without a template.

  For tools like `purejax.sample` that rebuild the template from the meta.
  """
  problems = []
  for _, path in list_checkpoints(out_dir):
    try:
      arrays, manifest = read(path)
    except CheckpointError as e:
      problems.append(str(e))
      continue
    return arrays, manifest["meta"]
  detail = f" ({'; '.join(problems)})" if problems else ""
  raise CheckpointError(f"no valid checkpoint in {out_dir}{detail}; train first "
                        f"(`gpt_loop.train_gpt`, or `python -m purejax.train`) into it.")


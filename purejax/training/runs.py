"""A training run's life, shared by every model's loop: start or resume, save, stop.

    run = RunConfig(out_dir="out-gpt", resume=True)
    check_out_dir(run.out_dir)
    state, step, logs = start_or_resume(run, template, meta)
    ...
    check_finite(losses, step, last_saved, skip=run.skip_nonfinite)
    if step % every == 0 or stop_requested():
      last_saved = save_checkpoint(run, step, state, meta, logs)

Every function takes its settings as arguments; none reads flags. With
several processes, each function here is called on all of them; only
process 0 writes.
"""

import contextlib
import dataclasses
import functools
import json
import pathlib
import signal
import tempfile
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import optax

from purejax.training import checkpoint
from purejax.training import parallel


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Where a run lives and how it persists.

  Attributes:
    out_dir: the run directory, for checkpoints (one shared directory when
      there are several hosts).
    resume: continue from the newest valid checkpoint in `out_dir`; without
      it, an `out_dir` holding checkpoints is refused, so nothing is
      overwritten.
    keep_checkpoints: newest checkpoints kept.
    skip_nonfinite: skip updates whose gradients are NaN/Inf instead of
      stopping at the first non-finite loss.
  """
  out_dir: str
  resume: bool = False
  keep_checkpoints: int = 3
  skip_nonfinite: bool = False

  def __post_init__(self):
    if self.keep_checkpoints < 1:
      raise ValueError(f"--keep_checkpoints must be a positive integer, got "
                       f"{self.keep_checkpoints}.")


_SINKS: List[Callable[[str], None]] = []


def log(message: str) -> None:
  """Prints on process 0 only, so a multi-host run logs once (through `log_to`'s sink)."""
  if parallel.is_main_process():
    (_SINKS[-1] if _SINKS else functools.partial(print, flush=True))(message)


@contextlib.contextmanager
def log_to(sink: Callable[[str], None]):
  """Within the block, `log` lines go to `sink` (e.g. a progress bar's `write`)."""
  _SINKS.append(sink)
  try:
    yield
  finally:
    _SINKS.pop()


def require_positive(**values: Optional[int]) -> None:
  """Raises ValueError naming the first value that is not a positive integer."""
  for name, value in values.items():
    if value is None or value < 1:
      raise ValueError(f"--{name} must be a positive integer, got {value}.")


def check_out_dir(out_dir: str) -> None:
  """Fails before training if checkpoints could not be written to `out_dir`."""
  if not parallel.is_main_process():
    return  # only process 0 writes
  path = pathlib.Path(out_dir)
  try:
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
      pass
  except OSError as e:
    raise ValueError(f"--out_dir={out_dir} is not writable ({e.strerror or e}); pass "
                     f"a writable directory.") from None


# ----------------------------------------------------------------------------
# Signals


class Interrupted(Exception):
  """SIGINT/SIGTERM arrived; the loop saved a checkpoint and stops."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


# Signals are process-wide, so the note of one is too.
_PENDING_SIGNALS: List[int] = []


def _on_signal(signum, frame):  # pylint: disable=unused-argument
  # Only note it: the loop saves a checkpoint at the next step boundary.
  _PENDING_SIGNALS.append(signum)


def catch_stop_signals() -> None:
  """From now on, SIGINT and SIGTERM ask the loop to save and stop.

  Call it after `jax.distributed` starts (its preemption notifier takes
  SIGTERM for itself).
  """
  _PENDING_SIGNALS.clear()
  signal.signal(signal.SIGINT, _on_signal)
  signal.signal(signal.SIGTERM, _on_signal)


def stop_requested() -> bool:
  """Whether any process got SIGINT/SIGTERM (a collective: all processes ask)."""
  stop = parallel.any_process(bool(_PENDING_SIGNALS))
  if stop and not _PENDING_SIGNALS:  # another process was signalled
    _PENDING_SIGNALS.append(signal.SIGTERM)
  return stop


def raise_if_stopped(stop: bool) -> None:
  """Raises `Interrupted` for the first pending signal when `stop`."""
  if stop:
    raise Interrupted(_PENDING_SIGNALS[0])


# ----------------------------------------------------------------------------
# Non-finite losses


class NonFiniteLoss(RuntimeError):
  """The loss became NaN/Inf; the last checkpoint is intact."""


def check_finite(losses: np.ndarray, first_step: int, last_saved: Optional[str], *,
                 skip: bool = False) -> None:
  """Raises `NonFiniteLoss` at the first NaN/Inf in `losses` (with `skip`, only warns).

  Args:
    losses: losses of steps `first_step, first_step + 1, ...`.
    first_step: step of `losses[0]`.
    last_saved: path of the newest checkpoint, for the message; None if none.
    skip: the optimizer skips non-finite updates (`skip_nonfinite_updates`).
  """
  bad = np.flatnonzero(~np.isfinite(losses))
  if not bad.size:
    return
  where = f"loss is {losses[bad[0]]} at step {first_step + int(bad[0])}"
  if skip:
    log(f"warning: {where}; skipping non-finite updates (--skip_nonfinite)")
    return
  saved = (f"the last good checkpoint, {last_saved}, is intact: resume from it with "
           f"--resume" if last_saved else "no checkpoint was saved before it")
  raise NonFiniteLoss(f"{where}; stopped without saving. {saved}. Try a lower "
                      f"--learning_rate, or --skip_nonfinite to skip such updates.")


def skip_nonfinite_updates(optimizer: optax.GradientTransformation
                           ) -> optax.GradientTransformation:
  """`optimizer` that leaves params and moments unchanged on NaN/Inf gradients."""
  return optax.apply_if_finite(optimizer, max_consecutive_errors=100)


# ----------------------------------------------------------------------------
# Checkpoints


def start_or_resume(
    run: RunConfig,
    template: Any,
    meta: Dict[str, Any],
    *,
    identity: Sequence[str] = ("model", "config", "optimizer", "batch_size", "seed"),
    saved_defaults: Optional[Dict[str, Dict[str, Any]]] = None,
    ignored: Optional[Dict[str, Sequence[str]]] = None,
    digest_extra: Any = None,
) -> Tuple[Any, int, Dict[str, Any]]:
  """The state to start from: `template` at step 0, or the newest valid checkpoint.

  Every process reads `run.out_dir` (so with several hosts it must be on a
  shared filesystem), and they must all find the same checkpoint.

  Args:
    run: the run's settings.
    template: the state a fresh run starts from (structure, shapes, dtypes).
    meta: this run's metadata, saved with every checkpoint.
    identity: keys of `meta` that must equal the checkpoint's for it to
      continue the same computation; a difference names the key.
    saved_defaults: `{meta key: {field: default}}` filled into a saved dict
      before comparing, so a checkpoint saved before a field existed counts
      as trained with that field's default.
    ignored: `{meta key: [field, ...]}` left out of the comparison (settings
      a resumed run may change, e.g. where the schedule ends).
    digest_extra: further settings that must agree across processes.

  Returns:
    `(state, step, saved meta)`; the saved meta is `{}` on a fresh start.
  """
  digest = zlib.crc32(json.dumps([meta, digest_extra, run.out_dir], sort_keys=True,
                                 default=str).encode()) & 0x7FFFFFFF
  parallel.check_same_on_all_processes(
      digest, "the processes were started with different flags; pass the same "
      "flags to every process (only --process_id differs).")
  state, step, saved = _start_or_resume(run, template, meta, identity,
                                        saved_defaults or {}, ignored or {})
  parallel.check_same_on_all_processes(
      step, f"the processes found different checkpoints in {run.out_dir}; with several "
      f"hosts --out_dir must be one shared directory.")
  return state, step, saved


def _start_or_resume(run, template, meta, identity, saved_defaults, ignored):
  existing = checkpoint.list_checkpoints(run.out_dir)
  if not run.resume:
    if existing:
      raise ValueError(
          f"{run.out_dir} already holds checkpoints (newest: {existing[0][1].name}); pass "
          f"--resume to continue that run, or another --out_dir for a new one.")
    return template, 0, {}

  def without_ignored(name, value):
    if not isinstance(value, dict):
      return value
    return {k: v for k, v in value.items() if k not in ignored.get(name, ())}

  def same_run(saved, path):
    for name in identity:
      value = saved.get(name)
      if isinstance(value, dict) and name in saved_defaults:
        value = {**saved_defaults[name], **value}
      if without_ignored(name, value) != without_ignored(name, meta.get(name)):
        raise checkpoint.CheckpointError(
            f"{path} was trained with {name}={value!r}, this run has "
            f"{meta.get(name)!r}; resume with the original flags or use another --out_dir.")

  restored, warnings = checkpoint.restore_latest(run.out_dir, template, check_meta=same_run)
  for warning in warnings:
    log(f"warning: {warning}")
  if restored is None:
    log(f"--resume: no valid checkpoint in {run.out_dir}, so this starts a new run")
    return template, 0, {}
  log(f"resumed from {restored.path} at step {restored.step}")
  return restored.state, restored.step, restored.meta


def save_checkpoint(run: RunConfig, step: int, state: Any, meta: Dict[str, Any], *,
                    best: bool = False) -> pathlib.Path:
  """Gathers `state` to the hosts (all processes), and process 0 writes it.

  The file holds whole arrays, whatever the sharding, so it restores on any
  number of devices. `best=True` writes the run's best checkpoint
  (`checkpoint.best_path`) instead of one of the keep-K rotation.
  """
  state = parallel.fetch(state)
  path = (checkpoint.best_path(run.out_dir) if best else
          checkpoint.checkpoint_path(run.out_dir, step))
  if parallel.is_main_process():
    if best:
      checkpoint.save_best(run.out_dir, step, state, meta)
      log(f"saved {path} (lowest val loss so far)")
    else:
      checkpoint.save(run.out_dir, step, state, meta, keep=run.keep_checkpoints)
      log(f"saved {path}")
  return path


def every(interval: int, step: int, last: int) -> bool:
  """Whether `step` is a multiple of `interval`, or the run's `last` step."""
  return step % interval == 0 or step == last


def next_boundary(step: int, intervals: Sequence[int], last: int) -> int:
  """The first step after `step` that is a multiple of one of `intervals`, or `last`."""
  return min([(step // n + 1) * n for n in intervals] + [last])


def dataclass_defaults(cls: Callable) -> Dict[str, Any]:
  """`{field: default}` of a dataclass."""
  return {f.name: f.default for f in dataclasses.fields(cls)}

"""A training run's life, shared by every model's loop: start or resume, save, stop.

    run = RunConfig(out_dir="out-gpt", resume=True)
    check_out_dir(run.out_dir)
    state, step, saved_meta = start_or_resume(run, template, meta)  # TrainStates
    ...
    if every(checkpoint_every, step, max_iters):
      last_saved = save_checkpoint(run, step, state, meta)

Every function takes its settings as arguments; none reads flags. Lines
for the user go to a `log` argument (default `print_line`). With several
processes, each function here is called on all of them; only process 0
writes.
"""

import dataclasses
import json
import pathlib
import tempfile
import zlib
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence

from purejax import checkpoint
from purejax.optimizers import optim
from purejax.training.pure import parallel
from purejax.training.pure import state as state_lib
from purejax.training.pure.state import TrainState

Log = Callable[[str], None]


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
      raise ValueError(f"`RunConfig.keep_checkpoints` must be a positive integer, got "
                       f"{self.keep_checkpoints}.")


def print_line(message: str) -> None:
  """The default `log` of this module's functions: a line on stdout, from process 0
  only, so a multi-host run logs once."""
  if parallel.is_main_process():
    print(message, flush=True)


def require_positive(**values: Optional[int]) -> None:
  """Raises ValueError naming the first value that is not a positive integer."""
  for name, value in values.items():
    if value is None or value < 1:
      raise ValueError(f"`{name}` must be a positive integer, got {value}.")


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
    raise ValueError(f"`out_dir={out_dir}` is not writable ({e.strerror or e}); pass "
                     f"a writable directory.") from None


# ----------------------------------------------------------------------------
# Checkpoints


class Start(NamedTuple):
  """Where a run starts (`start_or_resume`).

  Attributes:
    state: the template (a new run) or the restored checkpoint's state.
    step: 0, or the checkpoint's step.
    saved: the checkpoint's metadata; `{}` in a new run.
  """
  state: TrainState
  step: int
  saved: Dict[str, Any]


def start_or_resume(
    run: RunConfig,
    template: TrainState,
    meta: Dict[str, Any],
    *,
    identity: Sequence[str] = ("model", "config", "optimizer", "batch_size", "seed", "lora"),
    saved_defaults: Optional[Dict[str, Any]] = None,
    ignored: Optional[Dict[str, Sequence[str]]] = None,
    digest_extra: Any = None,
    log: Log = print_line,
    at_most: Optional[int] = None,
) -> Start:
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
      before comparing, so a checkpoint saved before a field existed counts as
      trained with that field's default; or a function of the saved dict giving
      the whole record this version would write for it (the optimizer's:
      `optim.saved_record`).
    ignored: `{meta key: [field, ...]}` left out of the comparison (settings
      a resumed run may change, e.g. where the schedule ends).
    digest_extra: further settings that must agree across processes.
    log: where the lines on what was found go.
    at_most: resume from the newest valid checkpoint of this step or older
      (a sweep's runs resume from the newest step they all saved).

  Returns:
    `Start(state, step, saved)`; `saved` is `{}` on a fresh start.
  """
  digest = zlib.crc32(json.dumps([meta, digest_extra, run.out_dir], sort_keys=True,
                                 default=str).encode()) & 0x7FFFFFFF
  parallel.check_same_on_all_processes(
      digest, "the processes were started with different settings; pass the same "
      "settings to every process (only `process_id` differs).")
  saved_defaults = {"optimizer": optim.saved_record, **(saved_defaults or {})}
  state, step, saved = _start_or_resume(run, template, meta, identity,
                                        saved_defaults, ignored or {}, log, at_most)
  parallel.check_same_on_all_processes(
      step, f"the processes found different checkpoints in {run.out_dir}; with several "
      f"hosts `out_dir` must be one shared directory.")
  return Start(state, step, saved)


def _difference(name: str, saved: Any, asked: Any) -> str:
  """`"lora.alpha=8.0, this run has 16.0"`: the first field that differs, or the whole values."""
  if isinstance(saved, dict) and isinstance(asked, dict):
    for field in sorted(set(saved) | set(asked)):
      if saved.get(field) != asked.get(field):
        return (f"{name}.{field}={saved.get(field)!r}, this run has "
                f"{name}.{field}={asked.get(field)!r}")
  return f"{name}={saved!r}, this run has {name}={asked!r}"


def _start_or_resume(run, template, meta, identity, saved_defaults, ignored, log, at_most):
  existing = checkpoint.list_checkpoints(run.out_dir)
  if not run.resume:
    if existing:
      raise ValueError(
          f"{run.out_dir} already holds checkpoints (newest: {existing[0][1].name}); pass "
          f"`resume=True` to continue that run, or another `out_dir` for a new one.")
    return template, 0, {}

  def without_ignored(name, value):
    if not isinstance(value, dict):
      return value
    return {k: v for k, v in value.items() if k not in ignored.get(name, ())}

  def same_run(saved, path):
    for name in identity:
      value = saved.get(name)
      if isinstance(value, dict) and name in saved_defaults:
        defaults = saved_defaults[name]
        value = defaults(value) if callable(defaults) else {**defaults, **value}
      # as JSON holds them (a tuple reads back as a list)
      saved_value = without_ignored(name, value)
      asked = json.loads(json.dumps(without_ignored(name, meta.get(name)), default=str))
      if saved_value != asked:
        raise checkpoint.CheckpointError(
            f"{path} was trained with {_difference(name, saved_value, asked)}; resume "
            f"with the original settings or use another `out_dir`.")

  restored, warnings = checkpoint.restore_latest(
      run.out_dir, state_lib.as_tree(template), check_meta=same_run,
      renamed=state_lib.RENAMED, at_most=at_most)
  for warning in warnings:
    log(f"warning: {warning}")
  if restored is None:
    log(f"resume: no valid checkpoint in {run.out_dir}, so this starts a new run")
    return template, 0, {}
  log(f"resumed from {restored.path} at step {restored.step}")
  return state_lib.from_tree(restored.state), restored.step, restored.meta


LORA_BASE = "['params']['base']"  # a LoRA run's frozen base (`lora.trainable`), by path


def save_checkpoint(run: RunConfig, step: int, state: TrainState, meta: Dict[str, Any], *,
                    best: bool = False, log: Log = print_line, prune: bool = True
                    ) -> pathlib.Path:
  """Gathers `state` to the hosts (all processes), and process 0 writes it.

  The file holds whole arrays, whatever the sharding, so it restores on any
  number of devices; a LoRA run's frozen base is written once, to a file its
  checkpoints share (`checkpoint.save`'s `frozen`). `best=True` writes the run's
  best checkpoint (`checkpoint.best_path`) instead of one of the keep-K rotation. `prune=False`
  keeps the older checkpoints until `prune_checkpoints` (a sweep's runs prune
  only once all of them have saved the step, so a step they all hold survives).
  """
  tree = parallel.fetch(state_lib.as_tree(state))
  path = (checkpoint.best_path(run.out_dir) if best else
          checkpoint.checkpoint_path(run.out_dir, step))
  is_lora = isinstance(tree["params"], dict) and set(tree["params"]) == {"base", "adapters"}
  frozen = (LORA_BASE,) if is_lora else ()  # written once for all the run's checkpoints
  if parallel.is_main_process():
    if best:
      checkpoint.save_best(run.out_dir, step, tree, meta, frozen=frozen)
      log(f"saved {path} (lowest val loss so far)")
    else:
      checkpoint.save(run.out_dir, step, tree, meta,
                      keep=run.keep_checkpoints + (0 if prune else 1), frozen=frozen)
      log(f"saved {path}")
  return path


def prune_checkpoints(run: RunConfig) -> None:
  """Keeps the newest `run.keep_checkpoints` of the run's checkpoints (process 0 deletes)."""
  if parallel.is_main_process():
    checkpoint.prune(run.out_dir, run.keep_checkpoints)


def every(interval: int, step: int, last: int) -> bool:
  """Whether `step` is a multiple of `interval`, or the run's `last` step."""
  return step % interval == 0 or step == last


def next_boundary(step: int, intervals: Sequence[int], last: int) -> int:
  """The first step after `step` that is a multiple of one of `intervals`, or `last`."""
  return min([(step // n + 1) * n for n in intervals] + [last])


def dataclass_defaults(cls: Callable) -> Dict[str, Any]:
  """`{field: default}` of a dataclass."""
  return {f.name: f.default for f in dataclasses.fields(cls)}

"""What every training loop does around its steps, in one object the loop owns.

    with Session([Recorded(run, meta, saved_meta)], total=max_iters, start=step) as session:
      record = session.record                       # the run's (one per run: `records`)
      while step < max_iters:
        state, metrics = train_steps(state, ...)
        record.check_finite(losses, step)           # NaN/Inf: stop, or warn
        step += num_steps
        session.log(f"step {step} | loss ...")      # above the progress bar
        record.monitor.log_train(step, loss=..., lr=...)
        if eval_due:
          record.add_eval(step, state, {"step": step, **losses}, **losses)
        session.save_if(checkpoint_due, step, state)  # or on SIGINT/SIGTERM

Its parts: the progress bar (`progress`) and the stop signals, one for the
loop, and per run (`RunRecord`) metrics.jsonl and TensorBoard (`monitor`),
the evaluation history (saved in every checkpoint) and the best checkpoint.
A sweep's loop records its N runs in one session: one bar, one signal
handler, each run's files in its own folder. Only process 0 prints and writes.
"""

import contextlib
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Union

from purejax.training.effects import monitor as monitor_lib
from purejax.training.effects import nonfinite
from purejax.training.effects import progress as progress_lib
from purejax.training.effects import runs
from purejax.training.effects import signals
from purejax.training.pure import parallel
from purejax.training.pure.state import TrainState


class Recorded(NamedTuple):
  """A run a session records.

  Attributes:
    run: where the run lives and how it persists.
    meta: the run's metadata, saved with every checkpoint (plus `history`).
    saved_meta: the resumed checkpoint's metadata (`{}` in a new run); its
      `history` is continued.
    sinks: further metric sinks of its monitor (`monitor.Monitor`), e.g.
      `wandb_sink.WandbSink`.
  """
  run: runs.RunConfig
  meta: Dict[str, Any]
  saved_meta: Dict[str, Any]
  sinks: Sequence[Any] = ()


class RunRecord:
  """One run's metrics files, evaluation history and checkpoints (`Session.records`)."""

  def __init__(self, recorded: Recorded, *, start: int, keep_best: bool,
               log: Callable[[str], None]):
    self.run, self.meta, self.keep_best, self.log = (recorded.run, recorded.meta, keep_best,
                                                      log)
    self.history = list(recorded.saved_meta.get("history", []))
    self.best_loss = min((h["val_loss"] for h in self.history if "val_loss" in h),
                         default=float("inf"))
    self.last_saved: Optional[str] = None
    self.monitor = monitor_lib.Monitor(self.run.out_dir, resume_step=start or None,
                                       enabled=parallel.is_main_process(), log=log,
                                       sinks=recorded.sinks)

  def evaluated_at(self, step: int) -> bool:
    """Whether the history's last evaluation is of `step` (e.g. before a resume)."""
    return bool(self.history) and self.history[-1].get("step") == step

  def add_eval(self, step: int, state: Optional[TrainState], record: Dict[str, Any],
               **metrics: float) -> None:
    """Adds `record` to the history and `metrics` to metrics.jsonl (synced to disk).

    With `keep_best`, a `record["val_loss"]` below every earlier one (after
    step 0) saves `state` as the best checkpoint (`state` is unused without).
    """
    self.monitor.log_eval(step, **metrics)
    self.history.append(record)
    loss = record.get("val_loss", float("inf"))
    if self.keep_best and step > 0 and loss < self.best_loss:
      self.best_loss = loss
      runs.save_checkpoint(self.run, step, state, self._meta(), best=True, log=self.log)

  def check_finite(self, losses, first_step: int) -> None:
    """Stops the run at a NaN/Inf loss, naming its last checkpoint (see `nonfinite`)."""
    nonfinite.check_finite(losses, first_step, self.last_saved,
                           skip=self.run.skip_nonfinite, log=self.log)

  def save(self, step: int, state: TrainState, *, prune: bool = True) -> None:
    """Saves the checkpoint of `step` (after syncing the metrics it records);
    `prune=False` keeps the older ones (`runs.save_checkpoint`)."""
    self.monitor.sync()
    self.last_saved = runs.save_checkpoint(self.run, step, state, self._meta(), log=self.log,
                                           prune=prune)

  def _meta(self) -> Dict[str, Any]:
    return {**self.meta, "history": self.history}


class Session:
  """A training loop's progress bar and stop signals, and a `RunRecord` per run.

  Args:
    recorded: the runs the loop trains (one, or a sweep's N in one program).
    total: steps (or epochs) of the whole loop.
    start: the step the runs start from (all of them).
    unit: what one step is, for the progress bar.
    bar: draw a live progress bar; None: when stderr is a terminal.
    keep_best: an evaluation with a new lowest `val_loss` also writes the
      run's best checkpoint (`checkpoint.best_path`).
  """

  def __init__(self, recorded: Sequence[Recorded], *, total: int, start: int,
               unit: str = "step", bar: Optional[bool] = None, keep_best: bool = False):
    self.progress = progress_lib.Progress(total, start, unit=unit,
                                          enabled=parallel.is_main_process(), bar=bar)
    self.signals = signals.StopSignals()
    with contextlib.ExitStack() as made:  # a monitor that fails closes those made before
      self.records: List[RunRecord] = []
      for r in recorded:
        self.records.append(RunRecord(r, start=start, keep_best=keep_best, log=self.log))
        made.callback(self.records[-1].monitor.close)
      self._monitors = made.pop_all()
    self._exit = contextlib.ExitStack()

  @property
  def record(self) -> RunRecord:
    """The record of the session's only run."""
    (record,) = self.records
    return record

  def __enter__(self) -> "Session":
    self._exit.enter_context(self.progress)
    self._exit.enter_context(self._monitors)
    self._exit.enter_context(self.signals)
    return self

  def __exit__(self, *exc_info) -> Optional[bool]:
    return self._exit.__exit__(*exc_info)

  def log(self, line: str) -> None:
    """Prints a line above the progress bar (process 0 only)."""
    self.progress.write(line)

  def save_if(self, due: bool, step: int,
              state: Union[TrainState, Callable[[int], TrainState]]) -> None:
    """Saves every run's checkpoint when `due` or a stop signal arrived; then stops on a signal.

    Args:
      due: a checkpoint step.
      step: the runs' step.
      state: the only run's state; with several runs, a function of a run's
        index that gives its state (so it is gathered only to be saved).
        Several runs prune their older checkpoints only once all have saved
        `step`, so a step every run holds always survives a kill.

    Raises:
      signals.Interrupted: SIGINT/SIGTERM arrived (after the checkpoints are saved).
    """
    stop = self.signals.stop_requested()
    if due or stop:
      state_of = state if callable(state) else lambda _: state
      alone = len(self.records) == 1
      for i, record in enumerate(self.records):
        record.save(step, state_of(i), prune=alone)
      if not alone:
        for record in self.records:
          runs.prune_checkpoints(record.run)
    self.signals.raise_if(stop)

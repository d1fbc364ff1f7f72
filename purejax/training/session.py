"""What every training loop does around its steps, in one object the loop owns.

    with Session(run, meta, saved_meta, total=max_iters, start=step) as session:
      while step < max_iters:
        state, metrics = train_steps(state, ...)
        session.check_finite(losses, step)            # NaN/Inf: stop, or warn
        step += num_steps
        session.log(f"step {step} | loss ...")        # above the progress bar
        session.monitor.log_train(step, loss=..., lr=...)
        if eval_due:
          session.add_eval(step, state, {"step": step, **losses}, **losses)
        session.save_if(checkpoint_due, step, state)  # or on SIGINT/SIGTERM

Its parts: the progress bar (`progress`), metrics.jsonl and TensorBoard
(`monitor`), the run's evaluation history (saved in every checkpoint), the
best checkpoint, and the stop signals. Only process 0 prints and writes.
"""

import contextlib
from typing import Any, Dict, Optional, Sequence

import optax

from purejax.training import monitor as monitor_lib
from purejax.training import nonfinite
from purejax.training import optim
from purejax.training import parallel
from purejax.training import progress as progress_lib
from purejax.training import runs
from purejax.training import signals
from purejax.training.state import TrainState


class Session:
  """A training run's progress bar, metrics, history, checkpoints and signals.

  Args:
    run: where the run lives and how it persists.
    meta: the run's metadata, saved with every checkpoint (plus `history`).
    saved_meta: the resumed checkpoint's metadata (`{}` in a new run); its
      `history` is continued.
    total: steps (or epochs) of the whole run.
    start: the step the run starts from.
    unit: what one step is, for the progress bar.
    bar: draw a live progress bar; None: when stderr is a terminal.
    keep_best: an evaluation with a new lowest `val_loss` also writes the
      best checkpoint (`checkpoint.best_path`).
    sinks: further metric sinks of the monitor (`monitor.Monitor`), e.g.
      `wandb_sink.WandbSink`.
  """

  def __init__(self, run: runs.RunConfig, meta: Dict[str, Any], saved_meta: Dict[str, Any],
               *, total: int, start: int, unit: str = "step", bar: Optional[bool] = None,
               keep_best: bool = False, sinks: Sequence[Any] = ()):
    self.run, self.meta, self.keep_best = run, meta, keep_best
    self.history = list(saved_meta.get("history", []))
    self.best_loss = min((h["val_loss"] for h in self.history if "val_loss" in h),
                         default=float("inf"))
    self.last_saved: Optional[str] = None
    main = parallel.is_main_process()
    self.progress = progress_lib.Progress(total, start, unit=unit, enabled=main, bar=bar)
    self.monitor = monitor_lib.Monitor(run.out_dir, resume_step=start or None,
                                       enabled=main, log=self.progress.write,
                                       sinks=sinks)
    self.signals = signals.StopSignals()
    self._exit = contextlib.ExitStack()

  def __enter__(self) -> "Session":
    for part in (self.progress, self.monitor, self.signals):
      self._exit.enter_context(part)
    return self

  def __exit__(self, *exc_info) -> Optional[bool]:
    return self._exit.__exit__(*exc_info)

  def log(self, line: str) -> None:
    """Prints a line above the progress bar (process 0 only)."""
    self.progress.write(line)

  def evaluated_at(self, step: int) -> bool:
    """Whether the history's last evaluation is of `step` (e.g. before a resume)."""
    return bool(self.history) and self.history[-1].get("step") == step

  def add_eval(self, step: int, state: TrainState, record: Dict[str, Any],
               **metrics: float) -> None:
    """Adds `record` to the history and `metrics` to metrics.jsonl (synced to disk).

    With `keep_best`, a `record["val_loss"]` below every earlier one (after
    step 0) saves the best checkpoint.
    """
    self.monitor.log_eval(step, **metrics)
    self.history.append(record)
    loss = record.get("val_loss", float("inf"))
    if self.keep_best and step > 0 and loss < self.best_loss:
      self.best_loss = loss
      runs.save_checkpoint(self.run, step, state, self._meta(), best=True, log=self.log)

  def check_finite(self, losses, first_step: int) -> None:
    """Stops the run at a NaN/Inf loss, naming the last checkpoint (see `nonfinite`)."""
    nonfinite.check_finite(losses, first_step, self.last_saved,
                           skip=self.run.skip_nonfinite, log=self.log)

  def save_if(self, due: bool, step: int, state: TrainState) -> None:
    """Saves a checkpoint when `due` or a stop signal arrived; then stops on a signal.

    Raises:
      signals.Interrupted: SIGINT/SIGTERM arrived (after the checkpoint is saved).
    """
    stop = self.signals.stop_requested()
    if due or stop:
      self.monitor.sync()
      self.last_saved = runs.save_checkpoint(self.run, step, state, self._meta(),
                                             log=self.log)
    self.signals.raise_if(stop)

  def _meta(self) -> Dict[str, Any]:
    return {**self.meta, "history": self.history}


def make_optimizer(opt_config: optim.OptimizerConfig, run: runs.RunConfig
                   ) -> optax.GradientTransformation:
  """The run's optimizer; with `run.skip_nonfinite`, NaN/Inf updates are skipped."""
  optimizer = optim.make_optimizer(opt_config)
  return nonfinite.skip_nonfinite_updates(optimizer) if run.skip_nonfinite else optimizer

"""A sweep's training loop: what its runs do between their first step and their last.

    step, times = train_loop(driven, session, Cadence(total=2000, eval_interval=250,
                                                      log_interval=50, checkpoint_interval=250),
                             metrics=[split_losses, bits_per_byte], report=report, start=0)

The loop keeps the cadence: it evaluates at the interval (and where the runs
start on one, unless they already did before a resume), times each call of
the jitted steps, stops at a NaN/Inf loss, hands each call and evaluation to
the `report` (the log lines, progress and metrics files), and saves the
checkpoints at their interval or on SIGINT/SIGTERM (`session.Session`).

What it drives (`Driven`) is a sweep's runs, trained one at a time, each in
its own program, or vmapped together in one (`gpt_run.RunsOneByOne`,
`gpt_run.RunsTogether`): the loop is the same for both. A run alone has its
loop written out in `gpt_loop.train_gpt` (and the MLP's in `mlp_loop`). What it
evaluates is a list of `Metric`s, called in order, each seeing the values
those before it gave.
"""

import dataclasses
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import numpy as np

from purejax.training.effects import runs
from purejax.training.effects.session import Session
from purejax.training.pure.state import TrainState

Values = Dict[str, np.ndarray]  # {metric name: [runs] values}


class Driven(Protocol):
  """What the loop trains: a sweep's runs, stepping together."""

  def train(self, step: int, num_steps: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Runs steps `step .. step + num_steps - 1` of every run, to the end (waits for them).

    Returns:
      `(losses, grad_norms)`, `[runs, num_steps]` numpy arrays each.
    """

  def run_state(self, index: int) -> TrainState:
    """Run `index`'s state (what its checkpoint saves)."""

  def split_losses(self) -> Dict[str, np.ndarray]:
    """`{split: [runs] mean losses}` of every run's evaluation batches."""

  def eval_key(self, index: int) -> Any:
    """Run `index`'s evaluation key (its batches are the same at every evaluation)."""

  def model(self, index: int) -> Tuple[Any, Any, Any]:
    """Run `index`'s `(params, config, forms)`, whole on one local device."""


# metric(driven, values so far) -> more values, `[runs]` each.
Metric = Callable[[Any, Values], Values]


class Call(NamedTuple):
  """One call of the jitted steps, as the loop measured it.

  Attributes:
    step: the runs' step after it.
    seconds_per_step: its wall time over its steps.
    losses: `[runs, num_steps]` losses of its steps.
    grad_norms: `[runs, num_steps]` gradient norms, or None.
  """
  step: int
  seconds_per_step: float
  losses: np.ndarray
  grad_norms: Optional[np.ndarray]


class Report(Protocol):
  """How a loop shows what happened: its log lines, progress bar and metrics records."""

  def trained(self, session: Session, call: Call, log_due: bool) -> None:
    """After every call; `log_due` at the log interval."""

  def evaluated(self, session: Session, step: int, values: Values, call: Optional[Call],
                run_state: Callable[[int], TrainState]) -> None:
    """After every evaluation, with the metrics' values (`call`: the call just before, or
    None for an evaluation before the first call; `run_state`: a run's state, for
    a best checkpoint)."""


@dataclasses.dataclass(frozen=True)
class Cadence:
  """When the loop evaluates, logs and saves, in steps (the MLP's: epochs).

  Attributes:
    total: the step the loop ends at.
    eval_interval, log_interval, checkpoint_interval: every so many steps,
      and at `total`.
    evaluate_first: also evaluate before the first call where the start is on
      the evaluation interval (step 0: the untrained model), unless the
      resumed history already holds that step.
    call_length: steps of the call starting at a step (never across a
      boundary of the intervals).
    count_from: what the first step is called in messages (a NaN's): the GPT's
      steps count from 0, the MLP's epochs from 1.
  """
  total: int
  eval_interval: int
  log_interval: int
  checkpoint_interval: int
  evaluate_first: bool = True
  call_length: Callable[[int], int] = lambda step: 1
  count_from: int = 0


class _NoProfiler:
  def before(self, step: int) -> None:
    del step

  def after(self, step: int, log: Callable[[str], None]) -> None:
    del step, log


def evaluate(driven: Driven, metrics: Sequence[Metric]) -> Values:
  """Every metric's values, in order, each given those before it."""
  values: Values = {}
  for metric in metrics:
    values.update(metric(driven, values))
  return values


def train_loop(driven: Driven, session: Session, cadence: Cadence, *,
               metrics: Sequence[Metric], report: Report, start: int,
               profiler: Any = None) -> Tuple[int, List[float]]:
  """Trains `driven` from step `start` to `cadence.total`.

  Args:
    driven: the runs.
    session: their progress, signals and records (one `RunRecord` per run).
    cadence: when to evaluate, log and save.
    metrics: what an evaluation computes (`evaluate`).
    report: what the loop shows of each call and evaluation.
    start: the step the runs start from.
    profiler: `before(step)` and `after(step, log)` around each call
      (`progress.Profiler`); None: none.

  Returns:
    `(the last step, seconds per step of every call)`.

  Raises:
    nonfinite.NonFiniteLoss: a run's loss was NaN/Inf (its last checkpoint stays).
    signals.Interrupted: SIGINT/SIGTERM arrived (after the checkpoints are saved).
  """
  profiler = profiler or _NoProfiler()
  records = session.records

  def evaluated(step: int, call: Optional[Call]) -> None:
    report.evaluated(session, step, evaluate(driven, metrics), call, driven.run_state)

  step, times = start, []
  while step < cadence.total:
    if (cadence.evaluate_first and step % cadence.eval_interval == 0
        and not records[0].evaluated_at(step)):
      evaluated(step, None)
    num_steps = cadence.call_length(step)
    profiler.before(step)
    began = time.perf_counter()
    losses, grad_norms = driven.train(step, num_steps)  # numpy: the steps have finished
    seconds = (time.perf_counter() - began) / num_steps
    profiler.after(step + num_steps, session.log)
    for i, record in enumerate(records):
      record.check_finite(losses[i], step + cadence.count_from)
    step += num_steps
    times.append(seconds)
    call = Call(step, seconds, losses, grad_norms)
    report.trained(session, call, runs.every(cadence.log_interval, step, cadence.total))
    if runs.every(cadence.eval_interval, step, cadence.total):
      evaluated(step, call)
    # Every run saves, then all prune: a step every run holds survives a kill.
    session.save_if(runs.every(cadence.checkpoint_interval, step, cadence.total), step,
                    driven.run_state)
  return step, times

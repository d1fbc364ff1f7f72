"""A training loop's live progress bar (tqdm), drawn only on an interactive terminal, and
its profiler trace of chosen steps (`Profiler`).

    with progress.Progress(max_iters, initial=step) as bar:
      ...
      bar.update_to(step, loss=loss, tok_s=tokens_per_s)
      bar.write(f"step {step} | loss {loss:.4f}")  # log lines go above the bar

Without a terminal (CI, a file, nohup, a pipe) it draws nothing and `write`
prints plain lines, so logs stay free of carriage returns.
"""

import os
import pathlib
import shutil
import sys
from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import numpy as np


def _format_postfix(value: Any) -> str:
  if isinstance(value, float):
    if abs(value) >= 1e4:
      import tqdm  # pylint: disable=import-outside-toplevel
      return tqdm.tqdm.format_sizeof(value)  # 123456.0 -> "123k"
    return f"{value:.4g}"
  return str(value)


class Progress:
  """A live tqdm bar on an interactive terminal; nothing at all otherwise.

  The bar (on stderr) shows steps done of `total`, the rate, the ETA and the
  values passed to `update` (loss, tokens/s, ...). When stderr is not a
  terminal (CI, a file, nohup, a pipe) there is no bar and no carriage return
  in the output: the loop's log lines, printed through `write`, are then the
  only output, as without this class.
  """

  def __init__(self, total: int, initial: int = 0, *, unit: str = "step",
               enabled: bool = True, bar: Optional[bool] = None, stream=None):
    """Starts the bar.

    Args:
      total: steps (or examples, ...) of the whole run.
      initial: already done (the step a resumed run starts from).
      unit: what one count is, shown in the rate ("step/s").
      enabled: False prints nothing, not even `write` lines (processes
        other than 0).
      bar: draw the live bar; None: when `stream` is a terminal. Without a
        bar, `write` lines are all that is printed.
      stream: where the bar goes; default sys.stderr, read when the bar
        starts (so a test's redirection applies).
    """
    self.total, self.n, self.enabled = total, initial, enabled
    stream = sys.stderr if stream is None else stream
    self._bar = None
    if enabled and (_is_terminal(stream) if bar is None else bar):
      import tqdm  # pylint: disable=import-outside-toplevel
      # Follow the terminal's size. A terminal that reports none (a bare
      # pseudo-terminal) gets $COLUMNS x $LINES or 80 x 24: tqdm draws no
      # bar at all on a screen of 0 lines.
      sized = _terminal_size(stream) is not None
      fallback = shutil.get_terminal_size()
      self._bar = tqdm.tqdm(total=total, initial=initial, unit=unit, file=stream,
                            dynamic_ncols=sized, ncols=None if sized else fallback.columns,
                            nrows=None if sized else fallback.lines)

  @property
  def live(self) -> bool:
    """Whether a bar is being drawn."""
    return self._bar is not None

  def update(self, n: int = 1, **postfix) -> None:
    """Advances by `n` (never past `total`) and shows `postfix` values beside the bar."""
    n = max(0, min(n, self.total - self.n))
    self.n += n
    if self._bar is not None:
      if postfix:
        self._bar.set_postfix({k: _format_postfix(v) for k, v in postfix.items()},
                              refresh=False)
      self._bar.update(n)

  def update_to(self, done: int, **postfix) -> None:
    """Sets the count to `done` (e.g. the loop's step); see `update`."""
    self.update(done - self.n, **postfix)

  def write(self, line: str) -> None:
    """Prints a log line to stdout; a live bar is cleared first and redrawn below it."""
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(line, file=sys.stdout)
    else:
      print(line, flush=True)

  def close(self) -> None:
    """Draws the bar's final state (steps done of total) and ends its line."""
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _terminal_size(stream) -> Optional[os.terminal_size]:
  """The terminal's size, or None if it reports none (or is not a terminal)."""
  try:
    size = os.get_terminal_size(stream.fileno())
  except (AttributeError, OSError, ValueError):
    return None
  return size if size.columns > 0 and size.lines > 0 else None


def _is_terminal(stream) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, ValueError):  # no isatty, or a closed stream
    return False


class Profiler:
  """A `jax.profiler` trace of steps `(first, last)`, into `out_dir/profile`
  (`GPTTrainConfig.profile_steps`)."""

  def __init__(self, steps_range: Optional[Tuple[int, int]], out_dir: str):
    self._range, self._dir = steps_range, str(pathlib.Path(out_dir) / "profile")

  def before(self, step: int) -> None:
    if self._range and step == self._range[0]:
      jax.profiler.start_trace(self._dir)

  def after(self, step: int, log: Callable[[str], None]) -> None:
    if self._range and step == self._range[1]:
      jax.profiler.stop_trace()
      log(f"profile of steps {self._range[0]}-{self._range[1]} in {self._dir} "
          f"(TensorBoard's profile plugin reads it)")


def median_ms(seconds_per_step: Sequence[float]) -> Optional[float]:
  """Median ms per step of a loop's calls (None without any), the first two left out:
  they compile (a program per call length), so they are not the loop's speed."""
  if not seconds_per_step:
    return None
  return 1000 * float(np.median(seconds_per_step[2:] or seconds_per_step))

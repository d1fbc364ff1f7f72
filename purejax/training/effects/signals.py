"""SIGINT and SIGTERM during training: noted, then a checkpoint, then a clean stop.

    with StopSignals() as signals:            # the loop owns the handlers
      while step < max_iters:
        ...
        stop = signals.stop_requested()       # every process asks together
        if due or stop:
          save_checkpoint(...)
        signals.raise_if(stop)                # Interrupted, after the save

Handlers are installed only while the block runs, and only from the main
thread (Python delivers signals there); the previous handlers come back after.
Start `jax.distributed` before the block: its preemption notifier takes
SIGTERM for itself.
"""

import signal
import threading
from typing import List

from purejax.training.pure import parallel

_CAUGHT = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
  """SIGINT/SIGTERM arrived; the loop saved a checkpoint and stops."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


class StopSignals:
  """Notes SIGINT/SIGTERM instead of dying, so the loop can save and stop."""

  def __init__(self):
    self.pending: List[int] = []
    self._previous = {}

  def _note(self, signum, frame):  # pylint: disable=unused-argument
    # Only note it: the loop saves a checkpoint at the next step boundary.
    self.pending.append(signum)

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for signum in _CAUGHT:
        self._previous[signum] = signal.signal(signum, self._note)
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def stop_requested(self) -> bool:
    """Whether any process got SIGINT/SIGTERM (a collective: all processes ask)."""
    stop = parallel.any_process(bool(self.pending))
    if stop and not self.pending:  # another process was signalled
      self.pending.append(signal.SIGTERM)
    return stop

  def raise_if(self, stop: bool) -> None:
    """Raises `Interrupted` for the first pending signal when `stop`."""
    if stop:
      raise Interrupted(self.pending[0])

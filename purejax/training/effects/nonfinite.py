"""NaN/Inf losses: stop before saving them (or, where the optimizer skips such updates,
`optim.skip_nonfinite_updates`, warn).

    check_finite(losses, first_step, last_saved, skip=False)   # raises NonFiniteLoss
"""

from typing import Callable, Optional

import numpy as np


class NonFiniteLoss(RuntimeError):
  """The loss became NaN/Inf; the last checkpoint is intact."""


def check_finite(losses: np.ndarray, first_step: int, last_saved: Optional[str], *,
                 skip: bool = False, log: Callable[[str], None] = print) -> None:
  """Raises `NonFiniteLoss` at the first NaN/Inf in `losses` (with `skip`, only warns).

  Args:
    losses: losses of steps `first_step, first_step + 1, ...`.
    first_step: step of `losses[0]`.
    last_saved: path of the newest checkpoint, for the message; None if none.
    skip: the optimizer skips non-finite updates (`skip_nonfinite_updates`).
    log: where the warning goes when `skip`.
  """
  bad = np.flatnonzero(~np.isfinite(losses))
  if not bad.size:
    return
  where = f"loss is {losses[bad[0]]} at step {first_step + int(bad[0])}"
  if skip:
    log(f"warning: {where}; skipping non-finite updates (`skip_nonfinite`)")
    return
  saved = (f"the last good checkpoint, {last_saved}, is intact: resume from it "
           f"(`resume`)" if last_saved else "no checkpoint was saved before it")
  raise NonFiniteLoss(f"{where}; stopped without saving. {saved}. Try a lower "
                      f"`learning_rate`, or `skip_nonfinite` to skip such updates.")

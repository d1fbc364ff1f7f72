"""Subprocess driver for tests/test_monitor.py (run as a script, not collected).

    python tests/monitor_worker.py metrics OUT_DIR   # writes records until killed
    python tests/monitor_worker.py progress TOTAL    # drives a Progress bar to TOTAL
"""

import os
import sys
import time

# The repository this file is in, not whichever purejax is installed (a
# script's sys.path starts at its own folder, tests/).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from purejax.training.effects import monitor  # pylint: disable=wrong-import-position
from purejax.training.effects import progress as progress_lib  # pylint: disable=wrong-import-position


def write_metrics_forever(out_dir: str) -> None:
  """Appends large records in a tight loop; says "ready" after 100 of them."""
  log = monitor.MetricsLog(out_dir, resume_step=None)
  # Long lines (16 KiB) make it likely that the kill lands inside a write.
  padding = "x" * 16384
  step = 0
  while True:
    log.append("train", step, {"loss": 1.0 / (step + 1), "padding": padding})
    step += 1
    if step == 100:
      print("ready", flush=True)


def drive_progress(total: int) -> None:
  """Runs a bar to `total`, printing a log line every 5 steps through it."""
  with progress_lib.Progress(total) as progress:
    for step in range(1, total + 1):
      time.sleep(0.01)
      progress.update(1, loss=4.0 / step, tok_s=123456.0)
      if step % 5 == 0:
        progress.write(f"step {step:3d} | loss {4.0 / step:.4f}")


if __name__ == "__main__":
  mode, arg = sys.argv[1:3]
  if mode == "metrics":
    write_metrics_forever(arg)
  else:
    drive_progress(int(arg))

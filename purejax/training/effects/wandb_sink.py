"""Weights & Biases as one more sink of a run's metrics (nanoGPT's `--wandb_log`).

    sink = WandbSink(project="owt", run_name="gpt2-124M", config=meta, out_dir="out-gpt")
    with monitor.Monitor(out_dir, sinks=[sink]) as mon:
      mon.log_train(step, loss=loss, lr=lr)     # also logged to W&B as train/loss, train/lr

W&B gets each record `monitor.Monitor` writes to metrics.jsonl, with the
same values under TensorBoard's tags (`train/loss`, `eval/val_loss`, ...)
at the record's step. `wandb` is imported only when a sink is made, so runs
without it do not need the package (`pip install purejax[wandb]`). Its
offline mode (`WANDB_MODE=offline`) writes the run under `out_dir/wandb`
for a later `wandb sync`.

A resumed run starts a new W&B run (as nanoGPT's does), whose steps begin
after the checkpoint's.
"""

import importlib
import os
from typing import Any, Dict, Mapping, Optional

from purejax.training.effects import monitor


def _import_wandb():
  try:
    return importlib.import_module("wandb")
  except ImportError:
    raise ValueError("logging to Weights & Biases needs the wandb package: pip install "
                     "wandb (or purejax[wandb]).") from None


class WandbSink:
  """Sends every metrics record to a W&B run; a `monitor.Monitor` sink.

  Raises (on construction) ValueError when wandb is not installed, or when
  W&B cannot start the run (no API key: the message says to run `wandb
  login` or to log offline).
  """

  def __init__(self, *, project: str, run_name: Optional[str] = None,
               config: Optional[Mapping[str, Any]] = None, out_dir: Optional[str] = None):
    """Starts the W&B run.

    Args:
      project: W&B project.
      run_name: the run's display name (W&B picks one when None).
      config: settings shown with the run (e.g. a checkpoint's metadata).
      out_dir: where W&B keeps its files (`out_dir/wandb`); default: W&B's.
    """
    wandb = _import_wandb()
    if out_dir is not None:
      os.makedirs(out_dir, exist_ok=True)
    # create_new: the runs of a sweep are W&B runs side by side in one process.
    try:
      self._run = wandb.init(project=project, name=run_name, config=dict(config or {}),
                             dir=out_dir, reinit="create_new")
    except wandb.errors.Error as e:  # no or a bad API key, no network: before any step
      where = os.path.join(out_dir, "wandb") if out_dir else "W&B's folder"
      reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
      raise ValueError(
          f"Weights & Biases did not start the run ({reason}); run `wandb login`, or set "
          f"WANDB_MODE=offline to keep the run in {where} for a later `wandb sync`.") from None

  def __call__(self, kind: str, record: Dict[str, Any]) -> None:
    """Logs a record's numeric values as `{"<kind>/<name>": value}` at its step."""
    values = monitor.scalars(kind, record)
    if values:
      self._run.log(values, step=record["step"])

  def close(self) -> None:
    if self._run is not None:
      self._run.finish()
      self._run = None

"""wandb_sink: a W&B run, in wandb's offline mode, holds the values metrics.jsonl holds."""

import pathlib

import pytest

from conftest import read_wandb_offline_history
from purejax.training import monitor
from purejax.training import wandb_sink

wandb = pytest.importorskip("wandb", reason="wandb is a test extra: pip install purejax[test]")


def test_the_offline_run_holds_the_values_of_metrics_jsonl(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  sink = wandb_sink.WandbSink(project="purejax-test", run_name="tiny",
                              config={"batch_size": 12}, out_dir=str(tmp_path))
  with monitor.Monitor(tmp_path, tensorboard=False, sinks=[sink]) as mon:
    mon.log_eval(0, train_loss=4.2, val_loss=4.25)
    for step in (10, 20):
      mon.log_train(step, loss=3.0 / step, lr=1e-3 * step, grad_norm=0.5, mfu=None)
    mon.log_eval(20, train_loss=2.5, val_loss=2.75)
  logged = {}
  for record in monitor.read_metrics(tmp_path):
    logged.setdefault(record["step"], {}).update(monitor.scalars(record["kind"], record))
  rows = {row["_step"]: {k: v for k, v in row.items() if not k.startswith("_")}
          for row in read_wandb_offline_history(tmp_path)}
  assert rows == logged
  assert rows[20]["eval/val_loss"] == 2.75 and rows[10]["train/loss"] == 0.3


def test_wandb_is_imported_only_when_a_sink_is_made():
  import subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  code = ("import sys, purejax, purejax.training.wandb_sink, purejax.training.loop; "
          "print('wandb' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=pathlib.Path(__file__).resolve().parents[1])
  assert out.stdout.strip() == "False"

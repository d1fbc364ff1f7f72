"""wandb_sink: a W&B run, in wandb's offline mode, holds the values metrics.jsonl holds."""

import pathlib

import pytest

from helpers.cli import read_wandb_offline_history
from helpers.data import need
from purejax.training.effects import monitor
from purejax.training.effects import wandb_sink


@pytest.fixture(autouse=True)
def fresh_wandb():
  """wandb reads its settings (WANDB_MODE, ...) into a process-wide object once; each test
  sets its own environment, so each starts and ends without that object. (Imported here,
  not when a worker collects this file: wandb takes most of a second to import.)"""
  wandb = need("wandb")
  wandb.teardown()
  yield
  wandb.teardown()


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
  code = ("import sys, purejax, purejax.training.effects.wandb_sink, purejax.training.loops.gpt_loop; "
          "print('wandb' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=pathlib.Path(__file__).resolve().parents[1])
  assert out.stdout.strip() == "False"


def test_an_online_run_without_an_api_key_is_one_line_saying_how_to_log_in(tmp_path,
                                                                          monkeypatch):
  """No key anywhere (environment, netrc, settings): the fix, not wandb's traceback."""
  home = tmp_path / "home"
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.setenv("WANDB_MODE", "online")
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "no-wandb-settings"))
  monkeypatch.setenv("NETRC", str(home / "no-netrc"))
  monkeypatch.setenv("WANDB_INIT_TIMEOUT", "30")  # were the key found, no long wait for it
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  with pytest.raises(ValueError) as e:
    wandb_sink.WandbSink(project="purejax-test", run_name="tiny", out_dir=str(tmp_path))
  message = str(e.value)
  assert "\n" not in message and e.value.__cause__ is None, message
  assert "run `wandb login`" in message, message
  assert f"WANDB_MODE=offline to keep the run in {tmp_path / 'wandb'}" in message, message

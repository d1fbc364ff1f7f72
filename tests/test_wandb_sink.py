"""wandb_sink: a W&B run, in wandb's offline mode, holds the values metrics.jsonl holds."""

import json
import pathlib
import struct

import pytest

from purejax.training import monitor
from purejax.training import wandb_sink

wandb = pytest.importorskip("wandb", reason="wandb is a test extra: pip install purejax[test]")


def read_offline_history(out_dir: pathlib.Path):
  """The history rows of the offline run under `out_dir/wandb`, without wandb's API.

  The `.wandb` file is a short header then LevelDB's log format (32 KiB
  blocks of records: crc32 (4), length (2), type (1), data), each record one
  protobuf `Record`.
  """
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  (path,) = out_dir.glob("wandb/offline-run-*/run-*.wandb")
  data, pos, pending, rows = path.read_bytes(), 7, b"", []
  block = 32768
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if length == 0 and kind == 0:
      break
    pending += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # a whole record, or the last piece of one
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      pending = b""
      if record.WhichOneof("record_type") == "history":
        rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item})
  return rows


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
          for row in read_offline_history(tmp_path)}
  assert rows == logged
  assert rows[20]["eval/val_loss"] == 2.75 and rows[10]["train/loss"] == 0.3


def test_wandb_is_imported_only_when_a_sink_is_made():
  import subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  code = ("import sys, purejax, purejax.training.wandb_sink, purejax.training.loop; "
          "print('wandb' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=pathlib.Path(__file__).resolve().parents[1])
  assert out.stdout.strip() == "False"

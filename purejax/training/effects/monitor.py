"""A run's logged metrics: metrics.jsonl and TensorBoard scalars, behind one `Monitor`.

A training loop uses it like this (process 0 writes, the others stay quiet):

    with monitor.Monitor(out_dir, resume_step=step if resumed else None,
                         enabled=is_main, log=progress.write) as mon:
      ...
      mon.log_train(step, loss=loss, lr=lr, tokens_per_s=tps, mfu=mfu_or_none)
      mon.log_eval(step, train_loss=train_loss, val_loss=val_loss)
      mon.sync()  # before saving a checkpoint at `step`

Files in `out_dir`:

* `metrics.jsonl`: one JSON object per line, per log point and per eval
  point: `{"step": 100, "time": 12.5, "kind": "train", "loss": 2.1, ...}`.
  `time` is wall seconds since the run started, continuing across resumes.
  Each line goes to the file in one `write` call of the whole line and its
  newline, so a killed process leaves complete lines plus at most one
  truncated last line; the next open drops that line. A resumed run drops the
  lines after its checkpoint's step (they are recomputed), rewriting the file
  atomically. JSON has no NaN, so non-finite values are written as `null`.
* `events.out.tfevents.*`: the same scalars for TensorBoard
  (`tensorboard --logdir OUT_DIR`), tagged `train/loss`, `train/lr`,
  `train/grad_norm`, `train/tokens_per_s`, `train/mfu`, `eval/train_loss`,
  `eval/val_loss`, `eval/val_bpb` (`<kind>/<name>`).

TensorBoard writer: tensorboardX, not `tf.summary`. tensorboardX is pure
Python (protobuf, numpy) and imports in about 0.1 s; TensorFlow takes
seconds to import, and GPU images that carry only JAX lack it. It was checked
to write event files that TensorBoard's own reader and TensorFlow's
`summary_iterator` read back under the installed protobuf (7.x). We use its
synchronous `EventsWriter` rather than its `SummaryWriter`, whose background
queue `flush()` does not drain, so `sync()` here really puts every logged
scalar in the file. If tensorboardX is missing or fails to import, the run
goes on without event files after one warning line.

The MFU values logged come from `purejax.training.pure.flops`; the progress bar whose
`write` the example passes as `log` is `purejax.training.effects.progress`.
"""

import json
import math
import numbers
import operator
import os
import pathlib
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from purejax import _files

METRICS_FILE = "metrics.jsonl"
KINDS = ("train", "eval")
# Keys every metrics record has; values may not reuse them.
_RESERVED = ("step", "time", "kind")


# ----------------------------------------------------------------------------
# metrics.jsonl


def _json_value(name: str, value: Any) -> Any:
  """A JSON-ready copy of one logged value: int, float (None if not finite), bool or str.

  Accepts Python, numpy and 0-d JAX scalars (converting a JAX array waits for it).
  """
  if value is None or isinstance(value, (bool, str)):
    return value
  dtype = str(getattr(value, "dtype", ""))  # numpy and JAX scalars
  try:
    if dtype == "bool":
      return bool(value)
    if isinstance(value, numbers.Integral) or "int" in dtype:
      return int(value)
    number = float(value)
  except (TypeError, ValueError) as e:
    raise TypeError(f"metric {name}={value!r} is not a number, bool or string.") from e
  # JSON has no NaN or Infinity; null keeps every line strict JSON (jq, pandas).
  return number if math.isfinite(number) else None


def make_record(kind: str, step: int, seconds: float, values: Mapping[str, Any]
                ) -> Dict[str, Any]:
  """`{"step", "time", "kind", **values}` with JSON-ready values; None values left out.

  Raises:
    ValueError: an unknown kind, or a value named like a reserved key.
    TypeError: a value that is not a number, bool or string.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  reserved = [name for name in values if name in _RESERVED]
  if reserved:
    raise ValueError(f"{reserved} are reserved names in metrics records.")
  record = {"step": operator.index(step), "time": round(seconds, 3), "kind": kind}
  record.update((name, _json_value(name, value)) for name, value in values.items()
                if value is not None)
  return record


def _is_record(record: Any) -> bool:
  return (isinstance(record, dict) and type(record.get("step")) is int
          and record.get("kind") in KINDS and isinstance(record.get("time"), (int, float)))


def _parse(data: bytes) -> Tuple[List[Tuple[dict, bytes]], int]:
  """Splits a metrics file's bytes into `([(record, line bytes)], lines dropped)`.

  The bytes after the last newline are a line whose write a crash cut short:
  every line is written together with its newline, so a line without one is
  incomplete even when it happens to parse. Lines that are not valid records
  (only a damaged disk makes those) are dropped too.
  """
  *lines, tail = data.split(b"\n")
  kept, dropped = [], 1 if tail.strip() else 0
  for line in lines:
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except ValueError:
      record = None
    if _is_record(record):
      kept.append((record, line + b"\n"))
    else:
      dropped += 1
  return kept, dropped


def read_metrics(path) -> List[Dict[str, Any]]:
  """The records of a `metrics.jsonl` (or of the one in a run directory), in file order.

  Safe on a file that a running (or killed) training is writing: an
  incomplete last line is left out.

  Args:
    path: the file, or the run directory holding it.

  Returns:
    One dict per line: `step`, `time`, `kind` and the logged values.

  Raises:
    FileNotFoundError: there is no such file.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / METRICS_FILE
  records, _ = _parse(path.read_bytes())
  return [record for record, _ in records]


def _write_all(fd: int, data: bytes) -> None:
  # One write() puts a short line in the file whole; the loop only matters for
  # the short writes a full disk or a huge line can cause.
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]


class MetricsLog:
  """Appends training and eval records to `out_dir/metrics.jsonl`, crash-safely.

  Opening it settles the file left by earlier runs:

  * `resume_step=None` (a fresh run): an existing file belongs to an older run
    in the same directory (the caller has checked that it holds no
    checkpoints) and is replaced by an empty one.
  * `resume_step=N` (resuming from the checkpoint at step N): records after
    step N are dropped, since the run recomputes those steps, together with a
    truncated last line; the file is rewritten atomically only if anything
    is dropped. `time` continues from the last record kept.

  Records of each kind must have strictly increasing steps; `append` refuses
  a step at or before the last one (a resumed loop re-logging step N, say).
  """

  def __init__(self, out_dir, *, resume_step: Optional[int],
               clock: Callable[[], float] = time.time):
    """Opens (or creates) the run's metrics file.

    Args:
      out_dir: the run directory (created if missing).
      resume_step: the step of the checkpoint the run resumes from, or None
        for a fresh run.
      clock: wall-clock seconds; tests pass a fake one.
    """
    self.path = pathlib.Path(out_dir) / METRICS_FILE
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.warnings: List[str] = []
    self._clock = clock
    records = self._settle(resume_step)
    self._time_offset = max((r["time"] for r in records), default=0.0)
    self.last_step = {kind: max((r["step"] for r in records if r["kind"] == kind), default=None)
                      for kind in KINDS}
    self._start = clock()
    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

  def _settle(self, resume_step: Optional[int]) -> List[dict]:
    """Leaves only the records a run starting now keeps in the file; returns them."""
    if resume_step is None or not self.path.exists():
      if self.path.exists() and self.path.stat().st_size:
        self.warnings.append(f"replacing {self.path} of an earlier run (this run starts at step 0)")
        _files.atomic_write(self.path, lambda f: None)
      return []
    parsed, damaged = _parse(self.path.read_bytes())
    kept = [(record, line) for record, line in parsed if record["step"] <= resume_step]
    later = len(parsed) - len(kept)
    if damaged:
      self.warnings.append(f"dropped {damaged} incomplete or unreadable line(s) from "
                           f"{self.path} (a run killed while writing)")
    if later:
      self.warnings.append(f"dropped {later} record(s) after step {resume_step} from "
                           f"{self.path}; the run resumes from step {resume_step}")
    if damaged or later:
      _files.atomic_write(self.path, lambda f: f.write(b"".join(line for _, line in kept)))
    return [record for record, _ in kept]

  def elapsed(self) -> float:
    """Wall seconds since the run started, counting the time before a resume."""
    return self._time_offset + self._clock() - self._start

  def append(self, kind: str, step: int, values: Mapping[str, Any]) -> Dict[str, Any]:
    """Writes one record as one line; returns it.

    Args:
      kind: "train" or "eval".
      step: training step; above the last step logged for `kind`.
      values: metric name -> number, bool or string. None values are left out.

    Returns:
      The record written, with `step`, `time` and `kind` first.

    Raises:
      ValueError: unknown kind, a reserved name, or a step not after the last.
      TypeError: a value that is not a number, bool or string.
    """
    record = make_record(kind, step, self.elapsed(), values)
    step, last = record["step"], self.last_step[kind]
    if last is not None and step <= last:
      raise ValueError(f"{kind} step {step} is not after the last {kind} step {last} in "
                       f"{self.path}; steps must increase (a resumed run logs only new steps).")
    line = json.dumps(record, allow_nan=False, separators=(", ", ": ")) + "\n"
    _write_all(self._fd, line.encode())
    self.last_step[kind] = step
    return record

  def sync(self) -> None:
    """Forces the lines written so far onto the disk (they survive a power cut)."""
    if self._fd is not None:
      os.fsync(self._fd)

  def close(self) -> None:
    if self._fd is not None:
      self.sync()
      os.close(self._fd)
      self._fd = None


# ----------------------------------------------------------------------------
# TensorBoard


def _import_tensorboardx():
  """`(EventsWriter, event_pb2, summary_pb2)` from tensorboardX.

  tensorboardX's package import pulls in torch when torch is installed, only
  to accept torch tensors; that costs about 2 s and we log plain floats.
  Torch is hidden for the import (if nobody imported it yet), so tensorboardX
  sees it as absent; a later `import torch` works as usual.
  """
  hide_torch = "torch" not in sys.modules
  if hide_torch:
    sys.modules["torch"] = None  # makes `import torch` raise ImportError
  try:
    # pylint: disable=import-outside-toplevel
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto import event_pb2, summary_pb2
  finally:
    if hide_torch and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return EventsWriter, event_pb2, summary_pb2


class ScalarWriter:
  """Writes scalars to a TensorBoard event file in `out_dir`, synchronously.

  Each writer starts a new event file. Its first event marks a (re)start at
  `purge_step`: TensorBoard then hides the scalars with step >= `purge_step`
  from the directory's older event files, i.e. those of a run's crashed
  attempt (resume from step N: `purge_step=N + 1`) or of an earlier run in
  the same directory (fresh start: `purge_step=0`).

  Raises (on construction) whatever importing tensorboardX raises.
  """

  def __init__(self, out_dir, *, purge_step: int = 0):
    events_writer, self._event_pb2, self._summary_pb2 = _import_tensorboardx()
    os.makedirs(out_dir, exist_ok=True)
    # The file name holds the start second and host name; the nanosecond
    # suffix keeps two starts within one second apart (the second would
    # otherwise overwrite the first) and in order for TensorBoard, which
    # reads a directory's files in name order.
    self._writer = events_writer(os.path.join(os.fspath(out_dir), "events"),
                                 f".{time.time_ns():020d}")
    session_log = self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)
    self._writer.write_event(self._event_pb2.Event(
        wall_time=time.time(), step=purge_step, session_log=session_log))
    self._writer.flush()

  def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    """Writes `{tag: value}` at `step` as one event and flushes it to the file."""
    summary = self._summary_pb2.Summary(value=[
        self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
        for tag, value in scalars.items()])
    self._writer.write_event(self._event_pb2.Event(
        wall_time=time.time(), step=int(step), summary=summary))
    # Flushing each log point lets a live TensorBoard show it at once; log
    # points are seconds apart, so this costs nothing measurable.
    self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


# ----------------------------------------------------------------------------
# Monitor: both files behind one object


def scalars(kind: str, record: Mapping[str, Any]) -> Dict[str, float]:
  """`{"<kind>/<name>": value}` for a record's numeric values (not bools or strings).

  The tags of TensorBoard and of a run's other sinks (`wandb_sink`).
  """
  return {f"{kind}/{name}": value for name, value in record.items()
          if name not in _RESERVED and isinstance(value, (int, float))
          and not isinstance(value, bool)}


def _print_warning(message: str) -> None:
  print(f"warning: {message}", file=sys.stderr, flush=True)


class Monitor:
  """A run's metrics.jsonl and TensorBoard file behind `log_train` / `log_eval`.

  With `enabled=False` (every process but 0 of a multi-host run) nothing is
  opened or written; the log methods still return their records.

  Call `sync()` before saving a checkpoint, so that the metrics up to its
  step are on disk whenever the checkpoint is (a resume then finds them).
  """

  def __init__(self, out_dir, *, resume_step: Optional[int] = None, enabled: bool = True,
               tensorboard: bool = True, log: Optional[Callable[[str], None]] = None,
               clock: Callable[[], float] = time.time, sinks: Sequence[Any] = ()):
    """Opens the run's files.

    Args:
      out_dir: the run directory.
      resume_step: the step of the checkpoint this run resumed from; None for
        a fresh run.
      enabled: whether this process writes (False on processes other than 0).
      tensorboard: whether to write TensorBoard event files too.
      log: prints one line, for warnings about the files found (a truncated
        line dropped, a missing tensorboardX); default: "warning: ..." on stderr.
        Pass the loop's own logger (e.g. `Progress.write`) to keep one stream.
      clock: wall-clock seconds; tests pass a fake one.
      sinks: further writers, each called `sink(kind, record)` with every
        record written (e.g. `wandb_sink.WandbSink`) and closed with the
        monitor if it has a `close`. Unused when not `enabled`.
    """
    warn = _print_warning if log is None else (lambda message: log(f"warning: {message}"))
    self._clock, self._start = clock, clock()
    self.metrics: Optional[MetricsLog] = None
    self.scalars: Optional[ScalarWriter] = None
    self.sinks = tuple(sinks) if enabled else ()
    if not enabled:
      return
    self.metrics = MetricsLog(out_dir, resume_step=resume_step, clock=clock)
    for message in self.metrics.warnings:
      warn(message)
    if tensorboard:
      try:
        purge_step = 0 if resume_step is None else resume_step + 1
        self.scalars = ScalarWriter(out_dir, purge_step=purge_step)
      except Exception as e:  # pylint: disable=broad-except
        # ImportError, or protobuf's version check: TensorBoard is optional.
        warn(f"no TensorBoard files: tensorboardX failed to import ({type(e).__name__}: {e}); "
             f"pip install tensorboardX")

  def _log(self, kind: str, step: int, values: Mapping[str, Any]) -> Dict[str, Any]:
    if self.metrics is None:
      return make_record(kind, step, self._clock() - self._start, values)
    record = self.metrics.append(kind, step, values)
    if self.scalars is not None:
      self.scalars.add_scalars(step, scalars(kind, record))
    for sink in self.sinks:
      sink(kind, record)
    return record

  def log_train(self, step: int, **values) -> Dict[str, Any]:
    """Records a training log point (e.g. loss, lr, grad_norm, tokens_per_s, mfu).

    None values are left out, so e.g. `mfu=None` on an unknown device is fine.

    Returns:
      The record, `{"step", "time", "kind": "train", **values}`.
    """
    return self._log("train", step, values)

  def log_eval(self, step: int, **values) -> Dict[str, Any]:
    """Records an evaluation (e.g. train_loss, val_loss) and syncs the files to disk."""
    record = self._log("eval", step, values)
    self.sync()
    return record

  def sync(self) -> None:
    """Puts everything logged so far on the disk (call before saving a checkpoint)."""
    if self.metrics is not None:
      self.metrics.sync()

  def close(self) -> None:
    if self.metrics is not None:
      self.metrics.close()
    if self.scalars is not None:
      self.scalars.close()
    for sink in self.sinks:
      getattr(sink, "close", lambda: None)()
    self.sinks = ()

  def __enter__(self) -> "Monitor":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

"""Loss curves of training runs, read from their `metrics.jsonl`.

    figure = plots.plot_runs(["out-gpt", "out-gpt-bf16"], "loss.png")

One PNG, two panels: loss against step and loss against wall time. Each run
has one color and is labelled by its directory's name; train loss is solid,
validation loss dashed with markers. Works on a run still training (its
file's incomplete last line is skipped).

Needs matplotlib, an optional extra: `pip install purejax[plot]`.
"""

import pathlib
from typing import List, NamedTuple, Sequence, Tuple

from purejax.training.effects import monitor

MATPLOTLIB_MISSING = ("purejax.plot needs matplotlib: pip install purejax[plot] "
                      "(or pip install matplotlib)")


class Curve(NamedTuple):
  steps: List[int]
  times: List[float]  # wall seconds since the run started
  losses: List[float]


def _curve(records: Sequence[dict], kind: str, key: str) -> Curve:
  """The `key` values of `kind` records; null (non-finite) values are skipped."""
  points = [(r["step"], r["time"], r[key]) for r in records
            if r["kind"] == kind and isinstance(r.get(key), (int, float))]
  return Curve(*map(list, zip(*points))) if points else Curve([], [], [])


def run_curves(run_dir) -> Tuple[Curve, Curve]:
  """`(train loss, val loss)` of a run directory.

  Train loss comes from the train log points (`loss`); a run that logs none
  (the MLP logs once per epoch) falls back to its evals' `train_loss`.

  Raises:
    FileNotFoundError: the directory has no metrics.jsonl.
  """
  path = pathlib.Path(run_dir) / monitor.METRICS_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{run_dir} has no {monitor.METRICS_FILE} (is it a training "
                            f"run's folder?)")
  records = monitor.read_metrics(path)
  train = _curve(records, "train", "loss")
  if not train.steps:
    train = _curve(records, "eval", "train_loss")
  return train, _curve(records, "eval", "val_loss")


def _labels(run_dirs: Sequence) -> List[str]:
  """Each run's directory name, or its path as given where two names are the same."""
  names = [pathlib.Path(d).resolve().name for d in run_dirs]
  return [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs)]


def _time_unit(seconds: float) -> Tuple[str, float]:
  """A readable unit for an axis running to `seconds`: (name, seconds per unit)."""
  if seconds < 120:
    return "s", 1.0
  if seconds < 2 * 3600:
    return "min", 60.0
  return "h", 3600.0


def plot_runs(run_dirs: Sequence, out_path=None):
  """Draws the runs' loss curves; writes a PNG if `out_path` is given.

  Args:
    run_dirs: training run directories (each with a metrics.jsonl).
    out_path: where to write the PNG, or None to only return the figure.

  Returns:
    The `matplotlib.figure.Figure`: axes 0 is loss against step, axes 1
    against wall time. Per run, a solid train line and a dashed val line
    with markers, in the run's color.

  Raises:
    FileNotFoundError: a directory has no metrics.jsonl.
    ValueError: no run has a loss value yet.
    ImportError: matplotlib is not installed.
  """
  # The Agg canvas and a bare Figure: no pyplot, so no GUI backend, no
  # window, and no global figure list to leak into.
  # pylint: disable=import-outside-toplevel
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  curves = [run_curves(d) for d in run_dirs]
  if not any(c.steps for run in curves for c in run):
    raise ValueError(f"nothing to plot: no loss values yet in {', '.join(map(str, run_dirs))}.")
  unit, per_unit = _time_unit(max(t for run in curves for c in run for t in c.times))

  figure = Figure(figsize=(12, 4.5), layout="constrained")
  FigureCanvasAgg(figure)
  by_step, by_time = figure.subplots(1, 2, sharey=True)
  for i, (label, (train, val)) in enumerate(zip(_labels(run_dirs), curves)):
    color = f"C{i % 10}"
    for ax, x_train, x_val in ((by_step, train.steps, val.steps),
                               (by_time, [t / per_unit for t in train.times],
                                [t / per_unit for t in val.times])):
      if train.steps:
        ax.plot(x_train, train.losses, "-", color=color, label=f"{label} train")
      if val.steps:
        ax.plot(x_val, val.losses, "--", marker="o", markersize=4, color=color,
                label=f"{label} val")
  by_step.set(xlabel="step", ylabel="loss", title="loss against step")
  by_time.set(xlabel=f"wall time ({unit})", title="loss against wall time")
  for ax in (by_step, by_time):
    ax.grid(alpha=0.3)
  by_step.legend()
  if out_path is not None:
    figure.savefig(out_path, dpi=120)
  return figure


def save_loss_plot(out_dir: str) -> None:
  """`out_dir/loss.png` of the run's losses, when matplotlib is installed (a run's last act)."""
  try:
    plot_runs([out_dir], pathlib.Path(out_dir) / "loss.png")
  except ImportError:
    pass  # matplotlib is optional: pip install purejax[plot]

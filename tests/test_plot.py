"""plot: loss curves of runs from their metrics.jsonl, as a PNG."""

import json
import sys

import pytest

from helpers.cli import run_module
from purejax.cli import plot
from purejax.training.effects import plots

try:
  import matplotlib  # pylint: disable=unused-import
except ImportError:
  matplotlib = None
needs_matplotlib = pytest.mark.skipif(matplotlib is None, reason="matplotlib not installed")

# Two runs as the training loop would log them: train loss every 10 steps,
# an eval every 20; the second run is faster per step.
RUNS = {
    "baseline": {"seconds_per_step": 0.5, "train_loss": 4.0},
    "bf16": {"seconds_per_step": 0.25, "train_loss": 3.0},
}


def write_run(run_dir, seconds_per_step, train_loss):
  run_dir.mkdir()
  lines = []
  for step in range(10, 61, 10):
    time = step * seconds_per_step
    lines.append({"step": step, "time": time, "kind": "train", "loss": train_loss / step})
    if step % 20 == 0:
      lines.append({"step": step, "time": time + 0.1, "kind": "eval",
                    "train_loss": train_loss / step, "val_loss": 1.5 * train_loss / step})
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
  return lines


@pytest.fixture
def runs(tmp_path):
  return {name: (tmp_path / name, write_run(tmp_path / name, **spec))
          for name, spec in RUNS.items()}


@needs_matplotlib
def test_two_runs_give_one_png_with_each_runs_curves(runs, tmp_path):
  out = tmp_path / "loss.png"
  figure = plots.plot_runs([path for path, _ in runs.values()], out)
  assert out.read_bytes().startswith(b"\x89PNG")

  by_step, by_time = figure.axes
  assert by_step.get_xlabel() == "step" and by_time.get_xlabel() == "wall time (s)"
  for ax, x in ((by_step, "step"), (by_time, "time")):
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert sorted(lines) == ["baseline train", "baseline val", "bf16 train", "bf16 val"]
    for name, (_, records) in runs.items():
      train, val = lines[f"{name} train"], lines[f"{name} val"]
      assert list(train.get_xdata()) == [r[x] for r in records if r["kind"] == "train"]
      assert list(train.get_ydata()) == [r["loss"] for r in records if r["kind"] == "train"]
      assert list(val.get_xdata()) == [r[x] for r in records if r["kind"] == "eval"]
      assert list(val.get_ydata()) == [r["val_loss"] for r in records if r["kind"] == "eval"]
      # One color per run; train solid, val dashed with markers.
      assert train.get_color() == val.get_color()
      assert train.get_linestyle() == "-" and train.get_marker() in ("None", None, "")
      assert val.get_linestyle() == "--" and val.get_marker() == "o"
    assert lines["baseline train"].get_color() != lines["bf16 train"].get_color()


@needs_matplotlib
def test_long_runs_get_hours_on_the_time_axis(tmp_path):
  run = tmp_path / "long"
  write_run(run, seconds_per_step=600.0, train_loss=2.0)  # 60 steps: 10 hours
  by_time = plots.plot_runs([run]).axes[1]
  assert by_time.get_xlabel() == "wall time (h)"
  assert list(by_time.get_lines()[0].get_xdata()) == [step / 6 for step in range(10, 61, 10)]


def test_a_run_still_writing_is_plotted_without_its_partial_line(runs):
  path, records = runs["bf16"]
  with open(path / "metrics.jsonl", "a") as f:
    f.write('{"step": 70, "time": 17.5, "ki')
  train, _ = plots.run_curves(path)
  assert train.steps == [r["step"] for r in records if r["kind"] == "train"]


@pytest.mark.slow  # renders a PNG with matplotlib; the full suite runs it
@needs_matplotlib
def test_cli_writes_the_png(runs, tmp_path, capsys):
  out = tmp_path / "both.png"
  capsys.readouterr()
  assert plot.run([*[str(path) for path, _ in runs.values()], f"--out={out}"]) == 0
  result = capsys.readouterr()
  assert result.out == f"wrote {out}\n", result.err
  assert out.read_bytes().startswith(b"\x89PNG")


def test_cli_a_dir_without_metrics_is_a_one_line_error(runs, tmp_path, capsys):
  (tmp_path / "empty").mkdir()
  assert plot.run([str(runs["bf16"][0]), str(tmp_path / "empty"),
                   f"--out={tmp_path / 'x.png'}"]) == 1
  assert capsys.readouterr().err.splitlines() == [
      f"error: {tmp_path / 'empty'} has no metrics.jsonl (is it a training run's folder?)"]
  assert not (tmp_path / "x.png").exists()


def test_cli_without_matplotlib_names_the_install_command(runs, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it fails
  assert plot.run([str(runs["bf16"][0])]) == 1
  assert capsys.readouterr().err.splitlines() == [
      "error: purejax.plot needs matplotlib: pip install purejax[plot] (or pip install matplotlib)"]


def test_cli_bad_arguments_are_one_line(capsys):
  assert plot.run([]) == 1
  assert capsys.readouterr().err.splitlines() == [
      "error: the following arguments are required: OUT_DIR (--help lists the arguments)."]


@pytest.mark.slow  # a subprocess; the full suite runs it
def test_python_m_plot_refuses_bad_arguments_in_one_line(tmp_path):
  result = run_module("purejax.plot", "--bins=3", str(tmp_path))
  assert result.returncode == 1
  assert result.stderr.splitlines() == [
      "error: unrecognized arguments: --bins=3 (--help lists the arguments)."]

"""The GPT's training loop for a sweep: N runs in one program, each a run of its own.

    results = train_gpt_sweep(model_config, text, GPTTrainConfig(max_iters=2000),
                              recipes.GPT_OPTIMIZER, RunConfig(out_dir="out-sweep"),
                              grid={"learning_rate": (3e-4, 1e-3, 3e-3)}, num_seeds=2)

The runs (`sweep.expand`: every combination of the grid's values, each with
`num_seeds` seeds from `train.seed`) train together in the one training loop
(`skeleton.train_loop`): on a GPU in one vmapped program
(`gpt_run.RunsTogether`), equal to each run alone to float rounding; where
`sweep_batch` is 1 (the CPU), one after another, each in the program it
compiles alone (`gpt_run.RunsOneByOne`), so bit for bit. Each
run lives in `out_dir/<run name>/` (its settings: `learning_rate=0.001_seed=0`,
so the same grid in any order finds the same runs) exactly as if it had
been trained alone: its own `metrics.jsonl`, TensorBoard events (so
TensorBoard shows the runs side by side under `--logdir out_dir`),
checkpoints and `loss.png`, with the metadata of a single run of its seed,
optimizer and model (its dropout, where the grid sweeps it). So one run can
be resumed, sampled or exported on its own (`purejax.train
--out_dir=out-sweep/<run> --resume` with that run's flags, `purejax.convert
--from=purejax:out-sweep/<run>`).

The whole sweep resumes with the same sweep flags and `--resume`, as one
unit: its runs prune their older checkpoints only after all of them have
saved a step, and a resume takes every run from the newest step all of
them hold, so a sweep killed between its runs' writes goes on
bit-identically. `out_dir/sweep.json` lists the runs; resuming with
another grid is refused (the runs of one program share their step, so new
runs cannot join old ones: they are a sweep of their own). Folders of
earlier versions, `run<index>_<settings>`, are found and go on in place.

The corpus must fit on the device: every run draws its own batches there.
"""

import contextlib
import dataclasses
import json
import pathlib
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from purejax import _files
from purejax import checkpoint
from purejax import gpt
from purejax import lora
from purejax.data import corpus as corpus_lib
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.effects import folder_lock
from purejax.training.effects import plots
from purejax.training.effects import progress as progress_lib
from purejax.training.effects import runs
from purejax.training.effects.runs import RunConfig
from purejax.training.effects.session import Recorded, Session
from purejax.training.loops import gpt_metrics
from purejax.training.loops import gpt_run
from purejax.training.loops import skeleton
from purejax.training.pure import parallel
from purejax.training.pure import preference
from purejax.training.pure import sweep
from purejax.training.pure.parallel import ParallelConfig


class SweepReport:
  """What a sweep shows of its calls and evaluations (`skeleton.Report`): one progress bar
  and log line for all runs (the best and worst), each run's metrics in its own folder."""

  def __init__(self, names: Sequence[str], schedules, tokens_per_step: int):
    self._names, self._schedules, self._tokens_per_step = names, schedules, tokens_per_step

  def trained(self, session: Session, call: skeleton.Call, log_due: bool) -> None:
    losses, seconds, step = call.losses, call.seconds_per_step, call.step
    best = sweep.best_run(losses[:, -1])
    session.progress.update_to(step, best=self._names[best], loss=float(losses[best, -1]))
    if not log_due:
      return
    for i, record in enumerate(session.records):
      record.monitor.log_train(step, loss=losses[i, -1], lr=float(self._schedules[i](step - 1)),
                               grad_norm=float(call.grad_norms[i, -1]),
                               ms_per_iter=1000 * seconds,
                               tokens_per_s=self._tokens_per_step / seconds)
    runs_count = len(self._names)
    session.log(f"step {step:5d} | best loss {losses[best, -1]:.4f} ({self._names[best]}) "
                f"| worst {np.nanmax(losses[:, -1]):.4f} | {1000 * seconds:6.2f} ms/iter for "
                f"{runs_count} runs | {runs_count * self._tokens_per_step / seconds:8.0f} "
                f"tokens/s")

  def evaluated(self, session: Session, step: int, values: skeleton.Values,
                call: Optional[skeleton.Call], run_state) -> None:
    del call, run_state  # a sweep keeps no best checkpoint
    for i, record in enumerate(session.records):
      one = gpt_metrics.one_run(values, i)
      record.add_eval(step, None, {"step": step, **one}, **one)
    best = sweep.best_run(values["val_loss"])
    session.log(f"step {step:5d} | best val loss {values['val_loss'][best]:.4f} "
                f"({self._names[best]}) | worst {np.nanmax(values['val_loss']):.4f}")


def run_dir(out_dir: str, name: str) -> pathlib.Path:
  """Where run `name` lives: `out_dir/<name>`, or the folder an older version of the
  sweep named `run<index>_<name>`, where only that one exists."""
  folder = pathlib.Path(out_dir) / name
  if not folder.exists() and folder.parent.is_dir():
    legacy = [p for p in folder.parent.iterdir()
              if re.fullmatch(rf"run\d+_{re.escape(name)}", p.name) and p.is_dir()]
    if len(legacy) == 1:
      return legacy[0]
  return folder


SWEEP_FILE = "sweep.json"


def check_runs(run: RunConfig, names: Sequence[str]) -> None:
  """A resumed sweep must have the runs its `out_dir/sweep.json` lists (`record_runs`).

  The same grid in another order names the same runs (`sweep.run_name`).

  Raises:
    ValueError: resuming with runs the sweep in `out_dir` did not have, or without some it had.
  """
  path = pathlib.Path(run.out_dir) / SWEEP_FILE
  if run.resume and path.exists():
    saved = json.loads(path.read_text())["runs"]
    added, dropped = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
    if added or dropped:
      change = "; ".join(f"{what} {', '.join(which)}" for what, which in
                         (("adds", added), ("drops", dropped)) if which)
      raise ValueError(f"the sweep in {run.out_dir} has other runs: this grid {change}. "
                       f"Resume with its grid and seeds (in any order), or train the new "
                       f"runs as a sweep of their own in another `out_dir`.")


def record_runs(run: RunConfig, names: Sequence[str]) -> None:
  """Writes the sweep's run names to `out_dir/sweep.json` (atomically)."""
  path = pathlib.Path(run.out_dir) / SWEEP_FILE
  if parallel.is_main_process():
    path.parent.mkdir(parents=True, exist_ok=True)
    _files.atomic_write_bytes(path, json.dumps({"runs": sorted(names)}, indent=1).encode())


def common_step(run: RunConfig, members: Sequence[RunConfig], log) -> Optional[int]:
  """The step every run resumes from: the newest at which all of them hold a valid checkpoint.

  A sweep killed between its runs' checkpoint writes of a step resumes them
  all from the step before (each run keeps it until all have saved the next:
  `session.Session.save_if`), so the runs go on bit-identically.

  Returns:
    None for a fresh sweep (nothing to resume), -1 when some run saved none
    yet (all start anew), else the step.

  Raises:
    ValueError: every run holds checkpoints, but of no step in common.
  """
  if not run.resume:
    return None
  saved = {m.out_dir: checkpoint.valid_steps(m.out_dir) for m in members}
  if not any(saved.values()):
    return None
  if not all(saved.values()):
    return -1
  common = set.intersection(*(set(s) for s in saved.values()))
  if not common:
    raise ValueError(f"the sweep's runs hold checkpoints of no step in common "
                     f"({ {pathlib.Path(d).name: s for d, s in saved.items()} }); resume "
                     f"each run alone, or start the sweep anew in another `out_dir`.")
  step = max(common)
  ahead = [f"{pathlib.Path(d).name} at {s[0]}" for d, s in saved.items() if s[0] > step]
  if ahead:
    log(f"resuming every run of the sweep from step {step}, the newest all of them saved "
        f"(it recomputes the newer checkpoints of {', '.join(ahead)})")
  return step


def train_gpt_sweep(
    config: gpt.GPTConfig,
    text: corpus_lib.Corpus,
    train: gpt_run.GPTTrainConfig,
    opt_config: optim.OptimizerConfig,
    run: RunConfig,
    grid: Mapping[str, Sequence[float]],
    num_seeds: int = 1,
    devices: ParallelConfig = ParallelConfig(),
    *,
    init_params: Optional[gpt.Params] = None,
    init_from: Optional[str] = None,
    lora_config: Optional[lora.LoraConfig] = None,
    forms: Union[kernels.Forms, Mapping[str, Any], None] = None,
    sweep_batch: Optional[int] = None,
    data: Optional[str] = None,
    sinks: Callable[[str, Dict[str, Any]], Sequence[Any]] = lambda name, meta: (),
    metrics: Sequence[gpt_metrics.Metric] = (),
    dpo: Optional[preference.DPO] = None,
) -> List[Dict[str, Any]]:
  """Trains every run of a sweep in one program; returns each run's final evaluation.

  Args:
    config, text, train, opt_config: as `gpt_loop.train_gpt`; `train.seed` is the
      first seed, `opt_config` holds the settings the grid does not vary.
    run: `out_dir` is the sweep's folder; each run gets `out_dir/<run name>`.
    grid: `{optimizer field, or "dropout": values}` (`sweep.parse_grid`);
      may be empty (seeds only). A swept dropout replaces `config.dropout`:
      each run trains, and records in its metadata, its own rate.
    num_seeds: seeds per combination.
    devices: one device only (`grad_accum_steps` may be > 1).
    init_params, init_from, forms, lora_config, data: as `gpt_loop.train_gpt`,
      for every run.
    sweep_batch: runs vmapped together (`sweep.choose_sweep_batch`); None:
      the platform's choice; 0: all at once.
    sinks: `sinks(run name, meta)` -> further metric sinks of that run
      (e.g. a `wandb_sink.WandbSink`).
    metrics: further evaluation metrics, as `gpt_loop.train_gpt`'s, of every run.
    dpo: a preference run's DPO settings, as `gpt_loop.train_gpt`'s.

  Returns:
    `[{"run", "step", "train_loss", "val_loss"}]`, one per run, in sweep order.

  Raises:
    ValueError: a corpus too large for the device, several devices, a bad
      grid value, a resume with another grid (other runs) than the sweep's,
      or runs that hold checkpoints of no step in common.
  """
  if not text.on_device():
    raise ValueError(f"a sweep draws every run's batches on the device, and {text.source} "
                     f"does not fit there; train its runs one at a time.")
  if devices.fsdp or (devices.num_devices or 1) > 1:
    raise ValueError("a sweep runs on one device; drop `fsdp` and `num_devices` (or train "
                     "its runs one at a time across devices).")
  specs = sweep.expand(opt_config, train.seed, grid, num_seeds)
  names = [spec.name for spec in specs]
  folders = [dataclasses.replace(run, out_dir=str(run_dir(run.out_dir, name))) for name in names]
  # One writer per folder: the sweep's and each of its runs' (a run may be
  # resumed alone), held before anything in them is read or written.
  with folder_lock.hold([run.out_dir, *(f.out_dir for f in folders)], log=runs.print_line):
    check_runs(run, names)
    # The run's own model config (its swept dropout), so that it resumes,
    # replays and exports alone as it trained here.
    started = gpt_run.start_runs(
        config, text, train, devices,
        [gpt_run.Member(folder, spec.seed, spec.model_config(config), spec.opt_config)
         for spec, folder in zip(specs, folders)],
        run=run, init_params=init_params, init_from=init_from, forms=forms,
        lora_config=lora_config, data=data, at_most=common_step(run, folders, runs.print_line),
        dpo=dpo)
    context = started.context
    record_runs(run, names)
    sweep_batch = sweep.choose_sweep_batch(kernels.platform_of(context.plan), sweep_batch)
    if sweep_batch == 1:
      driven = gpt_run.RunsOneByOne(started)
    else:
      driven = gpt_run.RunsTogether(started, specs, sweep_batch)
    runs.print_line(f"sweep: {len(specs)} runs {driven.how}, each in {run.out_dir}/<run>: "
                    + ", ".join(names))
    report = SweepReport(names, [optim.make_schedule(r.opt_config) for r in started.runs],
                         train.batch_size * config.block_size)
    with contextlib.closing(context.feed), Session(
        [Recorded(r.run, r.meta, r.saved, sinks(name, r.meta))
         for r, name in zip(started.runs, names)],
        total=train.max_iters, start=started.step, bar=train.progress) as session:
      step, times = skeleton.train_loop(
          driven, session, gpt_run.cadence(context),
          metrics=[*gpt_metrics.evaluation_metrics(text, context),
                   *map(gpt_metrics.per_run,
                        [*gpt_metrics.objective_metrics(context), *metrics])],
          report=report, start=started.step)
    if parallel.is_main_process():
      for folder in folders:
        plots.save_loss_plot(folder.out_dir)
    if times:
      runs.print_line(f"median {progress_lib.median_ms(times):.2f} ms/iter for {len(specs)} "
                      f"runs after compilation")
    return [{"run": name, **(record.history[-1] if record.history else {"step": step})}
            for name, record in zip(names, session.records)]

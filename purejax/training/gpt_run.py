"""What a GPT run is and how it starts, for a run alone and for a sweep's runs.

    started = start_runs(config, text, train, devices, [Member(run, seed, config, opt)])
    state, train_steps = run_program(started.runs[0].state, started.plan, ...)

`loop.train_gpt` starts one run here and `sweep_loop.train_gpt_sweep` its N
(each in its own folder, resumed from their newest common step): the same
checks, checkpoint metadata, seeded or resumed state, schedule, devices,
forms and batches, so a run of a sweep is the run trained alone.
"""

import dataclasses
import functools
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from purejax import gpt
from purejax import lora
from purejax.data import batches
from purejax.data import corpus as corpus_lib
from purejax.ops import kernels
from purejax.training import optim
from purejax.training import parallel
from purejax.training import runs
from purejax.training import state as state_lib
from purejax.training import steps
from purejax.training.parallel import ParallelConfig
from purejax.training.runs import RunConfig
from purejax.training.state import TrainState


@dataclasses.dataclass(frozen=True)
class GPTTrainConfig:
  """How long and how the GPT trains, evaluates, logs and saves (nanoGPT's names).

  Attributes:
    batch_size: sequences per step (the global batch).
    max_iters: optimisation steps.
    eval_interval: steps between evaluations of train and val loss.
    eval_iters: batches per evaluation.
    log_interval: steps between log points (a line, metrics.jsonl, TensorBoard).
    steps_per_call: steps fused into one jitted `lax.scan`.
    checkpoint_every: steps between checkpoints; None: `eval_interval`.
    always_save_checkpoint: False also keeps the checkpoint of the lowest val
      loss so far (`checkpoint.best_path`), beside the keep-K rotation.
    sample_tokens: tokens sampled at the end (0: none).
    seed: seed of the run's PRNG key.
    profile_steps: `(first, last)`: a `jax.profiler` trace of these steps
      goes to `out_dir/profile` (for TensorBoard's profile plugin).
    progress: a live progress bar; None: when stderr is a terminal.
    peak_flops: one device's peak FLOP/s for the logged MFU; None: the
      device's known peak (`flops.device_peak_flops`), or no MFU.
  """
  batch_size: int = 12
  max_iters: int = 2000
  eval_interval: int = 250
  eval_iters: int = 200
  log_interval: int = 50
  steps_per_call: int = 10
  checkpoint_every: Optional[int] = None
  always_save_checkpoint: bool = True
  sample_tokens: int = 300
  seed: int = 0
  profile_steps: Optional[Tuple[int, int]] = None
  progress: Optional[bool] = None
  peak_flops: Optional[float] = None

  def __post_init__(self):
    runs.require_positive(
        batch_size=self.batch_size, max_iters=self.max_iters,
        eval_interval=self.eval_interval, eval_iters=self.eval_iters,
        log_interval=self.log_interval, steps_per_call=self.steps_per_call,
        checkpoint_every=self.checkpoint_interval)
    if self.peak_flops is not None and not self.peak_flops > 0:
      raise ValueError(f"`peak_flops` must be one device's peak FLOP/s, a positive number "
                       f"(e.g. 989e12), or None for the device's known peak; got "
                       f"{self.peak_flops}.")
    if self.profile_steps is not None:
      first, last = self.profile_steps
      if not 0 <= first < last <= self.max_iters:
        raise ValueError(f"`profile_steps={first},{last}` must be two steps A,B with "
                         f"0 <= A < B <= `max_iters={self.max_iters}`.")

  @property
  def checkpoint_interval(self) -> int:
    """Steps between checkpoints: `checkpoint_every`, else `eval_interval`."""
    return self.checkpoint_every or self.eval_interval


def check_fits(config: gpt.GPTConfig, text, batch_size: int) -> None:
  if config.vocab_size < text.vocab_size:
    raise ValueError(f"the model's vocab_size {config.vocab_size} is below the "
                     f"{text.vocab_size} ids of the data's tokenizer; use the model's "
                     f"own tokenizer (`tokenizer`) or a larger model vocabulary.")
  text.check_block_size(config.block_size)


class CallLengths:
  """How many steps the loop's call from `step` runs: up to `steps_per_call`, never
  across an eval, log, checkpoint or profile boundary (the host feed reads ahead by it)."""

  def __init__(self, train: GPTTrainConfig):
    self._train = train
    self._marks = (train.eval_interval, train.log_interval,
                   train.checkpoint_interval)

  def __call__(self, step: int) -> int:
    boundary = runs.next_boundary(step, self._marks, self._train.max_iters)
    for mark in self._train.profile_steps or ():
      boundary = min(boundary, mark) if mark > step else boundary
    return min(self._train.steps_per_call, boundary - step)


def forms_of(plan: parallel.ShardingPlan, forms: Optional[kernels.Forms] = None
             ) -> kernels.Forms:
  """`forms`, else those `kernels.select` chooses for the plan's platform."""
  return forms or kernels.select(kernels.platform_of(plan))


def make_feed(text, config, train, plan, *, start_step, steps_per_call, end_step=None
              ) -> batches.Feed:
  """The data's batches (`Corpus.feed`, `Conversations.feed`): on every device where they
  fit (each device draws its rows of every batch from its own copy), else read by the host."""
  return text.feed(functools.partial(parallel.put, shardings=plan.replicated),
                   block_size=config.block_size, batch_size=train.batch_size,
                   eval_batches=train.eval_iters, seed=train.seed, start_step=start_step,
                   end_step=train.max_iters if end_step is None else end_step,
                   steps_per_call=steps_per_call)


def _describe_model(config: gpt.GPTConfig, n_params: int) -> str:
  """One short line: size, shape and vocabulary (the whole config is in the checkpoints)."""
  return (f"{n_params / 1e6:.2f}M params (without position embeddings), {config.n_layer} "
          f"layers x {config.n_head} heads x {config.n_embd}, context {config.block_size}, "
          f"vocab {config.vocab_size}, dropout {config.dropout:g}"
          f"{'' if config.bias else ', no biases'}")


def gpt_meta(config, text, opt_config, batch_size, seed, init_from, *, lora_config=None,
             data=None, grad_accum_steps=1) -> Dict[str, Any]:
  """What a GPT checkpoint records: the run's identity, its tokenizer and origin,
  what `purejax.replay` needs to load its data again (`data`: the `--dataset`
  given), and its LoRA adapters' settings."""
  meta = {"model": "gpt", "config": dataclasses.asdict(config),
          "tokenizer": text.tokenizer.spec().to_dict(),
          "optimizer": dataclasses.asdict(opt_config), "batch_size": batch_size,
          "seed": seed, "init_from": init_from, "dataset": text.name or None,
          "data": data, "grad_accum_steps": grad_accum_steps}
  if lora_config is not None:
    meta["lora"] = dataclasses.asdict(lora_config)
  return meta


def run_optimizer(opt_config: optim.OptimizerConfig, run: RunConfig, lora_config=None
                  ) -> optim.RunOptimizer:
  """The run's optimizer, built when called (a sweep calls it with each run's numbers):
  NaN/Inf updates skipped with `run.skip_nonfinite`, and with LoRA only the
  adapters trained (`optim.frozen_base`)."""
  return optim.RunOptimizer(opt_config, run.skip_nonfinite, lora_config is not None)


def run_program(state, plan, config, opt_config, run, lora_config, train, grad_accum_steps,
                forms, view):
  """`(state on the plan's devices, its jitted `steps.train_steps`)`: one run's program,
  the same for a run alone and a run of a sweep taken one at a time (so they agree bitwise)."""
  state, shardings = state_lib.shard(state, plan)
  return state, parallel.sharded_step(
      steps.train_steps, plan, shardings, config=config,
      optimizer=run_optimizer(opt_config, run, lora_config)(), batch_size=train.batch_size,
      grad_accum_steps=grad_accum_steps, forms=forms, params_view=view)


class Member(NamedTuple):
  """One run a GPT loop trains, before it starts (`start_runs`).

  Attributes:
    run: its folder and how it persists (a sweep's run: `out_dir/<run name>`).
    seed: its seed (`state.run_keys`).
    config: its model (a sweep's run: with its own dropout).
    opt_config: its optimizer; `decay_iters=None` is decided at the start
      (`optim.with_schedule_end`).
  """
  run: RunConfig
  seed: int
  config: gpt.GPTConfig
  opt_config: optim.OptimizerConfig


class StartedRun(NamedTuple):
  """One run, ready for its first step.

  Attributes:
    run, config: the member's.
    opt_config: the member's, its schedule's end decided (a resumed run's kept).
    meta: what its checkpoints record.
    state: its `TrainState` on the host, fresh or resumed.
    step: the step it starts from.
    saved: the resumed checkpoint's metadata (`{}` in a new run).
    keys: `state.run_keys(seed)` (the final sample's key).
    view: the params view of LoRA's base and adapters (None without LoRA).
    n_params: the model's size, without position embeddings.
  """
  run: RunConfig
  config: gpt.GPTConfig
  opt_config: optim.OptimizerConfig
  meta: Dict[str, Any]
  state: TrainState
  step: int
  saved: Dict[str, Any]
  keys: Dict[str, Any]
  view: Optional[Any]
  n_params: int


class Started(NamedTuple):
  """What a GPT loop trains and what its runs share (`start_runs`).

  Attributes:
    runs: one `StartedRun` per member, in order.
    step: the step they all start from.
    plan: how the step is spread over devices.
    forms: how the model runs.
    view: the params view of LoRA's base and adapters (None without LoRA).
    feed: the batches of every run (each draws its own from its keys).
    call_length: steps per call from a step (`CallLengths`).
  """
  runs: List[StartedRun]
  step: int
  plan: parallel.ShardingPlan
  forms: kernels.Forms
  view: Optional[Any]
  feed: batches.Feed
  call_length: CallLengths


def _start(member: Member, text, train: GPTTrainConfig, devices: ParallelConfig, init_params,
           init_from, lora_config, data, at_most) -> StartedRun:
  """The member's start: a fresh state, or its newest checkpoint of step `at_most` or older."""
  keys = state_lib.run_keys(member.seed)
  params = (gpt.init_params(member.config, keys["params"]) if init_params is None
            else init_params)
  gpt.check_params(params, member.config)
  fresh = optim.with_schedule_end(member.opt_config, train.max_iters)
  meta = gpt_meta(member.config, text, fresh, train.batch_size, member.seed, init_from,
                  lora_config=lora_config, data=data, grad_accum_steps=devices.grad_accum_steps)
  # The data sampler's whole state is (train key, step): batch s is drawn
  # from fold_in(train key, s), so restoring both resumes the same stream.
  template, view = state_lib.start_state(
      params, keys, run_optimizer(fresh, member.run, lora_config)(), lora_config)
  start = runs.start_or_resume(
      member.run, template, meta,
      saved_defaults={"config": runs.dataclass_defaults(gpt.GPTConfig)},
      ignored={"optimizer": ("decay_iters",), "config": gpt.EXECUTION_FIELDS},
      digest_extra=[devices.fsdp, devices.grad_accum_steps], at_most=at_most)
  resolved = optim.with_schedule_end(member.opt_config, train.max_iters,
                                     start.saved.get("optimizer", {}).get("decay_iters"))
  meta = {**meta, "optimizer": dataclasses.asdict(resolved)}
  return StartedRun(member.run, member.config, resolved, meta, start.state, start.step,
                    start.saved, keys, view, gpt.num_params(params))


def start_runs(config: gpt.GPTConfig, text: corpus_lib.Corpus, train: GPTTrainConfig,
               devices: ParallelConfig, members: Sequence[Member], *, init_params=None,
               init_from=None, forms=None, lora_config=None, data=None,
               at_most: Optional[int] = None, what: str = "run") -> Started:
  """Everything a GPT loop builds before its first step, for a run alone or a sweep's runs.

  Args:
    config: the model the runs share (a member's may differ in dropout).
    text, train, devices, init_params, init_from, forms, lora_config, data:
      as `train_gpt`.
    members: the runs (one alone; a sweep's in its order).
    at_most: resume every run from its newest checkpoint of this step or
      older (a sweep's newest common step); None: its newest.
    what: what the runs are, for the log ("run" or "sweep").

  Returns:
    The runs, started at one step, and what they share.
  """
  check_fits(config, text, train.batch_size)
  plan = parallel.make_plan(devices, train.batch_size)
  runs.print_line(f"devices: {parallel.describe(plan, train.batch_size, devices.grad_accum_steps)}")
  forms = forms_of(plan, forms)
  runs.print_line(f"forms: {forms.describe()}")
  started = [_start(m, text, train, devices, init_params, init_from, lora_config, data, at_most)
             for m in members]
  first = started[0]
  assert all(r.step == first.step for r in started), "runs restored at different steps"
  kept = sorted({r.opt_config.decay_iters for m, r in zip(members, started)
                 if r.saved and m.opt_config.decay_iters is None
                 and r.opt_config.decay_iters != train.max_iters})
  if kept:
    runs.print_line(f"keeping the {what}'s schedule: it ends at step "
                    f"{', '.join(map(str, kept))} (set the optimizer's decay_iters to "
                    f"change that)")
  call_length = CallLengths(train)
  feed = make_feed(text, config, train, plan, start_step=first.step,
                   steps_per_call=call_length)
  runs.print_line(f"model: {_describe_model(config, first.n_params)}")
  if lora_config is not None:
    adapters = lora.num_params(first.state.params["adapters"])
    runs.print_line(f"LoRA: {adapters / 1e6:.3f}M adapter params train, the base is frozen; "
                    f"{lora_config}")
  runs.print_line(f"data: {text.source}; batches drawn "
                  f"{'on the device' if feed.on_device else 'by the host, one call ahead'}")
  return Started(started, first.step, plan, forms, first.view, feed, call_length)

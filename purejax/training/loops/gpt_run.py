"""What a GPT run is, how it starts and what trains it, for a run alone and a sweep's runs.

    context, started = start_run(config, text, train, devices, run, opt_config)
    state, train_step = run_program(started.state, started.opt_config, config, context)

`gpt_loop.train_gpt` starts one run here (`start_run`) and `sweep_loop.train_gpt_sweep`
its N (`start_runs`: each in its own folder, resumed from their newest common step):
the same checks, checkpoint metadata, seeded or resumed state, schedule, devices,
forms and batches, so a run of a sweep is the run trained alone. What the runs
share is one `RunContext`; what trains a sweep's runs is a `skeleton.Driven`.
"""

import dataclasses
import functools
import time
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import numpy as np

from purejax import gpt
from purejax import lora
from purejax.data import batches
from purejax.data import corpus as corpus_lib
from purejax.data import preferences
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.effects import runs
from purejax.training.effects.runs import RunConfig
from purejax.training.loops import gpt_metrics
from purejax.training.loops import skeleton
from purejax.training.pure import parallel
from purejax.training.pure import preference
from purejax.training.pure import state as state_lib
from purejax.training.pure import steps
from purejax.training.pure import sweep
from purejax.training.pure.parallel import ParallelConfig
from purejax.training.pure.state import TrainState


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


def cadence(context: "RunContext") -> skeleton.Cadence:
  """When a GPT loop evaluates, logs and saves: its `train`'s intervals, in calls of up to
  `steps_per_call` steps (`CallLengths`)."""
  train = context.train
  return skeleton.Cadence(total=train.max_iters, eval_interval=train.eval_interval,
                          log_interval=train.log_interval,
                          checkpoint_interval=train.checkpoint_interval,
                          call_length=context.call_length)


def forms_of(plan: parallel.ShardingPlan,
             forms: Union[kernels.Forms, Mapping[str, Any], None] = None) -> kernels.Forms:
  """The run's forms: `forms` itself where it is a `kernels.Forms`, else those
  `kernels.select` chooses for the plan's platform with `forms` as its overrides
  (e.g. `{"attention": "xla"}`; None: none)."""
  if isinstance(forms, kernels.Forms):
    return forms
  return kernels.select(kernels.platform_of(plan), **(forms or {}))


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
             data=None, grad_accum_steps=1, objective=steps.lm_loss) -> Dict[str, Any]:
  """What a GPT checkpoint records: the run's identity, its tokenizer and origin,
  what `purejax.replay` needs to load its data again (`data`: the `--dataset`
  given), its LoRA adapters' settings, and a preference run's DPO settings."""
  meta = {"model": "gpt", "config": dataclasses.asdict(config),
          "tokenizer": text.tokenizer.spec().to_dict(),
          "optimizer": optim.to_saved(opt_config), "batch_size": batch_size,
          "seed": seed, "init_from": init_from, "dataset": text.name or None,
          "data": data, "grad_accum_steps": grad_accum_steps}
  if lora_config is not None:
    meta["lora"] = dataclasses.asdict(lora_config)
  if isinstance(objective, preference.DPO):
    meta["dpo"] = dataclasses.asdict(objective)
  return meta


def objective_of(text, dpo: Optional[preference.DPO]):
  """The run's objective: DPO (`dpo`, else its defaults) on preference pairs, the
  language-model loss on anything else."""
  if isinstance(text, preferences.Preferences):
    return dpo or preference.DPO()
  if dpo is not None:
    raise ValueError("DPO trains on preference pairs; load them with "
                     "preferences.load_preferences (a .jsonl of prompt, chosen and rejected).")
  return steps.lm_loss


def with_reference(text, objective, init_params, config: gpt.GPTConfig, forms: kernels.Forms,
                   batch_size: int):
  """A preference run's pairs with the reference's log-probabilities: `init_params`'
  (the starting model; with LoRA, the base the adapters are added to), computed once
  before training, so no reference model is held. Other data as it is."""
  if not isinstance(objective, preference.DPO):
    return text
  if init_params is None:
    raise ValueError("DPO starts from a trained model, which is also its reference; pass "
                     "its params as `init_params`.")
  began = time.perf_counter()
  # On the device once: host weights (a loader's, transposed views) would be copied in
  # on every pass.
  init_params = jax.device_put(init_params)
  ref = [preference.pair_logps(init_params, rows, weights, config, forms=forms,
                               batch_size=batch_size)[0] for rows, weights in (text.train,
                                                                             text.val)]
  runs.print_line(f"reference: the starting model's log-probabilities of "
                  f"{2 * sum(len(r) for r in ref)} answers ({time.perf_counter() - began:.1f} s)")
  return text.with_reference(*ref)


def run_optimizer(opt_config: optim.OptimizerConfig, run: RunConfig, lora_config=None
                  ) -> optim.RunOptimizer:
  """The run's optimizer, built when called (a sweep calls it with each run's numbers):
  NaN/Inf updates skipped with `run.skip_nonfinite`, and with LoRA only the
  adapters trained (`optim.frozen_base`)."""
  return optim.RunOptimizer(opt_config, run.skip_nonfinite, lora_config is not None)


class RunContext(NamedTuple):
  """What the runs of a GPT loop share.

  Attributes:
    config: the model (a sweep's run may differ in dropout: `StartedRun.config`).
    train: steps, evaluation, logging, checkpoints.
    run: where the run lives and how it persists (a sweep's: its folder).
    plan: how the step is spread over devices.
    forms: how the model runs.
    view: the params view of LoRA's base and adapters (None without LoRA).
    lora_config: the LoRA adapters trained (None: the params train).
    grad_accum_steps: microbatches per step.
    feed: the batches of every run (each draws its own from its keys).
    call_length: steps per call from a step (`CallLengths`).
    objective: the loss of a batch: `steps.lm_loss`, or a preference run's
      `preference.DPO` (`objective_of`).
  """
  config: gpt.GPTConfig
  train: GPTTrainConfig
  run: Optional[RunConfig]
  plan: parallel.ShardingPlan
  forms: kernels.Forms
  view: Optional[Any]
  lora_config: Optional[lora.LoraConfig]
  grad_accum_steps: int
  feed: batches.Feed
  call_length: Optional["CallLengths"]
  objective: Any = steps.lm_loss


def run_program(state: TrainState, opt_config: optim.OptimizerConfig, config: gpt.GPTConfig,
                context: RunContext):
  """`(state on the plan's devices, its jitted `steps.train_steps`)`: one run's program,
  the same for a run alone and a run of a sweep taken one at a time (so they agree bitwise)."""
  state, shardings = state_lib.shard(state, context.plan)
  return state, parallel.jit_train_step(
      steps.train_steps_fn, context.plan, shardings, config=config,
      optimizer=run_optimizer(opt_config, context.run, context.lora_config)(),
      batch_size=context.train.batch_size, grad_accum_steps=context.grad_accum_steps,
      forms=context.forms, params_view=context.view, objective=context.objective)


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
    context: what they share.
  """
  runs: List[StartedRun]
  step: int
  context: RunContext


# What a checkpoint's metadata must agree on to continue the run (`runs.start_or_resume`).
IDENTITY = ("model", "config", "optimizer", "batch_size", "seed", "lora", "dpo")


def _start(run: RunConfig, seed: int, config: gpt.GPTConfig, opt_config: optim.OptimizerConfig,
           text, train: GPTTrainConfig, devices: ParallelConfig, init_params, init_from,
           lora_config, data, at_most, objective=steps.lm_loss) -> StartedRun:
  """A run's start: a fresh state, or its newest checkpoint of step `at_most` or older."""
  keys = state_lib.run_keys(seed)
  params = gpt.init_params(config, keys["params"]) if init_params is None else init_params
  gpt.check_params(params, config)
  fresh = optim.with_schedule_end(opt_config, train.max_iters)
  meta = gpt_meta(config, text, fresh, train.batch_size, seed, init_from,
                  lora_config=lora_config, data=data, grad_accum_steps=devices.grad_accum_steps,
                  objective=objective)
  # The data sampler's whole state is (train key, step): batch s is drawn
  # from fold_in(train key, s), so restoring both resumes the same stream.
  template, view = state_lib.start_state(
      params, keys, run_optimizer(fresh, run, lora_config)(), lora_config)
  start = runs.start_or_resume(
      run, template, meta, identity=IDENTITY,
      saved_defaults={"config": runs.dataclass_defaults(gpt.GPTConfig)},
      ignored={"optimizer": ("decay_iters",), "config": gpt.EXECUTION_FIELDS},
      digest_extra=[devices.fsdp, devices.grad_accum_steps], at_most=at_most)
  resolved = optim.with_schedule_end(opt_config, train.max_iters,
                                     start.saved.get("optimizer", {}).get("decay_iters"))
  meta = {**meta, "optimizer": optim.to_saved(resolved)}
  return StartedRun(run, config, resolved, meta, start.state, start.step, start.saved, keys,
                    view, gpt.num_params(params))


def _plan_and_forms(config, text, train, devices, forms) -> Tuple[parallel.ShardingPlan,
                                                                   kernels.Forms]:
  """The checks before anything loads, then the devices' plan and the forms, each logged."""
  check_fits(config, text, train.batch_size)
  plan = parallel.make_plan(devices, train.batch_size)
  runs.print_line(f"devices: {parallel.describe(plan, train.batch_size, devices.grad_accum_steps)}")
  forms = forms_of(plan, forms)
  runs.print_line(f"forms: {forms.describe()}")
  return plan, forms


def _context(config, text, train, devices, run, plan, forms, first: StartedRun, lora_config,
             objective) -> RunContext:
  """What the runs share once they have started at `first.step`: the batches, logged."""
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
  if isinstance(objective, preference.DPO):
    runs.print_line(f"objective: {objective}")
  return RunContext(config, train, run, plan, forms, first.view, lora_config,
                    devices.grad_accum_steps, feed, call_length, objective)


def _log_kept_schedule(kept: Sequence[int], what: str) -> None:
  if kept:
    runs.print_line(f"keeping the {what}'s schedule: it ends at step "
                    f"{', '.join(map(str, kept))} (set the optimizer's decay_iters to "
                    f"change that)")


def start_run(config: gpt.GPTConfig, text: corpus_lib.Corpus, train: GPTTrainConfig,
              devices: ParallelConfig, run: RunConfig, opt_config: optim.OptimizerConfig, *,
              init_params=None, init_from=None, forms=None, lora_config=None, data=None,
              dpo=None) -> Tuple[RunContext, StartedRun]:
  """Everything a run alone builds before its first step (`gpt_loop.train_gpt`'s).

  Args: as `gpt_loop.train_gpt`'s.

  Returns:
    `(what the run's loop reads, the run: its state, fresh or resumed, its step,
    schedule and checkpoint metadata)`.
  """
  objective = objective_of(text, dpo)
  plan, forms = _plan_and_forms(config, text, train, devices, forms)
  started = _start(run, train.seed, config, opt_config, text, train, devices, init_params,
                   init_from, lora_config, data, at_most=None, objective=objective)
  ends = started.opt_config.decay_iters
  _log_kept_schedule([ends] if started.saved and opt_config.decay_iters is None
                     and ends != train.max_iters else [], "run")
  text = with_reference(text, objective, init_params, config, forms, train.batch_size)
  return _context(config, text, train, devices, run, plan, forms, started, lora_config,
                  objective), started


def start_runs(config: gpt.GPTConfig, text: corpus_lib.Corpus, train: GPTTrainConfig,
               devices: ParallelConfig, members: Sequence[Member], *, run: RunConfig,
               init_params=None, init_from=None, forms=None, lora_config=None, data=None,
               at_most: Optional[int] = None, dpo=None) -> Started:
  """Everything a sweep builds before its first step: `start_run`'s, for each of its runs.

  Args:
    config: the model the runs share (a member's may differ in dropout).
    text, train, devices, init_params, init_from, forms, lora_config, data:
      as `gpt_loop.train_gpt`.
    members: the sweep's runs, in its order.
    run: how the sweep persists (its folder; each member has its own).
    at_most: resume every run from its newest checkpoint of this step or
      older (the sweep's newest common step); None: its newest.
    dpo: as `gpt_loop.train_gpt`'s.

  Returns:
    The runs, started at one step, and what they share.
  """
  objective = objective_of(text, dpo)
  plan, forms = _plan_and_forms(config, text, train, devices, forms)
  started = [_start(m.run, m.seed, m.config, m.opt_config, text, train, devices, init_params,
                    init_from, lora_config, data, at_most, objective) for m in members]
  first = started[0]
  assert all(r.step == first.step for r in started), "runs restored at different steps"
  _log_kept_schedule(sorted({r.opt_config.decay_iters for m, r in zip(members, started)
                             if r.saved and m.opt_config.decay_iters is None
                             and r.opt_config.decay_iters != train.max_iters}), "sweep")
  text = with_reference(text, objective, init_params, config, forms, train.batch_size)
  context = _context(config, text, train, devices, run, plan, forms, first, lora_config,
                     objective)
  return Started(started, first.step, context)


# ----------------------------------------------------------------------------
# What trains the started runs: the training loop's `skeleton.Driven`.

class RunsOneByOne:
  """The runs one after another, each in the program it compiles alone (`run_program`):
  a run alone, or a sweep's runs where `sweep_batch` is 1 (the CPU), so a run of the
  sweep is bit-identical to the run trained alone."""
  how = "one at a time, each in its own program"

  def __init__(self, started: Started):
    self._context = started.context
    self._configs = [r.config for r in started.runs]
    self._states, self._programs = [], []
    for r in started.runs:
      state, program = run_program(r.state, r.opt_config, r.config, started.context)
      self._states.append(state)
      self._programs.append(program)

  def train(self, step: int, num_steps: int) -> Tuple[np.ndarray, np.ndarray]:
    """Runs `num_steps` steps of every run; `(losses, grad norms)`, `[runs, num_steps]` each."""
    tokens = self._context.feed.train(step, num_steps)
    metrics = []
    for i, program in enumerate(self._programs):
      self._states[i], m = program(self._states[i], tokens, step, num_steps=num_steps)
      metrics.append(m)
    return (np.stack([np.asarray(m.loss) for m in metrics]),
            np.stack([np.asarray(m.grad_norm) for m in metrics]))

  def split_losses(self) -> Dict[str, np.ndarray]:
    """`{split: [runs] mean losses}` (`evaluate_splits` of each run)."""
    losses = [gpt_metrics.evaluate_splits(s.params, s.keys["eval"], self._context, config)
              for s, config in zip(self._states, self._configs)]
    return {name: np.asarray([l[name] for l in losses]) for name in losses[0]}

  def eval_key(self, index: int):
    return self._states[index].keys["eval"]

  def run_state(self, index: int) -> TrainState:
    return self._states[index]

  def model(self, index: int):
    """Run `index`'s `(params, config, forms)` (`model_of`)."""
    return gpt_metrics.model_of(self._states[index].params, self._configs[index], self._context)


class RunsTogether:
  """A sweep's runs in one program (`sweep.train_steps`), `sweep_batch` of them vmapped
  together: equal to the runs trained alone to float rounding."""

  def __init__(self, started: Started, specs: Sequence[sweep.RunSpec],
               sweep_batch: Optional[int]):
    context = started.context
    self.state = sweep.stack([r.state for r in started.runs])
    self._feed, self._hyper = context.feed, sweep.hyperparams(specs)
    self._context, self._configs = context, [r.config for r in started.runs]
    self.how = f"in one program, {sweep_batch or len(specs)} vmapped together"
    # The settings the runs share are any run's: each replaces the swept numbers with its own.
    shared = started.runs[0].opt_config
    self._steps = functools.partial(
        sweep.train_steps, config=context.config,
        make_optimizer=run_optimizer(shared, context.run, context.lora_config),
        batch_size=context.train.batch_size, grad_accum_steps=context.grad_accum_steps,
        params_view=context.view, forms=context.forms, sweep_batch=sweep_batch,
        objective=context.objective)
    self._evaluate = functools.partial(
        sweep.evaluate, config=context.config, batch_size=context.train.batch_size,
        num_batches=context.train.eval_iters, params_view=context.view, forms=context.forms,
        sweep_batch=sweep_batch, objective=context.objective)

  def train(self, step: int, num_steps: int) -> Tuple[np.ndarray, np.ndarray]:
    self.state, metrics = self._steps(self.state, self._feed.train(step, num_steps), step,
                                      self._hyper, num_steps=num_steps)
    return np.asarray(metrics.loss), np.asarray(metrics.grad_norm)

  def split_losses(self) -> Dict[str, np.ndarray]:
    return {name: np.asarray(self._evaluate(self.state.params, tokens, self.state.keys["eval"]))
            for name, tokens in self._feed.eval.items()}

  def eval_key(self, index: int):
    return sweep.unstack(self.state.keys["eval"], index)

  def run_state(self, index: int) -> TrainState:
    return sweep.unstack(self.state, index)

  def model(self, index: int):
    """Run `index`'s `(params, config, forms)` (`model_of`)."""
    return gpt_metrics.model_of(sweep.unstack(self.state.params, index), self._configs[index],
                    self._context)

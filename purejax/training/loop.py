"""The GPT's training loop, as a library function that reads no flags.

    metrics = train_gpt(model_config, text, GPTTrainConfig(max_iters=2000),
                        GPT_OPTIMIZER, RunConfig(out_dir="out-gpt"))

`python -m purejax.train` only turns its flags into these configs and calls
`train_gpt` (or `mlp_loop.train_mlp`); a Python user can call them the same
way. The loop reads top to bottom: data -> model -> loss -> optimizer ->
checkpoint and log; what it shares with the MLP's loop (progress, metrics,
evaluations, checkpoints, signals) is `session.Session`.
"""

import contextlib
import dataclasses
import functools
import pathlib
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from purejax import decode
from purejax import gpt
from purejax import lora
from purejax.data import batches
from purejax.data import conversations
from purejax.data import corpus as corpus_lib
from purejax.data import tokenizers
from purejax.ops import kernels
from purejax.training import flops
from purejax.training import optim
from purejax.training import parallel
from purejax.training import plots
from purejax.training import progress as progress_lib
from purejax.training import runs
from purejax.training import state as state_lib
from purejax.training import steps
from purejax.training.parallel import ParallelConfig
from purejax.training.runs import RunConfig
from purejax.training.session import Session
from purejax.training.state import TrainState

# nanoGPT's character-level Shakespeare recipe for a CPU: the model (no
# biases, as nanoGPT's train.py; GPTConfig's own default is GPT-2's biases)
# and its optimizer. `purejax.train`'s GPT flags default to these.
SHAKESPEARE_CHAR = gpt.GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4,
                                 n_embd=128, dropout=0.0, bias=False)
GPT_OPTIMIZER = optim.OptimizerConfig(
    learning_rate=1e-3, schedule="cosine", warmup_iters=100, min_lr=1e-4, beta2=0.99,
    weight_decay=0.1, grad_clip=1.0)


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
        checkpoint_every=self.checkpoint_every or self.eval_interval)
    if self.peak_flops is not None and not self.peak_flops > 0:
      raise ValueError(f"`peak_flops` must be one device's peak FLOP/s, a positive number "
                       f"(e.g. 989e12), or None for the device's known peak; got "
                       f"{self.peak_flops}.")
    if self.profile_steps is not None:
      first, last = self.profile_steps
      if not 0 <= first < last <= self.max_iters:
        raise ValueError(f"`profile_steps={first},{last}` must be two steps A,B with "
                         f"0 <= A < B <= `max_iters={self.max_iters}`.")


def check_fits(config: gpt.GPTConfig, text, batch_size: int) -> None:
  if config.vocab_size < text.vocab_size:
    raise ValueError(f"the model's vocab_size {config.vocab_size} is below the "
                     f"{text.vocab_size} ids of the data's tokenizer; use the model's "
                     f"own tokenizer (`tokenizer`) or a larger model vocabulary.")
  if isinstance(text, conversations.Conversations):
    if text.train[0].shape[1] != config.block_size + 1:
      raise ValueError(f"the conversations are padded to {text.train[0].shape[1]} tokens, "
                       f"not the model's block_size + 1 = {config.block_size + 1}; load "
                       f"them with the model's block_size.")
  elif config.block_size >= min(len(text.train), len(text.val)):
    raise ValueError(f"`block_size={config.block_size}` must be shorter than the "
                     f"validation text ({len(text.val)} tokens) and the training text "
                     f"({len(text.train)} tokens).")


class CallLengths:
  """How many steps the loop's call from `step` runs: up to `steps_per_call`, never
  across an eval, log, checkpoint or profile boundary (the host feed reads ahead by it)."""

  def __init__(self, train: GPTTrainConfig):
    self._train = train
    self._marks = (train.eval_interval, train.log_interval,
                   train.checkpoint_every or train.eval_interval)

  def __call__(self, step: int) -> int:
    boundary = runs.next_boundary(step, self._marks, self._train.max_iters)
    for mark in self._train.profile_steps or ():
      boundary = min(boundary, mark) if mark > step else boundary
    return min(self._train.steps_per_call, boundary - step)


def make_feed(text, config, train, plan, *, start_step, steps_per_call, end_step=None
              ) -> batches.Feed:
  """The corpus on every device if it fits (`corpus.fits_on_device`), else read by the host."""
  put = functools.partial(parallel.put, shardings=plan.replicated)
  if isinstance(text, conversations.Conversations):  # whole padded rows, on the device
    return batches.rows_feed(text.train, text.val, put)
  if corpus_lib.fits_on_device(text):
    # Each device samples its rows of every batch from its own copy.
    return batches.device_feed(text.train, text.val, put)
  return batches.host_feed(
      text.train, text.val, put, block_size=config.block_size, batch_size=train.batch_size,
      eval_batches=train.eval_iters, seed=train.seed, start_step=start_step,
      end_step=train.max_iters if end_step is None else end_step,
      steps_per_call=steps_per_call)


def evaluate_splits(params, eval_key, feed, config, train, plan, forms, view=None,
                    byte_lengths=None) -> Dict[str, float]:
  """Mean loss of `train.eval_iters` batches of each split, the same batches every time;
  with `byte_lengths` (`tokenizers.byte_lengths`) also `val_bpb`, the val
  batches' bits per UTF-8 byte (`steps.target_bytes`)."""
  losses = {name: float(steps.evaluate(params, tokens, eval_key, config=config,
                                       batch_size=train.batch_size,
                                       num_batches=train.eval_iters, plan=plan, forms=forms,
                                       params_view=view))
            for name, tokens in feed.eval.items()}
  if byte_lengths is not None and "val_loss" in losses:
    losses["val_bpb"] = bits_per_byte(losses["val_loss"], feed.eval["val_loss"], eval_key,
                                      byte_lengths, config, train)
  return losses


def bits_per_byte(loss: float, tokens, eval_key, byte_lengths, config, train) -> float:
  """`loss`, the mean of `steps.evaluate`'s batches of `tokens` drawn with `eval_key`, in
  bits per UTF-8 byte: the sum of their tokens' losses over the bytes they decode to."""
  counts = steps.target_bytes(tokens, eval_key, byte_lengths, block_size=config.block_size,
                              batch_size=train.batch_size, num_batches=train.eval_iters)
  num_bytes = int(np.sum(np.asarray(counts), dtype=np.int64))
  num_tokens = train.eval_iters * train.batch_size * config.block_size
  return loss * num_tokens / (np.log(2) * num_bytes) if num_bytes else float("nan")


def device_byte_lengths(tokenizer, plan) -> Optional[jax.Array]:
  """The tokenizer's bytes per id on the plan's devices, or None where it has no text."""
  lengths = tokenizers.byte_lengths(tokenizer)
  return None if lengths is None else parallel.put(jnp.asarray(lengths), plan.replicated)


def _evaluate_and_record(session: Session, step: int, state: TrainState, feed, config,
                         train, plan, forms, view=None, byte_lengths=None) -> None:
  losses = evaluate_splits(state.params, state.keys["eval"], feed, config, train, plan, forms,
                           view, byte_lengths)
  bpb = f" | val bpb {losses['val_bpb']:.4f}" if "val_bpb" in losses else ""
  session.log(f"step {step:5d} | train loss {losses['train_loss']:.4f} | "
              f"val loss {losses['val_loss']:.4f}{bpb}")
  session.add_eval(step, state, {"step": step, **losses}, **losses)


def resumable_optimizer(opt_config: optim.OptimizerConfig, max_iters: int):
  """`opt_config` with the schedule's end filled in (the run's last step by default)."""
  if opt_config.decay_iters is None:
    return dataclasses.replace(opt_config, decay_iters=max_iters)
  return opt_config


def _keep_saved_schedule(opt_config, asked: optim.OptimizerConfig, meta, saved):
  """On resume without an explicit `decay_iters`, the schedule ends where the run's did."""
  if not saved or asked.decay_iters is not None:
    return opt_config, meta
  opt_config = dataclasses.replace(opt_config, decay_iters=saved["optimizer"]["decay_iters"])
  runs.print_line(f"keeping the run's schedule: it ends at step {opt_config.decay_iters} "
                  f"(set the optimizer's decay_iters to change that)")
  return opt_config, {**meta, "optimizer": dataclasses.asdict(opt_config)}


class _Throughput:
  """The GPT loop's per-call timing, progress and log lines (tokens/s, MFU)."""

  def __init__(self, config: gpt.GPTConfig, train: GPTTrainConfig, schedule, n_params: int,
               num_devices: int):
    self._train, self._schedule = train, schedule
    self.tokens_per_step = train.batch_size * config.block_size
    self._flops_per_token = flops.transformer_flops_per_token(
        n_params, config.n_layer, config.n_head, config.head_dim, config.block_size)
    peak = train.peak_flops or flops.device_peak_flops(jax.devices()[0], config.compute_dtype)
    self._peak = peak * num_devices if peak else None
    self.times: List[float] = []  # seconds per step of every call
    self._since_log: List[float] = []

  def record(self, session: Session, step: int, seconds_per_step: float,
             losses: np.ndarray, metrics: steps.StepMetrics) -> None:
    """Notes a call that ended at `step` with `losses`; logs a line at the log interval."""
    self.times.append(seconds_per_step)
    self._since_log.append(seconds_per_step)
    loss = float(losses[-1])
    session.progress.update_to(step, loss=loss,
                               tok_s=self.tokens_per_step / seconds_per_step)
    if not runs.every(self._train.log_interval, step, self._train.max_iters):
      return
    ms = 1000 * float(np.median(self._since_log))
    self._since_log = []
    tokens_per_s = self.tokens_per_step / ms * 1000
    record = session.monitor.log_train(
        step, loss=loss, lr=float(self._schedule(step - 1)),
        grad_norm=float(metrics.grad_norm[-1]), ms_per_iter=ms, tokens_per_s=tokens_per_s,
        mfu=flops.mfu(self._flops_per_token, tokens_per_s, self._peak))
    mfu = f" | MFU {100 * record['mfu']:.1f}%" if record.get("mfu") else ""
    session.log(f"step {step:5d} | loss {loss:.4f} | lr {record['lr']:.2e} | "
                f"grad norm {record['grad_norm']:.3f} | {ms:6.2f} ms/iter | "
                f"{tokens_per_s:8.0f} tokens/s{mfu}")

  def median_ms(self) -> Optional[float]:
    """Median ms per step; the first calls compile (one per chunk length), so they're dropped."""
    return 1000 * float(np.median(self.times[2:] or self.times)) if self.times else None


def _describe_model(config: gpt.GPTConfig, n_params: int) -> str:
  """One short line: size, shape and vocabulary (the whole config is in the checkpoints)."""
  return (f"{n_params / 1e6:.2f}M params (without position embeddings), {config.n_layer} "
          f"layers x {config.n_head} heads x {config.n_embd}, context {config.block_size}, "
          f"vocab {config.vocab_size}, dropout {config.dropout:g}"
          f"{'' if config.bias else ', no biases'}")


def gpt_meta(config, text, opt_config, train, init_from, *, lora_config=None, data=None,
             grad_accum_steps=1) -> Dict[str, Any]:
  """What a GPT checkpoint records: the run's identity, its tokenizer and origin,
  what `purejax.replay` needs to load its data again (`data`: the `--dataset`
  given), and its LoRA adapters' settings."""
  meta = {"model": "gpt", "config": dataclasses.asdict(config),
          "tokenizer": text.tokenizer.spec().to_dict(),
          "optimizer": dataclasses.asdict(opt_config), "batch_size": train.batch_size,
          "seed": train.seed, "init_from": init_from, "dataset": text.name or None,
          "data": data, "grad_accum_steps": grad_accum_steps}
  if lora_config is not None:
    meta["lora"] = dataclasses.asdict(lora_config)
  return meta


trained_params = state_lib.trained_params  # (the sweeps' loop calls it by this name)


def run_optimizer(opt_config: optim.OptimizerConfig, run: RunConfig, lora_config=None):
  """The run's optimizer: NaN/Inf updates skipped with `run.skip_nonfinite`, and
  with LoRA only the adapters trained (`optim.frozen_base`)."""
  return optim.RunOptimizer(opt_config, run.skip_nonfinite, lora_config is not None)()


def run_program(state, plan, config, opt_config, run, lora_config, train, grad_accum_steps,
                forms, view):
  """`(state on the plan's devices, its jitted `steps.train_steps`)`: one run's program,
  the same for a run alone and a run of a sweep taken one at a time (so they agree bitwise)."""
  state, shardings = state_lib.shard(state, plan)
  return state, parallel.sharded_step(
      steps.train_steps, plan, shardings, config=config,
      optimizer=run_optimizer(opt_config, run, lora_config), batch_size=train.batch_size,
      grad_accum_steps=grad_accum_steps, forms=forms, params_view=view)


def train_gpt(
    config: gpt.GPTConfig,
    text: corpus_lib.Corpus,
    train: GPTTrainConfig,
    opt_config: optim.OptimizerConfig,
    run: RunConfig,
    devices: ParallelConfig = ParallelConfig(),
    *,
    init_params: Optional[gpt.Params] = None,
    init_from: Optional[str] = None,
    forms: Optional[kernels.Forms] = None,
    lora_config: Optional[lora.LoraConfig] = None,
    data: Optional[str] = None,
    sinks: Sequence[Any] = (),
) -> Dict[str, Any]:
  """Trains a GPT on a token corpus; returns the final evaluation and timing.

  What a run writes to `run.out_dir`: checkpoints (`ckpt_<step>.npz`, and
  `ckpt_best.npz` with `always_save_checkpoint=False`), `metrics.jsonl` and
  TensorBoard events with every log and eval point (`purejax.training.monitor`), and
  `loss.png` at the end when matplotlib is installed.

  Args:
    config: the model; its `vocab_size` must cover the corpus's tokenizer.
    text: the corpus (`corpus.load_corpus`); small ones are put on every
      device, larger ones are read by the host one call ahead. Or
      conversations (`conversations.load_conversations`): whole padded rows
      on every device, the loss over the assistant's tokens only.
    train: steps, evaluation, logging, checkpoints.
    opt_config: the optimizer; `decay_iters=None` ends the schedule at
      `max_iters` in a new run and keeps the saved run's end on resume.
    run: out_dir, resuming, checkpoints kept, non-finite handling.
    devices: how the step is spread over devices and hosts.
    init_params: start from these params (fine-tuning) instead of a random init.
    init_from: where `init_params` came from, recorded in the checkpoints.
    forms: how the model runs (`kernels.select`); None: the forms of the
      devices' platform. Not part of the run's identity: a run may resume
      with other forms.
    lora_config: train LoRA adapters of the params (`lora`) instead of the
      params; checkpoints hold base and adapters, and loading them as
      weights (`weights.from_purejax`) merges them.
    data: the `--dataset` the corpus came from, recorded for `purejax.replay`.
    sinks: further metric sinks (`monitor.Monitor`'s), e.g. W&B's.

  Returns:
    `{"step", "train_loss", "val_loss", "ms_per_iter"}` of the last evaluation.
  """
  check_fits(config, text, train.batch_size)
  keys = state_lib.run_keys(train.seed)
  params = gpt.init_params(config, keys["params"]) if init_params is None else init_params
  gpt.check_params(params, config)
  n_params = gpt.num_params(params)
  plan = parallel.make_plan(devices, train.batch_size)
  runs.print_line(f"devices: {parallel.describe(plan, train.batch_size, devices.grad_accum_steps)}")
  forms = forms or kernels.select(kernels.platform_of(plan))
  runs.print_line(f"forms: {forms.describe()}")
  resolved = resumable_optimizer(opt_config, train.max_iters)
  meta = gpt_meta(config, text, resolved, train, init_from, lora_config=lora_config,
                  data=data, grad_accum_steps=devices.grad_accum_steps)
  # The data sampler's whole state is (train key, step): batch s is drawn
  # from fold_in(train key, s), so restoring both resumes the same stream.
  template, view = state_lib.start_state(
      params, keys, run_optimizer(resolved, run, lora_config), lora_config)
  state, step, saved = runs.start_or_resume(
      run, template, meta, saved_defaults={"config": runs.dataclass_defaults(gpt.GPTConfig)},
      ignored={"optimizer": ("decay_iters",), "config": gpt.EXECUTION_FIELDS},
      digest_extra=[devices.fsdp, devices.grad_accum_steps])
  resolved, meta = _keep_saved_schedule(resolved, opt_config, meta, saved)
  state, train_steps = run_program(state, plan, config, resolved, run, lora_config, train,
                                   devices.grad_accum_steps, forms, view)
  call_length = CallLengths(train)
  feed = make_feed(text, config, train, plan, start_step=step, steps_per_call=call_length)
  runs.print_line(f"model: {_describe_model(config, n_params)}")
  if lora_config is not None:
    adapters = lora.num_params(template.params["adapters"])
    runs.print_line(f"LoRA: {adapters / 1e6:.3f}M adapter params train, the base is frozen; "
                    f"{lora_config}")
  runs.print_line(f"data: {text.source}; batches drawn "
                  f"{'on the device' if feed.on_device else 'by the host, one call ahead'}")
  runs.print_line(f"optimizer: {optim.describe(resolved)}")
  for warning in optim.schedule_warnings(resolved, train.max_iters):
    runs.print_line(f"warning: {warning}")
  throughput = _Throughput(config, train, optim.make_schedule(resolved), n_params,
                           plan.num_devices)
  profiler = progress_lib.Profiler(train.profile_steps, run.out_dir)
  byte_lengths = device_byte_lengths(text.tokenizer, plan)
  with contextlib.closing(feed), Session(
      run, meta, saved, total=train.max_iters, start=step, bar=train.progress,
      keep_best=not train.always_save_checkpoint, sinks=sinks) as session:
    while step < train.max_iters:
      if step % train.eval_interval == 0 and not session.evaluated_at(step):
        _evaluate_and_record(session, step, state, feed, config, train, plan, forms, view,
                             byte_lengths)
      num_steps = call_length(step)
      profiler.before(step)
      start = time.perf_counter()
      state, metrics = train_steps(state, feed.train(step, num_steps), step,
                                   num_steps=num_steps)
      losses = np.asarray(metrics.loss)  # waits for the steps to finish
      seconds_per_step = (time.perf_counter() - start) / num_steps
      profiler.after(step + num_steps, session.log)
      session.check_finite(losses, step)
      step += num_steps
      throughput.record(session, step, seconds_per_step, losses, metrics)
      if runs.every(train.eval_interval, step, train.max_iters):
        _evaluate_and_record(session, step, state, feed, config, train, plan, forms, view,
                             byte_lengths)
      session.save_if(runs.every(train.checkpoint_every or train.eval_interval, step,
                                 train.max_iters), step, state)
  return _finish(run, state, session.history, step, throughput, text, config, keys, train,
                 forms, view)


def _finish(run, state, history, step, throughput, text, config, keys, train, forms,
            view=None) -> Dict[str, Any]:
  """The run's final metrics; then its loss plot and a sample, as nanoGPT ends."""
  metrics = dict(history[-1]) if history else {"step": step}
  ms = throughput.median_ms()
  if ms is not None:
    metrics["ms_per_iter"] = ms
    runs.print_line(f"median {ms:.2f} ms/iter after compilation")
  if parallel.is_main_process():
    plots.save_loss_plot(run.out_dir)
  if train.sample_tokens > 0:
    params = state.params if view is None else jax.jit(view)(state.params)
    sample = sample_text(params, text.tokenizer, config, keys["sample"],
                         train.sample_tokens, forms=forms)
    runs.print_line("---- sample ----\n" + sample)
  return metrics


def evaluate_gpt(params, config: gpt.GPTConfig, text: corpus_lib.Corpus,
                 train: GPTTrainConfig, devices: ParallelConfig = ParallelConfig(),
                 *, forms: Optional[kernels.Forms] = None) -> Dict[str, float]:
  """Train and val loss of `params` on `train.eval_iters` batches of each split (no training).

  `forms` as in `train_gpt`.
  """
  check_fits(config, text, train.batch_size)
  gpt.check_params(params, config)
  keys = state_lib.run_keys(train.seed)
  plan = parallel.make_plan(devices, train.batch_size)
  feed = make_feed(text, config, train, plan, start_step=0, steps_per_call=lambda _: 1,
               end_step=0)
  try:
    return evaluate_splits(parallel.put(params, plan.replicated), keys["eval"], feed, config,
                           train, plan, forms or kernels.select(kernels.platform_of(plan)),
                           byte_lengths=device_byte_lengths(text.tokenizer, plan))
  finally:
    feed.close()


def sample_text(params, tokenizer, config: gpt.GPTConfig, key, num_tokens: int,
                prompt: str = "\n", *, forms: Optional[kernels.Forms] = None) -> str:
  """`decode.sample_text` of a run's (possibly sharded) params, on process 0; '' elsewhere."""
  # Whole params on one local device: sampling is one sequence, not worth a mesh.
  params = jax.device_put(parallel.fetch(params), jax.local_devices()[0])
  if not parallel.is_main_process():
    return ""
  return decode.sample_text(params, tokenizer, config, key, num_tokens, prompt, forms=forms)

"""The training loops of both models, as library functions that read no flags.

    metrics = train_gpt(model_config, text, GPTTrainConfig(max_iters=2000),
                        GPT_OPTIMIZER, RunConfig(out_dir="out-gpt"))

`python -m purejax.train` only turns its flags into these configs and calls
`train_gpt` or `train_mlp`; a Python user can call them the same way. Each
loop: data -> model -> loss -> optimizer -> checkpoint and log, top to bottom.
"""

import dataclasses
import functools
import pathlib
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from purejax.data import batches
from purejax.data import corpus as corpus_lib
from purejax.data import datasets as data_lib
from purejax import decode
from purejax.training import flops
from purejax import gpt
from purejax import mlp
from purejax.ops import kernels
from purejax.training import monitor
from purejax.training import optim
from purejax.training import parallel
from purejax.training import progress as progress_lib
from purejax import rng
from purejax.training import runs
from purejax.training import steps
from purejax.training.parallel import ParallelConfig
from purejax.training.runs import RunConfig

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
    if self.profile_steps is not None:
      first, last = self.profile_steps
      if not 0 <= first < last <= self.max_iters:
        raise ValueError(f"--profile_steps={first},{last} must be two steps A,B with "
                         f"0 <= A < B <= --max_iters={self.max_iters}.")


def _check_fits(config: gpt.GPTConfig, text: corpus_lib.Corpus, batch_size: int) -> None:
  if config.vocab_size < text.vocab_size:
    raise ValueError(f"the model's vocab_size {config.vocab_size} is below the "
                     f"{text.vocab_size} ids of the data's tokenizer; use the model's "
                     f"own tokenizer (--tokenizer) or a larger model vocabulary.")
  if config.block_size >= min(len(text.train), len(text.val)):
    raise ValueError(f"--block_size={config.block_size} must be shorter than the "
                     f"validation text ({len(text.val)} tokens) and the training text "
                     f"({len(text.train)} tokens).")


def _feed(text, config, train, plan, *, start_step, steps_per_call, end_step=None
          ) -> batches.Feed:
  """The corpus on every device if it fits (`corpus.fits_on_device`), else read by the host."""
  put = functools.partial(parallel.put, shardings=plan.replicated)
  if corpus_lib.fits_on_device(text):
    # Each device samples its rows of every batch from its own copy.
    return batches.device_feed(text.train, text.val, put)
  return batches.host_feed(
      text.train, text.val, put, block_size=config.block_size, batch_size=train.batch_size,
      eval_batches=train.eval_iters, seed=train.seed, start_step=start_step,
      end_step=train.max_iters if end_step is None else end_step,
      steps_per_call=steps_per_call)


def _evaluate(params, eval_key, feed, config, train, plan, forms) -> Dict[str, float]:
  """Mean loss of `train.eval_iters` batches of each split, the same batches every time."""
  return {name: float(steps.evaluate(params, tokens, eval_key, config=config,
                                     batch_size=train.batch_size,
                                     num_batches=train.eval_iters, plan=plan, forms=forms))
          for name, tokens in feed.eval.items()}


def _resumable_optimizer(opt_config: optim.OptimizerConfig, max_iters: int):
  """`opt_config` with the schedule's end filled in (the run's last step by default)."""
  if opt_config.decay_iters is None:
    return dataclasses.replace(opt_config, decay_iters=max_iters)
  return opt_config


def _make_optimizer(opt_config: optim.OptimizerConfig, run: RunConfig):
  optimizer = optim.make_optimizer(opt_config)
  return runs.skip_nonfinite_updates(optimizer) if run.skip_nonfinite else optimizer


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
) -> Dict[str, Any]:
  """Trains a GPT on a token corpus; returns the final evaluation and timing.

  What a run writes to `run.out_dir`: checkpoints (`ckpt_<step>.npz`, and
  `ckpt_best.npz` with `always_save_checkpoint=False`), `metrics.jsonl` and
  TensorBoard events with every log and eval point (`purejax.training.monitor`), and
  `loss.png` at the end when matplotlib is installed.

  Args:
    config: the model; its `vocab_size` must cover the corpus's tokenizer.
    text: the corpus (`corpus.load_corpus`); small ones are put on every
      device, larger ones are read by the host one call ahead.
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

  Returns:
    `{"step", "train_loss", "val_loss", "ms_per_iter"}` of the last evaluation.
  """
  _check_fits(config, text, train.batch_size)
  checkpoint_every = train.checkpoint_every or train.eval_interval
  keys = rng.split_named(jax.random.PRNGKey(train.seed), ("params", "train", "eval", "sample"))
  params = gpt.init_params(config, keys["params"]) if init_params is None else init_params
  gpt.check_params(params, config)
  resolved = _resumable_optimizer(opt_config, train.max_iters)
  meta = {"model": "gpt", "config": dataclasses.asdict(config),
          "tokenizer": text.tokenizer.spec(), "optimizer": dataclasses.asdict(resolved),
          "batch_size": train.batch_size, "seed": train.seed, "init_from": init_from}
  # The data sampler's whole state is (train key, step): batch s is drawn
  # from fold_in(train key, s), so restoring both resumes the same stream.
  template = {"params": params, "opt_state": _make_optimizer(resolved, run).init(params),
              "keys": {"train": keys["train"], "eval": keys["eval"]}}
  plan = parallel.make_plan(devices, train.batch_size)
  runs.log(f"devices: {parallel.describe(plan, train.batch_size, devices.grad_accum_steps)}")
  forms = forms or kernels.select(kernels.platform_of(plan))
  runs.log(f"forms: {forms.describe()}")
  state, step, saved = runs.start_or_resume(
      run, template, meta, saved_defaults={"config": runs.dataclass_defaults(gpt.GPTConfig)},
      ignored={"optimizer": ("decay_iters",), "config": gpt.EXECUTION_FIELDS},
      digest_extra=[devices.fsdp, devices.grad_accum_steps])
  if step and opt_config.decay_iters is None:
    resolved = dataclasses.replace(resolved, decay_iters=saved["optimizer"]["decay_iters"])
    meta["optimizer"] = dataclasses.asdict(resolved)
    runs.log(f"keeping the run's schedule: it ends at step {resolved.decay_iters} "
             f"(pass --lr_decay_iters to change that)")
  optimizer = _make_optimizer(resolved, run)
  schedule = optim.make_schedule(resolved)
  history: List[dict] = saved.get("history", [])  # evaluations
  best = min((h["val_loss"] for h in history), default=float("inf"))
  state, shardings = parallel.shard_state(state, plan)

  def chunk_length(step):  # never run across an eval, log, checkpoint or profile boundary
    marks = (train.eval_interval, train.log_interval, checkpoint_every)
    boundary = runs.next_boundary(step, marks, train.max_iters)
    for mark in train.profile_steps or ():
      boundary = min(boundary, mark) if mark > step else boundary
    return min(train.steps_per_call, boundary - step)

  train_steps = parallel.sharded_step(
      steps.train_steps, plan, shardings, config=config, optimizer=optimizer,
      batch_size=train.batch_size, grad_accum_steps=devices.grad_accum_steps, forms=forms)
  feed = _feed(text, config, train, plan, start_step=step, steps_per_call=chunk_length)
  n_params = gpt.num_params(params)
  runs.log(f"model: {n_params / 1e6:.2f}M params (without position embeddings), {config}")
  runs.log(f"data: {text.source}; batches drawn "
           f"{'on the device' if feed.on_device else 'by the host, one call ahead'}")
  runs.log(f"optimizer: {resolved}")
  tokens_per_step = train.batch_size * config.block_size
  flops_per_token = flops.transformer_flops_per_token(
      n_params, config.n_layer, config.n_head, config.head_dim, config.block_size)
  peak = train.peak_flops or flops.device_peak_flops(jax.devices()[0],
                                                     config.compute_dtype)
  peak = peak * plan.num_devices if peak else None
  main = parallel.is_main_process()
  progress = progress_lib.Progress(train.max_iters, step, enabled=main, bar=train.progress)
  mon = monitor.Monitor(run.out_dir, resume_step=step if step else None, enabled=main,
                        log=progress.write)

  def evaluate(step):
    nonlocal best
    losses = _evaluate(state["params"], state["keys"]["eval"], feed, config, train, plan,
                       forms)
    runs.log(f"step {step:5d} | train loss {losses['train_loss']:.4f} | "
             f"val loss {losses['val_loss']:.4f}")
    mon.log_eval(step, **losses)  # also syncs the metrics to disk
    history.append({"step": step, **losses})
    if not train.always_save_checkpoint and step > 0 and losses["val_loss"] < best:
      best = losses["val_loss"]
      runs.save_checkpoint(run, step, state, {**meta, "history": history}, best=True)

  last_saved, times, since_log = None, [], []
  try:
    with runs.log_to(progress.write), mon, progress:
      while step < train.max_iters:
        if step % train.eval_interval == 0 and not (history and history[-1]["step"] == step):
          evaluate(step)
        num_steps = chunk_length(step)
        if train.profile_steps and step == train.profile_steps[0]:
          jax.profiler.start_trace(str(pathlib.Path(run.out_dir) / "profile"))
        start = time.perf_counter()
        params, opt_state, metrics = train_steps(
            state["params"], state["opt_state"], feed.train(step, num_steps),
            state["keys"]["train"], step, num_steps=num_steps)
        losses = np.asarray(metrics.loss)  # waits for the steps to finish
        seconds_per_step = (time.perf_counter() - start) / num_steps
        if train.profile_steps and step + num_steps == train.profile_steps[1]:
          jax.profiler.stop_trace()
          runs.log(f"profile of steps {train.profile_steps[0]}-{train.profile_steps[1]} in "
                   f"{run.out_dir}/profile (tensorboard --logdir {run.out_dir})")
        runs.check_finite(losses, step, last_saved, skip=run.skip_nonfinite)
        state = {**state, "params": params, "opt_state": opt_state}
        times.append(seconds_per_step)
        since_log.append(seconds_per_step)
        step += num_steps
        tokens_per_s = tokens_per_step / seconds_per_step
        progress.update_to(step, loss=float(losses[-1]), tok_s=tokens_per_s)
        if runs.every(train.log_interval, step, train.max_iters):
          ms = 1000 * float(np.median(since_log))
          record = mon.log_train(
              step, loss=losses[-1], lr=float(schedule(step - 1)),
              grad_norm=float(metrics.grad_norm[-1]), ms_per_iter=ms,
              tokens_per_s=tokens_per_step / ms * 1000,
              mfu=flops.mfu(flops_per_token, tokens_per_step / ms * 1000, peak))
          mfu = f" | MFU {100 * record['mfu']:.1f}%" if record.get("mfu") else ""
          runs.log(f"step {step:5d} | loss {losses[-1]:.4f} | lr {record['lr']:.2e} | "
                   f"grad norm {record['grad_norm']:.3f} | {ms:6.2f} ms/iter | "
                   f"{record['tokens_per_s']:8.0f} tokens/s{mfu}")
          since_log = []
        if runs.every(train.eval_interval, step, train.max_iters):
          evaluate(step)
        stop = runs.stop_requested()
        if runs.every(checkpoint_every, step, train.max_iters) or stop:
          mon.sync()
          last_saved = runs.save_checkpoint(run, step, state, {**meta, "history": history})
        runs.raise_if_stopped(stop)
  finally:
    feed.close()
  metrics = dict(history[-1]) if history else {"step": step}
  if times:
    # The first calls compile (one per distinct chunk length), so drop them.
    metrics["ms_per_iter"] = 1000 * float(np.median(times[2:] or times))
    runs.log(f"median {metrics['ms_per_iter']:.2f} ms/iter after compilation")
  if main:
    plot_losses(run.out_dir)
  if train.sample_tokens > 0:
    sample = sample_text(state["params"], text.tokenizer, config, keys["sample"],
                         train.sample_tokens, forms=forms)
    runs.log("---- sample ----\n" + sample)
  return metrics


def plot_losses(out_dir: str) -> None:
  """`out_dir/loss.png` of the run's losses, when matplotlib is installed."""
  try:
    from purejax.training import plots  # pylint: disable=import-outside-toplevel
    plots.plot_runs([out_dir], pathlib.Path(out_dir) / "loss.png")
  except ImportError:
    pass  # matplotlib is optional: pip install purejax[plot]


def evaluate_gpt(params, config: gpt.GPTConfig, text: corpus_lib.Corpus,
                 train: GPTTrainConfig, devices: ParallelConfig = ParallelConfig(),
                 *, forms: Optional[kernels.Forms] = None) -> Dict[str, float]:
  """Train and val loss of `params` on `train.eval_iters` batches of each split (no training).

  `forms` as in `train_gpt`.
  """
  _check_fits(config, text, train.batch_size)
  gpt.check_params(params, config)
  keys = rng.split_named(jax.random.PRNGKey(train.seed), ("params", "train", "eval", "sample"))
  plan = parallel.make_plan(devices, train.batch_size)
  feed = _feed(text, config, train, plan, start_step=0, steps_per_call=lambda _: 1,
               end_step=0)
  try:
    return _evaluate(parallel.put(params, plan.replicated), keys["eval"], feed, config,
                     train, plan, forms or kernels.select(kernels.platform_of(plan)))
  finally:
    feed.close()


def sample_text(params, tokenizer, config: gpt.GPTConfig, key, num_tokens: int,
                prompt: str = "\n", *, forms: Optional[kernels.Forms] = None) -> str:
  """A sample of `num_tokens` after `prompt`, decoded (on process 0; '' elsewhere).

  `forms`: how the model runs (default: those of the device it samples on).
  """
  # Whole params on one local device: sampling is one sequence, not worth a mesh.
  params = jax.device_put(parallel.fetch(params), jax.local_devices()[0])
  if not parallel.is_main_process():
    return ""
  out = decode.generate(params, jnp.asarray(tokenizer.encode(prompt)), config, key,
                        max_new_tokens=num_tokens, temperature=0.8, top_k=200,
                        valid_vocab=tokenizer.vocab_size, forms=forms)
  return tokenizer.decode(out)


# ----------------------------------------------------------------------------
# The MNIST MLP

MLP_OPTIMIZER = optim.OptimizerConfig(
    learning_rate=3e-3, schedule="cosine", warmup_iters=0, min_lr=0.0, beta2=0.999,
    weight_decay=1e-4, grad_clip=0.0)


@dataclasses.dataclass(frozen=True)
class MLPTrainConfig:
  """The MLP's network and epochs.

  Attributes:
    layer_sizes: widths, input first.
    init_scale: std of the initial weights and biases.
    batch_size: examples per step (the global batch).
    epochs: passes over the training set.
    checkpoint_every: epochs between checkpoints.
    seed: seed of the run's PRNG key.
  """
  layer_sizes: Sequence[int] = (784, 512, 512, 10)
  init_scale: float = 0.01
  batch_size: int = 128
  epochs: int = 10
  checkpoint_every: int = 1
  seed: int = 0

  def __post_init__(self):
    runs.require_positive(batch_size=self.batch_size, epochs=self.epochs,
                          checkpoint_every=self.checkpoint_every)


def train_mlp(
    mnist: data_lib.MnistData,
    train: MLPTrainConfig,
    opt_config: optim.OptimizerConfig,
    run: RunConfig,
    devices: ParallelConfig = ParallelConfig(),
    *,
    meta_config: Optional[Dict[str, Any]] = None,
    progress_bar: Optional[bool] = None,
) -> Dict[str, Any]:
  """Trains the MLP on MNIST; returns the last epoch's metrics.

  Writes checkpoints (one per `checkpoint_every` epochs), `metrics.jsonl` and
  TensorBoard events to `run.out_dir`; `progress_bar` as in `GPTTrainConfig`.

  `opt_config.decay_iters` should be `epochs * (examples // batch_size)` for
  the schedule to end with the run. `meta_config` adds settings to the
  checkpoint's identity (e.g. how pixels were scaled).
  """
  sizes = [int(s) for s in train.layer_sizes]
  keys = rng.split_named(jax.random.PRNGKey(train.seed), ("params", "data"))
  params = mlp.init_network_params(sizes, keys["params"], train.init_scale)
  mlp.check_input_size(params, mnist.num_features)
  if sizes[-1] < int(mnist.train_labels.max()) + 1:
    raise ValueError(f"the last layer size {sizes[-1]} is below the "
                     f"{int(mnist.train_labels.max()) + 1} classes of the data.")
  steps_per_epoch = len(mnist.train_labels) // train.batch_size
  runs.require_positive(steps_per_epoch=steps_per_epoch)
  plan = parallel.make_plan(devices, train.batch_size)
  runs.log(parallel.describe(plan, train.batch_size, devices.grad_accum_steps))
  # The whole dataset sits on every device; each device gathers its rows of
  # every batch (see mlp.train_epoch).
  train_x, train_y, test_x, test_y = parallel.put(
      (mnist.train_images, mnist.train_labels, mnist.test_images, mnist.test_labels),
      plan.replicated)
  optimizer = _make_optimizer(opt_config, run)
  schedule = optim.make_schedule(opt_config)
  meta = {"model": "mlp", "config": {"layer_sizes": sizes, "init_scale": train.init_scale,
                                     **(meta_config or {})},
          "optimizer": dataclasses.asdict(opt_config), "batch_size": train.batch_size,
          "seed": train.seed}
  template = {"params": params, "opt_state": optimizer.init(params), "data_key": keys["data"]}
  state, epoch, saved = runs.start_or_resume(
      run, template, meta, digest_extra=[devices.fsdp, devices.grad_accum_steps])
  history: List[dict] = saved.get("history", [])
  state, shardings = parallel.shard_state(state, plan)
  train_epoch = parallel.sharded_step(
      mlp.train_epoch, plan, shardings, optimizer=optimizer, batch_size=train.batch_size,
      grad_accum_steps=devices.grad_accum_steps)
  runs.log(f"model: mlp {sizes}, {sum(p.size for p in jax.tree.leaves(params)):,} params")
  runs.log(f"optimizer: {opt_config}, {steps_per_epoch} steps/epoch")

  main = parallel.is_main_process()
  progress = progress_lib.Progress(train.epochs, epoch, unit="epoch", enabled=main,
                                   bar=progress_bar)
  mon = monitor.Monitor(run.out_dir, resume_step=epoch if epoch else None, enabled=main,
                        log=progress.write)
  last_saved = None
  with runs.log_to(progress.write), mon, progress:
    while epoch < train.epochs:
      start = time.perf_counter()
      params, opt_state, train_loss = train_epoch(
          state["params"], state["opt_state"], train_x, train_y,
          rng.fold_in_step(state["data_key"], epoch + 1))
      train_loss = float(train_loss)  # waits for the epoch to finish
      seconds = time.perf_counter() - start
      runs.check_finite(np.array([train_loss]), epoch + 1, last_saved,
                        skip=run.skip_nonfinite)
      state = {**state, "params": params, "opt_state": opt_state}
      epoch += 1
      history.append(dict(
          epoch=epoch, seconds=seconds,
          examples_per_s=steps_per_epoch * train.batch_size / seconds, train_loss=train_loss,
          train_acc=float(mlp.evaluate_accuracy(params, train_x, train_y)),
          test_acc=float(mlp.evaluate_accuracy(params, test_x, test_y))))
      record = history[-1]
      mon.log_train(epoch, loss=train_loss, lr=float(schedule(epoch * steps_per_epoch - 1)),
                    examples_per_s=record["examples_per_s"])
      mon.log_eval(epoch, train_acc=record["train_acc"], test_acc=record["test_acc"])
      progress.update_to(epoch, loss=train_loss, test_acc=record["test_acc"])
      runs.log("epoch {epoch:3d} | {seconds:6.3f} s | {examples_per_s:9.0f} ex/s | "
               "loss {train_loss:.4f} | train acc {train_acc:.4f} | "
               "test acc {test_acc:.4f}".format(**record))
      stop = runs.stop_requested()
      if runs.every(train.checkpoint_every, epoch, train.epochs) or stop:
        mon.sync()
        last_saved = runs.save_checkpoint(run, epoch, state, {**meta, "history": history})
      runs.raise_if_stopped(stop)
  return history[-1] if history else {}

"""The training loops of both models, as library functions that read no flags.

    metrics = train_gpt(model_config, text, GPTTrainConfig(max_iters=2000),
                        GPT_OPTIMIZER, RunConfig(out_dir="out-gpt"))

`python -m purejax.train` only turns its flags into these configs and calls
`train_gpt` or `train_mlp`; a Python user can call them the same way. Each
loop: data -> model -> loss -> optimizer -> checkpoint and log, top to bottom.
"""

import dataclasses
import time
from typing import Any, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from purejax import data as data_lib
from purejax import decode
from purejax import gpt
from purejax import mlp
from purejax import optim
from purejax import parallel
from purejax import rng
from purejax import runs
from purejax import steps
from purejax.parallel import ParallelConfig
from purejax.runs import RunConfig

# nanoGPT's character-level Shakespeare recipe for a CPU: the model (no
# biases, as nanoGPT's train.py; GPTConfig's own default is GPT-2's biases)
# and its optimizer. `purejax.train`'s GPT flags default to these.
SHAKESPEARE_CHAR = gpt.GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4,
                                 n_embd=128, dropout=0.0, bias=False)
GPT_OPTIMIZER = optim.OptimizerConfig(
    learning_rate=1e-3, schedule="cosine", warmup_iters=100, decay_iters=2000,
    min_lr=1e-4, beta2=0.99, weight_decay=0.1, grad_clip=1.0)


@dataclasses.dataclass(frozen=True)
class GPTTrainConfig:
  """How long and how the GPT trains, evaluates and logs (nanoGPT's flag names).

  Attributes:
    batch_size: sequences per step (the global batch).
    max_iters: optimisation steps.
    eval_interval: steps between evaluations of train and val loss.
    eval_iters: batches per evaluation.
    log_interval: steps between loss lines.
    steps_per_call: steps fused into one jitted `lax.scan`.
    checkpoint_every: steps between checkpoints; None: `eval_interval`.
    sample_tokens: tokens sampled at the end (0: none).
    seed: seed of the run's PRNG key.
  """
  batch_size: int = 12
  max_iters: int = 2000
  eval_interval: int = 250
  eval_iters: int = 200
  log_interval: int = 50
  steps_per_call: int = 10
  checkpoint_every: Optional[int] = None
  sample_tokens: int = 300
  seed: int = 0

  def __post_init__(self):
    runs.require_positive(
        batch_size=self.batch_size, max_iters=self.max_iters,
        eval_interval=self.eval_interval, eval_iters=self.eval_iters,
        log_interval=self.log_interval, steps_per_call=self.steps_per_call,
        checkpoint_every=self.checkpoint_every or self.eval_interval)


def train_gpt(
    config: gpt.GPTConfig,
    text: data_lib.TextData,
    train: GPTTrainConfig,
    opt_config: optim.OptimizerConfig,
    run: RunConfig,
    devices: ParallelConfig = ParallelConfig(),
) -> Dict[str, Any]:
  """Trains a GPT on a token corpus; returns the final evaluation and timing.

  Args:
    config: the model; its `vocab_size` must fit the corpus's vocabulary.
    text: the corpus, split into train and val ids.
    train: steps, evaluation, logging.
    opt_config: the optimizer and its schedule.
    run: out_dir, resuming, checkpoints kept, non-finite handling.
    devices: how the step is spread over devices and hosts.

  Returns:
    `{"step", "train_loss", "val_loss", "ms_per_iter"}` of the last evaluation.
  """
  if config.vocab_size < text.vocab.size:
    raise ValueError(f"the model's vocab_size {config.vocab_size} is below the data's "
                     f"{text.vocab.size} tokens.")
  if config.block_size >= len(text.val):
    raise ValueError(f"--block_size={config.block_size} must be shorter than the "
                     f"validation text ({len(text.val)} characters).")
  checkpoint_every = train.checkpoint_every or train.eval_interval
  keys = rng.split_named(jax.random.PRNGKey(train.seed), ("params", "train", "eval", "sample"))
  params = gpt.init_params(config, keys["params"])
  optimizer = optim.make_optimizer(opt_config)
  if run.skip_nonfinite:
    optimizer = runs.skip_nonfinite_updates(optimizer)
  meta = {"model": "gpt", "config": dataclasses.asdict(config), "vocab": text.vocab.chars,
          "optimizer": dataclasses.asdict(opt_config), "batch_size": train.batch_size,
          "seed": train.seed}
  # The data sampler's whole state is (train key, step): batch s is drawn
  # from fold_in(train key, s), so restoring both resumes the same stream.
  template = {"params": params, "opt_state": optimizer.init(params),
              "keys": {"train": keys["train"], "eval": keys["eval"]}}
  plan = parallel.make_plan(devices, train.batch_size)
  runs.log(parallel.describe(plan, train.batch_size, devices.grad_accum_steps))
  state, step, saved = runs.start_or_resume(
      run, template, meta, saved_defaults={"config": runs.dataclass_defaults(gpt.GPTConfig)},
      digest_extra=[devices.fsdp, devices.grad_accum_steps])
  history: List[dict] = saved.get("history", [])  # evaluations
  step_losses: List[float] = saved.get("losses", [])  # every step's loss
  state, shardings = parallel.shard_state(state, plan)
  train_steps = parallel.sharded_step(
      steps.train_steps, plan, shardings, config=config, optimizer=optimizer,
      batch_size=train.batch_size, grad_accum_steps=devices.grad_accum_steps)
  # The text (1 MB) sits on every device; each device samples its rows.
  train_data, val_data = parallel.put((text.train, text.val), plan.replicated)
  runs.log(f"gpt {config}, {gpt.num_params(params) / 1e6:.2f}M params, {opt_config}")

  def evaluate(step):
    kwargs = dict(config=config, batch_size=train.batch_size, num_batches=train.eval_iters,
                  plan=plan)
    eval_key, params = state["keys"]["eval"], state["params"]
    losses = {"step": step,
              "train_loss": float(steps.evaluate(params, train_data, eval_key, **kwargs)),
              "val_loss": float(steps.evaluate(params, val_data, eval_key, **kwargs))}
    runs.log(f"step {step:5d} | train loss {losses['train_loss']:.4f} | "
             f"val loss {losses['val_loss']:.4f}")
    history.append(losses)

  last_saved, times, since_log = None, [], []
  while step < train.max_iters:
    if step % train.eval_interval == 0 and not (history and history[-1]["step"] == step):
      evaluate(step)
    # Never run across an evaluation, logging or checkpoint boundary in one call.
    boundary = runs.next_boundary(
        step, (train.eval_interval, train.log_interval, checkpoint_every), train.max_iters)
    num_steps = min(train.steps_per_call, boundary - step)
    start = time.perf_counter()
    params, opt_state, losses = train_steps(
        state["params"], state["opt_state"], train_data, state["keys"]["train"], step,
        num_steps=num_steps)
    losses = np.asarray(losses)  # waits for the steps to finish
    seconds_per_step = (time.perf_counter() - start) / num_steps
    runs.check_finite(losses, step, last_saved, skip=run.skip_nonfinite)
    state = {**state, "params": params, "opt_state": opt_state}
    step_losses.extend(losses.tolist())
    times.append(seconds_per_step)
    since_log.append(seconds_per_step)
    step += num_steps
    if runs.every(train.log_interval, step, train.max_iters):
      ms = 1000 * float(np.median(since_log))
      runs.log(f"step {step:5d} | loss {losses[-1]:.4f} | {ms:6.2f} ms/iter | "
               f"{train.batch_size * config.block_size / ms * 1000:8.0f} tokens/s")
      since_log = []
    if step == train.max_iters:
      evaluate(step)
    stop = runs.stop_requested()
    if runs.every(checkpoint_every, step, train.max_iters) or stop:
      last_saved = runs.save_checkpoint(run, step, state,
                                        {**meta, "history": history, "losses": step_losses})
    runs.raise_if_stopped(stop)
  metrics = dict(history[-1]) if history else {"step": step}
  if times:
    # The first calls compile (one per distinct chunk length), so drop them.
    metrics["ms_per_iter"] = 1000 * float(np.median(times[2:] or times))
    runs.log(f"median {metrics['ms_per_iter']:.2f} ms/iter after compilation")
  if train.sample_tokens > 0:
    sample = sample_text(state["params"], text.vocab, config, keys["sample"],
                         train.sample_tokens)
    runs.log("---- sample ----\n" + sample)
  return metrics


def sample_text(params, vocab: data_lib.CharVocab, config: gpt.GPTConfig, key,
                num_tokens: int, prompt: str = "\n") -> str:
  """A sample of `num_tokens` after `prompt`, decoded (on process 0; '' elsewhere)."""
  # Whole params on one local device: sampling is one sequence, not worth a mesh.
  params = jax.device_put(parallel.fetch(params), jax.local_devices()[0])
  if not parallel.is_main_process():
    return ""
  out = decode.generate(params, jnp.asarray(vocab.encode(prompt)), config, key,
                        max_new_tokens=num_tokens, temperature=0.8, top_k=200)
  return vocab.decode(out)


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
) -> Dict[str, Any]:
  """Trains the MLP on MNIST; returns the last epoch's metrics.

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
  optimizer = optim.make_optimizer(opt_config)
  if run.skip_nonfinite:
    optimizer = runs.skip_nonfinite_updates(optimizer)
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
  runs.log(f"mlp {sizes}, {opt_config}, {steps_per_epoch} steps/epoch")

  last_saved = None
  while epoch < train.epochs:
    start = time.perf_counter()
    params, opt_state, train_loss = train_epoch(
        state["params"], state["opt_state"], train_x, train_y,
        rng.fold_in_step(state["data_key"], epoch + 1))
    train_loss = float(train_loss)  # waits for the epoch to finish
    seconds = time.perf_counter() - start
    runs.check_finite(np.array([train_loss]), epoch + 1, last_saved, skip=run.skip_nonfinite)
    state = {**state, "params": params, "opt_state": opt_state}
    epoch += 1
    history.append(dict(
        epoch=epoch, seconds=seconds,
        examples_per_s=steps_per_epoch * train.batch_size / seconds, train_loss=train_loss,
        train_acc=float(mlp.evaluate_accuracy(params, train_x, train_y)),
        test_acc=float(mlp.evaluate_accuracy(params, test_x, test_y))))
    runs.log("epoch {epoch:3d} | {seconds:6.3f} s | {examples_per_s:9.0f} ex/s | "
             "loss {train_loss:.4f} | train acc {train_acc:.4f} | "
             "test acc {test_acc:.4f}".format(**history[-1]))
    stop = runs.stop_requested()
    if runs.every(train.checkpoint_every, epoch, train.epochs) or stop:
      last_saved = runs.save_checkpoint(run, epoch, state, {**meta, "history": history})
    runs.raise_if_stopped(stop)
  return history[-1] if history else {}

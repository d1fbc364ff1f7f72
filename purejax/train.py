r"""Trains a purejax model from the command line.

    python -m purejax.train                      # NanoGPT on Tiny Shakespeare
    python -m purejax.train --model=mlp --tfds_manual_dir=../shared/data/mnist

Flags left unset take the chosen model's defaults (`MODEL_DEFAULTS`); GPT
flags share nanoGPT's names. Bad values stop the run at once with a one-line
message naming the flag.
"""

import dataclasses
import functools
import json
import os
import pathlib
import signal
import sys
import tempfile
import time
import zlib

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from purejax import checkpoint
from purejax import data as data_lib
from purejax import gpt
from purejax import mlp
from purejax import optim
from purejax import parallel
from purejax import rng

_MODEL = flags.DEFINE_enum("model", "gpt", ["gpt", "mlp"], "Which model to train.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the run's PRNG key.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Run directory for checkpoints (default out-<model>).")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", None,
    "Save a checkpoint every N steps (gpt; default --eval_interval) or epochs (mlp; default 1).")
_KEEP_CHECKPOINTS = flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept in --out_dir.")
_RESUME = flags.DEFINE_bool("resume", False,
                            "Resume from the latest valid checkpoint in --out_dir.")
_SKIP_NONFINITE = flags.DEFINE_bool(
    "skip_nonfinite", False, "Skip updates whose gradients are NaN/Inf instead of stopping.")
_TFDS_DATA_DIR = flags.DEFINE_string(
    "tfds_data_dir", None, "TFDS data dir for prepared datasets (default: TFDS's).")
_TFDS_MANUAL_DIR = flags.DEFINE_string(
    "tfds_manual_dir", None,
    "Folder with the dataset's original files, for offline preparation "
    "(MNIST: the four .gz files; Shakespeare defaults to the text in the package).")

# Optimisation (both models).
_OPTIMIZER = flags.DEFINE_enum("optimizer", "adamw", list(optim.OPTIMIZERS), "Optimizer.")
_LR = flags.DEFINE_float("learning_rate", None, "Peak learning rate.")
_SCHEDULE = flags.DEFINE_enum("lr_schedule", None, ["cosine", "constant"],
                              "Warmup + cosine decay, or constant.")
_MIN_LR = flags.DEFINE_float("min_lr", None, "Learning rate at the end of the cosine.")
_WARMUP = flags.DEFINE_integer("warmup_iters", None, "Linear warmup steps.")
_DECAY_ITERS = flags.DEFINE_integer(
    "lr_decay_iters", None, "Step where the cosine ends (default: the run's last step).")
_BETA2 = flags.DEFINE_float("beta2", None, "Adam's second-moment decay.")
_WEIGHT_DECAY = flags.DEFINE_float("weight_decay", None, "AdamW decay (matrices only).")
_GRAD_CLIP = flags.DEFINE_float("grad_clip", None, "Global gradient-norm clip (0: off).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Examples (sequences) per step.")

# MLP.
_LAYER_SIZES = flags.DEFINE_list("layer_sizes", "784,512,512,10", "MLP layer widths.")
_INIT_SCALE = flags.DEFINE_float("init_scale", 0.01, "Std of the MLP's initial params.")
_EPOCHS = flags.DEFINE_integer("epochs", 10, "MLP training epochs.")
_MNIST_PIXELS = flags.DEFINE_enum(
    "mnist_pixels", "unit", list(data_lib.PIXEL_RANGES),
    "MNIST input scale: 'unit' = [0, 1]; 'raw' = 0..255 as in JAX's TFDS tutorial.")

# GPT (nanoGPT's names).
_N_LAYER = flags.DEFINE_integer("n_layer", 4, "Transformer blocks.")
_N_HEAD = flags.DEFINE_integer("n_head", 4, "Attention heads.")
_N_EMBD = flags.DEFINE_integer("n_embd", 128, "Model width.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 64, "Context length.")
_DROPOUT = flags.DEFINE_float("dropout", 0.0, "Dropout rate in [0, 1).")
_BIAS = flags.DEFINE_bool(
    "bias", False, "Biases in dense layers and LayerNorms (nanoGPT's train.py default: off).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Matmul dtype; params stay float32.")
_REMAT = flags.DEFINE_enum("remat", "dots", list(gpt.REMAT_POLICIES),
                           "What each block keeps for the backward pass (see GPTConfig).")
_ATTN_BLOCK = flags.DEFINE_integer(
    "attn_block", 64, "Queries per block of causal attention; speed only (see GPTConfig).")
_MAX_ITERS = flags.DEFINE_integer("max_iters", 2000, "GPT training steps.")
_EVAL_INTERVAL = flags.DEFINE_integer("eval_interval", 250, "Steps between evaluations.")
_EVAL_ITERS = flags.DEFINE_integer("eval_iters", 200, "Batches per evaluation.")
_LOG_INTERVAL = flags.DEFINE_integer("log_interval", 50, "Steps between loss logs.")
_STEPS_PER_CALL = flags.DEFINE_integer(
    "steps_per_call", 10, "Optimisation steps fused into one jitted call.")
_SAMPLE_TOKENS = flags.DEFINE_integer("sample_tokens", 300,
                                      "Characters sampled at the end (0: none).")

# Devices and hosts (see purejax/parallel.py).
_NUM_DEVICES = flags.DEFINE_integer(
    "num_devices", None, "Devices to train on (default: all that JAX sees).")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", None, "On a CPU: split the host into this many JAX devices and train "
    "data parallel across them (default: JAX's own count, 1 unless XLA_FLAGS says "
    "otherwise). One device per core is faster for small models: 1.0-1.2x (fp32) and "
    "1.1-1.5x (bf16) on 2 cores for nanoGPT's CPU recipe. --batch_size must divide by it.")
_FSDP = flags.DEFINE_bool(
    "fsdp", False, "Split params and optimizer state across the devices (FSDP / ZeRO-3); "
    "default: replicate them.")
_GRAD_ACCUM = flags.DEFINE_integer(
    "grad_accum_steps", 1, "Microbatches per optimisation step; --batch_size is the "
    "global batch and must divide by devices x this.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: HOST:PORT of process 0's coordinator "
    "(or set JAX_COORDINATOR_ADDRESS, or run under a cluster JAX detects).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")

# Unset flags take these per-model values. The GPT values are nanoGPT's CPU
# recipe; the MLP values are our default recipe (see README).
MODEL_DEFAULTS = {
    "gpt": dict(learning_rate=1e-3, lr_schedule="cosine", min_lr=1e-4, warmup_iters=100,
                beta2=0.99, weight_decay=0.1, grad_clip=1.0, batch_size=12),
    "mlp": dict(learning_rate=3e-3, lr_schedule="cosine", min_lr=0.0, warmup_iters=0,
                beta2=0.999, weight_decay=1e-4, grad_clip=0.0, batch_size=128),
}


def _flag(name: str):
  """The flag's value, or the current model's default when it was left unset."""
  value = flags.FLAGS[name].value
  return MODEL_DEFAULTS[_MODEL.value][name] if value is None else value


def _require_positive(**values):
  for name, value in values.items():
    if value is None or value < 1:
      raise ValueError(f"--{name} must be a positive integer, got {value}.")


def optimizer_config(total_steps: int) -> optim.OptimizerConfig:
  decay_iters = _DECAY_ITERS.value if _DECAY_ITERS.value is not None else total_steps
  return optim.OptimizerConfig(
      name=_OPTIMIZER.value, learning_rate=_flag("learning_rate"),
      schedule=_flag("lr_schedule"), warmup_iters=_flag("warmup_iters"),
      decay_iters=decay_iters, min_lr=_flag("min_lr"), beta2=_flag("beta2"),
      weight_decay=_flag("weight_decay"), grad_clip=_flag("grad_clip"))


def log(message: str) -> None:
  """Prints on process 0 only, so a multi-host run logs once."""
  if parallel.is_main_process():
    print(message, flush=True)


# ----------------------------------------------------------------------------
# Checkpoints, signals and non-finite losses: shared by both models


class Interrupted(Exception):
  """SIGINT/SIGTERM arrived; the loop saved a checkpoint and stops."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


class NonFiniteLoss(RuntimeError):
  pass


_PENDING_SIGNAL = []


def _on_signal(signum, frame):  # pylint: disable=unused-argument
  # Only note it: the loop saves a checkpoint at the next step boundary.
  _PENDING_SIGNAL.append(signum)


def signal_received() -> bool:
  """Whether any process got SIGINT/SIGTERM (a collective: all processes ask)."""
  stop = parallel.any_process(bool(_PENDING_SIGNAL))
  if stop and not _PENDING_SIGNAL:  # another process was signalled
    _PENDING_SIGNAL.append(signal.SIGTERM)
  return stop


def start_or_resume(out_dir: str, template, meta: dict):
  """The state to start from: `template` at step 0, or the latest valid checkpoint.

  Every process reads `out_dir` (so with several hosts it must be on a shared
  filesystem); they must all find the same checkpoint.

  Returns:
    `(state, step, logs)`: `logs` holds the resumed run's "history" (and for
    GPT its per-step "losses"), empty lists for a fresh start.
  """
  flags_digest = zlib.crc32(json.dumps(
      [meta, _FSDP.value, _GRAD_ACCUM.value, out_dir], sort_keys=True).encode()) & 0x7FFFFFFF
  parallel.check_same_on_all_processes(
      flags_digest, "the processes were started with different flags; pass the same "
      "flags to every process (only --process_id differs).")
  state, step, logs = _start_or_resume(out_dir, template, meta)
  parallel.check_same_on_all_processes(
      step, f"the processes found different checkpoints in {out_dir}; with several "
      f"hosts --out_dir must be one shared directory.")
  return state, step, {"history": logs.get("history", []), "losses": logs.get("losses", [])}


def _start_or_resume(out_dir, template, meta):
  existing = checkpoint.list_checkpoints(out_dir)
  if not _RESUME.value:
    if existing:
      raise ValueError(
          f"{out_dir} already holds checkpoints (newest: {existing[0][1].name}); pass "
          f"--resume to continue that run, or another --out_dir for a new one.")
    return template, 0, {}
  def same_run(saved, path):
    for name in RUN_IDENTITY:
      value = saved.get(name)
      if name == "config" and saved.get("model") == "gpt" and isinstance(value, dict):
        value = {**GPT_CONFIG_DEFAULTS, **value}
      if value != meta.get(name):
        raise checkpoint.CheckpointError(
            f"{path} was trained with {name}={value!r}, this run has "
            f"{meta.get(name)!r}; resume with the original flags or use another --out_dir.")

  restored, warnings = checkpoint.restore_latest(out_dir, template, check_meta=same_run)
  for warning in warnings:
    log(f"warning: {warning}")
  if restored is None:
    log(f"no valid checkpoint in {out_dir}; starting from step 0")
    return template, 0, {}
  log(f"resumed from {restored.path} at step {restored.step}")
  return restored.state, restored.step, restored.meta


# What must match for a resumed run to continue the same computation.
RUN_IDENTITY = ("model", "config", "optimizer", "batch_size", "seed")
# A checkpoint saved before a GPTConfig field existed was trained with that
# field's default (e.g. `attn_block`, added in session 3).
GPT_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(gpt.GPTConfig)}


def save_checkpoint(out_dir, step, state, meta, logs):
  """Gathers `state` to the hosts (all processes), and process 0 writes it.

  The file holds whole arrays, whatever the sharding, so it restores on any
  number of devices.
  """
  state = parallel.fetch(state)
  path = checkpoint.checkpoint_path(out_dir, step)
  if parallel.is_main_process():
    path = checkpoint.save(out_dir, step, state, {**meta, **logs},
                           keep=_KEEP_CHECKPOINTS.value)
    log(f"saved {path}")
  return path


def load_data(load):
  """`load()`, run by process 0 first when there are several.

  TFDS prepares a dataset on first use by writing into its data dir; with a
  shared dir, processes preparing at once would race. So process 0 loads
  (and prepares) first, then the others read what it wrote.
  """
  if jax.process_count() == 1:
    return load()
  result, error = None, None
  if parallel.is_main_process():
    try:
      result = load()
    except (ValueError, data_lib.DataUnavailableError) as e:
      error = e
  if parallel.any_process(error is not None):
    raise error or data_lib.DataUnavailableError(
        "process 0 could not load the data; its error says why.")
  return result if parallel.is_main_process() else load()


def make_plan(batch_size: int) -> parallel.ShardingPlan:
  """The mesh over the devices, checked against the batch."""
  plan = parallel.ShardingPlan(parallel.make_mesh(_NUM_DEVICES.value), fsdp=_FSDP.value)
  parallel.check_batch_size(batch_size, plan.mesh, _GRAD_ACCUM.value)
  log(f"{plan.num_devices} device(s) ({jax.devices()[0].platform}, "
      f"{jax.process_count()} process(es)), params "
      f"{'split (FSDP)' if plan.fsdp else 'replicated'}, batch {batch_size} = "
      f"{plan.num_devices} devices x {_GRAD_ACCUM.value} microbatches x "
      f"{batch_size // plan.num_devices // _GRAD_ACCUM.value}")
  return plan


def shard_state(state, plan):
  """Host state -> global arrays: params and optimizer state per the plan,
  everything else (keys) replicated."""
  shardings = {name: plan.state(value) if name in ("params", "opt_state")
               else plan.replicated for name, value in state.items()}
  return parallel.put(state, shardings), shardings


def sharded_step(fn, plan, shardings, **static):
  """`parallel.jit_train_step`, compiled once per distinct further keywords
  (the GPT's chunk length `num_steps`)."""
  @functools.lru_cache(maxsize=None)
  def compiled(**more):
    return parallel.jit_train_step(fn, plan, shardings["params"], shardings["opt_state"],
                                   **static, **more)
  return lambda *args, **more: compiled(**more)(*args)


def check_finite(losses, first_step, last_saved):
  """Stops at the first NaN/Inf loss (with --skip_nonfinite, only warns)."""
  bad = np.flatnonzero(~np.isfinite(losses))
  if not bad.size:
    return
  where = f"loss is {losses[bad[0]]} at step {first_step + int(bad[0])}"
  if _SKIP_NONFINITE.value:
    log(f"warning: {where}; skipping non-finite updates (--skip_nonfinite)")
    return
  saved = (f"the last good checkpoint, {last_saved}, is intact: resume from it with "
           f"--resume" if last_saved else "no checkpoint was saved before it")
  raise NonFiniteLoss(f"{where}; stopped without saving. {saved}. Try a lower "
                      f"--learning_rate, or --skip_nonfinite to skip such updates.")


def make_optimizer(opt_config):
  optimizer = optim.make_optimizer(opt_config)
  if _SKIP_NONFINITE.value:
    # Non-finite gradients leave params and moments unchanged for that step.
    optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=100)
  return optimizer


# ----------------------------------------------------------------------------
# MLP on MNIST


def train_mlp(out_dir: str) -> dict:
  """Trains the MNIST MLP; returns the final metrics."""
  batch_size, epochs = _flag("batch_size"), _EPOCHS.value
  checkpoint_every = _CHECKPOINT_EVERY.value or 1  # epochs
  _require_positive(batch_size=batch_size, epochs=epochs, checkpoint_every=checkpoint_every)
  try:
    sizes = [int(s) for s in _LAYER_SIZES.value]
  except ValueError:
    raise ValueError(f"--layer_sizes must be integers, got {_LAYER_SIZES.value}.") from None
  keys = rng.split_named(jax.random.PRNGKey(_SEED.value), ("params", "data"))
  params = mlp.init_network_params(sizes, keys["params"], _INIT_SCALE.value)

  mnist = load_data(lambda: data_lib.load_mnist(
      _TFDS_DATA_DIR.value, _TFDS_MANUAL_DIR.value, pixels=_MNIST_PIXELS.value))
  mlp.check_input_size(params, mnist.num_features)
  if sizes[-1] < int(mnist.train_labels.max()) + 1:
    raise ValueError(f"the last layer size {sizes[-1]} is below the "
                     f"{int(mnist.train_labels.max()) + 1} classes of the data.")
  steps_per_epoch = len(mnist.train_labels) // batch_size
  _require_positive(steps_per_epoch=steps_per_epoch)
  plan = make_plan(batch_size)
  # The whole dataset sits on every device; each device gathers its rows of
  # every batch (see mlp.train_epoch).
  train_x, train_y, test_x, test_y = parallel.put(
      (mnist.train_images, mnist.train_labels, mnist.test_images, mnist.test_labels),
      plan.replicated)

  opt_config = optimizer_config(epochs * steps_per_epoch)
  optimizer = make_optimizer(opt_config)
  meta = {"model": "mlp", "config": {"layer_sizes": sizes, "init_scale": _INIT_SCALE.value,
                                     "mnist_pixels": _MNIST_PIXELS.value},
          "optimizer": dataclasses.asdict(opt_config), "batch_size": batch_size,
          "seed": _SEED.value}
  template = {"params": params, "opt_state": optimizer.init(params), "data_key": keys["data"]}
  state, epoch, logs = start_or_resume(out_dir, template, meta)
  history = logs["history"]
  state, shardings = shard_state(state, plan)
  train_epoch = sharded_step(mlp.train_epoch, plan, shardings, optimizer=optimizer,
                             batch_size=batch_size, grad_accum_steps=_GRAD_ACCUM.value)
  log(f"mlp {sizes}, {opt_config}, {steps_per_epoch} steps/epoch")

  last_saved = None
  while epoch < epochs:
    start = time.perf_counter()
    params, opt_state, train_loss = train_epoch(
        state["params"], state["opt_state"], train_x, train_y,
        rng.fold_in_step(state["data_key"], epoch + 1))
    train_loss = float(train_loss)  # waits for the epoch to finish
    seconds = time.perf_counter() - start
    check_finite(np.array([train_loss]), epoch + 1, last_saved)
    state = {**state, "params": params, "opt_state": opt_state}
    epoch += 1
    history.append(dict(
        epoch=epoch, seconds=seconds,
        examples_per_s=steps_per_epoch * batch_size / seconds, train_loss=train_loss,
        train_acc=float(mlp.evaluate_accuracy(params, train_x, train_y)),
        test_acc=float(mlp.evaluate_accuracy(params, test_x, test_y))))
    log("epoch {epoch:3d} | {seconds:6.3f} s | {examples_per_s:9.0f} ex/s | "
        "loss {train_loss:.4f} | train acc {train_acc:.4f} | "
        "test acc {test_acc:.4f}".format(**history[-1]))
    stop = signal_received()
    if epoch % checkpoint_every == 0 or epoch == epochs or stop:
      last_saved = save_checkpoint(out_dir, epoch, state, meta, logs)
    if stop:
      raise Interrupted(_PENDING_SIGNAL[0])
  return history[-1] if history else {}


# ----------------------------------------------------------------------------
# GPT on Tiny Shakespeare


def gpt_config(vocab_size: int) -> gpt.GPTConfig:
  return gpt.GPTConfig(
      vocab_size=vocab_size, block_size=_BLOCK_SIZE.value, n_layer=_N_LAYER.value,
      n_head=_N_HEAD.value, n_embd=_N_EMBD.value, dropout=_DROPOUT.value,
      bias=_BIAS.value, compute_dtype=_DTYPE.value, remat=_REMAT.value,
      attn_block=_ATTN_BLOCK.value)


def train_gpt(out_dir: str) -> dict:
  """Trains NanoGPT on character-level Tiny Shakespeare; returns final metrics."""
  batch_size, max_iters = _flag("batch_size"), _MAX_ITERS.value
  checkpoint_every = _CHECKPOINT_EVERY.value or _EVAL_INTERVAL.value
  _require_positive(batch_size=batch_size, max_iters=max_iters,
                    eval_interval=_EVAL_INTERVAL.value, eval_iters=_EVAL_ITERS.value,
                    log_interval=_LOG_INTERVAL.value, steps_per_call=_STEPS_PER_CALL.value,
                    block_size=_BLOCK_SIZE.value, checkpoint_every=checkpoint_every)
  config = gpt_config(vocab_size=1)  # fail on bad model flags before loading data
  text = load_data(lambda: data_lib.load_shakespeare(_TFDS_DATA_DIR.value,
                                                     _TFDS_MANUAL_DIR.value))
  config = dataclasses.replace(config, vocab_size=text.vocab.size)
  if config.block_size >= len(text.val):
    raise ValueError(f"--block_size={config.block_size} must be shorter than the "
                     f"validation text ({len(text.val)} characters).")
  keys = rng.split_named(jax.random.PRNGKey(_SEED.value),
                         ("params", "train", "eval", "sample"))
  params = gpt.init_params(config, keys["params"])
  opt_config = optimizer_config(max_iters)
  optimizer = make_optimizer(opt_config)
  meta = {"model": "gpt", "config": dataclasses.asdict(config), "vocab": text.vocab.chars,
          "optimizer": dataclasses.asdict(opt_config), "batch_size": batch_size,
          "seed": _SEED.value}
  # The data sampler's whole state is (train key, step): batch s is drawn
  # from fold_in(train key, s), so restoring both resumes the same stream.
  template = {"params": params, "opt_state": optimizer.init(params),
              "keys": {"train": keys["train"], "eval": keys["eval"]}}
  plan = make_plan(batch_size)
  state, step, logs = start_or_resume(out_dir, template, meta)
  history, step_losses = logs["history"], logs["losses"]  # evaluations; every step's loss
  state, shardings = shard_state(state, plan)
  train_steps = sharded_step(gpt.train_steps, plan, shardings, config=config,
                             optimizer=optimizer, batch_size=batch_size,
                             grad_accum_steps=_GRAD_ACCUM.value)
  # The text (1 MB) sits on every device; each device samples its rows.
  train_data, val_data = parallel.put((text.train, text.val), plan.replicated)
  log(f"gpt {config}, {gpt.num_params(params) / 1e6:.2f}M params, {opt_config}")

  def evaluate(step):
    kwargs = dict(config=config, batch_size=batch_size, num_batches=_EVAL_ITERS.value,
                  plan=plan)
    eval_key, params = state["keys"]["eval"], state["params"]
    losses = {"step": step,
              "train_loss": float(gpt.evaluate(params, train_data, eval_key, **kwargs)),
              "val_loss": float(gpt.evaluate(params, val_data, eval_key, **kwargs))}
    log(f"step {step:5d} | train loss {losses['train_loss']:.4f} | "
        f"val loss {losses['val_loss']:.4f}")
    history.append(losses)

  last_saved, times, since_log = None, [], []
  while step < max_iters:
    if step % _EVAL_INTERVAL.value == 0 and not (history and history[-1]["step"] == step):
      evaluate(step)
    # Never run across an evaluation, logging or checkpoint boundary in one call.
    boundary = min(_next_multiple(step, _EVAL_INTERVAL.value),
                   _next_multiple(step, _LOG_INTERVAL.value),
                   _next_multiple(step, checkpoint_every), max_iters)
    num_steps = min(_STEPS_PER_CALL.value, boundary - step)
    start = time.perf_counter()
    params, opt_state, losses = train_steps(
        state["params"], state["opt_state"], train_data, state["keys"]["train"], step,
        num_steps=num_steps)
    losses = np.asarray(losses)  # waits for the steps to finish
    seconds_per_step = (time.perf_counter() - start) / num_steps
    check_finite(losses, step, last_saved)
    state = {**state, "params": params, "opt_state": opt_state}
    step_losses.extend(losses.tolist())
    times.append(seconds_per_step)
    since_log.append(seconds_per_step)
    step += num_steps
    if step % _LOG_INTERVAL.value == 0 or step == max_iters:
      ms = 1000 * float(np.median(since_log))
      log(f"step {step:5d} | loss {losses[-1]:.4f} | {ms:6.2f} ms/iter | "
          f"{batch_size * config.block_size / ms * 1000:8.0f} tokens/s")
      since_log = []
    if step == max_iters:
      evaluate(step)
    stop = signal_received()
    if step % checkpoint_every == 0 or step == max_iters or stop:
      last_saved = save_checkpoint(out_dir, step, state, meta, logs)
    if stop:
      raise Interrupted(_PENDING_SIGNAL[0])
  metrics = dict(history[-1]) if history else {"step": step}
  if times:
    # The first calls compile (one per distinct chunk length), so drop them.
    metrics["ms_per_iter"] = 1000 * float(np.median(times[2:] or times))
    log(f"median {metrics['ms_per_iter']:.2f} ms/iter after compilation")

  if _SAMPLE_TOKENS.value > 0:
    # Whole params on one local device: sampling is one sequence, not worth a mesh.
    params = jax.device_put(parallel.fetch(state["params"]), jax.local_devices()[0])
    if parallel.is_main_process():
      prompt = jnp.asarray(text.vocab.encode("\n"))
      sample = gpt.generate(params, prompt, config, keys["sample"],
                            max_new_tokens=_SAMPLE_TOKENS.value, temperature=0.8,
                            top_k=200)
      log("---- sample ----\n" + text.vocab.decode(sample))
  return metrics


def _next_multiple(step: int, interval: int) -> int:
  return (step // interval + 1) * interval


# Exit codes (documented in the README).
EXIT_ERROR = 1            # bad flags, missing data, unusable checkpoint
EXIT_NONFINITE = 2        # loss became NaN/Inf; the last checkpoint is intact
# SIGINT / SIGTERM: a checkpoint is saved, then exit 128 + signal (130 / 143).


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  out_dir = _OUT_DIR.value or f"out-{_MODEL.value}"
  try:
    if _CPU_DEVICES.value is not None:
      parallel.set_cpu_devices(_CPU_DEVICES.value)  # before anything starts JAX's backends
    if (_COORDINATOR.value or _NUM_PROCESSES.value or _PROCESS_ID.value is not None
        or os.environ.get("JAX_COORDINATOR_ADDRESS")):
      parallel.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value,
                                      _PROCESS_ID.value)
    # After jax.distributed, whose preemption notifier takes SIGTERM for
    # itself: the loop checks for signals on every process at each boundary.
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    optimizer_config(total_steps=1)  # fail on bad optimizer flags before loading data
    _require_positive(keep_checkpoints=_KEEP_CHECKPOINTS.value)
    _check_out_dir(out_dir)
    metrics = train_mlp(out_dir) if _MODEL.value == "mlp" else train_gpt(out_dir)
  except Interrupted as e:
    log(f"stopped by {e}; the checkpoint above holds the run (resume with --resume)")
    sys.exit(128 + e.signum)
  except NonFiniteLoss as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(EXIT_NONFINITE)
  except (ValueError, data_lib.DataUnavailableError, checkpoint.CheckpointError) as e:
    sys.exit(f"error: {e}")
  log("final " + json.dumps(metrics))


def _check_out_dir(out_dir: str) -> None:
  """Fails before training if checkpoints could not be written to `out_dir`."""
  if not parallel.is_main_process():
    return  # only process 0 writes
  path = pathlib.Path(out_dir)
  try:
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
      pass
  except OSError as e:
    raise ValueError(f"--out_dir={out_dir} is not writable ({e.strerror or e}); pass "
                     f"a writable directory.") from None


if __name__ == "__main__":
  app.run(main)

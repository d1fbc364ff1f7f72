r"""Trains a purejax model from the command line.

    python -m purejax.train                      # NanoGPT on Tiny Shakespeare
    python -m purejax.train --model=mlp --tfds_manual_dir=../shared/data/mnist

Flags left unset take the chosen model's defaults (`MODEL_DEFAULTS`); GPT
flags share nanoGPT's names. Bad values stop the run at once with a one-line
message naming the flag.
"""

import dataclasses
import json
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from purejax import checkpoint
from purejax import data as data_lib
from purejax import gpt
from purejax import mlp
from purejax import optim
from purejax import rng

_MODEL = flags.DEFINE_enum("model", "gpt", ["gpt", "mlp"], "Which model to train.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the run's PRNG key.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where to save params (default out-<model>).")
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
_MAX_ITERS = flags.DEFINE_integer("max_iters", 2000, "GPT training steps.")
_EVAL_INTERVAL = flags.DEFINE_integer("eval_interval", 250, "Steps between evaluations.")
_EVAL_ITERS = flags.DEFINE_integer("eval_iters", 200, "Batches per evaluation.")
_LOG_INTERVAL = flags.DEFINE_integer("log_interval", 50, "Steps between loss logs.")
_STEPS_PER_CALL = flags.DEFINE_integer(
    "steps_per_call", 10, "Optimisation steps fused into one jitted call.")
_SAMPLE_TOKENS = flags.DEFINE_integer("sample_tokens", 300,
                                      "Characters sampled at the end (0: none).")

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
  print(message, flush=True)


# ----------------------------------------------------------------------------
# MLP on MNIST


def train_mlp(out_dir: str) -> dict:
  """Trains the MNIST MLP; returns the final metrics."""
  batch_size, epochs = _flag("batch_size"), _EPOCHS.value
  _require_positive(batch_size=batch_size, epochs=epochs)
  try:
    sizes = [int(s) for s in _LAYER_SIZES.value]
  except ValueError:
    raise ValueError(f"--layer_sizes must be integers, got {_LAYER_SIZES.value}.") from None
  keys = rng.split_named(jax.random.PRNGKey(_SEED.value), ("params", "data"))
  params = mlp.init_network_params(sizes, keys["params"], _INIT_SCALE.value)

  mnist = data_lib.load_mnist(_TFDS_DATA_DIR.value, _TFDS_MANUAL_DIR.value,
                              pixels=_MNIST_PIXELS.value)
  mlp.check_input_size(params, mnist.num_features)
  if sizes[-1] < int(mnist.train_labels.max()) + 1:
    raise ValueError(f"the last layer size {sizes[-1]} is below the "
                     f"{int(mnist.train_labels.max()) + 1} classes of the data.")
  train_x, train_y = jnp.asarray(mnist.train_images), jnp.asarray(mnist.train_labels)
  test_x, test_y = jnp.asarray(mnist.test_images), jnp.asarray(mnist.test_labels)
  steps_per_epoch = len(mnist.train_labels) // batch_size
  _require_positive(steps_per_epoch=steps_per_epoch)

  opt_config = optimizer_config(epochs * steps_per_epoch)
  optimizer = optim.make_optimizer(opt_config)
  opt_state = optimizer.init(params)
  log(f"mlp {sizes}, {opt_config}, {steps_per_epoch} steps/epoch")

  metrics = {}
  for epoch in range(1, epochs + 1):
    start = time.perf_counter()
    params, opt_state, train_loss = mlp.train_epoch(
        params, opt_state, train_x, train_y, rng.fold_in_step(keys["data"], epoch),
        optimizer=optimizer, batch_size=batch_size)
    train_loss = float(train_loss)  # waits for the epoch to finish
    seconds = time.perf_counter() - start
    metrics = dict(
        epoch=epoch, seconds=seconds,
        examples_per_s=steps_per_epoch * batch_size / seconds, train_loss=train_loss,
        train_acc=float(mlp.evaluate_accuracy(params, train_x, train_y)),
        test_acc=float(mlp.evaluate_accuracy(params, test_x, test_y)))
    log("epoch {epoch:3d} | {seconds:6.3f} s | {examples_per_s:9.0f} ex/s | "
        "loss {train_loss:.4f} | train acc {train_acc:.4f} | "
        "test acc {test_acc:.4f}".format(**metrics))
  checkpoint.save_params(out_dir, params, {"model": "mlp", "layer_sizes": sizes})
  return metrics


# ----------------------------------------------------------------------------
# GPT on Tiny Shakespeare


def gpt_config(vocab_size: int) -> gpt.GPTConfig:
  return gpt.GPTConfig(
      vocab_size=vocab_size, block_size=_BLOCK_SIZE.value, n_layer=_N_LAYER.value,
      n_head=_N_HEAD.value, n_embd=_N_EMBD.value, dropout=_DROPOUT.value,
      bias=_BIAS.value, compute_dtype=_DTYPE.value, remat=_REMAT.value)


def train_gpt(out_dir: str) -> dict:
  """Trains NanoGPT on character-level Tiny Shakespeare; returns final metrics."""
  batch_size, max_iters = _flag("batch_size"), _MAX_ITERS.value
  _require_positive(batch_size=batch_size, max_iters=max_iters,
                    eval_interval=_EVAL_INTERVAL.value, eval_iters=_EVAL_ITERS.value,
                    log_interval=_LOG_INTERVAL.value, steps_per_call=_STEPS_PER_CALL.value,
                    block_size=_BLOCK_SIZE.value)
  config = gpt_config(vocab_size=1)  # fail on bad model flags before loading data
  text = data_lib.load_shakespeare(_TFDS_DATA_DIR.value, _TFDS_MANUAL_DIR.value)
  config = dataclasses.replace(config, vocab_size=text.vocab.size)
  if config.block_size >= len(text.val):
    raise ValueError(f"--block_size={config.block_size} must be shorter than the "
                     f"validation text ({len(text.val)} characters).")
  keys = rng.split_named(jax.random.PRNGKey(_SEED.value),
                         ("params", "train", "eval", "sample"))
  params = gpt.init_params(config, keys["params"])
  opt_config = optimizer_config(max_iters)
  optimizer = optim.make_optimizer(opt_config)
  opt_state = optimizer.init(params)
  train_data, val_data = jnp.asarray(text.train), jnp.asarray(text.val)
  log(f"gpt {config}, {gpt.num_params(params) / 1e6:.2f}M params, {opt_config}")

  def evaluate(step):
    kwargs = dict(config=config, batch_size=batch_size, num_batches=_EVAL_ITERS.value)
    losses = {"train_loss": float(gpt.evaluate(params, train_data, keys["eval"], **kwargs)),
              "val_loss": float(gpt.evaluate(params, val_data, keys["eval"], **kwargs))}
    log(f"step {step:5d} | train loss {losses['train_loss']:.4f} | "
        f"val loss {losses['val_loss']:.4f}")
    return losses

  metrics, step, times, since_log = {}, 0, [], []
  while step < max_iters:
    if step % _EVAL_INTERVAL.value == 0:
      metrics.update(evaluate(step))
    # Never run across an evaluation or logging boundary in one call.
    boundary = min(_next_multiple(step, _EVAL_INTERVAL.value),
                   _next_multiple(step, _LOG_INTERVAL.value), max_iters)
    num_steps = min(_STEPS_PER_CALL.value, boundary - step)
    start = time.perf_counter()
    params, opt_state, losses = gpt.train_steps(
        params, opt_state, train_data, keys["train"], step, config=config,
        optimizer=optimizer, batch_size=batch_size, num_steps=num_steps)
    losses = np.asarray(losses)  # waits for the steps to finish
    seconds_per_step = (time.perf_counter() - start) / num_steps
    times.append(seconds_per_step)
    since_log.append(seconds_per_step)
    step += num_steps
    if step % _LOG_INTERVAL.value == 0 or step == max_iters:
      ms = 1000 * float(np.median(since_log))
      log(f"step {step:5d} | loss {losses[-1]:.4f} | {ms:6.2f} ms/iter | "
          f"{batch_size * config.block_size / ms * 1000:8.0f} tokens/s")
      since_log = []
  metrics.update(evaluate(step))
  # The first calls compile (one per distinct chunk length), so drop them.
  steady = times[2:] or times
  metrics.update(step=step, ms_per_iter=1000 * float(np.median(steady)))
  log(f"median {metrics['ms_per_iter']:.2f} ms/iter after compilation")

  checkpoint.save_params(out_dir, params, {
      "model": "gpt", "config": checkpoint.config_to_dict(config),
      "vocab": text.vocab.chars})
  if _SAMPLE_TOKENS.value > 0:
    prompt = jnp.asarray(text.vocab.encode("\n"))
    sample = gpt.generate(params, prompt, config, keys["sample"],
                          max_new_tokens=_SAMPLE_TOKENS.value, temperature=0.8,
                          top_k=200)
    log("---- sample ----\n" + text.vocab.decode(sample))
  return metrics


def _next_multiple(step: int, interval: int) -> int:
  return (step // interval + 1) * interval


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  out_dir = _OUT_DIR.value or f"out-{_MODEL.value}"
  try:
    optimizer_config(total_steps=1)  # fail on bad optimizer flags before loading data
    metrics = train_mlp(out_dir) if _MODEL.value == "mlp" else train_gpt(out_dir)
  except (ValueError, data_lib.DataUnavailableError, checkpoint.CheckpointError) as e:
    sys.exit(f"error: {e}")
  log("final " + json.dumps(metrics))


if __name__ == "__main__":
  app.run(main)

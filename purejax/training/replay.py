"""Replaying a training step from a checkpoint, to see what made its loss.

    state = replay_to(state, ids, start=400, stop=449, ...)   # a checkpoint's TrainState
    report = inspect_step(state, ids, 449, ...)
    report.loss                 # what metrics.jsonl logged at step 450, bit for bit
    report.token_losses         # [batch, block]: which tokens it came from
    report.grad_norms           # {"blocks.attn.qkv.w": [n_layer], ..., "blocks": [n_layer]}

Step `s` of a run is a function of its state before the step and of
`fold_in(train key, s)` (its batch and dropout), or, when the host reads the
batches, of `(seed, s)` (`batches.sample_windows`). So the state of a
checkpoint and the same steps replay the run exactly: `replay_to` runs
`steps.train_steps` from the checkpoint's step, and `inspect_step` runs the
step once more and also returns its batch, each token's loss and each
layer's gradient norm. Exact for runs trained on one device (several
devices add a step's gradients in another order).

Numbering: the loop logs the loss of update `s` (0-based) at step `s + 1`,
the step count after it; `inspect_step(..., s)` returns that loss.
"""

from typing import Dict, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from purejax.data import batches
from purejax import gpt
from purejax.training import parallel
from purejax import rng
from purejax.training import steps
from purejax.training.state import TrainState


class StepReport(NamedTuple):
  """What one replayed step computed.

  Attributes:
    update: 0-based index of the update (logged as step `update + 1`).
    loss: the step's mean loss, as the training step computed it.
    tokens: `[batch, block + 1]` the batch's windows; inputs are `[:, :-1]`,
      targets `[:, 1:]`.
    token_losses: `[batch, block]` each target's loss, under the step's
      dropout; their mean equals `loss` to float rounding.
    grad_norm: the global norm of the step's gradient (as logged).
    grad_norms: `{dotted param path: norm}`; stacked block params give one
      norm per layer, `[n_layer]`, and `"blocks"` is each layer's total.
  """
  update: int
  loss: float
  tokens: np.ndarray
  token_losses: np.ndarray
  grad_norm: float
  grad_norms: Dict[str, np.ndarray]


def step_windows(train_tokens, key: chex.PRNGKey, update: int, *, config: gpt.GPTConfig,
                 batch_size: int, host_seed: Optional[int] = None) -> np.ndarray:
  """The `[batch, block + 1]` windows update `update` trained on.

  `host_seed`: the run's seed when the host read its batches
  (`batches.host_feed`); None when they were drawn on the device from `key`.
  """
  if host_seed is not None:
    return batches.sample_windows(train_tokens, config.block_size, batch_size, 2 * host_seed,
                                  update)
  batch_key, _ = jax.random.split(rng.fold_in_step(key, update))
  x, y = batches.sample_batch(batch_key, jnp.asarray(train_tokens), config.block_size,
                              batch_size)
  return np.concatenate([np.asarray(x), np.asarray(y[:, -1:])], axis=1)


def tokens_for(train_tokens, start, num_steps, config, batch_size, host_seed
               ) -> batches.Tokens:
  """What `steps.train_steps` was given for updates `start .. start + num_steps - 1`."""
  if host_seed is None:
    return batches.DeviceTokens(jnp.asarray(train_tokens))
  return batches.HostWindows(np.stack([
      batches.sample_windows(train_tokens, config.block_size, batch_size, 2 * host_seed, s)
      for s in range(start, start + num_steps)]))


def replay_to(state: TrainState, train_tokens, start: int, stop: int, *,
              config: gpt.GPTConfig, optimizer: optax.GradientTransformation,
              batch_size: int, grad_accum_steps: int = 1, host_seed: Optional[int] = None,
              steps_per_call: int = 10) -> TrainState:
  """Runs updates `start .. stop - 1`: the state before update `stop`.

  Args:
    state: the state before update `start` (a checkpoint at step `start`);
      donated. Its `keys["train"]` is the run's training key.
    train_tokens: the run's training ids (on the device, or a host array or
      memmap with `host_seed`).
    start, stop: the first update to run and the one to stop before.
    config, optimizer, batch_size, grad_accum_steps: the run's.
    host_seed: see `step_windows`.
    steps_per_call: updates per jitted call (the result does not depend on it).

  Returns:
    The state before update `stop`.
  """
  step = start
  while step < stop:
    n = min(steps_per_call, stop - step)
    state, _ = steps.train_steps(
        state, tokens_for(train_tokens, step, n, config, batch_size, host_seed), step,
        config=config, optimizer=optimizer, batch_size=batch_size, num_steps=n,
        grad_accum_steps=grad_accum_steps)
    step += n
  return state


def _dotted(path) -> str:
  return ".".join(str(getattr(entry, "key", entry)) for entry in path)


def _per_layer_norms(grads: gpt.Params) -> Dict[str, np.ndarray]:
  """`{path: norm}`, per layer (`[n_layer]`) for the stacked blocks."""
  norms, layer_squares = {}, 0.0
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    name = _dotted(path)
    g = np.asarray(g, np.float64)
    if name.startswith("blocks."):
      squares = (g.reshape(g.shape[0], -1) ** 2).sum(axis=1)
      layer_squares = layer_squares + squares
      norms[name] = np.sqrt(squares)
    else:
      norms[name] = np.sqrt((g ** 2).sum())
  norms["blocks"] = np.sqrt(layer_squares)
  return norms


def inspect_step(state: TrainState, train_tokens, update: int, *, config: gpt.GPTConfig,
                 optimizer: optax.GradientTransformation, batch_size: int,
                 grad_accum_steps: int = 1, host_seed: Optional[int] = None) -> StepReport:
  """Runs update `update` once more and reports what it computed.

  The loss comes from `steps.train_steps` itself (one step), so it equals
  the logged one bit for bit; the per-token losses and per-layer gradient
  norms are recomputed beside it, with the same batch and dropout keys.

  Args: as `replay_to`, with the state before update `update` (not donated).

  Returns:
    A `StepReport`.
  """
  params, key = state.params, state.keys["train"]
  windows = step_windows(train_tokens, key, update, config=config, batch_size=batch_size,
                         host_seed=host_seed)
  _, dropout_key = jax.random.split(rng.fold_in_step(key, update))
  x, y = jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])

  def microbatch_loss(params, xy, index):  # as steps.train_steps' update
    return gpt.loss(params, *xy, config, key=jax.random.fold_in(dropout_key, index),
                    deterministic=False)

  _, grads = jax.jit(lambda p, xy: parallel.accumulate_gradients(
      microbatch_loss, p, xy, grad_accum_steps))(params, (x, y))

  @jax.jit
  def token_losses(params, x, y):
    def part(xy, index):
      logits = gpt.forward(params, xy[0], config, key=jax.random.fold_in(dropout_key, index),
                           deterministic=False)
      return optax.softmax_cross_entropy_with_integer_labels(logits, xy[1])
    rows = batch_size // grad_accum_steps
    if grad_accum_steps == 1:
      return part((x, y), jnp.int32(0))
    parts = [part((x[j * rows:(j + 1) * rows], y[j * rows:(j + 1) * rows]), jnp.int32(j))
             for j in range(grad_accum_steps)]
    return jnp.concatenate(parts)

  per_token = np.asarray(token_losses(params, x, y))
  copy = jax.tree.map(jnp.array, state)  # train_steps donates its state
  _, metrics = steps.train_steps(
      copy, tokens_for(train_tokens, update, 1, config, batch_size, host_seed), update,
      config=config, optimizer=optimizer, batch_size=batch_size, num_steps=1,
      grad_accum_steps=grad_accum_steps)
  return StepReport(update, float(metrics.loss[0]), windows, per_token,
                    float(metrics.grad_norm[0]), _per_layer_norms(grads))

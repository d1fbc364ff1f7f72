"""Jitted training and evaluation steps of the GPT.

    params, opt_state, metrics = train_steps(params, opt_state, tokens, key, step,
                                             config=config, optimizer=optimizer,
                                             batch_size=12, num_steps=10)
    metrics.loss, metrics.grad_norm                   # [10] each
    val = evaluate(params, val_data, eval_key, config=config, batch_size=12,
                   num_batches=200)

Both run as one `lax.scan` inside a `jit`, with their batches drawn on the
device (`batches.sample_batch`), so there is no host round-trip per step.
"""

from typing import Any, NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp
import optax

from purejax.data import batches
from purejax import gpt
from purejax.ops import kernels
from purejax.training import parallel
from purejax import rng

Params = gpt.Params


class StepMetrics(NamedTuple):
  """What each training step reports, one entry per step.

  Attributes:
    loss: `[num_steps]` mean loss, measured before the step's update.
    grad_norm: `[num_steps]` global norm of the gradient, before clipping.
  """
  loss: chex.Array
  grad_norm: chex.Array


def _update(params, opt_state, batch, dropout_key, *, config, optimizer, grad_accum_steps,
            plan, forms):
  """One optimisation step on `batch` = (inputs, targets) `[batch, block]`."""
  def microbatch_loss(params, xy, index):
    x, y = xy
    return gpt.loss(params, x, y, config, key=jax.random.fold_in(dropout_key, index),
                    deterministic=False, forms=forms)

  value, grads = parallel.accumulate_gradients(
      microbatch_loss, params, batch, grad_accum_steps, plan=plan)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, StepMetrics(
      value, optax.tree.norm(grads))


def _train_steps(
    params: Params,
    opt_state: optax.OptState,
    tokens: chex.Array,
    key: chex.PRNGKey,
    step: chex.Numeric,
    *,
    config: gpt.GPTConfig,
    optimizer: optax.GradientTransformation,
    batch_size: int,
    num_steps: int,
    grad_accum_steps: int = 1,
    plan: Optional[parallel.ShardingPlan] = None,
    forms: Optional[kernels.Forms] = None,
) -> Tuple[Params, Any, StepMetrics]:
  """Runs `num_steps` optimisation steps in one jitted `lax.scan`.

  Step `s` draws its dropout keys, and its batch when drawn on the device,
  from `fold_in(key, s)`, so the whole run is a function of `(key, step)`:
  chunking the steps differently, or resuming at any step, gives the same
  result.

  Args:
    params: model params (donated).
    opt_state: optax state (donated).
    tokens: either the `[num_tokens]` training ids, on the device, from which
      each step draws random windows (`batches.sample_batch`); or the batches
      themselves, `[num_steps, batch_size, block_size + 1]` windows read by the
      host (`batches.sample_windows`) for corpora too large for the device.
      Inputs are a window's first `block_size` tokens, targets its last.
    key: base key of the run's training stream.
    step: global index of the first step.
    config: model config.
    optimizer: optax `GradientTransformation`.
    batch_size: sequences per step (the global batch).
    num_steps: steps to run.
    grad_accum_steps: microbatches per step (`parallel.accumulate_gradients`);
      must divide `batch_size`. Each draws its dropout from its own key.
    plan: how the step is spread over devices (`parallel.ShardingPlan`);
      None on one device. Wrap the call in a `jax.jit` with the plan's in/out
      shardings, as `purejax.train` does, to keep the state's layout.
    forms: execution forms (`kernels.select`); None: those of the platform
      the plan's mesh, or else `params`, lives on.

  Returns:
    `(params, opt_state, StepMetrics)` with `[num_steps]` entries.
  """
  from_host = tokens.ndim == 3
  if from_host:
    chex.assert_shape(tokens, (num_steps, batch_size, config.block_size + 1))

  def one_step(carry, xs):
    s, window = xs
    batch_key, dropout_key = jax.random.split(rng.fold_in_step(key, s))
    if from_host:
      batch = (window[:, :-1].astype(jnp.int32), window[:, 1:].astype(jnp.int32))
    else:
      batch = batches.sample_batch(batch_key, tokens, config.block_size, batch_size)
    params, opt_state, metrics = _update(
        *carry, batch, dropout_key, config=config, optimizer=optimizer,
        grad_accum_steps=grad_accum_steps, plan=plan, forms=forms)
    return (params, opt_state), metrics

  steps = step + jnp.arange(num_steps)
  (params, opt_state), metrics = jax.lax.scan(
      one_step, (params, opt_state), (steps, tokens if from_host else None))
  return params, opt_state, metrics


train_steps = kernels.jit_with_forms(
    _train_steps, platform_args=("plan", "params"),
    static_argnames=("config", "optimizer", "batch_size", "num_steps", "grad_accum_steps",
                     "plan"),
    donate_argnums=(0, 1))


def _evaluate(
    params: Params,
    tokens: chex.Array,
    key: chex.PRNGKey,
    *,
    config: gpt.GPTConfig,
    batch_size: int,
    num_batches: int,
    plan: Optional[parallel.ShardingPlan] = None,
    forms: Optional[kernels.Forms] = None,
) -> chex.Array:
  """Mean loss over `num_batches` batches of `tokens` (no dropout).

  `tokens` as in `train_steps`: ids on the device, from which the batches are
  drawn with `key` (pass the same `key` at every evaluation so the batches
  are fixed and the numbers compare across steps), or `[num_batches,
  batch_size, block_size + 1]` windows read by the host. `plan` splits each
  batch across devices, and `forms` chooses how the model runs, as in
  `train_steps`.
  """
  from_host = tokens.ndim == 3
  if from_host:
    chex.assert_shape(tokens, (num_batches, batch_size, config.block_size + 1))

  def body(total, xs):
    k, window = xs
    if from_host:
      x, y = window[:, :-1].astype(jnp.int32), window[:, 1:].astype(jnp.int32)
    else:
      x, y = batches.sample_batch(k, tokens, config.block_size, batch_size)
    if plan is not None:
      x, y = parallel.constrain((x, y), plan.batch)
    return total + gpt.loss(params, x, y, config, forms=forms), None

  xs = (jax.random.split(key, num_batches), tokens if from_host else None)
  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
  return total / num_batches


evaluate = kernels.jit_with_forms(
    _evaluate, platform_args=("plan", "params"),
    static_argnames=("config", "batch_size", "num_batches", "plan"))

"""Jitted training and evaluation steps: the GPT's fused steps, the MLP's epoch.

    forms = kernels.select()                          # how the model runs (one device)
    state, metrics = train_steps(state, DeviceTokens(ids), step, config=config,
                                 optimizer=optimizer, batch_size=12, num_steps=10,
                                 forms=forms)
    metrics.loss, metrics.grad_norm                   # [10] each
    val = evaluate(params, DeviceTokens(val_ids), eval_key, config=config,
                   batch_size=12, num_batches=200, forms=forms)
    state, loss = train_epoch(state, images, labels, epoch, optimizer=optimizer,
                              batch_size=128)         # the MNIST MLP

Each runs as one `lax.scan` inside a `jit`. `train_steps` and `train_epoch` are
the plain `train_steps_fn` and `train_epoch_fn` jitted for one device; across
devices, `parallel.jit_train_step` jits those plain functions with the state's
shardings instead. GPT batches are drawn on the
device from `DeviceTokens` (no host round-trip per step) or given as
`HostWindows` the host read (`purejax.data.batches`).
"""

import functools
from typing import Any, Callable, NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp
import optax

from purejax import gpt
from purejax import mlp
from purejax import rng
from purejax.data import batches
from purejax.ops import kernels
from purejax.training.pure import parallel
from purejax.training.pure.state import TrainState


class StepMetrics(NamedTuple):
  """What each training step reports, one entry per step.

  Attributes:
    loss: `[num_steps]` mean loss, measured before the step's update.
    grad_norm: `[num_steps]` global norm of the gradient, before clipping.
  """
  loss: chex.Array
  grad_norm: chex.Array


def _update(params, opt_state, loss_fn, batch, *, optimizer, grad_accum_steps, plan):
  """One optimisation step: `loss_fn(params, part, index)` over `batch`'s microbatches."""
  value, grads = parallel.accumulate_gradients(loss_fn, params, batch, grad_accum_steps,
                                               plan=plan)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, value, grads


def lm_loss(params, batch, config, **kwargs):
  """The language model's objective: `gpt.loss` of a batch `(inputs, targets)` or
  `(inputs, targets, weights)`.

  An objective is `objective(params, batch, config, *, forms, key=, deterministic=,
  dropout=) -> scalar mean loss` of the batches its data draws; a preference run's is
  `preference.DPO`.
  """
  if len(batch) == 3:
    kwargs["weights"] = batch[2]
  return gpt.loss(params, batch[0], batch[1], config, **kwargs)


def _per_step(tokens: batches.Tokens, num: int, block_size: int, batch_size: int):
  """What the scan slices per step (`per_step` of the batch kind: the host's windows, or
  nothing where each step draws its own)."""
  if not hasattr(tokens, "draw"):
    raise TypeError(f"tokens must be batches.DeviceTokens, batches.DeviceRows or "
                    f"batches.HostWindows, got {type(tokens).__name__}.")
  return tokens.per_step(num, block_size, batch_size)


def train_steps_fn(
    state: TrainState,
    tokens: batches.Tokens,
    step: chex.Numeric,
    *,
    config: gpt.GPTConfig,
    optimizer: optax.GradientTransformation,
    batch_size: int,
    num_steps: int,
    forms: kernels.Forms,
    grad_accum_steps: int = 1,
    plan: Optional[parallel.ShardingPlan] = None,
    params_view: Optional[Callable[[Any], gpt.Params]] = None,
    dropout: Optional[chex.Numeric] = None,
    objective: Callable[..., chex.Array] = lm_loss,
) -> Tuple[TrainState, StepMetrics]:
  """Runs `num_steps` optimisation steps of the GPT in one jitted `lax.scan`.

  Step `s` draws its dropout keys, and its batch from `DeviceTokens`, from
  `fold_in(state.keys["train"], s)`, so the whole run is a function of
  `(key, step)`: chunking the steps differently, or resuming at any step,
  gives the same result.

  Args:
    state: params, optimizer state and the run's keys (donated, keys too:
      use the returned state).
    tokens: `DeviceTokens`, the training ids on the device, from which each
      step draws random windows (`batches.sample_batch`); or `HostWindows`,
      `[num_steps, batch_size, block_size + 1]` windows the host read
      (`batches.sample_windows`) for corpora too large for the device; or
      `DeviceRows`, fixed rows (conversations) with per-target weights, from
      which each step draws whole rows (`batches.sample_rows`) and averages
      the loss over the weighted targets of the whole batch; or `DevicePairs`,
      preference pairs, with `objective=preference.DPO(...)`.
    step: global index of the first step.
    config: model config.
    optimizer: optax `GradientTransformation`.
    batch_size: sequences per step (the global batch).
    num_steps: steps to run.
    forms: how the model runs (`kernels.select`, which the entry points call:
      `gpt_loop.train_gpt`, the command lines).
    grad_accum_steps: microbatches per step (`parallel.accumulate_gradients`);
      must divide `batch_size`. Each draws its dropout from its own key.
    plan: how the step is spread over devices (`parallel.ShardingPlan`);
      None on one device. Under a plan, jit this function with
      `parallel.jit_train_step`, as the training loop does: its one jit keeps
      the state's layout.
    params_view: the model's params as a function of `state.params`, for
      trained params that are not the model's (LoRA's `lora.View`: base and
      adapters); None: `state.params` are the model's.
    dropout: the model's drop rate as a scalar array (`gpt.loss`; a sweep
      passes each run's), traced, so every rate shares one program; None:
      `config.dropout`, fixed in the program.
    objective: the loss of a batch (`lm_loss`; a preference run's `preference.DPO`),
      static: hashable, and a new one compiles a new program.

  Returns:
    `(state, StepMetrics)` with `[num_steps]` entries.
  """
  windows = _per_step(tokens, num_steps, config.block_size, batch_size)
  key = state.keys["train"]

  def one_step(carry, xs):
    params, opt_state = carry
    s, window = xs
    batch_key, dropout_key = jax.random.split(rng.fold_in_step(key, s))
    batch = tokens.draw(batch_key, window, config.block_size, batch_size)

    def microbatch_loss(params, xy, index):  # (the weights, if any, are cut with the rows)
      return objective(_view(params_view, params), xy, config,
                       key=jax.random.fold_in(dropout_key, index), deterministic=False,
                       forms=forms, dropout=dropout)

    params, opt_state, loss, grads = _update(
        params, opt_state, microbatch_loss, batch, optimizer=optimizer,
        grad_accum_steps=grad_accum_steps, plan=plan)
    return (params, opt_state), StepMetrics(loss, optax.tree.norm(grads))

  steps = step + jnp.arange(num_steps)
  (params, opt_state), metrics = jax.lax.scan(
      one_step, (state.params, state.opt_state), (steps, windows))
  return state._replace(params=params, opt_state=opt_state), metrics


# `train_steps_fn` jitted for one device (or inputs already placed): what a user calls.
train_steps = jax.jit(
    train_steps_fn, static_argnames=("config", "optimizer", "batch_size", "num_steps",
                                     "grad_accum_steps", "plan", "forms", "params_view",
                                     "objective"),
    donate_argnums=0)


def _view(params_view, params):
  return params if params_view is None else params_view(params)


@functools.partial(jax.jit, static_argnames=("config", "batch_size", "num_batches", "plan",
                                              "forms", "params_view", "objective"))
def evaluate(
    params: gpt.Params,
    tokens: batches.Tokens,
    key: chex.PRNGKey,
    *,
    config: gpt.GPTConfig,
    batch_size: int,
    num_batches: int,
    forms: kernels.Forms,
    plan: Optional[parallel.ShardingPlan] = None,
    params_view: Optional[Callable[[Any], gpt.Params]] = None,
    objective: Callable[..., chex.Array] = lm_loss,
) -> chex.Array:
  """Mean loss (`objective`'s) over `num_batches` batches of `tokens` (no dropout).

  `tokens` as in `train_steps`: `DeviceTokens`, from which the batches are
  drawn with `key` (pass the same `key` at every evaluation so the batches
  are fixed and the numbers compare across steps), or `HostWindows`,
  `[num_batches, batch_size, block_size + 1]`. `plan` splits each batch
  across devices, and `forms` chooses how the model runs, as in `train_steps`;
  `params_view` too.
  """
  windows = _per_step(tokens, num_batches, config.block_size, batch_size)

  def body(total, xs):
    k, window = xs
    batch = tokens.draw(k, window, config.block_size, batch_size)
    if plan is not None:
      batch = parallel.constrain(batch, plan.batch)
    return total + objective(_view(params_view, params), batch, config, forms=forms), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (jax.random.split(key, num_batches), windows))
  return total / num_batches


@functools.partial(jax.jit, static_argnames=("block_size", "batch_size", "num_batches"))
def target_bytes(
    tokens: batches.Tokens,
    key: chex.PRNGKey,
    byte_lengths: chex.Array,
    *,
    block_size: int,
    batch_size: int,
    num_batches: int,
) -> chex.Array:
  """`[num_batches]` int32: the UTF-8 bytes the targets of `evaluate`'s batches decode to.

  Given `evaluate`'s `tokens`, `key` and sizes, it draws the same batches, so
  a mean loss `L` (nats per token) of `evaluate` is
  `L * num_batches * batch_size * block_size / (ln 2 * sum(bytes))` bits per
  byte: every token's loss over the bytes those tokens decode to.

  Args:
    byte_lengths: `[vocab]` int32, each id's bytes (`tokenizers.byte_lengths`).
  """
  windows = _per_step(tokens, num_batches, block_size, batch_size)

  def body(_, xs):
    k, window = xs
    y = tokens.draw(k, window, block_size, batch_size)[1]
    return None, jnp.sum(byte_lengths[y], dtype=jnp.int32)

  _, counts = jax.lax.scan(body, None, (jax.random.split(key, num_batches), windows))
  return counts


def train_epoch_fn(
    state: TrainState,
    images: chex.Array,
    labels: chex.Array,
    epoch: chex.Numeric,
    *,
    optimizer: optax.GradientTransformation,
    batch_size: int,
    grad_accum_steps: int = 1,
    plan: Optional[parallel.ShardingPlan] = None,
) -> Tuple[TrainState, chex.Array]:
  """One pass of the MLP over a shuffled dataset, as a `lax.scan` of steps.

  Epoch `e` (0-based) is shuffled with `fold_in(state.keys["data"], e + 1)`
  and cut into `len(images) // batch_size` full batches; the remainder
  (fewer than `batch_size` examples, a different one each epoch) is left out
  so every step has the same shape.

  Args:
    state: the MLP's params, optimizer state and `"data"` key (donated).
    images: the whole training set `[num_examples, in_dim]`, on the device.
    labels: `[num_examples]` integers.
    epoch: the epoch's index, 0 for the first.
    optimizer: any optax `GradientTransformation`.
    batch_size: examples per step (the global batch).
    grad_accum_steps: microbatches per step (`parallel.accumulate_gradients`);
      must divide `batch_size`.
    plan: how the step is spread over devices (`parallel.ShardingPlan`);
      None on one device.

  Returns:
    `(state, mean_loss)` where `mean_loss` averages the loss of every step
    of the epoch (each measured before its step).
  """
  num_examples = images.shape[0]
  chex.assert_shape(labels, (num_examples,))
  num_batches = num_examples // batch_size
  if num_batches < 1:
    raise ValueError(
        f"batch_size {batch_size} exceeds the {num_examples} training examples.")
  key = rng.fold_in_step(state.keys["data"], epoch + 1)
  perm = jax.random.permutation(key, num_examples)[: num_batches * batch_size]

  def body(carry, rows):
    params, opt_state = carry
    params, opt_state, loss, _ = _update(
        params, opt_state, lambda p, xy, _: mlp.loss(p, *xy), (images[rows], labels[rows]),
        optimizer=optimizer, grad_accum_steps=grad_accum_steps, plan=plan)
    return (params, opt_state), loss

  (params, opt_state), losses = jax.lax.scan(
      body, (state.params, state.opt_state), perm.reshape(num_batches, batch_size))
  return state._replace(params=params, opt_state=opt_state), jnp.mean(losses)


# `train_epoch_fn` jitted for one device: what a user calls.
train_epoch = jax.jit(
    train_epoch_fn, static_argnames=("optimizer", "batch_size", "grad_accum_steps", "plan"),
    donate_argnums=0)

"""Learning-rate schedules, each a pure function of the step, found by name in `SCHEDULES`.

    schedule = SCHEDULES["cosine"](config, 1e-3, 1e-4)   # config: an optim.OptimizerConfig
    schedule(step)                                       # the rate at `step`

A schedule reads the config's step counts (`warmup_iters`, `decay_iters`,
`warmdown_frac`) and takes the peak rate and its floor as arguments: a sweep
passes them as traced arrays, so a schedule computes with them and never
branches on them.
"""

from typing import Callable, Dict

import chex
import jax.numpy as jnp
import optax


def warmup_cosine_schedule(
    learning_rate: float, warmup_iters: int, decay_iters: int, min_lr: float
) -> optax.Schedule:
  """nanoGPT's schedule as a pure function of the step.

  Linear warmup `lr * (step + 1) / (warmup + 1)` for `step < warmup`, then a
  cosine from `lr` down to `min_lr` at `decay_iters`, then `min_lr`.
  """
  def schedule(step: chex.Numeric) -> chex.Array:
    step = jnp.asarray(step, jnp.float32)
    warm = learning_rate * (step + 1) / (warmup_iters + 1)
    ratio = (step - warmup_iters) / max(decay_iters - warmup_iters, 1)
    cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.clip(ratio, 0.0, 1.0)))
    decayed = min_lr + cosine * (learning_rate - min_lr)
    return jnp.where(step < warmup_iters, warm, decayed)

  return schedule


def warmup_warmdown_schedule(
    learning_rate: float, warmup_iters: int, decay_iters: int, min_lr: float,
    warmdown_frac: float
) -> optax.Schedule:
  """Linear warmup (as `warmup_cosine_schedule`'s), the peak held, then linear decay.

  The decay runs over the last `warmdown_frac` of `decay_iters` steps, from
  `lr` to `min_lr` at `decay_iters`, then holds `min_lr` (nanochat's
  "warmdown", modded-nanogpt's "cooldown").
  """
  start = decay_iters * (1.0 - warmdown_frac)

  def schedule(step: chex.Numeric) -> chex.Array:
    step = jnp.asarray(step, jnp.float32)
    warm = learning_rate * (step + 1) / (warmup_iters + 1)
    done = jnp.clip((step - start) / max(decay_iters - start, 1.0), 0.0, 1.0)
    decayed = learning_rate + done * (min_lr - learning_rate)
    return jnp.where(step < warmup_iters, warm, decayed)

  return schedule


def _needs_end(config) -> None:
  if config.decay_iters is None:
    raise ValueError(f"a {config.schedule} schedule needs decay_iters, the step where it "
                     f"ends.")


def cosine(config, learning_rate: chex.Numeric, min_lr: chex.Numeric) -> optax.Schedule:
  """nanoGPT's: linear warmup, then a cosine to `min_lr` at `decay_iters`."""
  _needs_end(config)
  return warmup_cosine_schedule(learning_rate, config.warmup_iters, config.decay_iters, min_lr)


def warmdown(config, learning_rate: chex.Numeric, min_lr: chex.Numeric) -> optax.Schedule:
  """nanochat's: linear warmup, the peak held, a linear decay over the last `warmdown_frac`."""
  _needs_end(config)
  return warmup_warmdown_schedule(learning_rate, config.warmup_iters, config.decay_iters,
                                  min_lr, config.warmdown_frac)


def constant(config, learning_rate: chex.Numeric, min_lr: chex.Numeric) -> optax.Schedule:
  """The peak rate at every step."""
  del config, min_lr
  return optax.constant_schedule(learning_rate)


# name -> schedule(config, learning_rate, min_lr): the rates are arguments, not read from
# `config`, so a sweep passes each run's (traced) rate and floor.
SCHEDULES: Dict[str, Callable[..., optax.Schedule]] = {
    "cosine": cosine, "warmdown": warmdown, "constant": constant}

"""Dropout, below both its users: the model's residual stream (`gpt.model`) and attention.

    y = dropout(key, x, 0.1, deterministic=False)   # zeros 10% of x, rescales the rest
"""

from typing import Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np


def _is_array(rate: chex.Numeric) -> bool:
  return isinstance(rate, (jax.Array, np.ndarray))


def drops(rate: chex.Numeric, deterministic: bool) -> bool:
  """Whether `dropout` at `rate` draws a mask: not deterministic, and a rate
  that is an array (its value unknown at trace time) or a float above 0."""
  return not deterministic and (_is_array(rate) or rate > 0.0)


def dropout(
    key: Optional[chex.PRNGKey], x: chex.Array, rate: chex.Numeric, *, deterministic: bool
) -> chex.Array:
  """Zeros each element with probability `rate` and rescales the rest.

  Args:
    key: PRNG key; may be None when `deterministic` or `rate == 0.0` (a float).
    x: any array.
    rate: drop probability in [0, 1): a float, or a scalar array (e.g. one
      value per run of a vmapped sweep). A float is checked and a rate of 0
      returns `x` as it is; an array's value is not known at trace time, so
      it is not checked and the mask is always drawn (a rate of 0 keeps every
      element, unscaled). Both give the same values for the same key and rate.
    deterministic: if True (evaluation), returns `x` unchanged and ignores key.

  Returns:
    Array like `x`.
  """
  if not _is_array(rate) and not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout rate must be in [0, 1), got {rate}.")
  if not drops(rate, deterministic):
    return x
  if key is None:
    raise ValueError("dropout needs a PRNG key when deterministic=False; "
                     "pass key=... or deterministic=True.")
  if _is_array(rate):
    chex.assert_rank(rate, 0)
    keep_prob = 1.0 - jnp.asarray(rate, jnp.float32)
    keep = jax.random.bernoulli(key, keep_prob, x.shape)
    return jnp.where(keep, x / keep_prob.astype(x.dtype), jnp.zeros((), x.dtype))
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))

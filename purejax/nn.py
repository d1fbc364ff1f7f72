"""Layers as pure functions over params dicts.

Every layer is a pair: `init_<layer>(key, ...) -> params` builds a dict of
arrays, and `<layer>(params, x, ...)` applies it. Nothing holds state; compose
layers with plain function calls and keep their params in named dicts, so a
model's params read like its architecture (`params["blocks"]["attn"]["w"]`).
"""

from typing import Dict, Optional

import chex
import jax
import jax.numpy as jnp

from purejax.ops import kernels

Params = Dict[str, chex.Array]


# ----------------------------------------------------------------------------
# Dense


def init_dense(
    key: chex.PRNGKey,
    in_dim: int,
    out_dim: int,
    *,
    scale: float = 0.02,
    bias: bool = True,
    dtype=jnp.float32,
) -> Params:
  """Initialises a dense layer: weights ~ N(0, scale^2), biases zero.

  Args:
    key: PRNG key for the weights.
    in_dim: input features.
    out_dim: output features.
    scale: standard deviation of the weights.
    bias: whether to create a bias.
    dtype: dtype of the params.

  Returns:
    `{"w": [in_dim, out_dim]}` plus `{"b": [out_dim]}` when `bias`.
  """
  params = {"w": scale * jax.random.normal(key, (in_dim, out_dim), dtype)}
  if bias:
    params["b"] = jnp.zeros((out_dim,), dtype)
  return params


def dense(params: Params, x: chex.Array, *, compute_dtype=None) -> chex.Array:
  """Applies `x @ w + b` over the last axis of `x`.

  Args:
    params: from `init_dense`.
    x: `[..., in_dim]`.
    compute_dtype: if given, the matmul's operands are cast to this dtype
      (e.g. bfloat16) and the result is float32 (see `kernels.matmul`); params stay
      in their own dtype (mixed precision).

  Returns:
    `[..., out_dim]`: float32 if `compute_dtype` is given, else x's dtype.
  """
  y = kernels.matmul(x, params["w"], compute_dtype=compute_dtype)
  if "b" in params:
    y = y + params["b"].astype(y.dtype)
  return y


# ----------------------------------------------------------------------------
# Layer norm


def init_layer_norm(dim: int, *, bias: bool = True, dtype=jnp.float32) -> Params:
  """Initialises layer norm: scale ones, bias zeros (omitted if not `bias`)."""
  params = {"scale": jnp.ones((dim,), dtype)}
  if bias:
    params["bias"] = jnp.zeros((dim,), dtype)
  return params


def layer_norm(params: Params, x: chex.Array, *, eps: float = 1e-5) -> chex.Array:
  """Normalises the last axis of `x` to zero mean and unit variance.

  The statistics are computed in float32 whatever the input dtype, since
  bfloat16 sums lose precision; the result is cast back to `x.dtype`.

  Args:
    params: from `init_layer_norm`.
    x: `[..., dim]`.
    eps: added to the variance.

  Returns:
    `[..., dim]`, same dtype as `x`.
  """
  chex.assert_axis_dimension(x, -1, params["scale"].shape[0])
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps) * params["scale"]
  if "bias" in params:
    y = y + params["bias"]
  return y.astype(x.dtype)


# ----------------------------------------------------------------------------
# Embedding


def init_embedding(
    key: chex.PRNGKey, num_embeddings: int, dim: int, *, scale: float = 0.02,
    dtype=jnp.float32,
) -> Params:
  """Initialises an embedding table `{"embedding": [num_embeddings, dim]}`."""
  return {"embedding": scale * jax.random.normal(key, (num_embeddings, dim), dtype)}


def embed(params: Params, ids: chex.Array) -> chex.Array:
  """Looks up integer `ids` (any shape) -> `[*ids.shape, dim]`."""
  chex.assert_type(ids, int)
  return jnp.take(params["embedding"], ids, axis=0)


def embedding_logits(params: Params, x: chex.Array, *, compute_dtype=None) -> chex.Array:
  """Projects `[..., dim]` onto the embedding table: `[..., num_embeddings]`.

  This is the output head of a model with tied input/output embeddings.
  `compute_dtype` as in `kernels.matmul`.
  """
  return kernels.matmul(x, params["embedding"].T, compute_dtype=compute_dtype)


# ----------------------------------------------------------------------------
# Dropout and activations


def dropout(
    key: Optional[chex.PRNGKey], x: chex.Array, rate: float, *, deterministic: bool
) -> chex.Array:
  """Zeros each element with probability `rate` and rescales the rest.

  Args:
    key: PRNG key; may be None when `deterministic` or `rate == 0`.
    x: any array.
    rate: drop probability in [0, 1).
    deterministic: if True (evaluation), returns `x` unchanged and ignores key.

  Returns:
    Array like `x`.
  """
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout rate must be in [0, 1), got {rate}.")
  if deterministic or rate == 0.0:
    return x
  if key is None:
    raise ValueError("dropout needs a PRNG key when deterministic=False; "
                     "pass key=... or deterministic=True.")
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))


def relu(x: chex.Array) -> chex.Array:
  return jnp.maximum(x, 0)


def gelu(x: chex.Array) -> chex.Array:
  """GELU with the tanh approximation, as in GPT-2."""
  return jax.nn.gelu(x, approximate=True)


# ----------------------------------------------------------------------------
# Losses and metrics


# Mean cross-entropy of integer labels under logits, in float32.
cross_entropy = kernels.cross_entropy


def accuracy(logits: chex.Array, labels: chex.Array) -> chex.Array:
  """Fraction of positions where `argmax(logits) == labels`."""
  chex.assert_equal_shape_prefix((logits, labels), labels.ndim)
  chex.assert_rank(logits, labels.ndim + 1)
  return jnp.mean(jnp.argmax(logits, axis=-1) == labels)

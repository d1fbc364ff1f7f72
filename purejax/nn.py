"""Layers as pure functions over params dicts.

Every layer is a pair: `init_<layer>(key, ...) -> params` builds a dict of
arrays, and `<layer>(params, x, ...)` applies it. Nothing holds state; compose
layers with plain function calls and keep their params in named dicts, so a
model's params read like its architecture (`params["blocks"]["attn"]["w"]`).
"""

import functools
from typing import Dict, Optional

import chex
import jax
import jax.numpy as jnp

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _low_precision_matmul(x: chex.Array, w: chex.Array, dtype) -> chex.Array:
  """float32 `[n, k] @ [k, m]` computed from `dtype` operands, float32 output."""
  return jnp.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


def _low_precision_matmul_fwd(x, w, dtype):
  xc, wc = x.astype(dtype), w.astype(dtype)
  return jnp.dot(xc, wc, preferred_element_type=jnp.float32), (xc, wc)


def row_major_transpose(a: chex.Array) -> chex.Array:
  """Swaps the last two axes of `a`, writing the data out in row-major order.

  XLA's CPU backend runs a low-precision dot natively only when both operands
  are row-major `[..., m, k] @ [..., k, n]`. A plain transpose becomes a
  layout change, and the dot is then quietly upcast to float32 (3-4x slower
  with AMX-BF16). Splitting the last axis before transposing makes XLA copy
  the data instead. An odd last axis falls back to a plain transpose.
  """
  *lead, rows, cols = a.shape
  if cols % 2:
    return jnp.swapaxes(a, -1, -2)
  split = a.reshape(*lead, rows, cols // 2, 2)
  return jnp.moveaxis(split, -3, -1).reshape(*lead, cols, rows)


def _low_precision_matmul_bwd(dtype, residuals, g):
  # JAX's own transpose of a dot with preferred_element_type would multiply
  # float32 by bfloat16 and round the result to bfloat16; both run at a
  # fraction of the speed of bfloat16 operands with float32 accumulation.
  xc, wc = residuals
  gc = g.astype(dtype)
  dx = jnp.dot(gc, row_major_transpose(wc), preferred_element_type=jnp.float32)
  dw = jnp.dot(row_major_transpose(xc), gc, preferred_element_type=jnp.float32)
  # The barrier stops XLA from folding a later transpose of a gradient (e.g.
  # of the tied output head's `embedding.T`) into these dots: that would
  # recreate a non-row-major low-precision dot after the pass that upcasts
  # such dots, and XLA's CPU runtime cannot execute it.
  return jax.lax.optimization_barrier((dx, dw))


_low_precision_matmul.defvjp(_low_precision_matmul_fwd, _low_precision_matmul_bwd)


def matmul(x: chex.Array, w: chex.Array, *, compute_dtype=None) -> chex.Array:
  """`x @ w` over the last axis of `x`, with optional mixed precision.

  With `compute_dtype` (e.g. bfloat16), the operands of the product and of
  its two gradient products are cast to it, and all three accumulate and
  return float32. CPUs with AMX/AVX512-BF16 (and GPUs) run these 2-3x
  faster than float32 matmuls, while everything around them stays float32.

  Args:
    x: `[..., in_dim]` float.
    w: `[in_dim, out_dim]` float.
    compute_dtype: operand dtype, or None to multiply in the inputs' dtype.

  Returns:
    `[..., out_dim]`: float32 when `compute_dtype` is given, else x's dtype.
  """
  chex.assert_rank(w, 2)
  chex.assert_axis_dimension(x, -1, w.shape[0])
  # A 2-D [rows, in] @ [in, out] product: its weight gradient then contracts
  # over one axis. Contracting over several (batch and time) sends XLA's CPU
  # backend to a slow generic loop instead of its GEMM kernel.
  x2 = x.reshape(-1, x.shape[-1])
  if compute_dtype is None or jnp.dtype(compute_dtype) == jnp.float32:
    y = x2 @ w
  else:
    y = _low_precision_matmul(x2.astype(jnp.float32), w.astype(jnp.float32),
                              jnp.dtype(compute_dtype))
  return y.reshape(*x.shape[:-1], w.shape[-1])


def dense(params: Params, x: chex.Array, *, compute_dtype=None) -> chex.Array:
  """Applies `x @ w + b` over the last axis of `x`.

  Args:
    params: from `init_dense`.
    x: `[..., in_dim]`.
    compute_dtype: if given, the matmul's operands are cast to this dtype
      (e.g. bfloat16) and the result is float32 (see `matmul`); params stay
      in their own dtype (mixed precision).

  Returns:
    `[..., out_dim]`: float32 if `compute_dtype` is given, else x's dtype.
  """
  y = matmul(x, params["w"], compute_dtype=compute_dtype)
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
  `compute_dtype` as in `matmul`.
  """
  return matmul(x, params["embedding"].T, compute_dtype=compute_dtype)


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


def cross_entropy(logits: chex.Array, labels: chex.Array) -> chex.Array:
  """Mean cross-entropy of integer labels under `logits`.

  Computed in float32 through log-softmax, so it is stable for any logits.

  Args:
    logits: `[..., num_classes]`.
    labels: integers `[...]` in `[0, num_classes)`.

  Returns:
    Scalar mean loss.
  """
  chex.assert_equal_shape_prefix((logits, labels), labels.ndim)
  chex.assert_rank(logits, labels.ndim + 1)
  chex.assert_type(labels, int)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  return -jnp.mean(picked)


def accuracy(logits: chex.Array, labels: chex.Array) -> chex.Array:
  """Fraction of positions where `argmax(logits) == labels`."""
  chex.assert_equal_shape_prefix((logits, labels), labels.ndim)
  chex.assert_rank(logits, labels.ndim + 1)
  return jnp.mean(jnp.argmax(logits, axis=-1) == labels)

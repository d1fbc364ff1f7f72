"""Causal softmax attention, in the forms `kernels.select` chooses among.

    y = causal_attention(q, k, v, form="blocked")          # training, evaluation
    y = attend_to_cache(q, k_cache, v_cache, query_start)   # decoding

All forms compute the same function, `softmax(q k^T / sqrt(d) + causal mask) v`
per head, and take plain arguments: nothing here knows a model config.

* "plain": the masked softmax written as the math. The reference the others
  are tested against.
* "blocked": queries in blocks of `block`; block i multiplies only the keys
  up to its own end, so most of the masked upper triangle is never computed
  (10/16 of the scores for 256 positions in blocks of 64). Each block's
  softmax spans all its keys, so it is exact. With a finite mask and a
  written-out softmax, it is the fastest form on XLA's CPU backend.
* "fused": `jax.nn.dot_product_attention`, which is cuDNN's flash attention
  on a GPU in bfloat16/float16 (XLA's own form elsewhere). It has no
  attention dropout, so with dropout on, `causal_attention` runs "plain"
  instead (and says so in its docstring, not at run time).
"""

import math
from typing import Optional

import chex
import jax
import jax.numpy as jnp

from purejax.ops import kernels
from purejax import nn


def _bhtd(x: chex.Array) -> chex.Array:
  return x.transpose(0, 2, 1, 3)  # [b, t, h, d] <-> [b, h, t, d]


def _masked_softmax_attention(q, k, v, query_start, *, key, dropout, deterministic):
  """`[b, h, t, d]` queries at positions `query_start + i` over keys `[b, h, s, d]`."""
  t, s = q.shape[2], k.shape[2]
  scores = jnp.einsum("bhtd,bhsd->bhts", q, k)  # [b, h, t, s]
  causal = jnp.arange(s)[None, :] <= (query_start + jnp.arange(t))[:, None]  # [t, s]
  weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  weights = nn.dropout(key, weights, dropout, deterministic=deterministic)
  return jnp.einsum("bhts,bhsd->bhtd", weights, v)


def _finite_mask_attention(q, k, v, query_start, *, key, dropout, deterministic):
  """As `_masked_softmax_attention`, in the form XLA CPU runs fastest.

  A finite "minus infinity" and a written-out softmax: `jax.nn.softmax` over
  -inf entries ran ~3x slower on XLA CPU (256-token blocks). Every query sees
  at least itself, so no row is all masked. Dropout acts on the unnormalised
  weights, which is the same as on the normalised ones.
  """
  t, s = q.shape[2], k.shape[2]
  scores = jnp.einsum("bhtd,bhsd->bhts", q, k)  # [b, h, t, s]
  causal = jnp.arange(s)[None, :] <= (query_start + jnp.arange(t))[:, None]  # [t, s]
  scores = jnp.where(causal, scores, -1e30)
  unnormalised = jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
  total = unnormalised.sum(-1, keepdims=True)  # [b, h, t, 1]
  unnormalised = nn.dropout(key, unnormalised, dropout, deterministic=deterministic)
  # Normalising the [b, h, t, d] output instead of the [b, h, t, s] weights
  # saves a pass over the larger array.
  return jnp.einsum("bhts,bhsd->bhtd", unnormalised, v) / total


def causal_attention(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    *,
    form: str = "plain",
    block: int = 64,
    dropout: float = 0.0,
    key: Optional[chex.PRNGKey] = None,
    deterministic: bool = True,
    compute_dtype=None,
) -> chex.Array:
  """Causal self-attention: position t attends to positions <= t.

  Args:
    q, k, v: `[batch, time, heads, head_dim]` (unscaled queries).
    form: "plain", "blocked" or "fused" (see the module docstring); "fused"
      runs "plain" when dropout is on, since the fused kernels have none.
    block: queries per block of the "blocked" form.
    dropout: drop rate of the attention weights.
    key: dropout key (unused when deterministic).
    deterministic: disables dropout.
    compute_dtype: operand dtype of the "fused" form (cuDNN needs bfloat16 or
      float16); the other forms multiply in float32, since attention is a
      small share of the FLOPs at the contexts they serve.

  Returns:
    `[batch, time, heads, head_dim]`, in q's dtype.
  """
  chex.assert_rank((q, k, v), 4)
  chex.assert_equal_shape((q, k, v))
  if form not in kernels.ATTENTION_FORMS:
    raise ValueError(f"attention form {form!r} is not one of {kernels.ATTENTION_FORMS}.")
  dropping = not deterministic and dropout > 0.0
  if form == "fused" and not dropping:
    dtype = q.dtype if compute_dtype is None else jnp.dtype(compute_dtype)
    y = jax.nn.dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                                     is_causal=True)
    return y.astype(q.dtype)
  scale = 1.0 / math.sqrt(q.shape[-1])
  q, k, v = _bhtd(q * scale), _bhtd(k), _bhtd(v)  # [b, h, t, d]
  drop = dict(dropout=dropout, deterministic=deterministic)
  if form != "blocked":
    return _bhtd(_masked_softmax_attention(q, k, v, 0, key=key, **drop))
  t = q.shape[2]
  blocks = []
  for i, start in enumerate(range(0, t, block)):
    stop = min(start + block, t)
    block_key = jax.random.fold_in(key, i) if dropping else None
    blocks.append(_finite_mask_attention(q[:, :, start:stop], k[:, :, :stop],
                                         v[:, :, :stop], start, key=block_key, **drop))
  return _bhtd(jnp.concatenate(blocks, axis=2))


def attend_to_cache(
    q: chex.Array, k: chex.Array, v: chex.Array, query_start: chex.Numeric
) -> chex.Array:
  """Queries at positions `query_start, ...` over a cache of keys and values.

  Args:
    q: `[batch, heads, time, head_dim]` queries, already scaled by
      `1/sqrt(head_dim)`.
    k, v: `[batch, heads, cache_len, head_dim]`, key `s` at position `s`;
      slots past the queries' positions are masked out, whatever they hold.
    query_start: position of `q[:, :, 0]` (may be traced).

  Returns:
    `[batch, heads, time, head_dim]`.
  """
  if q.shape[2] == 1:
    # One query (a decoding step): here the plain softmax compiles to the
    # faster program (sampling ran ~8% slower with the finite-mask form).
    return _masked_softmax_attention(q, k, v, query_start, key=None, dropout=0.0,
                                     deterministic=True)
  return _finite_mask_attention(q, k, v, query_start, key=None, dropout=0.0,
                                deterministic=True)

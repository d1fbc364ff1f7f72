"""Causal softmax attention, in the forms `kernels.select` chooses among.

    y = causal_attention(q, k, v, form="blocked")          # training, evaluation
    y = attend_with_cache(q, k_cache, v_cache, starts)     # decoding, through a KV cache

All forms compute the same function, `softmax(q k^T / sqrt(d) + causal mask) v`
per head, and take plain arguments: nothing here knows a model config.

* "plain": the masked softmax written as the math, in float32. The reference
  the others are tested against.
* "blocked": queries in blocks of `block`; block i multiplies only the keys
  up to its own end, so most of the masked upper triangle is never computed
  (10/16 of the scores for 256 positions in blocks of 64). Each block's
  softmax spans all its keys, so it is exact. With a finite mask and a
  written-out softmax, it is the fastest form on XLA's CPU backend. With
  fewer key/value heads than query heads, each key/value head's queries
  are multiplied as one taller block, the keys not repeated. Its two
  products take `compute_dtype` operands (float32 accumulation); the
  softmax is float32.
* "xla": the plain form with its two products in `compute_dtype` (float32
  accumulation, `batched_matmul`, also in the backward pass) and the
  softmax and dropout in float32. It holds the whole `[batch, head, time,
  time]` scores; it is the GPU's form where cuDNN's is not, e.g. with
  attention dropout.
* "cudnn": cuDNN's flash attention, asked for explicitly
  (`jax.nn.dot_product_attention(..., implementation="cudnn")`): the scores
  never exist in memory. It takes bfloat16/float16 operands, head sizes
  that are multiples of 8 up to 128, and no dropout; anything else runs the
  "xla" form, and says so once in the log (`cudnn_unsupported` gives the
  reason). It lowers only for CUDA; `tests/test_gpu_lowering.py` reads the
  program it builds (no GPU timing of it is recorded).
"""

import functools
import logging
import math
from typing import Callable, NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from purejax.ops import dropout as dropout_lib
from purejax.ops import kernels
from purejax.ops.matmul import batched_matmul


def _bhtd(x: chex.Array) -> chex.Array:
  return x.transpose(0, 2, 1, 3)  # [b, t, h, d] <-> [b, h, t, d]


def _visible(key_positions: chex.Array, positions: chex.Array,
             window: Optional[int]) -> chex.Array:
  """`[t, s]`: which keys at `key_positions` `[s]` queries at `positions` `[t]` see.

  Causal: keys at or before the query; with `window`, only the last `window`
  of them (the query's own included). Ring-buffer slots not yet written
  have negative positions (`window` set), never seen.
  """
  visible = key_positions[None, :] <= positions[:, None]
  if window is not None:
    visible &= (key_positions[None, :] > positions[:, None] - window) & (
        key_positions[None, :] >= 0)
  return visible


def _capped(scores: chex.Array, softcap: Optional[float]) -> chex.Array:
  """`softcap * tanh(scores / softcap)` (Gemma 2's attention soft-cap), or the scores."""
  return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _masked_softmax_attention(q, k, v, positions, *, key, dropout, deterministic,
                              window=None, softcap=None, key_positions=None):
  """`[b, h, t, d]` queries at `positions` `[t]` over keys `[b, h, s, d]` at `key_positions`
  (`0, 1, ...` when None)."""
  s = k.shape[2]
  scores = _capped(jnp.einsum("bhtd,bhsd->bhts", q, k), softcap)  # [b, h, t, s]
  key_positions = jnp.arange(s) if key_positions is None else key_positions
  causal = _visible(key_positions, positions, window)  # [t, s]
  weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  weights = dropout_lib.dropout(key, weights, dropout, deterministic=deterministic)
  return jnp.einsum("bhts,bhsd->bhtd", weights, v)


def _finite_mask_softmax_parts(scores: chex.Array, positions: chex.Array,
                               key_positions: Optional[chex.Array] = None,
                               window: Optional[int] = None):
  """The causal softmax of `[..., t, s]` scores of queries at `positions` `[t]`, unnormalised.

  Keys are at `key_positions` `[s]` (`0, 1, ...` when None), seen within
  `window` (`_visible`). Returns the unnormalised weights and their
  `[..., t, 1]` sums.
  """
  if key_positions is None:
    key_positions = jnp.arange(scores.shape[-1])
  causal = _visible(key_positions, positions, window)  # [t, s]
  scores = jnp.where(causal, scores, -1e30)
  unnormalised = jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
  return unnormalised, unnormalised.sum(-1, keepdims=True)


def _key_range(start: int, window: Optional[int], block: int) -> int:
  """Where the keys of the query block starting at `start` begin: 0 without a window,
  else the start of the key block holding the first key its first query sees (whole
  blocks: XLA's CPU products ran faster than on ragged key ranges, 89 against 96 ms
  for T=1024, a 128 window, blocks of 64)."""
  return 0 if window is None else max(0, (start - window + 1) // block * block)


class _BlockProducts(NamedTuple):
  """The blocked form's two products, over heads `[b, h, t, *]` or grouped heads `[b, g, r, t, *]`.

  scores: queries `[..., t, d]` x keys `[b, h | g, s, d]` -> `[..., t, s]` float32.
  mix: weights `[..., t, s]` x values `[b, h | g, s, d]` -> `[..., t, d]` float32.
  """
  scores: Callable[[chex.Array, chex.Array], chex.Array]
  mix: Callable[[chex.Array, chex.Array], chex.Array]


_HEAD_EINSUMS = _BlockProducts(lambda q, k: jnp.einsum("bhtd,bhsd->bhts", q, k),
                               lambda w, v: jnp.einsum("bhts,bhsd->bhtd", w, v))
_GROUPED_EINSUMS = _BlockProducts(lambda q, k: jnp.einsum("bgrtd,bgsd->bgrts", q, k),
                                  lambda w, v: jnp.einsum("bgrts,bgsd->bgrtd", w, v))


def _block_products(compute_dtype, forms, grouped: bool) -> _BlockProducts:
  """float32 einsums, or `batched_matmul`s of `compute_dtype` operands.

  A low-precision product multiplies a key head's `r * t` query rows as one
  `[r * t, d]` matrix (float32 accumulation, float32 out), so its weight
  gradient is a plain batched product too; `forms` chooses the backward form
  as for the dense layers (on the CPU, row-major operands: bf16 attention
  forward and backward of SmolLM2-135M's shape ran 12.4 against 17.6 ms a
  layer in float32).
  """
  if compute_dtype is None or jnp.dtype(compute_dtype) == jnp.float32:
    return _GROUPED_EINSUMS if grouped else _HEAD_EINSUMS
  matmul = functools.partial(batched_matmul, compute_dtype=compute_dtype, forms=forms)

  def rows(a):  # [b, g, r, t, n] -> [b, g, r * t, n]; [b, h, t, n] as it is
    return a.reshape(*a.shape[:2], -1, a.shape[-1])

  def scores(q, k):
    return matmul(rows(q), jnp.swapaxes(k, -1, -2)).reshape(*q.shape[:-1], k.shape[-2])

  def mix(weights, v):
    return matmul(rows(weights), v).reshape(*weights.shape[:-1], v.shape[-1])

  return _BlockProducts(scores, mix)


def _finite_mask_attention(q, k, v, positions, *, key, dropout, deterministic,
                           products: _BlockProducts, key_positions=None, window=None,
                           softcap=None):
  """As `_masked_softmax_attention`, in the form XLA CPU runs fastest.

  A finite "minus infinity" and a written-out softmax: `jax.nn.softmax` over
  -inf entries ran ~3x slower on XLA CPU (256-token blocks). Every query sees
  at least itself, so no row is all masked. Dropout acts on the unnormalised
  weights, which is the same as on the normalised ones. `products`:
  `_block_products` of heads. Keys at `key_positions` (`0, 1, ...` when
  None) within `window`; `softcap` as `causal_attention`'s.
  """
  scores = _capped(products.scores(q, k), softcap)  # [b, h, t, s]
  unnormalised, total = _finite_mask_softmax_parts(  # total: [b, h, t, 1]
      scores, positions, key_positions, window)
  unnormalised = dropout_lib.dropout(key, unnormalised, dropout, deterministic=deterministic)
  # Normalising the [b, h, t, d] output instead of the [b, h, t, s] weights
  # saves a pass over the larger array.
  return products.mix(unnormalised, v) / total


def _grouped_blocked_attention(q, k, v, *, block, key, dropout, deterministic,
                               products: _BlockProducts, window=None, softcap=None):
  """The "blocked" form for grouped-query attention, keys and values not repeated.

  A key/value head's query heads are one block's rows: its products are
  `[group * block, d] x [d, s]`, a third as many and three times as tall as
  the repeated form's for three query heads a key (SmolLM2), which XLA's CPU
  backend runs faster (attention forward and backward of SmolLM2-135M's
  shape: 19.8 against 24.5 ms a layer). The same function, and with dropout
  the same masks, as the repeated form.

  Args:
    q: `[b, t, h, d]` scaled queries.
    k, v: `[b, s, g, d]`, `g` dividing `h`.
    products: `_block_products` of grouped heads.
  """
  b, t, h, d = q.shape
  g = k.shape[2]
  q = q.reshape(b, t, g, h // g, d).transpose(0, 2, 3, 1, 4)  # [b, g, h/g, t, d]
  k, v = _bhtd(k), _bhtd(v)  # [b, g, s, d]
  dropping = dropout_lib.drops(dropout, deterministic)
  blocks = []
  for i, start in enumerate(range(0, t, block)):
    stop = min(start + block, t)
    first = _key_range(start, window, block)  # keys before it are outside every query's window
    scores = _capped(products.scores(q[:, :, :, start:stop], k[:, :, first:stop]), softcap)
    unnormalised, total = _finite_mask_softmax_parts(
        scores, jnp.arange(start, stop), None if window is None else jnp.arange(first, stop),
        window)
    if dropping:  # the repeated form's masks: drawn over [b, h, t, s], head i in group i // (h/g)
      unnormalised = dropout_lib.dropout(
          jax.random.fold_in(key, i), unnormalised.reshape(b, h, stop - start, stop - first),
          dropout, deterministic=deterministic).reshape(unnormalised.shape)
    blocks.append(products.mix(unnormalised, v[:, :, first:stop]) / total)
  y = jnp.concatenate(blocks, axis=3)  # [b, g, h/g, t, d]
  return y.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def cudnn_unsupported(shape: Tuple[int, ...], dtype, dropping: bool,
                      softcap: Optional[float] = None) -> Optional[str]:
  """Why cuDNN's flash attention cannot run `[batch, time, heads, head_dim]` operands, or None.

  The limits are those JAX checks before calling cuDNN
  (`jax/_src/cudnn/fused_attention_stablehlo.py`), taken on every GPU
  generation: head_dim a multiple of 8 and at most 128 (Hopper takes 256),
  bfloat16 or float16 operands. `jax.nn.dot_product_attention` exposes no
  dropout.
  """
  head_dim = shape[-1]
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"it needs bfloat16 or float16 operands, not {jnp.dtype(dtype).name}"
  if head_dim % 8 or head_dim > 128:
    return f"it needs a head size that is a multiple of 8 up to 128, not {head_dim}"
  if dropping:
    return "jax.nn.dot_product_attention has no attention dropout"
  if softcap is not None:
    return "jax.nn.dot_product_attention has no attention soft-cap"
  return None


@functools.lru_cache(maxsize=None)
def _say_once(message: str) -> None:
  logging.getLogger(__name__).warning(message)


def _xla_attention(q, k, v, *, compute_dtype, key, dropout, deterministic, window=None,
                   softcap=None):
  """`[b, h, t, d]` causal attention with products in `compute_dtype`, softmax in float32."""
  t = q.shape[2]
  # Plain transposes in the backward pass: this is a GPU form.
  matmul = functools.partial(batched_matmul, compute_dtype=compute_dtype,
                             forms=kernels.Forms())
  scores = _capped(matmul(q, jnp.swapaxes(k, -1, -2)).astype(jnp.float32),  # [b, h, t, t]
                   softcap)
  causal = (jnp.tril(jnp.ones((t, t), bool)) if window is None else
            _visible(jnp.arange(t), jnp.arange(t), window))
  weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  weights = dropout_lib.dropout(key, weights, dropout, deterministic=deterministic)
  return matmul(weights, v)


def repeat_kv(x: chex.Array, heads: int) -> chex.Array:
  """`[batch, time, kv_heads, head_dim]` with each head repeated to `heads` heads in all."""
  return x if x.shape[2] == heads else jnp.repeat(x, heads // x.shape[2], axis=2)


def causal_attention(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    *,
    form: str = "plain",
    block: int = 64,
    dropout: chex.Numeric = 0.0,
    key: Optional[chex.PRNGKey] = None,
    deterministic: bool = True,
    compute_dtype=None,
    forms: Optional[kernels.Forms] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    scale: Optional[float] = None,
) -> chex.Array:
  """Causal self-attention: position t attends to positions <= t (within `window`).

  Grouped-query attention: `k` and `v` may have fewer heads than `q`, a
  divisor of them; query head `i` then reads key/value head
  `i // (heads // kv_heads)` (Hugging Face's `repeat_kv` order). cuDNN reads
  the grouped heads as they are; the other forms repeat them.

  Args:
    q: `[batch, time, heads, head_dim]` unscaled queries.
    k, v: `[batch, time, kv_heads, head_dim]`.
    form: one of `kernels.ATTENTION_FORMS` (see the module docstring);
      "cudnn" runs "xla" where cuDNN does not apply (`cudnn_unsupported`).
    block: queries per block of the "blocked" form (with a window, blocks
      as wide as the window, up to twice this).
    dropout: drop rate of the attention weights: a float, or a scalar array
      (`dropout.dropout`), which always counts as dropping.
    key: dropout key (unused when deterministic).
    deterministic: disables dropout.
    compute_dtype: operand dtype of the "blocked", "xla" and "cudnn" forms'
      products (float32 accumulation; None: q's dtype); "plain", the
      reference, multiplies in float32.
    forms: the low-precision products' backward form (`Forms.matmul_backward`,
      as `batched_matmul` takes it); None: the plain form.
    window: None, or sliding-window attention: position t attends to
      `t - window + 1 .. t` only. The blocked form then multiplies only the
      keys inside its blocks' windows, so its cost falls with the window;
      cuDNN takes it as `local_window_size`.
    softcap: None, or `c` in `c * tanh(scores / c)` on the scaled scores
      (Gemma 2); cuDNN does not take it (the "xla" form runs).
    scale: the queries' scale; None: `1 / sqrt(head_dim)`.

  Returns:
    `[batch, time, heads, head_dim]`, in q's dtype.
  """
  chex.assert_rank((q, k, v), 4)
  chex.assert_equal_shape((k, v))
  chex.assert_equal_shape_prefix((q, k), 2)
  if form not in kernels.ATTENTION_FORMS:
    raise ValueError(f"attention form {form!r} is not one of {kernels.ATTENTION_FORMS}.")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"{k.shape[2]} key/value heads do not divide {q.shape[2]} query heads.")
  dropping = dropout_lib.drops(dropout, deterministic)
  if window is not None and (not isinstance(window, int) or window < 1):
    raise ValueError(f"attention window must be a positive integer or None, got {window!r}.")
  dtype = q.dtype if compute_dtype is None else jnp.dtype(compute_dtype)
  if form == "cudnn":
    reason = cudnn_unsupported(q.shape, dtype, dropping, softcap)
    if reason is None:
      y = jax.nn.dot_product_attention(
          q.astype(dtype), k.astype(dtype), v.astype(dtype), scale=scale, is_causal=True,
          local_window_size=None if window is None else (window - 1, 0),
          implementation="cudnn")
      return y.astype(q.dtype)
    _say_once(f"attention: cuDNN's fused attention does not apply ({reason}); running "
              f"the 'xla' form, which holds the [batch, head, time, time] scores.")
    form = "xla"
  drop = dict(dropout=dropout, deterministic=deterministic)
  masks = dict(window=window, softcap=softcap)
  if window is not None:
    # Query blocks as wide as the window, up to twice `block`: fewer, larger products
    # (T=1024, a 128 window, forward and backward on this CPU: 51 ms in blocks of 128,
    # 60 in blocks of 64, 76 in blocks of 256).
    block = min(max(block, window), 2 * block)
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  if form == "blocked" and k.shape[2] < q.shape[2]:
    return _grouped_blocked_attention(
        q * scale, k, v, block=block, key=key,
        products=_block_products(compute_dtype, forms, grouped=True), **drop, **masks)
  k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
  q, k, v = _bhtd(q * scale), _bhtd(k), _bhtd(v)  # [b, h, t, d]
  if form == "xla":
    y = _xla_attention(q, k, v, compute_dtype=compute_dtype, key=key, **drop, **masks)
    return _bhtd(y).astype(q.dtype)
  if form == "plain":
    return _bhtd(_masked_softmax_attention(q, k, v, jnp.arange(q.shape[2]), key=key, **drop,
                                           **masks))
  t = q.shape[2]
  products = _block_products(compute_dtype, forms, grouped=False)
  blocks = []
  for i, start in enumerate(range(0, t, block)):
    stop = min(start + block, t)
    first = _key_range(start, window, block)  # keys before it are outside every query's window
    block_key = jax.random.fold_in(key, i) if dropping else None
    blocks.append(_finite_mask_attention(
        q[:, :, start:stop], k[:, :, first:stop], v[:, :, first:stop], jnp.arange(start, stop),
        key=block_key, products=products,
        key_positions=None if window is None else jnp.arange(first, stop), **drop, **masks))
  return _bhtd(jnp.concatenate(blocks, axis=2))


# Cache slots read per block by `attend_with_cache`.
CACHE_BLOCK = 128


def ring_positions(last: chex.Array, size: int) -> chex.Array:
  """`[..., size]`: the position each slot of a ring of `size` slots holds once positions
  `0 .. last` are written (slot `s` holds the latest `p <= last` with `p % size == s`;
  negative: not written yet). `last` is `[...]`, one a row."""
  last = jnp.asarray(last)[..., None]
  return last - jnp.mod(last - jnp.arange(size), size)


def attend_with_cache(
    q: chex.Array, k_cache: chex.Array, v_cache: chex.Array, starts: chex.Array, *,
    rows: Optional[chex.Array] = None, own: Optional[Tuple[chex.Array, chex.Array]] = None,
    ring_last: Optional[chex.Array] = None, window: Optional[int] = None,
    softcap: Optional[float] = None, compute_dtype=None,
) -> chex.Array:
  """Queries of several rows, each at its own positions, over a KV cache.

  The one attention of decoding: a prompt's chunk, a decoding step and a
  batch of either all go through it. Row `b`'s queries are at positions
  `starts[b], starts[b] + 1, ...` and see the keys of its cache row at
  positions up to their own (and, with `window`, above `position - window`).
  The cache is read in blocks of `CACHE_BLOCK` slots, only those below the
  furthest query, with an online softmax: a block none of a row's queries
  sees adds exactly nothing to it, so a row's output does not depend on
  which rows run beside it (a request decoded in a full batch gives the bits
  it gives alone).

  A cache of fewer key/value heads than query heads (grouped-query attention)
  is read as it is: each key/value head's group of query heads becomes more
  rows of one product.

  Args:
    q: `[batch, heads, time, head_dim]` queries, already scaled.
    k_cache, v_cache: `[cache_rows, kv_heads, slots, head_dim]`; slot `s` holds
      position `s` (or, with `ring_last`, a ring's position).
    starts: `[batch]` int: the position of each row's first query.
    rows: optional `[batch]` int: the cache row each query row reads (None: row
      `b` reads cache row `b`).
    own: optional `(k, v)` `[batch, kv_heads, time, head_dim]`: the queries' own
      keys and values, not yet in the cache, which then holds positions before
      `starts` only (a decoding step reads the cache as it was and its own key
      apart, so XLA writes the step's slot in place afterwards).
    ring_last: optional `[batch]` int: the cache is a ring buffer (a sliding
      window layer's) holding positions up to `ring_last[b]` (`ring_positions`).
    window: None, or the sliding window (`causal_attention`'s).
    softcap: None, or the attention soft-cap (`causal_attention`'s).
    compute_dtype: operand dtype of the two products (float32 accumulation,
      softmax in float32); None multiplies in float32.

  Returns:
    `[batch, heads, time, head_dim]` float32.
  """
  b, h, t, d = q.shape
  kv, size = k_cache.shape[1], k_cache.shape[2]
  g = h // kv
  dtype = jnp.float32 if compute_dtype is None else compute_dtype
  product = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  q = q.reshape(b, kv, g * t, d).astype(dtype)  # a key/value head's query heads are its rows
  positions = jnp.tile(starts[:, None] + jnp.arange(t), (1, g))  # [b, g * t]
  limit = starts if own is not None else starts + t - 1  # the furthest key a row may read

  def seen(key_positions):  # [b, s] -> [b, 1, g * t, s]
    ok = (key_positions[:, None, :] <= positions[:, :, None]) & (key_positions >= 0)[:, None]
    if own is not None:
      ok &= (key_positions < starts[:, None])[:, None]
    if window is not None:
      ok &= key_positions[:, None, :] > positions[:, :, None] - window
    return ok[:, None]

  def absorb(carry, scores, values):
    """The online softmax's state after `scores` `[b, kv, rows, s]` (-inf: unseen)."""
    high, total, out = carry  # running max, sum of weights, weighted values
    new_high = jnp.maximum(high, scores.max(-1))
    base = jnp.where(new_high == -jnp.inf, 0.0, new_high)  # no key seen yet: weights 0
    weights = jnp.exp(scores - base[..., None])
    kept = jnp.exp(high - base)
    return (new_high, total * kept + weights.sum(-1),
            out * kept[..., None] + product("bgrs,bgsd->bgrd", weights.astype(dtype),
                                            values.astype(dtype)))

  carry = (jnp.full((b, kv, g * t), -jnp.inf), jnp.zeros((b, kv, g * t)),
           jnp.zeros((b, kv, g * t, d)))
  if own is not None:
    k_own, v_own = own
    own_positions = starts[:, None] + jnp.arange(t)
    mask = (own_positions[:, None, :] <= positions[:, :, None])  # [b, g * t, t]
    if window is not None:
      mask &= own_positions[:, None, :] > positions[:, :, None] - window
    scores = _capped(product("bgrd,bgsd->bgrs", q, k_own.astype(dtype)), softcap)
    carry = absorb(carry, jnp.where(mask[:, None], scores, -jnp.inf), v_own)

  block = min(CACHE_BLOCK, size)
  cache_rows = k_cache.shape[0]

  def read(cache, lo):  # [b, kv, block, d]: each row's slots lo .. lo + block
    if rows is None and cache_rows == b:
      return jax.lax.dynamic_slice_in_dim(cache, lo, block, axis=2)
    index = jnp.arange(b) if rows is None else jnp.clip(rows, 0, cache_rows - 1)
    return jax.vmap(lambda r: jax.lax.dynamic_slice(cache, (r, 0, lo, 0),
                                                    (1, kv, block, d))[0])(index)

  def one_block(i, carry):
    lo = jnp.minimum(i * block, size - block)  # the last block ends at the cache's end
    slots = lo + jnp.arange(block)
    if ring_last is None:
      key_positions = jnp.broadcast_to(slots, (b, block))
    else:
      key_positions = jnp.take(ring_positions(ring_last, size), slots, axis=1)
    mask = seen(key_positions) & (slots >= i * block)[None, None, None]  # each slot once
    scores = _capped(product("bgrd,bgsd->bgrs", q, read(k_cache, lo).astype(dtype)), softcap)
    return absorb(carry, jnp.where(mask, scores, -jnp.inf), read(v_cache, lo))

  furthest = jnp.minimum(jnp.max(limit) + 1, size)  # slots that may hold a seen key
  _, total, out = jax.lax.fori_loop(0, (furthest + block - 1) // block, one_block, carry)
  return (out / total[..., None]).reshape(b, h, t, d)

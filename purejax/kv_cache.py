"""The KV cache: keys and values of past positions, and a GPT run through it.

    cache = kv_cache.init_kv_cache(config, batch=1, length=256)
    logits, cache = kv_cache.forward(kv_cache.layers_of(params, config), params,
                                     tokens, cache, pos, config, forms)

The pieces `purejax.decode` samples with: the cache pytree, the model's
blocks attending through it, and the sliding-window policy for context
beyond `block_size`. Everything here is a pure function of a cache in and
a cache out.
"""

import math
from typing import NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from purejax import gpt
from purejax.ops import attention
from purejax.ops import kernels

Params = gpt.Params


class KVCache(NamedTuple):
  """Keys and values of past positions: one `[batch * kv_heads, length, head_dim]` array per layer.

  Only the key/value heads are cached: with grouped-query attention
  (`GPTConfig.n_kv_head`) the cache takes `n_kv_head / n_head` of the memory
  a cache of every head would (a quarter for Llama 3 8B's 8 of 32 heads).

  A sliding-window layer (`GPTConfig.layer_kinds`) keeps only its last
  `min(window, length)` positions, a ring buffer (position `p` in slot
  `p % size`), so past the window a long context's memory grows only in
  the global layers.

  Batch and head share one axis because that is the layout XLA's batched
  matmul wants: with `[batch, head, ...]` arrays XLA fused the cache update
  into a reshape for the attention product as well as into the loop's
  output, so it wrote the cache twice and copied all of it three times per
  token.
  """
  k: Tuple[chex.Array, ...]
  v: Tuple[chex.Array, ...]


def _cache_layer_shape(config: gpt.GPTConfig, batch: int, length: int) -> Tuple[int, int, int]:
  return (batch * config.kv_heads, length, config.head_dim)


def layer_lengths(config: gpt.GPTConfig, length: int) -> Tuple[int, ...]:
  """Each layer's slots in a cache of `length` positions: a sliding-window layer's ring
  holds `min(window, length)`, a global layer `length`."""
  return tuple(min(config.window, length) if kind else length for kind in config.layer_kinds)


def cache_length(cache: KVCache, config: Optional[gpt.GPTConfig] = None) -> int:
  """Positions the cache has room for (static: its arrays' shapes).

  A model whose layers all slide (`config` needed to tell) has room for its
  whole context once its rings hold a window: older positions are dropped
  as the model drops them.
  """
  if config is None or 0 in config.layer_kinds:
    return cache.k[config.layer_kinds.index(0) if config else 0].shape[1]
  size = cache.k[0].shape[1]
  return config.block_size if size >= config.window else size


def init_kv_cache(config: gpt.GPTConfig, batch: int, length: Optional[int] = None) -> KVCache:
  """An empty (zero) cache for `batch` sequences of up to `length` positions.

  Each decoded token reads every slot of the cache, so a cache no longer
  than the call needs is faster: `generate` sizes it to prompt plus new
  tokens. `length` defaults to the model's context, `block_size`.
  """
  length = config.block_size if length is None else length
  if not 1 <= length <= config.block_size:
    raise ValueError(f"a KV cache of {length} positions; give 1 to block_size="
                     f"{config.block_size}.")
  # Separate arrays for keys and values: a cache donated to XLA (decode.step)
  # must not hold one buffer twice.
  zeros = lambda: tuple(jnp.zeros(_cache_layer_shape(config, batch, n), jnp.float32)
                        for n in layer_lengths(config, length))
  return KVCache(zeros(), zeros())


def grow_cache(cache: KVCache, length: int, config: Optional[gpt.GPTConfig] = None
               ) -> KVCache:
  """`cache` with room for `length` positions (its own kept, new slots zero).

  With `config` (needed for sliding-window layers), a ring shorter than
  the window grows too: until it first fills, position `p` is in slot `p`,
  so padding its end keeps every slot where `p % size` finds it.
  """
  if length < cache_length(cache, config):
    raise ValueError(f"grow_cache to {length} positions, fewer than the cache's "
                     f"{cache_length(cache, config)}.")
  sizes = (layer_lengths(config, length) if config is not None
           else (length,) * len(cache.k))
  pad = lambda a, n: jnp.pad(a, ((0, 0), (0, n - a.shape[1]), (0, 0)))
  return KVCache(tuple(map(pad, cache.k, sizes)), tuple(map(pad, cache.v, sizes)))


def check_cache(cache: KVCache, config: gpt.GPTConfig, batch: int) -> None:
  length = (cache.k[config.layer_kinds.index(0)].shape[1] if cache.k and 0 in config.layer_kinds
            else cache.k[0].shape[1] if cache.k else config.block_size)
  want = KVCache(*[tuple(_cache_layer_shape(config, batch, n)
                         for n in layer_lengths(config, length))] * 2)
  got = jax.tree.map(jnp.shape, cache)
  if got != want or length > config.block_size:
    raise ValueError(f"KV cache of shapes {got}, but this config and batch need "
                     f"{config.n_layer} layers of {_cache_layer_shape(config, batch, 'length')} "
                     f"(length <= {config.block_size}; a sliding-window layer's at most the "
                     f"window); build it with init_kv_cache(config, batch).")


def layers_of(params: Params, config: gpt.GPTConfig) -> Tuple[Params, ...]:
  """Each layer's params, sliced from the stacked `params["blocks"]` (static slices).

  Decoding runs the layers as an unrolled loop. Sliced inside the decode
  loop, XLA copies each layer's weights for every token (that was most of
  the time per token), so the decode loops slice once, before the loop.
  With a low-precision `config.matmul_dtype` the dense weights (`w`, which
  only the products read, and they cast them to it) are cast here too, so
  the slices are held in it: GPT-2 124M's decode program planned 0.39 GiB of
  temporaries for an H100 with float32 slices, about all its block weights
  again. The products see the same values.
  """
  compute_dtype = config.matmul_dtype
  low = compute_dtype is not None and jnp.dtype(compute_dtype) != jnp.float32

  def layer_leaf(path, p, i):
    name = getattr(path[-1], "key", None)
    return p[i].astype(compute_dtype) if low and name == "w" else p[i]

  return tuple(jax.tree_util.tree_map_with_path(lambda path, p, i=i: layer_leaf(path, p, i),
                                                params["blocks"]) for i in range(config.n_layer))


def with_head_matrix(params: Params) -> Params:
  """`params` whose tied output head is also held as its own `[embd, vocab]` matrix
  (`"lm_head"`, as an untied model's): the same logits, from a matrix laid out for them.

  The logits of a few tokens are one product with the `[vocab, embd]`
  embedding table, and XLA's CPU backend transposed the whole table for it
  on each call: SmolLM2-135M's head took 72 ms for one row's logits, 4 ms
  from the transposed matrix. A program called once a token or a prompt
  chunk (`decode.step`, `engine`) pays that every call, so their callers
  transpose once. The matrix takes the table's memory again.
  """
  table = params["wte"]["embedding"]
  if "lm_head" in params or not isinstance(table, jax.Array):
    return params
  return {**params, "lm_head": {"w": jnp.transpose(table)}}


def _cached_attend(k_buf: chex.Array, v_buf: chex.Array, pos: chex.Numeric,
                   config: gpt.GPTConfig, forms: kernels.Forms,
                   key_start: Optional[chex.Array] = None) -> gpt.Attend:
  """`gpt.Attend` for tokens at positions `pos, ...` through one layer's cache.

  Their keys and values are written into the cache, and they attend to
  every cached position up to their own; it carries out the updated
  `(k_buf, v_buf)`. At a static `pos == 0` (a prompt or a refill) the cache
  before them is empty, so with the "cudnn" form they attend among
  themselves through cuDNN, as in training. One-token steps read the cache
  with XLA's products: a single query has no `[time, time]` scores to
  avoid, and the work is one pass over the cache.
  """
  kv, d = config.kv_heads, config.head_dim
  # The GPU's forms multiply in the compute dtype; the CPU's in float32.
  low_precision = forms.attention in ("xla", "cudnn")
  compute_dtype = config.matmul_dtype if low_precision else None
  scale = config.attn_scale

  def attend(q, k, v):
    b, t = q.shape[:2]
    k_new, v_new = (a.transpose(0, 2, 1, 3) for a in (k, v))  # [b, kv, t, d]
    # Keys and values come out of the products in the forms' matmul_output
    # dtype; the cache keeps its own.
    written = lambda k_new, v_new: tuple(
        _write(buf, new.reshape(b * kv, t, d).astype(buf.dtype), pos, kv)
        for buf, new in ((k_buf, k_new), (v_buf, v_new)))
    if forms.attention == "cudnn" and isinstance(pos, int) and pos == 0 and key_start is None:
      y = attention.causal_attention(q, k, v, form="cudnn", compute_dtype=compute_dtype,
                                     softcap=config.attn_softcap, scale=scale)
      return y, written(k_new, v_new)
    q = q.transpose(0, 2, 1, 3)  # [b, h, t, d]
    # The model's own scale, as a Python float: the same program as before for 1/sqrt(d).
    q = q * (1.0 / math.sqrt(d) if config.attn_scalar is None else scale)
    masks = dict(compute_dtype=compute_dtype, key_start=key_start, softcap=config.attn_softcap)
    if t == 1:  # a decoding step: see `_written_after`
      y = attention.attend_to_cache_and_own(
          q, k_buf.reshape(b, kv, -1, d), v_buf.reshape(b, kv, -1, d), k_new[:, :, 0],
          v_new[:, :, 0], pos, **masks)
      return y.transpose(0, 2, 1, 3), written(*_written_after(y, k_new, v_new))
    new_k_buf, new_v_buf = written(k_new, v_new)
    y = attention.attend_to_cache(q, new_k_buf.reshape(b, kv, -1, d),
                                  new_v_buf.reshape(b, kv, -1, d), pos, **masks)
    return y.transpose(0, 2, 1, 3), (new_k_buf, new_v_buf)

  return attend


def _write(buf: chex.Array, new: chex.Array, slot: chex.Numeric, kv: int) -> chex.Array:
  """`buf` `[batch * kv, slots, d]` with `new` `[batch * kv, t, d]` written from `slot`:
  one slot for all rows, or `[batch]` slots, each row's own (one token a row)."""
  if jnp.ndim(slot) == 0:
    return jax.lax.dynamic_update_slice(buf, new, (0, slot, 0))
  return buf.at[jnp.arange(buf.shape[0]), jnp.repeat(slot, kv)].set(new[:, 0])


def _written_after(read: chex.Array, *new: chex.Array) -> Tuple[chex.Array, ...]:
  """`new` (a step's keys and values), made to depend on `read` (its attention output).

  A decoding step reads its layer's cache as it was before the step
  (`attention.attend_to_cache_and_own`) and writes its own key and value
  into one slot. Without an order between the two, XLA's CPU backend
  copied each layer's whole cache twice a step to keep the old one for the
  read (an `optimization_barrier` did not order them). Adding `0 *` one
  element of the output orders the write after the read, and the write is
  in place. The values are unchanged: the output is finite wherever the
  step's logits are.
  """
  after = 0.0 * read.reshape(-1)[0]
  return tuple(x + after.astype(x.dtype) for x in new)


def _ring_positions(pos: chex.Numeric, size: int) -> chex.Array:
  """`[size]`: the position each ring slot holds once positions `< pos` are written
  (slot `s` holds the latest `p < pos` with `p % size == s`; negative: none yet)."""
  return pos - 1 - jnp.mod(pos - 1 - jnp.arange(size), size)


def _ring_attend(k_buf: chex.Array, v_buf: chex.Array, pos: chex.Numeric, count: chex.Numeric,
                 config: gpt.GPTConfig, forms: kernels.Forms,
                 key_start: Optional[chex.Array] = None) -> gpt.Attend:
  """`gpt.Attend` of a sliding-window layer through its ring buffer (`KVCache`).

  One token (a decoding step) is written first, over the position that
  just left its window, then attends to the ring. Several tokens attend to
  the ring and to their own keys (only their own at a static `pos == 0`),
  then the last `min(count, size)` real ones (`count`: tokens before the
  padding) are written. Positions are those of `_cached_attend`, so left
  padding (`key_start`) and the window mask compose.
  """
  kv, d, size = config.kv_heads, config.head_dim, k_buf.shape[1]
  low_precision = forms.attention in ("xla", "cudnn")
  compute_dtype = config.matmul_dtype if low_precision else None
  masks = dict(window=config.window, softcap=config.attn_softcap, key_start=key_start,
               compute_dtype=compute_dtype)

  def attend(q, k, v):
    b, t = q.shape[:2]
    k_new, v_new = (a.transpose(0, 2, 1, 3).reshape(b * kv, t, d) for a in (k, v))
    q = q.transpose(0, 2, 1, 3) * config.attn_scale  # [b, h, t, d]
    heads = lambda a: a.reshape(b, kv, -1, d)
    if t == 1:  # the slot it writes holds a position that has left the window
      rows_pos = pos if jnp.ndim(pos) == 0 else pos[:, None]  # [batch, 1]: each row's ring
      y = attention.attend_to_cache_and_own(
          q, heads(k_buf), heads(v_buf), heads(k_new)[:, :, 0], heads(v_new)[:, :, 0], pos,
          key_positions=_ring_positions(rows_pos, size), **masks)
      bufs = tuple(_write(buf, new.astype(buf.dtype), jnp.mod(pos, size), kv)
                   for buf, new in zip((k_buf, v_buf), _written_after(y, k_new, v_new)))
      return y.transpose(0, 2, 1, 3), bufs
    if isinstance(pos, int) and pos == 0:
      keys, values, positions = k_new, v_new, jnp.arange(t)
    else:
      keys = jnp.concatenate([k_buf, k_new.astype(k_buf.dtype)], axis=1)
      values = jnp.concatenate([v_buf, v_new.astype(v_buf.dtype)], axis=1)
      positions = jnp.concatenate([_ring_positions(pos, size), pos + jnp.arange(t)])
    y = attention.attend_to_cache(q, heads(keys), heads(values), pos, key_positions=positions,
                                  **masks)
    # The last `m` real tokens go to their slots; indices before the first token
    # (fewer real tokens than `m`) are dropped, leaving the ring's older positions.
    m = min(t, size)
    index = count - m + jnp.arange(m)
    slots = jnp.where(index >= 0, jnp.mod(pos + index, size), size)
    index = jnp.maximum(index, 0)
    bufs = tuple(buf.at[:, slots].set(new[:, index].astype(buf.dtype), mode="drop")
                 for buf, new in ((k_buf, k_new), (v_buf, v_new)))
    return y.transpose(0, 2, 1, 3), bufs

  return attend


def forward(layers, params, tokens, cache, pos, config, forms, last=None, offsets=None):
  """`decode.forward_with_cache` over per-layer params `layers` (`layers_of`).

  Args:
    layers: `layers_of(params, config)`.
    params: the model's params (embeddings, final norm, head).
    tokens: `[batch, time]` ids at positions `pos, ...`.
    cache: the cache; positions `< pos` hold earlier tokens.
    pos: position of `tokens[:, 0]` (may be traced), or `[batch]` with one token a
      row: each row's own position and cache slot (`purejax.engine`).
    config, forms: the model and how it runs.
    last: which token's logits to return (may be traced; None: the last).
    offsets: optional `[batch]` padding slots before each row's first token (a
      batch of prompts left-padded to one length): row `r`'s token in slot `s`
      is at position `s - offsets[r]`, and its padding is never attended.

  Returns:
    `(logits [batch, vocab], cache)`.
  """
  start = pos if offsets is None else pos - offsets
  x = gpt.input_states(params, tokens, config, start)
  count = tokens.shape[1] if last is None else last + 1
  # Decoding does little work per layer, so a plain Python loop over the
  # layers (unrolled in the compiled program) beats a scan's overhead.
  ks, vs = [], []
  for i, (layer, k_buf, v_buf) in enumerate(zip(layers, cache.k, cache.v)):
    kind = config.layer_kinds[i]
    attend = (_ring_attend(k_buf, v_buf, pos, count, config, forms, offsets) if kind else
              _cached_attend(k_buf, v_buf, pos, config, forms, offsets))
    x, (k_buf, v_buf) = gpt.block(layer, x, config, forms=forms, attend=attend, start=start,
                                  value_embed=gpt.value_embedding(params, tokens, config, i),
                                  kind=kind)
    ks.append(k_buf)
    vs.append(v_buf)
  x = x[:, -1] if last is None else jax.lax.dynamic_index_in_dim(x, last, 1, keepdims=False)
  x = gpt.final_norm(params, x, config)
  return gpt.logits_of(params, x, config, forms), KVCache(tuple(ks), tuple(vs))


class SlidingWindow(NamedTuple):
  """When the cache slides while decoding (see `sliding_window`).

  Attributes:
    window: prompt tokens the cache starts from (the prompt's last ones).
    refill: tokens the cache is rebuilt from when it is full.
    first: tokens decoded before the first slide.
    period: tokens per slide cycle: one slide, then `period - 1` decodes.
    full_periods: whole cycles after `first`.
    tail: tokens of the last, partial cycle (0: none).
  """
  window: int
  refill: int
  first: int
  period: int
  full_periods: int
  tail: int


def sliding_window(prompt_len: int, max_new_tokens: int, block_size: int) -> SlidingWindow:
  """The context policy of `generate`, worked out before the loop runs.

  A prompt longer than `block_size` is conditioned on its last `block_size`
  tokens (as nanoGPT crops). Tokens are decoded through the cache while it
  has room. When it is full, the window *slides*: the cache is rebuilt from
  the last `block_size // 2` tokens, with positions restarting at 0, and
  decoding goes on. So every token sees between `block_size // 2` and
  `block_size` tokens of context. nanoGPT instead recomputes the last
  `block_size` tokens for every new token, which costs `block_size` times
  more; within `block_size` tokens the two are identical.

  The prompt length is static, so where the slides fall is known here, and
  the decode loop becomes fixed-length scans with slides between them.
  """
  window, refill = min(prompt_len, block_size), max(block_size // 2, 1)
  first = min(max_new_tokens, block_size - window)
  period = 1 + block_size - refill  # one slide, then decodes until full
  full_periods, tail = divmod(max_new_tokens - first, period)
  return SlidingWindow(window, refill, first, period, full_periods, tail)

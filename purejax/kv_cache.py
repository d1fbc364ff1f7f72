"""The KV cache: keys and values of past positions, and a GPT run through it.

    model = kv_cache.prepare(params, config)
    cache = kv_cache.init_kv_cache(config, batch=4, length=256)
    logits, cache = kv_cache.forward(model, tokens, cache, starts, counts, config, forms)

The pieces `purejax.engine` decodes with: the cache pytree, and the model's
blocks attending through it (`attention.attend_with_cache`), each row of a
batch at its own positions, so a prompt's chunks and a decoding step are the
same call. Everything here is a pure function of a cache in and a cache out.
"""

import dataclasses
import functools
import math
from typing import NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from purejax import gpt
from purejax.ops import attention
from purejax.ops import kernels
from purejax.ops import quant

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


def layer_lengths(config: gpt.GPTConfig, length: int, ring_room: int = 0) -> Tuple[int, ...]:
  """Each layer's slots in a cache of `length` positions: a sliding-window layer's ring
  holds `min(window + ring_room, length)`, a global layer `length`.

  `ring_room` is how many positions one call may write ahead of the oldest
  query's window: a call that feeds up to `ring_room` tokens of a row and
  then reads the ring (`forward` with `own=False`) finds every key its
  queries see still there.
  """
  return tuple(min(config.window + ring_room, length) if kind else length
               for kind in config.layer_kinds)


def init_kv_cache(config: gpt.GPTConfig, batch: int, length: Optional[int] = None,
                  ring_room: int = 0) -> KVCache:
  """An empty (zero) cache for `batch` sequences of up to `length` positions.

  Each token reads only the cache blocks below its position, so a long
  cache costs memory, not time. `length` defaults to the model's context,
  `block_size`; `ring_room` as in `layer_lengths`.
  """
  length = config.block_size if length is None else length
  if not 1 <= length <= config.block_size:
    raise ValueError(f"a KV cache of {length} positions; give 1 to block_size="
                     f"{config.block_size}.")
  # Separate arrays for keys and values: a cache donated to XLA (the engine's programs)
  # must not hold one buffer twice.
  zeros = lambda: tuple(jnp.zeros(_cache_layer_shape(config, batch, n), jnp.float32)
                        for n in layer_lengths(config, length, ring_room))
  return KVCache(zeros(), zeros())


def cache_length(cache: KVCache, config: gpt.GPTConfig) -> int:
  """Positions the cache has room for (static: its global layers' slots; a model whose
  layers all slide has room for its whole context)."""
  if 0 in config.layer_kinds:
    return cache.k[config.layer_kinds.index(0)].shape[1]
  return config.block_size


def check_cache(cache: KVCache, config: gpt.GPTConfig, batch: int) -> None:
  """Raises a ValueError unless `cache` is a cache of `batch` rows for `config`."""
  got = jax.tree.map(jnp.shape, cache)
  length = cache_length(cache, config) if len(cache.k) == config.n_layer else 0
  sizes = [s[1] for s in got.k] if len(got.k) == config.n_layer else []
  ok = (len(got.k) == len(got.v) == config.n_layer and got.k == got.v
        and 1 <= length <= config.block_size
        and all(shape == _cache_layer_shape(config, batch, n)
                for shape, n in zip(got.k, sizes))
        and all((n <= length) if kind else (n == length)
                for n, kind in zip(sizes, config.layer_kinds)))
  if not ok:
    raise ValueError(f"KV cache of shapes {got}, but this config and batch need "
                     f"{config.n_layer} layers of {_cache_layer_shape(config, batch, 'length')} "
                     f"(length <= {config.block_size}; a sliding-window layer's ring at most "
                     f"the length); build it with init_kv_cache(config, batch).")


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
    if isinstance(p, quant.QuantizedWeight):
      return LayerOf(p, i)
    name = getattr(path[-1], "key", None)
    return p[i].astype(compute_dtype) if low and name == "w" else p[i]

  return tuple(jax.tree_util.tree_map_with_path(
      lambda path, p, i=i: layer_leaf(path, p, i), params["blocks"],
      is_leaf=lambda x: isinstance(x, quant.QuantizedWeight)) for i in range(config.n_layer))


@functools.partial(jax.tree_util.register_dataclass, data_fields=("stacked",),
                   meta_fields=("index",))
@dataclasses.dataclass(frozen=True)
class LayerOf:
  """Layer `index` of a stacked `quant.QuantizedWeight`, sliced inside the program
  (`layer_params`). Its slice is read by the dequantization, one fused pass over the
  stacked codes, so it costs no copy, where slicing before the programs (as float
  weights are) would hold every layer's codes twice."""
  stacked: quant.QuantizedWeight
  index: int


def layer_params(layer: Params, x: chex.Array) -> Params:
  """A layer's params as `gpt.block` takes them: `LayerOf` leaves sliced, and each
  quantized weight tied to `x` (`quant.tied_to`)."""
  sliced = jax.tree.map(
      lambda p: jax.tree.map(lambda a: a[p.index], p.stacked) if isinstance(p, LayerOf) else p,
      layer, is_leaf=lambda p: isinstance(p, LayerOf))
  return quant.tied_to(sliced, x)


def with_head_matrix(params: Params) -> Params:
  """`params` whose tied output head is also held as its own `[embd, vocab]` matrix
  (`"lm_head"`, as an untied model's): the same logits, from a matrix laid out for them.

  The logits of a few tokens are one product with the `[vocab, embd]`
  embedding table, and XLA's CPU backend transposed the whole table for it
  on each call: SmolLM2-135M's head took 72 ms for one row's logits, 4 ms
  from the transposed matrix. A program called once a token or a prompt
  chunk (the engine's programs) pays that every call, so `prepare`
  transposes once. The matrix takes the table's memory again.
  """
  table = params["wte"]["embedding"]
  if "lm_head" in params or not isinstance(table, jax.Array):
    return params
  return {**params, "lm_head": {"w": jnp.transpose(table)}}


class Model(NamedTuple):
  """A model's params as the cache's programs take them (`prepare`).

  Attributes:
    layers: each layer's params, sliced from the stacked blocks (`layers_of`).
    rest: the params around them (embeddings, final norm, head: a tied one also
      as its own matrix, `with_head_matrix`).
  """
  layers: Tuple[Params, ...]
  rest: Params


def prepare(params: Params, config: gpt.GPTConfig) -> Model:
  """`params` checked against `config`, sliced per layer and put on the device once.

  Host (NumPy) weights would be copied in, and a tied head transposed, on
  every call of a decoding program; here that happens once.
  """
  gpt.check_params(params, config)
  layers = tuple(jax.tree.map(jnp.asarray, layers_of(params, config)))
  rest = jax.tree.map(jnp.asarray, {k: v for k, v in params.items() if k != "blocks"})
  return Model(layers, with_head_matrix(rest))


def _written_after(read: chex.Array, *new: chex.Array) -> Tuple[chex.Array, ...]:
  """`new` (a step's keys and values), made to depend on `read` (its attention output).

  A decoding step reads its layer's cache as it was before the step
  (`attend_with_cache`'s `own`) and writes its own key and value into one
  slot. Without an order between the two, XLA's CPU backend copied each
  layer's whole cache twice a step to keep the old one for the read (an
  `optimization_barrier` did not order them). Adding `0 *` one element of
  the output orders the write after the read, and the write is in place.
  The values are unchanged: the output is finite wherever the step's
  logits are.
  """
  after = 0.0 * read.reshape(-1)[0]
  return tuple(x + after.astype(x.dtype) for x in new)


def _slots(starts: chex.Array, counts: chex.Array, t: int, size: int, ring: bool,
           ring_last: Optional[chex.Array]) -> chex.Array:
  """`[batch, t]` the slot each token is written to; `size` (out of range, dropped) for
  padding, and in a ring for tokens a later token of its cache row overwrites."""
  positions = starts[:, None] + jnp.arange(t)
  real = jnp.arange(t)[None] < counts[:, None]
  if not ring:
    return jnp.where(real & (positions < size), positions, size)
  last = (starts + counts - 1) if ring_last is None else ring_last
  return jnp.where(real & (positions > last[:, None] - size), jnp.mod(positions, size), size)


def _attend_through(k_buf: chex.Array, v_buf: chex.Array, starts: chex.Array,
                    counts: chex.Array, rows: Optional[chex.Array], own: bool, ring: bool,
                    config: gpt.GPTConfig, forms: kernels.Forms) -> gpt.Attend:
  """`gpt.Attend` for tokens `[batch, time]` at positions `starts[b], ...` through one
  layer's cache (`[cache_rows * kv_heads, slots, head_dim]`), carrying it out updated.

  With `own`, the tokens attend to the cache as it was and to their own keys,
  then are written (a decoding step: the write is in place); without, they are
  written first and read back with the cache (a prompt's chunks, several of one
  row in one call). Rows with `rows` write into and read those cache rows.
  """
  kv, d, size = config.kv_heads, config.head_dim, k_buf.shape[1]
  cache_rows = k_buf.shape[0] // kv
  # The GPU's forms multiply in the compute dtype; the CPU's in float32.
  low_precision = forms.attention in ("xla", "cudnn")
  compute_dtype = config.matmul_dtype if low_precision else None
  row_of = jnp.arange(starts.shape[0]) if rows is None else rows
  ring_last = None
  if ring and not own:  # every call row of a cache row sees the ring as the call leaves it
    same = row_of[:, None] == row_of[None, :]
    ends = jnp.where(counts > 0, starts + counts - 1, -1)
    ring_last = jnp.max(jnp.where(same, ends[None, :], -1), axis=1)

  def write(buf, new):  # new: [batch, kv, t, d]
    b, _, t, _ = new.shape
    slots = _slots(starts, counts, t, size, ring, ring_last)  # [batch, t]
    lines = jnp.where(row_of < cache_rows, row_of, cache_rows)[:, None] * kv + jnp.arange(kv)
    return buf.at[lines[:, :, None], slots[:, None, :]].set(new.astype(buf.dtype), mode="drop")

  def attend(q, k, v):
    b, t = q.shape[:2]
    k_new, v_new = (a.transpose(0, 2, 1, 3) for a in (k, v))  # [b, kv, t, d]
    q = q.transpose(0, 2, 1, 3)  # [b, h, t, d]
    # The model's own scale, as a Python float: the same program for 1/sqrt(d).
    q = q * (1.0 / math.sqrt(d) if config.attn_scalar is None else config.attn_scale)
    options = dict(rows=rows, window=config.window if ring else None,
                   softcap=config.attn_softcap, compute_dtype=compute_dtype)
    grid = lambda buf: buf.reshape(cache_rows, kv, size, d)
    if own:
      y = attention.attend_with_cache(q, grid(k_buf), grid(v_buf), starts, own=(k_new, v_new),
                                      ring_last=starts - 1 if ring else None, **options)
      k_new, v_new = _written_after(y, k_new, v_new)
      return y.transpose(0, 2, 1, 3), (write(k_buf, k_new), write(v_buf, v_new))
    k_buf2, v_buf2 = write(k_buf, k_new), write(v_buf, v_new)
    y = attention.attend_with_cache(q, grid(k_buf2), grid(v_buf2), starts, ring_last=ring_last,
                                    **options)
    return y.transpose(0, 2, 1, 3), (k_buf2, v_buf2)

  return attend


def forward(model: Model, tokens: chex.Array, cache: KVCache, starts: chex.Array,
            counts: chex.Array, config: gpt.GPTConfig, forms: kernels.Forms, *,
            rows: Optional[chex.Array] = None, own: bool = True
            ) -> Tuple[chex.Array, KVCache]:
  """The model over `tokens` through the cache: each row at its own positions.

  Args:
    model: `prepare(params, config)`.
    tokens: `[batch, time]` ids; row `b`'s first `counts[b]` are real, at positions
      `starts[b], starts[b] + 1, ...` (the rest is padding: never written, never
      attended to).
    cache: the cache; a row's positions before `starts[b]` hold its earlier tokens.
    starts, counts: `[batch]` int32 (a row with count 0 writes nothing).
    config, forms: the model and how it runs.
    rows: optional `[batch]` the cache row each token row writes and reads (several
      token rows may share one: consecutive chunks of a prompt); out-of-range rows
      write nothing. None: row `b`.
    own: attend to the cache as it was and to the tokens' own keys, then write
      (a decoding step, written in place); False: write, then attend (needs a
      ring with room for the call's tokens, `layer_lengths`' `ring_room`).

  Returns:
    `(logits [batch, vocab] after each row's last real token, cache)`.
  """
  starts = jnp.asarray(starts, jnp.int32)
  counts = jnp.asarray(counts, jnp.int32)
  x = gpt.input_states(model.rest, tokens, config, starts)
  value_embeds = (model.rest["value_embeds"], tokens) if config.value_embeds else None
  ks, vs = [], []
  for i, (layer, k_buf, v_buf) in enumerate(zip(model.layers, cache.k, cache.v)):
    attend = _attend_through(k_buf, v_buf, starts, counts, rows, own,
                             bool(config.layer_kinds[i]), config, forms)
    # Unrolled, a layer without a value embedding skips its (zero) rows.
    ctx = gpt.Context(config, forms, starts=starts, attend=attend,
                      value_embeds=value_embeds if config.has_value_embed(i) else None)
    # Decoding does little work per layer, so a plain Python loop over the
    # layers (unrolled in the compiled program) beats a scan's overhead.
    # Unrolled, nothing orders a quantized layer's dequantization after the layers
    # before it, and XLA's CPU scheduler formed every layer's float matrices first
    # (Gemma 3 270M: 0.43 GB of temporaries, the float32 model again; an
    # `optimization_barrier` is dropped before scheduling). Tied to `x`, each is
    # formed when its layer runs.
    layer = layer_params(layer, x)
    x, (k_buf, v_buf) = gpt.block(x, layer, gpt.one_layer_consts(config, i), ctx)
    ks.append(k_buf)
    vs.append(v_buf)
  last = jnp.clip(counts - 1, 0, tokens.shape[1] - 1)
  x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [batch, embd]
  x = gpt.final_norm(model.rest, x, config)
  return gpt.logits_of(model.rest, x, config, forms), KVCache(tuple(ks), tuple(vs))

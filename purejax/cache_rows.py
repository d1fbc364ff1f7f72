"""The cache's rows on the device: the completions in flight, and the engine's programs.

    rows = cache_rows.init_rows(config, n_rows=16, length=2048, ring_room=256, text_bytes=1)
    rows = cache_rows.prefill(model, rows, tokens, cache_rows_of, starts, counts, ...)
    rows, emitted = cache_rows.decode_chunk(model, rows, settings, table, steps, ...)

What `purejax.engine` runs on the device, each a pure function of a `Rows` state
in and out (donated: written in place), each of one fixed shape for an engine's
life: `prefill` feeds prompt chunks into their rows, `decode_chunk` decodes a
token of every running row a step, `copy_row` copies a prefilled row to another
(a prompt's samples). Which request holds which row is the host's business
(`engine.Engine`).
"""

import functools
from typing import NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from purejax import decode
from purejax import gpt
from purejax import kv_cache
from purejax.kv_cache import KVCache
from purejax.ops import kernels


class Rows(NamedTuple):
  """The completions in flight, one a row.

  Attributes:
    cache: the KV cache, a row of each layer's per completion.
    logits: `[rows, vocab]` each row's next-token logits.
    positions: `[rows]` int32: how many tokens the row's cache holds (the next
      token's position).
    count: `[rows]` int32: new tokens so far (the next token's noise index).
    done: `[rows]` bool: its completion has ended (or the row holds none).
    stopped: `[rows]` bool: it ended at a stop id or string.
    text: `[rows, bytes]` int32: the last bytes of its new text (stop strings).
  """
  cache: KVCache
  logits: chex.Array
  positions: chex.Array
  count: chex.Array
  done: chex.Array
  stopped: chex.Array
  text: chex.Array


class Settings(NamedTuple):
  """Each row's request settings, `[rows, ...]`, given with every decoding call.

  Attributes:
    keys: `[rows, 2]` uint32: each completion's key (`decode.completion_key`).
    temperature: `[rows]` float32 (0: greedy).
    top_k: `[rows]` int32 (0: every token).
    top_p: `[rows]` float32 (1: every token).
    limit: `[rows]` int32: new tokens at most.
    stop_ids: `[rows, k]` int32, -1 for none.
    strings: `[rows, n, bytes]` int32 (`decode.encode_stop_strings`).
    active: `[rows]` bool: rows the host wants decoded (others are left done).
    top: `[rows]` bool: rows that want the most likely tokens reported.
  """
  keys: chex.Array
  temperature: chex.Array
  top_k: chex.Array
  top_p: chex.Array
  limit: chex.Array
  stop_ids: chex.Array
  strings: chex.Array
  active: chex.Array
  top: chex.Array


class Emitted(NamedTuple):
  """What a decoding call gives back: `[steps, rows, ...]` per step and row."""
  tokens: chex.Array
  emitted: chex.Array
  logprobs: chex.Array
  top_ids: chex.Array
  top_logprobs: chex.Array


def init_rows(config: gpt.GPTConfig, n_rows: int, length: Optional[int], ring_room: int,
              text_bytes: int) -> Rows:
  """`n_rows` empty rows (all done) of `length` cache positions (None: `block_size`);
  `ring_room` and `text_bytes` as `kv_cache.layer_lengths` and `decode.text_width` say."""
  return Rows(cache=kv_cache.init_kv_cache(config, n_rows, length, ring_room),
              logits=jnp.zeros((n_rows, config.vocab_size), jnp.float32),
              positions=jnp.zeros(n_rows, jnp.int32), count=jnp.zeros(n_rows, jnp.int32),
              done=jnp.ones(n_rows, bool), stopped=jnp.zeros(n_rows, bool),
              text=jnp.full((n_rows, text_bytes), -1, jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "forms"), donate_argnames=("rows",))
def prefill(model: kv_cache.Model, rows: Rows, tokens: chex.Array, cache_rows: chex.Array,
            starts: chex.Array, counts: chex.Array, finishing: chex.Array,
            count_after: chex.Array, *, config: gpt.GPTConfig, forms: kernels.Forms) -> Rows:
  """Feeds prompt chunks into their rows' caches.

  Args:
    model: `kv_cache.prepare(params, config)`.
    rows: the state (donated: written in place).
    tokens: `[calls, chunk]` ids; call row `c`'s first `counts[c]` are real, at
      positions `starts[c], ...` of cache row `cache_rows[c]` (out of range: a
      call row holding nothing, which writes nothing).
    finishing: `[calls]` bool: the chunk ends its prompt: its row becomes a live
      completion, its next-token logits those after the chunk's last real token.
    count_after: `[calls]` int32: a finishing row's count of new tokens (0 for a
      new completion; a slid one keeps its own).
  """
  logits, cache = kv_cache.forward(model, tokens, rows.cache, starts, counts, config, forms,
                                   rows=cache_rows, own=False)
  target = jnp.where(finishing, cache_rows, rows.done.shape[0])  # out of range: dropped
  put = lambda a, v: a.at[target].set(v, mode="drop")
  return Rows(cache=cache, logits=put(rows.logits, logits),
              positions=put(rows.positions, starts + counts), count=put(rows.count, count_after),
              done=put(rows.done, False), stopped=put(rows.stopped, False),
              text=put(rows.text, jnp.full(rows.text.shape[1:], -1, jnp.int32)))


@functools.partial(jax.jit, static_argnames=("kv",), donate_argnames=("rows",))
def copy_row(rows: Rows, source: chex.Numeric, target: chex.Numeric, *, kv: int) -> Rows:
  """`rows` with row `target` a copy of row `source` (cache, logits, position, count)."""
  def copy(buf):
    block = jax.lax.dynamic_slice_in_dim(buf, source * kv, kv, axis=0)
    return jax.lax.dynamic_update_slice_in_dim(buf, block, target * kv, axis=0)
  one = lambda a: a.at[target].set(a[source])
  return rows._replace(cache=jax.tree.map(copy, rows.cache), logits=one(rows.logits),
                       positions=one(rows.positions), count=one(rows.count),
                       done=one(rows.done), stopped=one(rows.stopped), text=one(rows.text))


@functools.partial(jax.jit, static_argnames=("config", "forms", "steps", "top",
                                              "valid_vocab"),
                   donate_argnames=("rows",))
def decode_chunk(model: kv_cache.Model, rows: Rows, settings: Settings,
                 table: Optional[decode.StopBytes], max_steps: chex.Numeric,
                 return_on_end: chex.Numeric, *, config: gpt.GPTConfig, forms: kernels.Forms,
                 steps: int, top: int, valid_vocab: Optional[int]) -> Tuple[Rows, Emitted]:
  """Decodes every active row, one token a step, for up to `max_steps` (<= `steps`) steps.

  Each running row draws its token from its logits by its own settings, with
  noise `decode.token_noise(key, count)`; checks its stop ids and strings;
  and feeds the token at its own position. A row ends at a stop, at its
  limit, or with its cache full (its last token drawn, not fed). Rows not
  running write nothing. The loop returns early when every row has ended,
  or, with `return_on_end`, as soon as a row that was running ends (a
  request is waiting for it).

  Returns:
    `(rows, emitted)`: `emitted` holds each step's token of every row, whether
    the row ran it, its log-probability and the `top` most likely (where a row
    asked, `settings.top`).
  """
  n, vocab = rows.logits.shape
  length = kv_cache.cache_length(rows.cache, config)
  rows = rows._replace(done=rows.done | ~settings.active)
  was_running = ~rows.done
  sampled = jnp.any(was_running & (settings.temperature > 0))
  wants_top = jnp.any(was_running & settings.top) if top else False

  def noise_at(count):  # [rows, vocab]
    return jax.vmap(lambda k, i: decode.token_noise(k, i, vocab))(settings.keys, count)

  def no_noise(count):
    return jnp.zeros((n, vocab), jnp.float32)

  # On XLA's CPU a draw inside the loop ran JAX's threefry as a rolled loop once per
  # token (a third of a step): the CPU draws a call's noise before its loop.
  ahead = None
  if forms.noise_ahead:
    ahead = jax.lax.cond(sampled, lambda: jax.vmap(lambda i: noise_at(rows.count + i))(
        jnp.arange(steps)), lambda: jnp.zeros((steps, n, vocab), jnp.float32))

  def step(carry):
    i, rows, out = carry
    running = ~rows.done
    if ahead is not None:
      noise = ahead[i]
    else:
      noise = jax.lax.cond(sampled, noise_at, no_noise, rows.count)
    token = decode.sample_logits(None, rows.logits, settings.temperature, settings.top_k,
                                 settings.top_p, gumbel=noise, valid_vocab=valid_vocab)
    hit = (token[:, None] == settings.stop_ids).any(-1)
    text = rows.text
    if table is not None:
      text = decode.appended(table, rows.text, token)
      hit |= decode.stop_hits(settings.strings, text)
      text = jnp.where(running[:, None], text, rows.text)
    if top:
      lp, top_ids, top_lp = jax.lax.cond(
          wants_top, lambda: decode.log_probs(rows.logits, token, top),
          lambda: (decode.log_probs(rows.logits, token, 0)[0],
                   jnp.zeros((n, top), jnp.int32), jnp.zeros((n, top), jnp.float32)))
    else:
      lp, top_ids, top_lp = decode.log_probs(rows.logits, token, 0)
    room = rows.positions < length
    fed = running & room
    # Rows not fed write nothing (count 0) and read the least of the cache (position 0).
    logits, cache = kv_cache.forward(model, token[:, None], rows.cache,
                                     jnp.where(fed, rows.positions, 0), fed.astype(jnp.int32),
                                     config, forms, own=True)
    count = rows.count + running
    ended = running & (hit | (count >= settings.limit) | ~room)
    rows = Rows(cache=cache, logits=jnp.where(fed[:, None], logits, rows.logits),
                positions=rows.positions + fed, count=count, done=rows.done | ended,
                stopped=rows.stopped | (running & hit), text=text)
    out = Emitted(out.tokens.at[i].set(token), out.emitted.at[i].set(running),
                  out.logprobs.at[i].set(lp), out.top_ids.at[i].set(top_ids),
                  out.top_logprobs.at[i].set(top_lp))
    return i + 1, rows, out

  def going(carry):
    i, rows, _ = carry
    some_ended = jnp.any(was_running & rows.done)
    return (i < max_steps) & jnp.any(~rows.done) & ~(return_on_end & some_ended)

  out = Emitted(jnp.zeros((steps, n), jnp.int32), jnp.zeros((steps, n), bool),
                jnp.zeros((steps, n), jnp.float32), jnp.zeros((steps, n, top), jnp.int32),
                jnp.zeros((steps, n, top), jnp.float32))
  _, rows, out = jax.lax.while_loop(going, step, (jnp.int32(0), rows, out))
  return rows, out

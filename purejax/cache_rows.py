"""The cache's rows on the device: the completions in flight, and the engine's programs.

    rows = cache_rows.init_rows(config, n_rows=16, length=2048, ring_room=256, text_bytes=1)
    rows = cache_rows.prefill(model, rows, tokens, cache_rows_of, starts, counts, ...)
    rows, emitted = cache_rows.decode_chunk(model, rows, settings, table, steps, ...)

What `purejax.engine` runs on the device, each a pure function of a `Rows` state
in and out (donated: written in place), each of one fixed shape for an engine's
life: `prefill` feeds prompt chunks into their rows and draws each finished
prompt's first token, `decode_chunk` feeds every running row's newest token and
draws its next, a step at a time, and `copy_row` copies a prefilled row to another
and draws that one's first token (a prompt's samples). All three draw with `draw`:
token choice, stop ids and strings, the token limit and log-probabilities are
written once. Which request holds which row is the host's business
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

  A row's newest token is drawn as soon as its logits exist (the first right
  after its prompt is fed) and fed at the next step, so a completion's first
  token leaves with its prefill and its last is never fed.

  Attributes:
    cache: the KV cache, a row of each layer's per completion.
    logits: `[rows, vocab]` each row's logits after its last fed token (a
      prompt's samples draw their first tokens from them).
    token: `[rows]` int32: its newest token, drawn, not yet fed.
    positions: `[rows]` int32: how many tokens its cache holds (where `token` goes).
    count: `[rows]` int32: new tokens drawn so far (the next one's noise index).
    done: `[rows]` bool: its completion has ended (or the row holds none).
    stopped: `[rows]` bool: it ended at a stop id or string.
    text: `[rows, bytes]` int32: the last bytes of its new text (stop strings).
  """
  cache: KVCache
  logits: chex.Array
  token: chex.Array
  positions: chex.Array
  count: chex.Array
  done: chex.Array
  stopped: chex.Array
  text: chex.Array


class Settings(NamedTuple):
  """Each row's request settings, `[rows, ...]`, given with every call.

  Attributes:
    keys: `[rows, 2]` uint32: each completion's key (`decode.completion_key`).
    temperature: `[rows]` float32 (0: greedy).
    top_k: `[rows]` int32 (0: every token).
    top_p: `[rows]` float32 (1: every token).
    limit: `[rows]` int32: new tokens at most.
    stop_ids: `[rows, k]` int32, -1 for none.
    strings: `[rows, n, bytes]` int32 (`decode.encode_stop_strings`).
    active: `[rows]` bool: rows the host wants decoded (others are left done).
    logprobs: `[rows]` bool: rows that want their tokens' log-probabilities.
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
  logprobs: chex.Array
  top: chex.Array


class Emitted(NamedTuple):
  """Tokens a call drew, `[..., rows, ...]`: each, whether the row drew it, its
  log-probability and the `top` most likely tokens' (where the row asked)."""
  tokens: chex.Array
  emitted: chex.Array
  logprobs: chex.Array
  top_ids: chex.Array
  top_logprobs: chex.Array


class Drawn(NamedTuple):
  """What `draw` gives for each row."""
  token: chex.Array
  hit: chex.Array
  text: chex.Array
  logprob: chex.Array
  top_ids: chex.Array
  top_logprobs: chex.Array


def init_rows(config: gpt.GPTConfig, n_rows: int, length: Optional[int], ring_room: int,
              text_bytes: int) -> Rows:
  """`n_rows` empty rows (all done) of `length` cache positions (None: `block_size`);
  `ring_room` and `text_bytes` as `kv_cache.layer_lengths` and `decode.text_width` say."""
  return Rows(cache=kv_cache.init_kv_cache(config, n_rows, length, ring_room),
              logits=jnp.zeros((n_rows, config.vocab_size), jnp.float32),
              token=jnp.zeros(n_rows, jnp.int32), positions=jnp.zeros(n_rows, jnp.int32),
              count=jnp.zeros(n_rows, jnp.int32), done=jnp.ones(n_rows, bool),
              stopped=jnp.zeros(n_rows, bool), text=jnp.full((n_rows, text_bytes), -1, jnp.int32))


def noise_of(settings: Settings, count: chex.Array, vocab: int) -> chex.Array:
  """`[rows, vocab]` each row's noise for its token `count`; zeros unless a row samples."""
  return jax.lax.cond(
      jnp.any(settings.temperature > 0),
      lambda: jax.vmap(lambda k, i: decode.token_noise(k, i, vocab))(settings.keys, count),
      lambda: jnp.zeros((count.shape[0], vocab), jnp.float32))


def draw(logits: chex.Array, settings: Settings, text: chex.Array, noise: chex.Array,
         table: Optional[decode.StopBytes], *, top: int, valid_vocab: Optional[int]) -> Drawn:
  """Each row's next token from its `logits` `[rows, vocab]` by its settings
  (`decode.sample_logits` with `noise`), whether it hits a stop id or (with `table`) a
  stop string in the row's `text`, the text with it, and its log-probabilities."""
  token = decode.sample_logits(None, logits, settings.temperature, settings.top_k,
                               settings.top_p, gumbel=noise, valid_vocab=valid_vocab)
  hit = (token[:, None] == settings.stop_ids).any(-1)
  if table is not None:
    text = decode.appended(table, text, token)
    hit |= decode.stop_hits(settings.strings, text)
  n = logits.shape[0]
  nothing = lambda: (jnp.zeros(n), jnp.zeros((n, top), jnp.int32), jnp.zeros((n, top)))
  chosen = lambda: (decode.log_probs(logits, token, 0)[0], *nothing()[1:])
  # Only where a row asks: a softmax (and for the most likely, a sort) of every row's logits.
  if top:
    lp, top_ids, top_lp = jax.lax.cond(
        jnp.any(settings.top), lambda: decode.log_probs(logits, token, top),
        lambda: jax.lax.cond(jnp.any(settings.logprobs), chosen, nothing))
  else:
    lp, top_ids, top_lp = jax.lax.cond(jnp.any(settings.logprobs), chosen, nothing)
  return Drawn(token, hit, text, lp, top_ids, top_lp)


def _emitted(drawn: Drawn, emitted: chex.Array) -> Emitted:
  return Emitted(drawn.token, emitted, drawn.logprob, drawn.top_ids, drawn.top_logprobs)


@functools.partial(jax.jit, static_argnames=("config", "forms", "top", "valid_vocab"),
                   donate_argnames=("rows",))
def prefill(model: kv_cache.Model, rows: Rows, settings: Settings,
            table: Optional[decode.StopBytes], tokens: chex.Array, cache_rows: chex.Array,
            starts: chex.Array, counts: chex.Array, finishing: chex.Array,
            count_after: chex.Array, *, config: gpt.GPTConfig, forms: kernels.Forms, top: int,
            valid_vocab: Optional[int]) -> Tuple[Rows, Emitted]:
  """Feeds prompt chunks into their rows' caches; a chunk that ends its prompt draws the
  row's first token.

  Args:
    model: `kv_cache.prepare(params, config)`.
    rows: the state (donated: written in place).
    settings, table: the rows' settings and the stop strings' bytes (`draw`).
    tokens: `[calls, chunk]` ids; call row `c`'s first `counts[c]` are real, at
      positions `starts[c], ...` of cache row `cache_rows[c]` (out of range: a
      call row holding nothing, which writes nothing).
    finishing: `[calls]` bool: the chunk ends its prompt: its row becomes a live
      completion, its first token drawn from the logits after the chunk.
    count_after: `[calls]` int32: a finishing row's count of tokens drawn before
      (0 for a new completion; a slid one keeps its own).

  Returns:
    `(rows, emitted)`: `emitted` `[calls]`, the first tokens (where `finishing`).
  """
  n = rows.done.shape[0]
  logits, cache = kv_cache.forward(model, tokens, rows.cache, starts, counts, config, forms,
                                   rows=cache_rows, own=False)
  own = jax.tree.map(lambda a: a[jnp.clip(cache_rows, 0, n - 1)], settings)  # [calls, ...]
  fresh_text = jnp.full((tokens.shape[0], rows.text.shape[1]), -1, jnp.int32)
  drawn = draw(logits, own, fresh_text, noise_of(own, count_after, logits.shape[1]), table,
               top=top, valid_vocab=valid_vocab)
  count = count_after + 1
  target = jnp.where(finishing, cache_rows, n)  # out of range: dropped
  put = lambda a, v: a.at[target].set(v, mode="drop")
  rows = Rows(cache=cache, logits=put(rows.logits, logits), token=put(rows.token, drawn.token),
              positions=put(rows.positions, starts + counts), count=put(rows.count, count),
              done=put(rows.done, drawn.hit | (count >= own.limit)),
              stopped=put(rows.stopped, drawn.hit), text=put(rows.text, drawn.text))
  return rows, _emitted(drawn, finishing)


@functools.partial(jax.jit, static_argnames=("kv", "top", "valid_vocab"),
                   donate_argnames=("rows",))
def copy_row(rows: Rows, settings: Settings, table: Optional[decode.StopBytes],
             source: chex.Numeric, target: chex.Numeric, *, kv: int, top: int,
             valid_vocab: Optional[int]) -> Tuple[Rows, Emitted]:
  """`rows` with row `target` a copy of the prefilled row `source` (its cache and logits),
  its own first token drawn by its own settings; `emitted` `[1]` holds that token."""
  def copy(buf):
    block = jax.lax.dynamic_slice_in_dim(buf, source * kv, kv, axis=0)
    return jax.lax.dynamic_update_slice_in_dim(buf, block, target * kv, axis=0)
  own = jax.tree.map(lambda a: a[target][None], settings)
  count = rows.count[source] - 1  # the tokens drawn before the source's first
  logits = rows.logits[source][None]
  drawn = draw(logits, own, jnp.full((1, rows.text.shape[1]), -1, jnp.int32),
               noise_of(own, count[None], logits.shape[1]), table, top=top,
               valid_vocab=valid_vocab)
  one = lambda a, v: a.at[target].set(v[0])
  rows = Rows(cache=jax.tree.map(copy, rows.cache), logits=one(rows.logits, logits),
              token=one(rows.token, drawn.token), positions=one(rows.positions,
                                                                rows.positions[source][None]),
              count=one(rows.count, count[None] + 1),
              done=one(rows.done, drawn.hit | (count[None] + 1 >= own.limit)),
              stopped=one(rows.stopped, drawn.hit), text=one(rows.text, drawn.text))
  return rows, _emitted(drawn, jnp.ones(1, bool))


@functools.partial(jax.jit, static_argnames=("config", "forms", "steps", "top",
                                              "valid_vocab"),
                   donate_argnames=("rows",))
def decode_chunk(model: kv_cache.Model, rows: Rows, settings: Settings,
                 table: Optional[decode.StopBytes], max_steps: chex.Numeric,
                 return_on_end: chex.Numeric, *, config: gpt.GPTConfig, forms: kernels.Forms,
                 steps: int, top: int, valid_vocab: Optional[int]) -> Tuple[Rows, Emitted]:
  """Decodes every active row, one token a step, for up to `max_steps` (<= `steps`) steps.

  Each running row feeds its newest token at its own position, then draws
  the next from the logits (`draw`: its own settings, noise
  `decode.token_noise(key, count)`, its stop ids and strings). A row ends at
  a stop or at its limit (that token is not fed), or when its cache is full
  (its newest token has no slot). Rows not running write nothing. The loop
  returns early when every row has ended, or, with `return_on_end`, as soon
  as a row that was running ends (a request is waiting for it).

  Returns:
    `(rows, emitted)`: `emitted` `[steps, rows]` each step's drawn tokens.
  """
  n, vocab = rows.logits.shape
  length = kv_cache.cache_length(rows.cache, config)
  rows = rows._replace(done=rows.done | ~settings.active)
  was_running = ~rows.done

  # On XLA's CPU a draw inside the loop ran JAX's threefry as a rolled loop once per
  # token (a third of a step): the CPU draws a call's noise before its loop.
  ahead = None
  if forms.noise_ahead:
    ahead = jax.vmap(lambda i: noise_of(settings, rows.count + i, vocab))(jnp.arange(steps))

  def step(carry):
    i, rows, out = carry
    running = ~rows.done
    fed = running & (rows.positions < length)
    # Rows not fed write nothing (count 0) and read the least of the cache (position 0).
    logits, cache = kv_cache.forward(model, rows.token[:, None], rows.cache,
                                     jnp.where(fed, rows.positions, 0), fed.astype(jnp.int32),
                                     config, forms, own=True)
    noise = ahead[i] if ahead is not None else noise_of(settings, rows.count, vocab)
    drawn = draw(logits, settings, rows.text, noise, table, top=top, valid_vocab=valid_vocab)
    count = rows.count + fed
    ended = (running & ~fed) | (fed & (drawn.hit | (count >= settings.limit)))
    keep = lambda new, old: jnp.where(fed.reshape(-1, *([1] * (new.ndim - 1))), new, old)
    rows = Rows(cache=cache, logits=keep(logits, rows.logits), token=keep(drawn.token, rows.token),
                positions=rows.positions + fed, count=count, done=rows.done | ended,
                stopped=rows.stopped | (fed & drawn.hit), text=keep(drawn.text, rows.text))
    step_out = _emitted(drawn, fed)
    out = jax.tree.map(lambda all_, one: all_.at[i].set(one), out, step_out)
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

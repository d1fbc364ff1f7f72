"""Continuous batching: many prompts decoded through a fixed set of cache rows, each row
refilled with the next prompt as soon as its completion ends.

    completions = engine.generate_many(params, prompts, config, key, max_new_tokens=256,
                                       rows=16, stop_ids=[eos], stop_strings=strings)

`decode.generate_batch` decodes one batch of prompts until its last row ends:
a batch whose completions mostly end after 30 tokens still runs as long as
its longest one. Here each of `rows` cache rows holds one completion at a
time, at its own position. When a completion ends, the decode loop returns,
the row is refilled with the next prompt (prefilled alone, in chunks of four
compiled lengths), and decoding goes on. So the steps run are about the
tokens the completions need, divided by `rows`, plus one longest completion
at the end, and the same few programs serve every prompt length.

Everything on the device is a pure function of a `Rows` state in and out;
the loop that refills rows is plain Python, below.
"""

import collections
import functools
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np

from purejax import decode
from purejax import gpt
from purejax import kv_cache
from purejax.kv_cache import KVCache
from purejax.ops import kernels

Params = gpt.Params

# Prompt tokens fed per prefill call, largest first: a prompt is fed in the largest
# chunks it fills, its end in the smallest that holds it. Four programs serve every
# prompt length. On a 2-core CPU a token cost 3.3 ms in chunks of 32 and 64, 2.6 in
# chunks of 128 and 2.2 in chunks of 256 (SmolLM2-135M).
PREFILL_CHUNKS = (256, 128, 64, 32)


class Rows(NamedTuple):
  """The completions in flight, one a row.

  Attributes:
    cache: the KV cache, one row of each layer's per completion.
    logits: `[rows, vocab]` each row's next-token logits.
    positions: `[rows]` int32: the position (and cache slot) of each row's next token.
    tokens: `[rows, max_new_tokens]` int32: each row's new tokens.
    count: `[rows]` int32: how many it has.
    done: `[rows]` bool: its completion has ended (or the row holds none).
    stopped: `[rows]` bool: it ended at a stop id or string (else at the limit).
    job: `[rows]` int32: which completion it is (`prompt * num_samples + sample`),
      for its sampling noise.
    stops: `[rows, k]` int32: its stop ids, -1 for none.
    text: with stop strings, `[rows, bytes]` the last bytes of its new text.
  """
  cache: KVCache
  logits: chex.Array
  positions: chex.Array
  tokens: chex.Array
  count: chex.Array
  done: chex.Array
  stopped: chex.Array
  job: chex.Array
  stops: chex.Array
  text: Optional[chex.Array] = None


def init_rows(config: gpt.GPTConfig, rows: int, length: int, max_new_tokens: int,
              stop_width: int, strings: Optional[decode.StopStrings] = None) -> Rows:
  """`rows` empty rows (all done) of a cache of `length` positions."""
  text = (None if strings is None else
          jnp.full((rows, decode._text_width(strings)), -1, jnp.int32))  # pylint: disable=protected-access
  return Rows(cache=kv_cache.init_kv_cache(config, rows, length),
              logits=jnp.zeros((rows, config.vocab_size), jnp.float32),
              positions=jnp.zeros(rows, jnp.int32),
              tokens=jnp.zeros((rows, max_new_tokens), jnp.int32),
              count=jnp.zeros(rows, jnp.int32), done=jnp.ones(rows, bool),
              stopped=jnp.zeros(rows, bool), job=jnp.zeros(rows, jnp.int32),
              stops=jnp.full((rows, stop_width), -1, jnp.int32), text=text)


@functools.partial(jax.jit, static_argnames=("config", "forms"), donate_argnames=("cache",))
def prefill_chunk(layers, params: Params, cache: KVCache, chunk: chex.Array, pos: chex.Numeric,
                  last: chex.Numeric, *, config: gpt.GPTConfig, forms: kernels.Forms
                  ) -> Tuple[chex.Array, KVCache]:
  """One prompt's tokens `chunk` `[1, size]` at positions `pos, ...` into its own one-row
  cache; the logits `[1, vocab]` after token `last` (the chunk's last real one)."""
  return kv_cache.forward(layers, params, chunk, cache, pos, config, forms, last=last)


@functools.partial(jax.jit, static_argnames=("kv",), donate_argnames=("rows",))
def place(rows: Rows, cache: KVCache, logits: chex.Array, row: chex.Numeric,
          length: chex.Numeric, job: chex.Numeric, stops: chex.Array, *, kv: int) -> Rows:
  """`rows` with row `row` holding a prefilled prompt of `length` tokens: its one-row
  `cache` and `logits` `[1, vocab]`, completion `job`, stop ids `stops` `[k]`."""
  put = lambda big, one: jax.lax.dynamic_update_slice_in_dim(big, one, row * kv, axis=0)
  text = None if rows.text is None else rows.text.at[row].set(-1)
  return rows._replace(
      cache=jax.tree.map(put, rows.cache, cache), logits=rows.logits.at[row].set(logits[0]),
      positions=rows.positions.at[row].set(length), count=rows.count.at[row].set(0),
      done=rows.done.at[row].set(False), stopped=rows.stopped.at[row].set(False),
      job=rows.job.at[row].set(job), stops=rows.stops.at[row].set(stops), text=text)


@functools.partial(jax.jit, static_argnames=("config", "forms", "top_k", "valid_vocab",
                                              "greedy"),
                   donate_argnames=("rows",))
def decode_until_one_ends(layers, params: Params, rows: Rows, live: chex.Array,
                          key: chex.PRNGKey, temperature: chex.Numeric,
                          top_p: Optional[chex.Numeric],
                          strings: Optional[decode.StopStrings], *, config: gpt.GPTConfig,
                          forms: kernels.Forms, top_k: Optional[int],
                          valid_vocab: Optional[int], greedy: bool) -> Rows:
  """Decodes every row, one token a step, until a `live` row's completion ends.

  Each row samples its next token (row `r`'s noise: `fold_in(fold_in(key, job),
  count)`, so a completion's tokens do not depend on which rows run beside it),
  checks its stop ids and strings, and feeds the token through the cache at its
  own position. Rows already done still run (a batch's shape is static) but
  write nothing of theirs.

  Args:
    live: `[rows]` bool: rows whose completions are wanted (the loop returns as
      soon as one of them is done; none is done when it is called).
  """
  n_rows, max_new = rows.tokens.shape
  index = jnp.arange(n_rows)

  def step(rows: Rows) -> Rows:
    if greedy:
      token = decode.sample_logits(None, rows.logits, 0.0, valid_vocab=valid_vocab,
                                   gumbel=jnp.zeros((), rows.logits.dtype))
    else:
      noise = jax.vmap(lambda job, i: jax.random.gumbel(
          jax.random.fold_in(jax.random.fold_in(key, job), i), (config.vocab_size,)))(
              rows.job, rows.count)
      token = decode.sample_logits(None, rows.logits, temperature, top_k, top_p,
                                   gumbel=noise, valid_vocab=valid_vocab)
    running = ~rows.done
    hit = (token[:, None] == rows.stops).any(-1)
    text = rows.text
    if strings is not None:
      text = decode._appended(strings, rows.text, token)  # pylint: disable=protected-access
      hit |= decode._holds_a_string(strings, text)  # pylint: disable=protected-access
      text = jnp.where(running[:, None], text, rows.text)
    tokens = rows.tokens.at[index, jnp.where(running, rows.count, max_new)].set(
        token, mode="drop")
    count = rows.count + running
    done = rows.done | hit | (count >= max_new)
    # A row that holds nothing is fed at slot 0, so the furthest position (how much
    # of the cache a step reads, `attention.attend_to_cache_and_own`) is a live row's.
    logits, cache = kv_cache.forward(layers, params, token[:, None], rows.cache,
                                     jnp.where(running, rows.positions, 0), config, forms)
    # A row's position stays at its last slot once it is done: it is fed again
    # there (wasted work, never read) and never runs past its cache.
    positions = rows.positions + (running & ~done)
    return rows._replace(cache=cache, logits=logits, positions=positions, tokens=tokens,
                         count=count, done=done, stopped=rows.stopped | (running & hit),
                         text=text)

  def going(rows: Rows) -> chex.Array:
    return jnp.any(live & ~rows.done) & ~jnp.any(live & rows.done)

  return jax.lax.while_loop(going, step, rows)


def cache_length(prompt_lengths: Sequence[int], max_new_tokens: int,
                 config: gpt.GPTConfig) -> int:
  """Cache positions a row needs: the longest prompt, rounded up to the smallest prefill
  chunk where the context allows, and `max_new_tokens`."""
  longest, smallest = max(prompt_lengths), PREFILL_CHUNKS[-1]
  return min(config.block_size, -(-longest // smallest) * smallest + max_new_tokens)


def prefill(layers, params: Params, prompt: Sequence[int], length: int,
            config: gpt.GPTConfig, forms: kernels.Forms) -> Tuple[chex.Array, KVCache]:
  """`prompt`'s one-row cache of `length` positions, and its next-token logits `[1, vocab]`.

  Fed in chunks of `PREFILL_CHUNKS` tokens: the largest the rest of the prompt
  fills, and its end in the smallest, padded after the prompt (a padding key
  sits past the prompt, where the row's own tokens overwrite it before
  anything reads it). A chunk that would pass the cache's end is cut to end
  there (a program of its own length; only near the context's end). Feeding
  tokens again instead would be wrong in a sliding layer's ring, which holds
  only the latest.
  """
  cache = kv_cache.init_kv_cache(config, 1, length)
  logits, start = None, 0
  while start < len(prompt):
    rest = len(prompt) - start
    size = min(next((c for c in PREFILL_CHUNKS if c <= rest), PREFILL_CHUNKS[-1]),
               length - start)
    ids = list(prompt[start:start + size])
    chunk = jnp.asarray([ids + [0] * (size - len(ids))], jnp.int32)
    logits, cache = prefill_chunk(layers, params, cache, chunk, start, len(ids) - 1,
                                  config=config, forms=forms)
    start += len(ids)
  return logits, cache


def generate_many(
    params: Params,
    prompts: Sequence[Sequence[int]],
    config: gpt.GPTConfig,
    key: chex.PRNGKey,
    max_new_tokens: int,
    *,
    rows: int = 16,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    valid_vocab: Optional[int] = None,
    stop_ids: Union[None, Sequence[int], Sequence[Sequence[int]]] = None,
    num_samples: int = 1,
    forms: Optional[kernels.Forms] = None,
    stop_strings: Optional[decode.StopStrings] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> List[List[decode.Completion]]:
  """Completes every prompt, `rows` completions at a time: `[prompt][sample]` completions.

  The same completions as `decode.generate_batch` gives (greedy: each those
  of its prompt decoded alone), with as many decoding steps as the
  completions need rather than as many as each batch's longest: a row whose
  completion ends is refilled with the next prompt at once. A prompt with
  `num_samples` is prefilled once; its cache is copied to each sample's row.
  Sampled completion `j` (`prompt * num_samples + sample`) draws its token
  `i` with noise `gumbel(fold_in(fold_in(key, j), i))`, whatever row it runs in.

  Args:
    params, config: the model.
    prompts: token ids, at least one each.
    key: the sampling key.
    max_new_tokens: new tokens per completion, at most.
    rows: completions decoded side by side (the batch of each step), at most
      as many as there are completions.
    temperature, top_k, top_p, valid_vocab: as `decode.generate` (0: greedy).
    stop_ids: ids that end a completion: one list for all prompts, or a list per prompt.
    num_samples: completions per prompt.
    forms: execution forms; None: those of the platform `params` live on.
    stop_strings: optional `decode.StopStrings`: a completion also ends once
      its text holds one (the caller cuts the text at the string).
    progress: optional `progress(prompts_done, prompts)`, called as each prompt's
      last completion ends.

  Raises:
    ValueError: no prompts, an empty one, one that does not fit the context
      with `max_new_tokens`, stop ids for another number of prompts, or
      `rows`, `num_samples` or `max_new_tokens` below 1.
  """
  decode.check_prompts(prompts, max_new_tokens, config, "generate_many")
  if min(rows, num_samples, max_new_tokens) < 1:
    raise ValueError(f"generate_many needs rows, num_samples and max_new_tokens >= 1, got "
                     f"{rows}, {num_samples} and {max_new_tokens}.")
  rows = min(rows, len(prompts) * num_samples)  # rows beyond the completions would idle
  per_prompt = _stop_lists(stop_ids, len(prompts))
  width = max(1, max(len(s) for s in per_prompt))
  stops = np.full((len(prompts), width), -1, np.int32)
  for p, ids in enumerate(per_prompt):
    stops[p, :len(ids)] = ids
  forms = forms or kernels.select(kernels.platform_of(params))
  gpt.check_params(params, config)
  # On the device once, outside every program: host (NumPy) weights would be copied in,
  # and transposed where their strides are a transpose's, on every call.
  layers = jax.tree.map(jnp.asarray, kv_cache.layers_of(params, config))
  params = kv_cache.with_head_matrix(
      jax.tree.map(jnp.asarray, {k: v for k, v in params.items() if k != "blocks"}))
  length = cache_length([len(p) for p in prompts], max_new_tokens, config)
  state = init_rows(config, rows, length, max_new_tokens, width, stop_strings)
  sampling = dict(temperature=jnp.float32(max(temperature, 0.0)),
                  top_p=None if top_p is None else jnp.float32(top_p), strings=stop_strings,
                  config=config, forms=forms, top_k=top_k, valid_vocab=valid_vocab,
                  greedy=decode.is_greedy(temperature))

  # Longest prompts first: rows decoded together are of like lengths, so a step reads
  # little more of the cache than its rows need.
  order = sorted(range(len(prompts)), key=lambda p: -len(prompts[p]))
  pending = collections.deque(p * num_samples + s for p in order for s in range(num_samples))
  live = np.zeros(rows, bool)
  held = {}  # row -> job
  results: Dict[int, decode.Completion] = {}
  finished = collections.Counter()
  prefilled = (-1, None, None)  # (prompt, logits, cache): the samples of one prompt share it
  while pending or live.any():
    for row in np.flatnonzero(~live):
      if not pending:
        break
      job = pending.popleft()
      prompt = job // num_samples
      if prefilled[0] != prompt:
        prefilled = (prompt, *prefill(layers, params, prompts[prompt], length, config, forms))
      state = place(state, prefilled[2], prefilled[1], row, len(prompts[prompt]), job,
                    stops[prompt], kv=config.kv_heads)
      live[row], held[row] = True, job
    state = decode_until_one_ends(layers, params, state, jnp.asarray(live), key, **sampling)
    # All rows' tokens at once: a gather of the ended rows would compile for each count.
    done, count, stopped, tokens = jax.device_get(
        (state.done, state.count, state.stopped, state.tokens))
    ended = np.flatnonzero(live & done)
    for row, row_tokens in zip(ended, tokens[ended]):
      job = held.pop(row)
      results[job] = decode.Completion(tuple(int(t) for t in row_tokens[:count[row]]),
                                       bool(stopped[row]))
      live[row] = False
      finished[job // num_samples] += 1
      if progress is not None and finished[job // num_samples] == num_samples:
        progress(sum(n == num_samples for n in finished.values()), len(prompts))
  return [[results[p * num_samples + s] for s in range(num_samples)]
          for p in range(len(prompts))]


def _stop_lists(stop_ids, n_prompts: int) -> List[Tuple[int, ...]]:
  """`stop_ids` (None, one list, or a list per prompt) as a list per prompt."""
  if stop_ids is None or not len(stop_ids):
    return [()] * n_prompts
  if isinstance(stop_ids[0], (int, np.integer)):
    return [tuple(int(i) for i in stop_ids)] * n_prompts
  if len(stop_ids) != n_prompts:
    raise ValueError(f"stop_ids has {len(stop_ids)} lists for {n_prompts} prompts.")
  return [tuple(int(i) for i in s) for s in stop_ids]

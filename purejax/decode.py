"""Sampling from a GPT with a KV cache, in one jitted `lax.scan` decode loop.

    out = generate(params, prompt, config, key, max_new_tokens=500,
                   temperature=0.8, top_k=200)          # [batch, prompt + new]

The model's own code is `purejax/gpt/model.py`; this module runs its blocks one
token at a time against cached keys and values (`purejax/kv_cache.py`), and
never the reverse. `generate` samples a batch in one program; `prefill` and
`step` continue a conversation kept in a cache, one token per call, for
streaming it as it is decoded.
"""

import functools
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np

from purejax import gpt
from purejax import kv_cache
from purejax.kv_cache import KVCache, cache_length, grow_cache, init_kv_cache
from purejax.ops import kernels

Params = gpt.Params


def forward_with_cache(
    params: Params,
    tokens: chex.Array,
    cache: KVCache,
    pos: chex.Numeric,
    config: gpt.GPTConfig,
    *,
    forms: Optional[kernels.Forms] = None,
) -> Tuple[chex.Array, KVCache]:
  """Runs `tokens` at positions `pos, pos+1, ...` against a KV cache.

  Each layer is `gpt.block`, attending through the cache.

  Args:
    params: model params (`gpt.init_params`).
    tokens: `[batch, time]` ids; `pos + time <= block_size`.
    cache: keys and values of positions `< pos` (later slots are ignored).
    pos: position of `tokens[:, 0]` (may be traced).
    config: model config.
    forms: execution forms; None: those of the platform `params` live on.

  Returns:
    `(logits of the last token [batch, vocab], cache updated with tokens)`.
  """
  gpt.check_tokens(tokens, config)
  gpt.check_params(params, config)
  kv_cache.check_cache(cache, config, tokens.shape[0])
  return kv_cache.forward(kv_cache.layers_of(params, config), params, tokens, cache, pos,
                          config, forms or kernels.select(kernels.platform_of(params)))


def sample_logits(
    key: Optional[chex.PRNGKey],
    logits: chex.Array,
    temperature: chex.Numeric = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    *,
    gumbel: Optional[chex.Array] = None,
    valid_vocab: Optional[int] = None,
) -> chex.Array:
  """Draws one token per row of `logits` `[batch, vocab]` -> `[batch]` int32.

  `temperature <= 0` means greedy (argmax). `top_k` keeps the k most likely
  tokens; `top_p` keeps the smallest set whose probability reaches p
  (nucleus sampling). Both filters may be combined. The draw is the
  Gumbel-max trick, `argmax(logits / temperature + g)` with
  `g = jax.random.gumbel(key, logits.shape)`; pass `gumbel` instead of `key`
  to supply `g` drawn ahead of time. Ids from `valid_vocab` on (a vocabulary
  padded for speed, e.g. GPT-2's 50257 ids in a 50304-row table) are never
  drawn.
  """
  chex.assert_rank(logits, 2)
  if valid_vocab is not None and valid_vocab < logits.shape[-1]:
    logits = jnp.where(jnp.arange(logits.shape[-1]) < valid_vocab, logits, -jnp.inf)
  if top_k is not None and top_k < 1:
    raise ValueError(f"top_k={top_k}: pass None to keep every token, or k >= 1.")
  if gumbel is None:
    gumbel = jax.random.gumbel(key, logits.shape)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits / jnp.maximum(temperature, 1e-6)
  if top_k is not None and top_k < logits.shape[-1]:
    kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]  # [batch, 1]
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
  if top_p is not None:
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # The smallest logit still inside the nucleus: tokens whose mass before
    # them is below top_p are kept (always at least the most likely one).
    inside = (jnp.cumsum(probs, axis=-1) - probs) < top_p
    cutoff = jnp.min(jnp.where(inside, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
  drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)

class DecodeState(NamedTuple):
  """What the decode loop carries from one token to the next.

  Attributes:
    tokens: `[batch, prompt_len + max_new_tokens]` prompt and tokens so far.
    cache: the KV cache.
    cache_len: positions filled in the cache.
    logits: `[batch, vocab]` next-token logits.
    index: how many new tokens are written.
    lengths, done: with stop ids or strings, `[batch]` new tokens up to and
      with each row's stop token, and whether it has one (else None).
    text: with stop strings, `[batch, bytes]` the last bytes of each row's
      new text (`StopStrings`; -1 before its first byte), else None.
  """
  tokens: chex.Array
  cache: KVCache
  cache_len: chex.Array
  logits: chex.Array
  index: chex.Array
  lengths: Optional[chex.Array] = None
  done: Optional[chex.Array] = None
  text: Optional[chex.Array] = None


class StopStrings(NamedTuple):
  """Strings that end a row, as the decode loop looks for them (`stop_strings`).

  Each row keeps the last bytes of its new text; after each token, a row
  whose text holds one of the strings stops, so a batch of completions
  that end at a string (HumanEval's "\ndef", say) ends with them instead of
  running to `max_new_tokens`. The caller still cuts each text at the first
  string; the tokens before it are the same either way.

  Attributes:
    token_bytes: `[vocab, width]` int32: each id's UTF-8 bytes, left-aligned,
      -1 after them.
    token_lengths: `[vocab]` int32: how many.
    strings: `[n, longest]` int32: each string's UTF-8 bytes, right-aligned,
      -1 before them.
  """
  token_bytes: chex.Array
  token_lengths: chex.Array
  strings: chex.Array


def stop_strings(token_texts: Sequence[str], strings: Sequence[str],
                 vocab_size: Optional[int] = None) -> StopStrings:
  """The `StopStrings` of `strings` for a tokenizer whose id `i` reads `token_texts[i]`.

  Args:
    token_texts: each id's text as it reads inside a longer text
      (`tokenizers.token_texts`).
    strings: the stop strings, each non-empty.
    vocab_size: the model's ids, if more than the tokenizer's (a padded
      vocabulary: the extra ids have no text).

  Raises:
    ValueError: no strings, or an empty one.
  """
  if not strings or not all(strings):
    raise ValueError(f"stop strings must be non-empty strings, got {list(strings)!r}.")
  encoded = [t.encode("utf-8") for t in token_texts]
  vocab_size = max(vocab_size or 0, len(encoded))
  width = max(1, max(len(b) for b in encoded))
  token_bytes = np.full((vocab_size, width), -1, np.int32)
  lengths = np.zeros(vocab_size, np.int32)
  for i, b in enumerate(encoded):
    token_bytes[i, :len(b)] = list(b)
    lengths[i] = len(b)
  wanted = [s.encode("utf-8") for s in strings]
  longest = max(len(b) for b in wanted)
  table = np.full((len(wanted), longest), -1, np.int32)
  for i, b in enumerate(wanted):
    table[i, longest - len(b):] = list(b)
  return StopStrings(jnp.asarray(token_bytes), jnp.asarray(lengths), jnp.asarray(table))


def _text_width(table: StopStrings) -> int:
  """Bytes a row keeps: enough for a string that ends in the newest token's bytes."""
  return table.token_bytes.shape[1] + table.strings.shape[1]


def _appended(table: StopStrings, text: chex.Array, token: chex.Array) -> chex.Array:
  """`[batch, bytes]` the last bytes of each row's text once `token` `[batch]` is read."""
  new = table.token_bytes[token]  # [batch, width]
  joined = jnp.concatenate([text, new], axis=1)
  start = table.token_lengths[token][:, None] + jnp.arange(text.shape[1])[None]
  return jnp.take_along_axis(joined, start, axis=1)


def _holds_a_string(table: StopStrings, text: chex.Array) -> chex.Array:
  """`[batch]` whether each row's kept text holds one of the strings."""
  longest = table.strings.shape[1]
  # One gather of every window (82 slices and a stack took 10% of a decoding step).
  starts = np.arange(text.shape[1] - longest + 1)[:, None] + np.arange(longest)[None]
  windows = text[:, starts]  # [batch, windows, longest]
  wanted = table.strings[None, None]  # [1, 1, n, longest]
  equal = (windows[:, :, None] == wanted) | (wanted < 0)
  return equal.all(-1).any((1, 2))


class Generated(NamedTuple):
  """What `generate` returns when given stop ids (or `jitted_generate` stop strings).

  Attributes (unbatched like the prompt):
    tokens: `[batch, prompt_len + max_new_tokens]`: the prompt, each row's new
      tokens up to its stop token, then that stop token repeated.
    lengths: `[batch]` new tokens of each row, its stop token included.
    stopped: `[batch]` whether the row ended at a stop id or string (False: it
      ran to `max_new_tokens`).
  """
  tokens: chex.Array
  lengths: chex.Array
  stopped: chex.Array


def generate(
    params: Params,
    prompt: chex.Array,
    config: gpt.GPTConfig,
    key: chex.PRNGKey,
    max_new_tokens: int,
    temperature: chex.Numeric = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    valid_vocab: Optional[int] = None,
    *,
    stop_ids: Optional[Sequence[int]] = None,
    forms: Optional[kernels.Forms] = None,
) -> Union[chex.Array, Generated]:
  """Continues `prompt` by `max_new_tokens` sampled tokens: `jitted_generate`, with
  `forms` (None: those of the platform `params` live on, `kernels.select`).

  With `stop_ids` (e.g. a model's end-of-turn ids), each row stops at its
  first stop id and the result is a `Generated` (tokens, lengths, stopped);
  without, it is the tokens, as always.
  """
  forms = forms or kernels.select(kernels.platform_of(params))
  stops = None if stop_ids is None else tuple(int(i) for i in stop_ids)
  if stops == ():
    raise ValueError("`stop_ids` is empty; pass None to never stop early.")
  return jitted_generate(params, prompt, config, key, max_new_tokens, temperature, top_k,
                         top_p, valid_vocab, stop_ids=stops, forms=forms,
                         greedy=is_greedy(temperature))


def is_greedy(temperature: chex.Numeric) -> bool:
  """Whether `temperature` is a Python number <= 0: greedy decoding known before tracing
  (a traced temperature may be either, so its program draws the noise)."""
  return isinstance(temperature, (int, float)) and temperature <= 0


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "top_k",
                                              "valid_vocab", "stop_ids", "forms",
                                              "num_samples", "greedy"))
def jitted_generate(
    params: Params,
    prompt: chex.Array,
    config: gpt.GPTConfig,
    key: chex.PRNGKey,
    max_new_tokens: int,
    temperature: chex.Numeric = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    valid_vocab: Optional[int] = None,
    *,
    stop_ids: Optional[Tuple[int, ...]] = None,
    forms: kernels.Forms,
    offsets: Optional[chex.Array] = None,
    num_samples: int = 1,
    row_stop_ids: Optional[chex.Array] = None,
    greedy: bool = False,
    strings: Optional[StopStrings] = None,
) -> Union[chex.Array, Generated]:
  """Continues `prompt` by `max_new_tokens` sampled tokens, with a KV cache.

  One program for each static argument (`.lower` and `.trace` as `jax.jit`'s).
  The whole decode loop is one `lax.scan` inside it (a `lax.while_loop`
  that ends when every row has stopped, with `stop_ids`); each step feeds
  one token through the cache. The cache holds prompt plus new tokens,
  up to `block_size`; context beyond follows `sliding_window`.

  Args:
    params: model params.
    prompt: `[batch, prompt_len]` or `[prompt_len]` int ids, prompt_len >= 1.
    config: model config.
    key: PRNG key; token i is drawn with `gumbel(fold_in(key, i))`.
    max_new_tokens: tokens to add (>= 1).
    temperature: softmax temperature; <= 0 for greedy decoding.
    top_k: optional top-k filter.
    top_p: optional nucleus filter.
    valid_vocab: ids from this one on are never sampled (the padding of a
      padded vocabulary); None: every id of the model's.
    stop_ids: ids that end a row (it is kept, and repeated after); static.
    forms: execution forms (`generate` chooses them when given none); static.
    offsets: optional `[batch]` int: the padding each prompt row begins with
      (prompts of different lengths, left-padded to one; `generate_batch`).
      Each row then runs at its own positions and never attends to its
      padding. Prompt and new tokens must fit in `block_size` (no sliding).
    num_samples: rows decoded per prompt row from its one prefill (its cache
      copied); the result's rows are prompt-major (`r * num_samples + i`).
    row_stop_ids: optional `[batch, k]` int: each prompt row's own stop ids
      (padded with -1), with `stop_ids` given (any tuple): rows stop at their own.
    greedy: static: every token is the argmax, and no noise is drawn (`temperature`
      is then not read). Drawn ahead for a greedy batch of HumanEval (256 tokens
      x 16 rows x 49152 ids), the noise held 805 MB; its draw took 2% of the
      batch's time.
    strings: optional `StopStrings`: a row also stops once its new text holds
      one of them (the token that completes it is its stop token).

  Returns:
    `[batch, prompt_len + max_new_tokens]` (or unbatched like `prompt`): the
    prompt followed by the new tokens; with `stop_ids` or `strings`, a
    `Generated`.
  """
  unbatched = prompt.ndim == 1
  if unbatched:
    prompt = prompt[None]
  chex.assert_rank(prompt, 2)
  chex.assert_type(prompt, int)
  b, p = prompt.shape
  if p < 1 or max_new_tokens < 1:
    raise ValueError(f"generate needs a non-empty prompt and max_new_tokens >= 1, "
                     f"got prompt length {p} and max_new_tokens={max_new_tokens}.")
  prompt = prompt.astype(jnp.int32)
  gpt.check_params(params, config)
  layers = kv_cache.layers_of(params, config)  # once, outside the decode loop
  plan = kv_cache.sliding_window(p, max_new_tokens, config.block_size)
  if (offsets is not None or num_samples > 1) and (plan.full_periods or plan.tail):
    raise ValueError(f"a padded or sampled-several batch must fit the context: prompt "
                     f"{p} + max_new_tokens {max_new_tokens} > block_size {config.block_size}.")
  # Late-bound below: a prompt row becomes num_samples rows after the prefill.
  rows = offsets
  feed = lambda tokens, cache, pos: kv_cache.forward(layers, params, tokens, cache, pos, config,
                                                     forms, offsets=rows)
  stops = None if stop_ids is None else jnp.asarray(stop_ids, jnp.int32)
  if stops is not None and row_stop_ids is not None:
    stops = jnp.asarray(row_stop_ids, jnp.int32)  # [batch, k]: each row's own
  stopping = stops is not None or strings is not None

  def noise(index):  # [batch, vocab] Gumbel noise of new token `index`
    return jax.random.gumbel(jax.random.fold_in(key, index), (b, config.vocab_size))

  def sample_and_write(state: DecodeState, token_noise) -> Tuple[DecodeState, chex.Array]:
    if greedy:
      token = sample_logits(None, state.logits, 0.0, gumbel=jnp.zeros((), state.logits.dtype),
                            valid_vocab=valid_vocab)
    else:
      token = sample_logits(None, state.logits, temperature, top_k, top_p, gumbel=token_noise,
                            valid_vocab=valid_vocab)
    if stopping:  # a stopped row repeats its stop token
      last = jax.lax.dynamic_index_in_dim(state.tokens, p + state.index - 1, 1, False)
      token = jnp.where(state.done, last, token)
      hit = jnp.zeros_like(state.done)
      if stops is not None:
        hit = jnp.isin(token, stops) if stops.ndim == 1 else (token[:, None] == stops).any(-1)
      if strings is not None:
        state = state._replace(text=_appended(strings, state.text, token))
        hit = hit | _holds_a_string(strings, state.text)
      state = state._replace(lengths=jnp.where(state.done, state.lengths, state.index + 1),
                             done=state.done | hit)
    tokens = jax.lax.dynamic_update_slice(state.tokens, token[:, None], (0, p + state.index))
    return state._replace(tokens=tokens, index=state.index + 1), token

  def decode(state: DecodeState, token_noise=None) -> Tuple[DecodeState, None]:
    # Each new token is sampled, written, then fed back (the last feed is wasted).
    if token_noise is None and not greedy:
      token_noise = noise(state.index)
    state, token = sample_and_write(state, token_noise)
    logits, cache = feed(token[:, None], state.cache, state.cache_len)
    return state._replace(cache=cache, cache_len=state.cache_len + 1, logits=logits), None

  def slide(state: DecodeState) -> DecodeState:
    state, _ = sample_and_write(state, None if greedy else noise(state.index))
    recent = jax.lax.dynamic_slice(state.tokens, (0, p + state.index - plan.refill),
                                   (b, plan.refill))
    logits, cache = feed(recent, state.cache, 0)
    return state._replace(cache=cache, cache_len=jnp.int32(plan.refill), logits=logits)

  def decodes(state: DecodeState, n: int) -> DecodeState:
    if n == 0:
      return state
    # One batch of noise per loop: on XLA CPU a draw inside the loop runs
    # JAX's threefry as a rolled loop once per token (a third of the time).
    ahead = (jax.vmap(noise)(state.index + jnp.arange(n)) if forms.noise_ahead and not greedy
             else None)
    if stopping:  # until every row has stopped
      first = state.index
      step = lambda s: decode(s, None if ahead is None else ahead[s.index - first])[0]
      return jax.lax.while_loop(lambda s: (s.index < first + n) & ~jnp.all(s.done), step,
                                state)
    if ahead is not None:
      return jax.lax.scan(decode, state, ahead)[0]
    return jax.lax.scan(lambda s, _: decode(s), state, None, length=n)[0]

  def slides(state: DecodeState, n: int) -> DecodeState:
    """`slide`, then `n` decodes; with stop ids or strings, nothing once every row has stopped."""
    if not stopping:
      return decodes(slide(state), n)
    return jax.lax.cond(jnp.all(state.done), lambda s: s, lambda s: decodes(slide(s), n), state)

  # The cache holds what this call needs: a short call reads a short cache.
  cache = init_kv_cache(config, b, min(config.block_size, plan.window + max_new_tokens))
  logits, cache = feed(prompt[:, p - plan.window:], cache, 0)
  if num_samples > 1:  # one prefill per prompt, its cache copied to each sample's row
    copy = lambda a: jnp.repeat(a.reshape(b, -1, *a.shape[1:]), num_samples,
                                axis=0).reshape(-1, *a.shape[1:])
    cache, logits = jax.tree.map(copy, cache), jnp.repeat(logits, num_samples, axis=0)
    prompt = jnp.repeat(prompt, num_samples, axis=0)
    rows = None if offsets is None else jnp.repeat(offsets, num_samples)
    if stops is not None and stops.ndim == 2:
      stops = jnp.repeat(stops, num_samples, axis=0)
    b = b * num_samples
  tokens = jnp.concatenate([prompt, jnp.zeros((b, max_new_tokens), jnp.int32)], axis=1)
  state = DecodeState(tokens, cache, jnp.int32(plan.window), logits, jnp.int32(0))
  if stopping:
    state = state._replace(lengths=jnp.zeros(b, jnp.int32), done=jnp.zeros(b, bool))
  if strings is not None:
    state = state._replace(text=jnp.full((b, _text_width(strings)), -1, jnp.int32))
  state = decodes(state, plan.first)
  if plan.full_periods:
    state = jax.lax.scan(lambda s, _: (slides(s, plan.period - 1), None), state,
                         None, length=plan.full_periods)[0]
  if plan.tail:
    state = slides(state, plan.tail - 1)
  tokens = state.tokens
  if stopping:  # rows cut short by the while loop's end repeat their stop token
    written = jnp.arange(max_new_tokens)[None, :] < state.lengths[:, None]
    last = jnp.take_along_axis(tokens, p + state.lengths[:, None] - 1, axis=1)
    tokens = tokens.at[:, p:].set(jnp.where(written | ~state.done[:, None],
                                            tokens[:, p:], last))
    lengths = jnp.where(state.done, state.lengths, max_new_tokens)
    out = Generated(tokens, lengths, state.done)
    return jax.tree.map(lambda a: a[0], out) if unbatched else out
  return tokens[0] if unbatched else tokens


# ----------------------------------------------------------------------------
# Many prompts of different lengths in one program.


class Completion(NamedTuple):
  """One row of `generate_batch`: the new tokens, and how they ended.

  Attributes:
    tokens: the new ids, through the stop id that ended them (if any).
    stopped: True where a stop id or stop string ended it (the caller cuts the text
      at the string).
  """
  tokens: Tuple[int, ...]
  stopped: bool


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  config: gpt.GPTConfig, caller: str) -> None:
  """Raises a ValueError naming `caller` unless there are prompts, none empty, and the
  longest fits the context with `max_new_tokens`."""
  if not prompts or not all(len(p) for p in prompts):
    raise ValueError(f"{caller} needs at least one prompt, each of at least one token.")
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > config.block_size:
    raise ValueError(f"the longest prompt ({longest} tokens) and max_new_tokens="
                     f"{max_new_tokens} exceed block_size={config.block_size}; lower "
                     f"max_new_tokens or shorten the prompts.")


def generate_batch(
    params: Params,
    prompts: Sequence[Sequence[int]],
    config: gpt.GPTConfig,
    key: chex.PRNGKey,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    valid_vocab: Optional[int] = None,
    stop_ids: Union[None, Sequence[int], Sequence[Sequence[int]]] = None,
    num_samples: int = 1,
    forms: Optional[kernels.Forms] = None,
    stop_strings: Optional[StopStrings] = None,
) -> List[List[Completion]]:
  """Continues every prompt in one program: `[prompt][sample]` completions.

  The prompts are left-padded to the longest (rounded up to a multiple of 32
  where the context allows, so that batches reuse programs); each row runs at its own
  positions and never attends to its padding, so a row's greedy tokens are
  those of its prompt decoded alone. Each prompt is prefilled once and its
  cache copied to its `num_samples` rows; row `i` of prompt `r` draws its noise
  as row `r * num_samples + i` of the batch. The cache is as long as the
  longest prompt plus `max_new_tokens`; they must fit in `block_size`.

  Args:
    params, config: the model.
    prompts: token ids, at least one each.
    key: the sampling key.
    max_new_tokens: new tokens per row, at most.
    temperature, top_k, top_p, valid_vocab: as `generate` (0: greedy).
    stop_ids: ids that end a row: one list for all prompts, or a list per prompt.
    num_samples: completions per prompt.
    forms: execution forms; None: those of the platform `params` live on.
    stop_strings: optional `StopStrings` (`stop_strings`): a row also ends once
      its new text holds one; its tokens run through the token that completes
      it (the caller cuts the text at the string).

  Raises:
    ValueError: no prompts, an empty prompt, a batch that does not fit the
      context, or stop ids for another number of prompts.
  """
  check_prompts(prompts, max_new_tokens, config, "generate_batch")
  if num_samples < 1 or max_new_tokens < 1:
    raise ValueError(f"generate_batch needs num_samples >= 1 and max_new_tokens >= 1, got "
                     f"{num_samples} and {max_new_tokens}.")
  longest = max(len(p) for p in prompts)
  # Padded to a multiple of 32 where it fits: batches of other lengths reuse a program.
  longest = max(longest, min(-(-longest // 32) * 32, config.block_size - max_new_tokens))
  tokens = jnp.asarray([[0] * (longest - len(p)) + [int(i) for i in p] for p in prompts],
                       jnp.int32)
  offsets = jnp.asarray([longest - len(p) for p in prompts], jnp.int32)
  per_row = None
  if stop_ids is not None and len(stop_ids) and not isinstance(stop_ids[0], int):
    if len(stop_ids) != len(prompts):
      raise ValueError(f"stop_ids has {len(stop_ids)} lists for {len(prompts)} prompts.")
    width = max(1, max(len(s) for s in stop_ids))
    per_row = jnp.asarray([list(s) + [-1] * (width - len(s)) for s in stop_ids], jnp.int32)
    shared = (-1,)
  else:
    shared = tuple(int(i) for i in stop_ids) if stop_ids else None
  forms = forms or kernels.select(kernels.platform_of(params))
  out = jitted_generate(params, tokens, config, key, max_new_tokens, temperature, top_k, top_p,
                        valid_vocab, stop_ids=shared, forms=forms, offsets=offsets,
                        num_samples=num_samples, row_stop_ids=per_row,
                        greedy=is_greedy(temperature), strings=stop_strings)
  if isinstance(out, Generated):
    rows, lengths, stopped = (jax.device_get(a) for a in out)
  else:
    rows = jax.device_get(out)
    lengths, stopped = [max_new_tokens] * len(rows), [False] * len(rows)
  completions = [Completion(tuple(int(t) for t in row[longest:longest + int(n)]), bool(s))
                 for row, n, s in zip(rows, lengths, stopped)]
  return [completions[r * num_samples:(r + 1) * num_samples] for r in range(len(prompts))]


# ----------------------------------------------------------------------------
# A conversation kept in a cache: each turn feeds only its own tokens.


class Conversation(NamedTuple):
  """The tokens a cache holds the keys and values of, for one sequence.

  `extend` and `stream` write into the cache in place (donated to XLA: a
  copy per token would cost more than the token), so the conversation given
  to them is used up; go on with the one they return.

  Attributes:
    cache: a batch-1 `KVCache` (`init_kv_cache(config, 1, length)`).
    ids: the ids at positions `0 .. len(ids) - 1` of the cache.
  """
  cache: KVCache
  ids: Tuple[int, ...] = ()


class Step(NamedTuple):
  """One streamed token: the token, the conversation holding it, the next logits."""
  token: int
  conversation: Conversation
  logits: chex.Array


def model_part(params: Params, config: gpt.GPTConfig) -> Tuple[Tuple[Params, ...], Params]:
  """`(layers, rest)`: each layer's params, sliced once (`kv_cache.layers_of`), and
  the params around them (embeddings, final norm, head: a tied one also as its own
  matrix, `kv_cache.with_head_matrix`), on the device, as `prefill` and `step` take them."""
  gpt.check_params(params, config)
  layers = tuple(jax.tree.map(jnp.asarray, kv_cache.layers_of(params, config)))
  rest = jax.tree.map(jnp.asarray, {k: v for k, v in params.items() if k != "blocks"})
  return layers, kv_cache.with_head_matrix(rest)


@functools.partial(jax.jit, static_argnames=("config", "forms"), donate_argnames=("cache",))
def prefill(layers, rest: Params, tokens: chex.Array, cache: KVCache, pos: chex.Numeric,
            count: chex.Numeric, config: gpt.GPTConfig, *, forms: kernels.Forms
            ) -> Tuple[chex.Array, KVCache]:
  """Feeds `tokens[:, :count]` `[batch, time]` at positions `pos, ...` (the rest is
  padding, so a few lengths compile); the logits `[batch, vocab]` of token
  `count - 1` and the cache. Needs `pos + time <= cache_length(cache)`."""
  return kv_cache.forward(layers, rest, tokens, cache, pos, config, forms, last=count - 1)


@functools.partial(jax.jit, static_argnames=("top_k", "valid_vocab", "config", "forms"),
                   donate_argnames=("cache",))
def step(layers, rest: Params, logits: chex.Array, cache: KVCache, pos: chex.Numeric,
         key: chex.PRNGKey, temperature: chex.Numeric = 1.0, top_k: Optional[int] = None,
         top_p: Optional[float] = None, valid_vocab: Optional[int] = None, *,
         config: gpt.GPTConfig, forms: kernels.Forms
         ) -> Tuple[chex.Array, chex.Array, KVCache]:
  """Draws a token from `logits` `[batch, vocab]` (`sample_logits`) and feeds it at
  `pos`: `(token [batch], its logits, cache)`."""
  token = sample_logits(key, logits, temperature, top_k, top_p, valid_vocab=valid_vocab)
  logits, cache = kv_cache.forward(layers, rest, token[:, None], cache, pos, config, forms)
  return token, logits, cache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  """How many ids `a` and `b` share from the start."""
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _room(conversation: Conversation, needed: int, config: gpt.GPTConfig) -> Conversation:
  """`conversation` with room for `needed` positions (doubling: few lengths compile)."""
  length = cache_length(conversation.cache, config)
  if needed <= length:
    return conversation
  if needed > config.block_size:
    raise ValueError(f"the conversation needs {needed} positions, more than the model's "
                     f"context (block_size={config.block_size}); start a new one.")
  while length < needed:
    length *= 2
  return conversation._replace(cache=grow_cache(conversation.cache,
                                                min(length, config.block_size), config))


def extend(layers, rest: Params, conversation: Conversation, ids: Sequence[int],
           config: gpt.GPTConfig, *, forms: kernels.Forms, pad_to: int = 64
           ) -> Tuple[chex.Array, Conversation]:
  """Brings `conversation` to the whole token sequence `ids` (a chat so far).

  Only what differs from the tokens already cached is fed: the ids past the
  longest common prefix, padded to a multiple of `pad_to`. A turn costs
  its own tokens, and the result equals feeding all of `ids` afresh.

  Returns:
    `(logits [1, vocab] after the last id, conversation holding ids)`.
  """
  ids = tuple(int(i) for i in ids)
  if not ids:
    raise ValueError("`ids` is empty; a conversation needs at least one token.")
  same = min(common_prefix(conversation.ids, ids), len(ids) - 1)  # feed one, for its logits
  if 1 in config.layer_kinds and same < len(conversation.ids) - 1:
    # A sliding-window layer's ring has overwritten what came before the tokens
    # being replaced (and the layers above depend on it): feed everything again.
    same = 0
  fresh = ids[same:]
  padded = -(-len(fresh) // pad_to) * pad_to
  _room(conversation, len(ids), config)  # raises past the model's context
  conversation = _room(conversation, min(same + padded, config.block_size), config)
  padded = min(padded, cache_length(conversation.cache, config) - same)
  tokens = jnp.asarray([fresh + (0,) * (padded - len(fresh))], jnp.int32)
  logits, cache = prefill(layers, rest, tokens, conversation.cache, jnp.int32(same),
                          jnp.int32(len(fresh)), config, forms=forms)
  return logits, Conversation(cache, ids)


def stream(layers, rest: Params, conversation: Conversation, logits: chex.Array,
           key: chex.PRNGKey, max_new_tokens: int, stop_ids: Sequence[int] = (),
           temperature: float = 1.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, valid_vocab: Optional[int] = None, *,
           config: gpt.GPTConfig, forms: kernels.Forms) -> Iterator[Step]:
  """Samples after `conversation` (whose next-token `logits` are given), one `Step`
  per token as it is decoded, until a stop id (yielded too), `max_new_tokens`
  or the model's context. Token i of the answer is drawn with
  `fold_in(key, i)`; the cache grows as needed."""
  stops = set(int(i) for i in stop_ids)
  for index in range(max_new_tokens):
    pos = len(conversation.ids)
    if pos >= config.block_size:
      return
    conversation = _room(conversation, pos + 1, config)
    token, logits, cache = step(layers, rest, logits, conversation.cache, jnp.int32(pos),
                                jax.random.fold_in(key, index), temperature, top_k, top_p,
                                valid_vocab, config=config, forms=forms)
    token = int(token[0])
    conversation = Conversation(cache, conversation.ids + (token,))
    yield Step(token, conversation, logits)
    if token in stops:
      return


def sample_text(params: Params, tokenizer, config: gpt.GPTConfig, key: chex.PRNGKey,
                num_tokens: int, prompt: Union[str, Sequence[int]] = "\n", *,
                stop_ids: Optional[Sequence[int]] = None,
                forms: Optional[kernels.Forms] = None) -> str:
  """`num_tokens` sampled after `prompt` (temperature 0.8, top-k 200), decoded to text.

  Args:
    params, config: the model.
    tokenizer: anything with `encode(str) -> ids`, `decode(ids) -> str` and
      `vocab_size` (ids past it, a padded vocabulary's rows, are never sampled).
    key: the sampling key.
    num_tokens: tokens to sample, at most.
    prompt: the text to continue, or its ids (a chat template's, whose
      special tokens a plain `encode` would spell out).
    stop_ids: ids that end the sample early (kept in it), e.g. an end of turn.
    forms: as in `generate`.

  Returns the prompt and its continuation, as text.
  """
  ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
  out = generate(params, jnp.asarray(ids), config, key, max_new_tokens=num_tokens,
                 temperature=0.8, top_k=200, valid_vocab=tokenizer.vocab_size,
                 stop_ids=stop_ids or None, forms=forms)
  if isinstance(out, Generated):
    out = out.tokens[:len(ids) + int(out.lengths)]
  return tokenizer.decode(out)

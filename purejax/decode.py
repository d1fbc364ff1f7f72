"""Choosing tokens: how each row's next token is drawn, when a row stops, and its text.

    token = decode.sample_logits(key, logits, temperature=0.8, top_k=200)   # [batch]

The rules `purejax.engine` decodes by, each written once:

* **Token choice** (`sample_logits`): greedy at temperature 0, else the
  Gumbel-max draw `argmax(logits / temperature + g)` after top-k and nucleus
  (top-p) filters. Settings may differ per row (`[batch]` arrays).
* **Noise** (`token_noise`): token `i` of a completion whose key is `k` is
  drawn with `g = gumbel(fold_in(k, i))`, whatever rows decode beside it. A
  batch call gives completion `j` the key `fold_in(key, j)`
  (`completion_key`), so a seed means the same tokens in any batch.
* **Stops**: stop ids, and stop strings matched on each row's last bytes
  inside the decode loop (`StopBytes`, `stop_hits`), so a row ends at a
  string without a trip to the host.
* **Text** (`TextStream`): new tokens become text in whole UTF-8
  characters, cut at the first stop string, and never show a string's start
  before it is known not to be one.

The model through its cache is `purejax.kv_cache`; this module knows nothing
of it beyond `forward_with_cache`, the one-call form of it.
"""

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np

from purejax import gpt
from purejax import kv_cache
from purejax.kv_cache import KVCache
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

  Each layer is `gpt.block`, attending through the cache (`kv_cache.forward`).

  Args:
    params: model params (`gpt.init_params`).
    tokens: `[batch, time]` ids; `pos + time <= ` the cache's length.
    cache: keys and values of positions `< pos` (later slots are ignored).
    pos: position of `tokens[:, 0]` (may be traced).
    config: model config.
    forms: execution forms; None: those of the platform `params` live on.

  Returns:
    `(logits of the last token [batch, vocab], cache updated with tokens)`.
  """
  gpt.check_tokens(tokens, config)
  gpt.check_params(params, config)
  b, t = tokens.shape
  kv_cache.check_cache(cache, config, b)
  model = kv_cache.Model(kv_cache.layers_of(params, config), kv_cache.with_head_matrix(params))
  starts = jnp.broadcast_to(jnp.asarray(pos, jnp.int32), (b,))
  return kv_cache.forward(model, tokens, cache, starts, jnp.full((b,), t, jnp.int32), config,
                          forms or kernels.select(kernels.platform_of(params)))


# ----------------------------------------------------------------------------
# Token choice and noise.


def completion_key(key: chex.PRNGKey, index: chex.Numeric) -> chex.PRNGKey:
  """The key of completion `index` of a call given `key`."""
  return jax.random.fold_in(key, index)


def token_noise(key: chex.PRNGKey, index: chex.Numeric, vocab_size: int) -> chex.Array:
  """`[vocab]` Gumbel noise of token `index` of the completion whose key is `key`."""
  return jax.random.gumbel(jax.random.fold_in(key, index), (vocab_size,))


def _per_row(value, rows: int, dtype) -> chex.Array:
  return jnp.broadcast_to(jnp.asarray(value, dtype), (rows,))


def sample_logits(
    key: Optional[chex.PRNGKey],
    logits: chex.Array,
    temperature: chex.Numeric = 1.0,
    top_k: Union[None, int, chex.Array] = None,
    top_p: Union[None, float, chex.Array] = None,
    *,
    gumbel: Optional[chex.Array] = None,
    valid_vocab: Optional[int] = None,
) -> chex.Array:
  """Draws one token per row of `logits` `[batch, vocab]` -> `[batch]` int32.

  `temperature <= 0` means greedy (argmax). `top_k` keeps the k most likely
  tokens (0 or None: all); `top_p` keeps the smallest set whose probability
  reaches p (nucleus sampling; 1 or None: all). Both filters may be combined,
  and each setting may be a scalar or `[batch]`, one a row. The draw is the
  Gumbel-max trick, `argmax(logits / temperature + g)` with
  `g = jax.random.gumbel(key, logits.shape)`; pass `gumbel` `[batch, vocab]`
  instead of `key` to supply `g` drawn ahead of time (`token_noise`). Ids
  from `valid_vocab` on (a vocabulary padded for speed, e.g. GPT-2's 50257
  ids in a 50304-row table) are never drawn.
  """
  chex.assert_rank(logits, 2)
  b, vocab = logits.shape
  if valid_vocab is not None and valid_vocab < vocab:
    logits = jnp.where(jnp.arange(vocab) < valid_vocab, logits, -jnp.inf)
  if isinstance(top_k, (int, np.integer)) and top_k < 0:
    raise ValueError(f"top_k={top_k}: pass None or 0 to keep every token, or k >= 1.")
  temperature = _per_row(temperature, b, jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  if top_k is not None or top_p is not None:
    top_k = _per_row(0 if top_k is None else top_k, b, jnp.int32)
    top_p = _per_row(1.0 if top_p is None else top_p, b, jnp.float32)
    # The filters sort every row's logits: only where some row asks for one. The
    # branches are module functions taking the settings as operands: a fresh closure
    # each call would compile the cond anew in every call made outside `jit`.
    scaled = jax.lax.cond(jnp.any(top_k > 0) | jnp.any(top_p < 1),
                          filter_logits, _unfiltered, scaled, top_k, top_p)
  if gumbel is None:
    gumbel = jax.random.gumbel(key, logits.shape)
  drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


def _unfiltered(scaled: chex.Array, top_k: chex.Array, top_p: chex.Array) -> chex.Array:
  del top_k, top_p
  return scaled


def filter_logits(scaled: chex.Array, top_k: chex.Array, top_p: chex.Array) -> chex.Array:
  """`scaled` `[batch, vocab]` with the tokens outside each row's top-k (`[batch]`, 0: all)
  and nucleus (`[batch]`, 1: all) at -inf."""
  vocab = scaled.shape[-1]
  ordered = -jnp.sort(-scaled, axis=-1)  # [batch, vocab], most likely first
  kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=1)[:, 0]
  cutoff = jnp.where(top_k > 0, kth, -jnp.inf)
  kept = jnp.where(ordered >= cutoff[:, None], ordered, -jnp.inf)
  probs = jax.nn.softmax(kept, axis=-1)
  # The smallest logit still inside the nucleus: tokens whose mass before them is
  # below top_p are kept (always at least the most likely one).
  inside = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
  nucleus = jnp.min(jnp.where(inside, ordered, jnp.inf), axis=-1)
  cutoff = jnp.where(top_p < 1, jnp.maximum(cutoff, nucleus), cutoff)
  return jnp.where(scaled < cutoff[:, None], -jnp.inf, scaled)


def log_probs(logits: chex.Array, token: chex.Array, top: int
              ) -> Tuple[chex.Array, chex.Array, chex.Array]:
  """The model's log-probabilities (temperature 1, no filters) of `token` `[batch]` under
  `logits` `[batch, vocab]`, and the `top` most likely ids and theirs:
  `([batch], [batch, top] ids, [batch, top])`."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0]
  if top == 0:
    empty = jnp.zeros((logits.shape[0], 0))
    return chosen, empty.astype(jnp.int32), empty
  values, ids = jax.lax.top_k(logp, top)
  return chosen, ids.astype(jnp.int32), values


# ----------------------------------------------------------------------------
# Stop strings, inside the decode loop.


class StopBytes(NamedTuple):
  """Each token's UTF-8 bytes, for matching stop strings inside the decode loop.

  Attributes:
    token_bytes: `[vocab, width]` int32: each id's bytes, left-aligned, -1 after.
    token_lengths: `[vocab]` int32: how many.
  """
  token_bytes: chex.Array
  token_lengths: chex.Array


def stop_bytes(token_texts: Sequence[str], vocab_size: Optional[int] = None) -> StopBytes:
  """The `StopBytes` of a tokenizer whose id `i` reads `token_texts[i]` inside a longer
  text (`tokenizers.token_texts`); ids past them (a padded vocabulary's) have none."""
  encoded = [t.encode("utf-8") for t in token_texts]
  vocab_size = max(vocab_size or 0, len(encoded))
  width = max(1, max(len(b) for b in encoded))
  token_bytes = np.full((vocab_size, width), -1, np.int32)
  lengths = np.zeros(vocab_size, np.int32)
  for i, b in enumerate(encoded):
    token_bytes[i, :len(b)] = list(b)
    lengths[i] = len(b)
  return StopBytes(jnp.asarray(token_bytes), jnp.asarray(lengths))


def encode_stop_strings(strings: Sequence[str], count: int, longest: int) -> np.ndarray:
  """`[count, longest]` int32: each string's UTF-8 bytes, right-aligned, -1 before; rows
  past the strings all -1 (no string).

  Raises:
    ValueError: an empty string, more than `count`, or one over `longest` bytes.
  """
  if not all(isinstance(s, str) and s for s in strings):
    raise ValueError(f"stop strings must be non-empty strings, got {list(strings)!r}.")
  if len(strings) > count:
    raise ValueError(f"{len(strings)} stop strings; at most {count} are matched.")
  table = np.full((count, longest), -1, np.int32)
  for i, s in enumerate(strings):
    b = s.encode("utf-8")
    if len(b) > longest:
      raise ValueError(f"stop string {s!r} is {len(b)} bytes; at most {longest} are matched.")
    table[i, longest - len(b):] = list(b)
  return table


def text_width(table: StopBytes, longest: int) -> int:
  """Bytes a row keeps: enough for a string that ends in the newest token's bytes."""
  return table.token_bytes.shape[1] + longest


def appended(table: StopBytes, text: chex.Array, token: chex.Array) -> chex.Array:
  """`[batch, bytes]` the last bytes of each row's text once `token` `[batch]` is read."""
  new = table.token_bytes[token]  # [batch, width]
  joined = jnp.concatenate([text, new], axis=1)
  start = table.token_lengths[token][:, None] + jnp.arange(text.shape[1])[None]
  return jnp.take_along_axis(joined, start, axis=1)


def stop_hits(strings: chex.Array, text: chex.Array) -> chex.Array:
  """`[batch]` whether each row's kept text `[batch, bytes]` holds one of its own strings
  `[batch, n, longest]` (`encode_stop_strings`)."""
  longest = strings.shape[-1]
  # One gather of every window (82 slices and a stack took 10% of a decoding step).
  starts = np.arange(text.shape[1] - longest + 1)[:, None] + np.arange(longest)[None]
  windows = text[:, starts]  # [batch, windows, longest]
  wanted = strings[:, None]  # [batch, 1, n, longest]
  equal = (windows[:, :, None] == wanted) | (wanted < 0)
  real = (strings[:, :, -1] >= 0)[:, None]  # [batch, 1, n]: a string, not an empty row
  return (equal.all(-1) & real).any((1, 2))


# ----------------------------------------------------------------------------
# What a completion is, and its text.


class Completion(NamedTuple):
  """One completion: its new tokens, how they ended, and their log-probabilities.

  Attributes:
    tokens: the new ids, through the stop id or the token that completed the stop
      string that ended them (if any).
    stopped: True where a stop id or stop string ended it; False where it ran to its
      token limit (or the context's end).
    logprobs: with log-probabilities asked for, each token's under the model.
    top_logprobs: with `top` of them asked for, each step's `((id, logprob), ...)`.
  """
  tokens: Tuple[int, ...]
  stopped: bool
  logprobs: Optional[Tuple[float, ...]] = None
  top_logprobs: Optional[Tuple[Tuple[Tuple[int, float], ...], ...]] = None

  @property
  def finish_reason(self) -> str:
    """OpenAI's name for how it ended: "stop" or "length"."""
    return "stop" if self.stopped else "length"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  """How many ids `a` and `b` share from the start."""
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class TextStream:
  """A completion's text as its tokens arrive: whole characters, cut at a stop string.

      stream = TextStream(tokenizer.decode, stop=["\\n\\n"])
      for tokens in chunks:
        show(stream.push(tokens))       # the new text, maybe ""
        if stream.stopped: break
      show(stream.finish())

  Text is shown only when it can no longer change: not while the last
  bytes are part of a character still arriving (U+FFFD), and not while its
  end could be the start of a stop string. A stop string and what follows
  are never shown. The tokens are decoded whole each push, so a tokenizer's
  merges across token boundaries read as they will in the final text.
  """

  def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
    self._decode, self._stop = decode, tuple(s for s in stop if s)
    self._ids: List[int] = []
    self._shown = 0  # characters of the final text given out
    self.text = ""  # the text so far, cut at a stop string
    self.stopped = False

  def push(self, tokens: Sequence[int]) -> str:
    """Takes new tokens; returns the text that became certain (maybe "")."""
    if self.stopped or not tokens:
      return ""
    self._ids.extend(int(t) for t in tokens)
    text = self._decode(self._ids)
    cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
    if cut >= 0:
      self.text, self.stopped = text[:cut], True
      return self._give(len(self.text))
    self.text = text
    end = len(text.rstrip("\ufffd"))  # a character still arriving
    held = max((n for s in self._stop for n in range(1, min(len(s) - 1, end) + 1)
                if text[end - n:end] == s[:n]), default=0)  # could begin a stop string
    return self._give(end - held)

  def finish(self) -> str:
    """The rest of the text, once no more tokens come."""
    return self._give(len(self.text))

  def _give(self, end: int) -> str:
    out = self.text[self._shown:max(end, self._shown)]
    self._shown = max(end, self._shown)
    return out

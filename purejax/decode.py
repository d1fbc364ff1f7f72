"""Sampling from a GPT with a KV cache, in one jitted `lax.scan` decode loop.

    out = generate(params, prompt, config, key, max_new_tokens=500,
                   temperature=0.8, top_k=200)          # [batch, prompt + new]

The model's own code is `purejax/gpt.py`; this module runs its blocks one
token at a time against cached keys and values, and never the reverse.
"""

import functools
import math
from typing import NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from purejax.ops import attention
from purejax.ops import kernels
from purejax import gpt
from purejax import nn

Params = gpt.Params


class KVCache(NamedTuple):
  """Keys and values of past positions: one `[batch * kv_heads, block, head_dim]` array per layer.

  Only the key/value heads are cached: with grouped-query attention
  (`GPTConfig.n_kv_head`) the cache takes `n_kv_head / n_head` of the memory
  a cache of every head would (a quarter for Llama 3 8B's 8 of 32 heads).

  Batch and head share one axis because that is the layout XLA's batched
  matmul wants: with `[batch, head, ...]` arrays XLA fused the cache update
  into a reshape for the attention product as well as into the loop's
  output, so it wrote the cache twice and copied all of it three times per
  token.
  """
  k: Tuple[chex.Array, ...]
  v: Tuple[chex.Array, ...]


def _cache_layer_shape(config: gpt.GPTConfig, batch: int) -> Tuple[int, int, int]:
  return (batch * config.kv_heads, config.block_size, config.head_dim)


def init_kv_cache(config: gpt.GPTConfig, batch: int) -> KVCache:
  """An empty (zero) cache for `batch` sequences."""
  shape = _cache_layer_shape(config, batch)
  zeros = tuple(jnp.zeros(shape, jnp.float32) for _ in range(config.n_layer))
  return KVCache(zeros, zeros)


def _check_cache(cache: KVCache, config: gpt.GPTConfig, batch: int) -> None:
  layer_shape = _cache_layer_shape(config, batch)
  want = KVCache(*[(layer_shape,) * config.n_layer] * 2)
  got = jax.tree.map(jnp.shape, cache)
  if got != want:
    raise ValueError(f"KV cache of shapes {got}, but this config and batch need "
                     f"{config.n_layer} layers of {layer_shape}; build it with "
                     f"init_kv_cache(config, batch).")


def _layers(params: Params, n_layer: int) -> Tuple[Params, ...]:
  """Each layer's params, sliced from the stacked `params["blocks"]` (static slices).

  Decoding runs the layers as an unrolled loop. Sliced inside the decode
  loop, XLA copies each layer's weights for every token (that was most of
  the time per token), so `generate` slices once, before the loop.
  """
  return tuple(jax.tree.map(lambda p, i=i: p[i], params["blocks"]) for i in range(n_layer))


def _cached_attend(k_buf: chex.Array, v_buf: chex.Array, pos: chex.Numeric,
                   config: gpt.GPTConfig, forms: kernels.Forms) -> gpt.Attend:
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

  def attend(q, k, v):
    b, t = q.shape[:2]
    k_new, v_new = (a.transpose(0, 2, 1, 3) for a in (k, v))  # [b, kv, t, d]
    bufs = (jax.lax.dynamic_update_slice(buf, new.reshape(b * kv, t, d), (0, pos, 0))
            for buf, new in ((k_buf, k_new), (v_buf, v_new)))
    if forms.attention == "cudnn" and isinstance(pos, int) and pos == 0:
      y = attention.causal_attention(q, k, v, form="cudnn", compute_dtype=compute_dtype)
      return y, tuple(bufs)
    q = q.transpose(0, 2, 1, 3)  # [b, h, t, d]
    new_k_buf, new_v_buf = bufs
    y = attention.attend_to_cache(q * (1.0 / math.sqrt(d)), new_k_buf.reshape(b, kv, -1, d),
                                  new_v_buf.reshape(b, kv, -1, d), pos,
                                  compute_dtype=compute_dtype)
    return y.transpose(0, 2, 1, 3), (new_k_buf, new_v_buf)

  return attend


def _forward_with_cache(layers, params, tokens, cache, pos, config, forms):
  """`forward_with_cache` over per-layer params `layers` (`_layers`)."""
  x = gpt.input_states(params, tokens, config, pos)
  # Decoding does little work per layer, so a plain Python loop over the
  # layers (unrolled in the compiled program) beats a scan's overhead.
  ks, vs = [], []
  for i, (layer, k_buf, v_buf) in enumerate(zip(layers, cache.k, cache.v)):
    x, (k_buf, v_buf) = gpt.block(layer, x, config, forms=forms,
                                  attend=_cached_attend(k_buf, v_buf, pos, config, forms),
                                  start=pos,
                                  value_embed=gpt.value_embedding(params, tokens, config, i))
    ks.append(k_buf)
    vs.append(v_buf)
  x = gpt.final_norm(params, x[:, -1], config)
  return gpt.logits_of(params, x, config, forms), KVCache(tuple(ks), tuple(vs))


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
  _check_cache(cache, config, tokens.shape[0])
  return _forward_with_cache(_layers(params, config.n_layer), params, tokens, cache, pos,
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


class DecodeState(NamedTuple):
  """What the decode loop carries from one token to the next.

  Attributes:
    tokens: `[batch, prompt_len + max_new_tokens]` prompt and tokens so far.
    cache: the KV cache.
    cache_len: positions filled in the cache.
    logits: `[batch, vocab]` next-token logits.
    index: how many new tokens are written.
  """
  tokens: chex.Array
  cache: KVCache
  cache_len: chex.Array
  logits: chex.Array
  index: chex.Array


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
    forms: Optional[kernels.Forms] = None,
) -> chex.Array:
  """Continues `prompt` by `max_new_tokens` sampled tokens: `jitted_generate`, with
  `forms` (None: those of the platform `params` live on, `kernels.select`)."""
  forms = forms or kernels.select(kernels.platform_of(params))
  return jitted_generate(params, prompt, config, key, max_new_tokens, temperature, top_k,
                         top_p, valid_vocab, forms=forms)


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "top_k",
                                              "valid_vocab", "forms"))
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
    forms: kernels.Forms,
) -> chex.Array:
  """Continues `prompt` by `max_new_tokens` sampled tokens, with a KV cache.

  One program for each static argument (`.lower` and `.trace` as `jax.jit`'s).
  The whole decode loop is one `lax.scan` inside it; each step feeds
  one token through the cache. Context beyond `block_size` follows
  `sliding_window`.

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
    forms: execution forms (`generate` chooses them when given none); static.

  Returns:
    `[batch, prompt_len + max_new_tokens]` (or unbatched like `prompt`): the
    prompt followed by the new tokens.
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
  layers = _layers(params, config.n_layer)  # once, outside the decode loop
  plan = sliding_window(p, max_new_tokens, config.block_size)
  feed = functools.partial(_forward_with_cache, layers, params, config=config, forms=forms)

  def noise(index):  # [batch, vocab] Gumbel noise of new token `index`
    return jax.random.gumbel(jax.random.fold_in(key, index), (b, config.vocab_size))

  def sample_and_write(state: DecodeState, token_noise) -> Tuple[DecodeState, chex.Array]:
    token = sample_logits(None, state.logits, temperature, top_k, top_p, gumbel=token_noise,
                          valid_vocab=valid_vocab)
    tokens = jax.lax.dynamic_update_slice(state.tokens, token[:, None], (0, p + state.index))
    return state._replace(tokens=tokens, index=state.index + 1), token

  def decode(state: DecodeState, token_noise=None) -> Tuple[DecodeState, None]:
    # Each new token is sampled, written, then fed back through the cache.
    # (The last token's feed is wasted work, one step.)
    if token_noise is None:
      token_noise = noise(state.index)
    state, token = sample_and_write(state, token_noise)
    logits, cache = feed(token[:, None], state.cache, state.cache_len)
    return state._replace(cache=cache, cache_len=state.cache_len + 1, logits=logits), None

  def slide(state: DecodeState) -> DecodeState:
    state, _ = sample_and_write(state, noise(state.index))
    recent = jax.lax.dynamic_slice(state.tokens, (0, p + state.index - plan.refill),
                                   (b, plan.refill))
    logits, cache = feed(recent, state.cache, 0)
    return state._replace(cache=cache, cache_len=jnp.int32(plan.refill), logits=logits)

  def decodes(state: DecodeState, n: int) -> DecodeState:
    if n == 0:
      return state
    if forms.noise_ahead:
      # One batch of noise per scan: on XLA CPU a draw inside the loop runs
      # JAX's threefry as a rolled loop once per token (a third of the time).
      ahead = jax.vmap(noise)(state.index + jnp.arange(n))  # [n, batch, vocab]
      return jax.lax.scan(decode, state, ahead)[0]
    return jax.lax.scan(lambda s, _: decode(s), state, None, length=n)[0]

  logits, cache = feed(prompt[:, p - plan.window:], init_kv_cache(config, b), 0)
  tokens = jnp.concatenate([prompt, jnp.zeros((b, max_new_tokens), jnp.int32)], axis=1)
  state = DecodeState(tokens, cache, jnp.int32(plan.window), logits, jnp.int32(0))
  state = decodes(state, plan.first)
  if plan.full_periods:
    state = jax.lax.scan(lambda s, _: (decodes(slide(s), plan.period - 1), None), state,
                         None, length=plan.full_periods)[0]
  if plan.tail:
    state = decodes(slide(state), plan.tail - 1)
  return state.tokens[0] if unbatched else state.tokens


def sample_text(params: Params, tokenizer, config: gpt.GPTConfig, key: chex.PRNGKey,
                num_tokens: int, prompt: str = "\n", *,
                forms: Optional[kernels.Forms] = None) -> str:
  """`num_tokens` sampled after `prompt` (temperature 0.8, top-k 200), decoded to text.

  Args:
    params, config: the model.
    tokenizer: anything with `encode(str) -> ids`, `decode(ids) -> str` and
      `vocab_size` (ids past it, a padded vocabulary's rows, are never sampled).
    key: the sampling key.
    num_tokens: tokens to sample.
    prompt: the text to continue.
    forms: as in `generate`.

  Returns:
    The prompt and its continuation, as text.
  """
  out = generate(params, jnp.asarray(tokenizer.encode(prompt)), config, key,
                 max_new_tokens=num_tokens, temperature=0.8, top_k=200,
                 valid_vocab=tokenizer.vocab_size, forms=forms)
  return tokenizer.decode(out)

"""NanoGPT as pure functions over a params pytree.

    config = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    params = init_params(config, jax.random.PRNGKey(0))
    logits = forward(params, tokens, config)                  # [batch, time, vocab]
    text_ids = generate(params, prompt, config, key, max_new_tokens=500)

The architecture is GPT-2's: learned token and position embeddings,
pre-LayerNorm blocks of causal self-attention and a tanh-GELU MLP, a final
LayerNorm and an output head tied to the token embedding.

The `n_layer` blocks share one structure, so their params are stacked on a
leading `[n_layer]` axis and the blocks run as one `jax.lax.scan`: XLA
compiles one block, not `n_layer` copies, so compile time barely grows with
depth. Dropout keys are threaded explicitly, one per layer.
"""

import dataclasses
import functools
import math
from typing import Any, Dict, NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp
import optax

from purejax import nn
from purejax import parallel
from purejax import rng

Params = Dict[str, Any]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# GPTConfig.remat -> what jax.checkpoint keeps for the backward pass.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Model hyperparameters (hashable, so it can be a static jit argument).

  Attributes:
    vocab_size: number of token ids.
    block_size: longest context the model sees (size of the position table).
    n_layer: transformer blocks.
    n_head: attention heads; must divide `n_embd`.
    n_embd: model width.
    dropout: drop rate in [0, 1) for embeddings, attention and residuals.
    bias: whether dense layers and LayerNorms have biases.
    param_dtype: dtype of the stored params ("float32").
    compute_dtype: dtype of the matmuls ("float32" or "bfloat16"); LayerNorm,
      softmax and the loss always run in float32.
    remat: how each block is wrapped in `jax.checkpoint` for the backward
      pass: "none" stores every activation; "full" stores only the block's
      input and recomputes the rest; "dots" (default) stores the matmul
      outputs and recomputes the cheap elementwise ops. On CPU "dots" is the
      fastest by far (26 ms/iter vs 55 ms/iter for "none" on nanoGPT's CPU
      recipe): writing every activation of every layer into the scan's
      stacked buffers, and reading it back, costs more than recomputing it.
    attn_block: queries per block of causal attention (see
      `causal_self_attention`); only speed depends on it.
  """
  vocab_size: int = 65
  block_size: int = 64
  n_layer: int = 4
  n_head: int = 4
  n_embd: int = 128
  dropout: float = 0.0
  bias: bool = True
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  remat: str = "dots"
  attn_block: int = 64

  def __post_init__(self):
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "attn_block"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
    if self.n_embd % self.n_head:
      raise ValueError(
          f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; choose "
          f"n_head among the divisors of n_embd (e.g. --n_head="
          f"{math.gcd(self.n_embd, self.n_head)}).")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {self.dropout}.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r} is not one of {sorted(REMAT_POLICIES)}.")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is not one of "
                         f"{sorted(_DTYPES)}.")

  @property
  def head_dim(self) -> int:
    return self.n_embd // self.n_head

  @property
  def matmul_dtype(self):
    """Operand dtype of the matmuls; None when they run in float32."""
    return None if self.compute_dtype == "float32" else _DTYPES[self.compute_dtype]


# ----------------------------------------------------------------------------
# Initialisation


def init_block(key: chex.PRNGKey, config: GPTConfig) -> Params:
  """Params of one transformer block (unstacked).

  GPT-2 initialisation: weights N(0, 0.02^2), except the two projections that
  write into the residual stream, scaled by 1/sqrt(2 * n_layer) so the
  residual variance does not grow with depth.
  """
  c, dtype = config.n_embd, _DTYPES[config.param_dtype]
  keys = rng.split_named(key, ("qkv", "attn_proj", "fc", "mlp_proj"))
  resid_scale = 0.02 / math.sqrt(2 * config.n_layer)
  dense = functools.partial(nn.init_dense, bias=config.bias, dtype=dtype)
  return {
      "ln_1": nn.init_layer_norm(c, bias=config.bias, dtype=dtype),
      "attn": {
          "qkv": dense(keys["qkv"], c, 3 * c, scale=0.02),
          "proj": dense(keys["attn_proj"], c, c, scale=resid_scale),
      },
      "ln_2": nn.init_layer_norm(c, bias=config.bias, dtype=dtype),
      "mlp": {
          "fc": dense(keys["fc"], c, 4 * c, scale=0.02),
          "proj": dense(keys["mlp_proj"], 4 * c, c, scale=resid_scale),
      },
  }


def init_params(config: GPTConfig, key: chex.PRNGKey) -> Params:
  """All model params; block params are stacked on a leading `[n_layer]` axis.

  Returns:
    `{"wte": {"embedding": [vocab, embd]}, "wpe": {"embedding": [block, embd]},
      "blocks": <init_block tree, each leaf with a leading [n_layer] axis>,
      "ln_f": {...}}`. The output head reuses `wte` (tied embeddings).
  """
  keys = rng.split_named(key, ("wte", "wpe", "blocks"))
  dtype = _DTYPES[config.param_dtype]
  block_keys = rng.layer_keys(keys["blocks"], config.n_layer)
  return {
      "wte": nn.init_embedding(keys["wte"], config.vocab_size, config.n_embd, dtype=dtype),
      "wpe": nn.init_embedding(keys["wpe"], config.block_size, config.n_embd, dtype=dtype),
      "blocks": jax.vmap(lambda k: init_block(k, config))(block_keys),
      "ln_f": nn.init_layer_norm(config.n_embd, bias=config.bias, dtype=dtype),
  }


def num_params(params: Params, *, non_embedding: bool = True) -> int:
  """Parameter count; like nanoGPT, leaves out position embeddings by default."""
  total = sum(x.size for x in jax.tree.leaves(params))
  if non_embedding:
    total -= params["wpe"]["embedding"].size
  return total


# ----------------------------------------------------------------------------
# The model


class KVCache(NamedTuple):
  """Keys and values of past positions: one `[batch * head, block, head_dim]` array per layer.

  Batch and head share one axis because that is the layout XLA's batched
  matmul wants: with `[batch, head, ...]` arrays XLA fused the cache update
  into a reshape for the attention product as well as into the loop's
  output, so it wrote the cache twice and copied all of it three times per
  token (bench/README.md, #13).
  """
  k: Tuple[chex.Array, ...]
  v: Tuple[chex.Array, ...]


def _kv_cache_layer_shape(config: GPTConfig, batch: int) -> Tuple[int, int, int]:
  return (batch * config.n_head, config.block_size, config.head_dim)


def init_kv_cache(config: GPTConfig, batch: int) -> KVCache:
  shape = _kv_cache_layer_shape(config, batch)
  zeros = tuple(jnp.zeros(shape, jnp.float32) for _ in range(config.n_layer))
  return KVCache(zeros, zeros)


def unstack_layers(params: Params) -> Params:
  """`params` with `"blocks"` as a tuple of per-layer dicts instead of stacked arrays.

  Decoding slices each layer's weights for every token; inside a loop XLA
  copies those slices each time. Unstacking once, before the loop, removes
  the copies (they were most of the time per token).
  """
  blocks = params["blocks"]
  if isinstance(blocks, tuple):
    return params
  n_layer = jax.tree.leaves(blocks)[0].shape[0]
  layers = tuple(jax.tree.map(lambda p, i=i: p[i], blocks) for i in range(n_layer))
  return {**params, "blocks": layers}


def attend(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    query_start: chex.Numeric,
    *,
    key: Optional[chex.PRNGKey] = None,
    dropout: float = 0.0,
    deterministic: bool = True,
) -> chex.Array:
  """Causal softmax attention of queries at positions `query_start, ...`.

  Args:
    q: `[batch, head, time, head_dim]` queries, already scaled by
      `1/sqrt(head_dim)`.
    k, v: `[batch, head, keys, head_dim]`, key `s` at position `s`.
    query_start: position of `q[:, :, 0]` (may be traced).
    key, dropout, deterministic: dropout on the attention weights.

  Returns:
    `[batch, head, time, head_dim]`: query t attends to keys `<= query_start + t`.
  """
  t, s = q.shape[2], k.shape[2]
  scores = jnp.einsum("bhtd,bhsd->bhts", q, k)  # [b, h, t, s]
  causal = jnp.arange(s)[None, :] <= (query_start + jnp.arange(t))[:, None]  # [t, s]
  if t == 1:
    # One query (a decoding step): here the plain softmax compiles to the
    # faster program (sampling ran ~8% slower with the form below).
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    weights = nn.dropout(key, weights, dropout, deterministic=deterministic)
    return jnp.einsum("bhts,bhsd->bhtd", weights, v)
  # A finite "minus infinity" and a written-out softmax: `jax.nn.softmax`
  # over -inf entries ran ~3x slower on XLA CPU (256-token blocks). Every
  # query sees at least itself, so no row is all masked.
  scores = jnp.where(causal, scores, -1e30)
  unnormalised = jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
  total = unnormalised.sum(-1, keepdims=True)  # [b, h, t, 1]
  unnormalised = nn.dropout(key, unnormalised, dropout, deterministic=deterministic)
  # Normalising the [b, h, t, d] output instead of the [b, h, t, s] weights
  # saves a pass over the larger array.
  return jnp.einsum("bhts,bhsd->bhtd", unnormalised, v) / total


def causal_self_attention(
    params: Params,
    x: chex.Array,
    config: GPTConfig,
    *,
    key: Optional[chex.PRNGKey],
    deterministic: bool,
    cache: Optional[Tuple[chex.Array, chex.Array]] = None,
    pos: chex.Numeric = 0,
) -> Tuple[chex.Array, Optional[Tuple[chex.Array, chex.Array]]]:
  """Multi-head causal self-attention.

  Without a cache, position t attends to positions <= t of `x`. The queries
  run in blocks of `config.attn_block`: block i needs only the keys up to
  its own end, so the masked upper triangle is mostly never computed
  (10/16 of the full score matrix for 256 positions in blocks of 64). Each
  block's softmax spans all of its keys at once, so the result is exact.

  With a cache (`[batch * head, block, head_dim]` keys and values of one
  layer), `x` holds the tokens at positions `pos, pos+1, ...`: their keys and
  values are written into the cache and they attend to every cached position
  up to their own.

  Args:
    params: `{"qkv", "proj"}` dense params.
    x: `[batch, time, embd]`.
    config: model config.
    key: dropout key (unused if deterministic).
    deterministic: disables dropout.
    cache: optional `(k, v)` of one layer.
    pos: position of `x[:, 0]` (cache mode only).

  Returns:
    `([batch, time, embd], updated cache or None)`.
  """
  b, t, c = x.shape
  h, d = config.n_head, config.head_dim
  qkv = nn.dense(params["qkv"], x, compute_dtype=config.matmul_dtype)  # [b, t, 3c]
  qkv = qkv.reshape(b, t, 3, h, d).transpose(2, 0, 3, 1, 4)  # [3, b, h, t, d]
  # Attention's products stay float32: they are ~10% of the FLOPs at T=256,
  # and bf16 versions measured no faster overall (bench/README.md, #10).
  q, k, v = qkv[0] * (1.0 / math.sqrt(d)), qkv[1], qkv[2]
  attend_ = functools.partial(attend, dropout=config.dropout, deterministic=deterministic)
  if cache is not None:
    cache = tuple(jax.lax.dynamic_update_slice(buf, new.reshape(b * h, t, d), (0, pos, 0))
                  for buf, new in zip(cache, (k, v)))  # [b * h, block, d] each
    k, v = (buf.reshape(b, h, config.block_size, d) for buf in cache)
    y = attend_(q, k, v, pos, key=key)
  else:
    blocks = []
    for i, start in enumerate(range(0, t, config.attn_block)):
      stop = min(start + config.attn_block, t)
      block_key = None if deterministic else jax.random.fold_in(key, i)
      blocks.append(attend_(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], start,
                            key=block_key))
    y = jnp.concatenate(blocks, axis=2)  # [b, h, t, d]
  y = y.transpose(0, 2, 1, 3).reshape(b, t, c)
  return nn.dense(params["proj"], y, compute_dtype=config.matmul_dtype), cache


def mlp(params: Params, x: chex.Array, config: GPTConfig) -> chex.Array:
  """Position-wise `proj(gelu(fc(x)))`: `[..., embd] -> [..., embd]`."""
  hidden = nn.gelu(nn.dense(params["fc"], x, compute_dtype=config.matmul_dtype))
  return nn.dense(params["proj"], hidden, compute_dtype=config.matmul_dtype)


def block(
    params: Params,
    x: chex.Array,
    config: GPTConfig,
    *,
    key: Optional[chex.PRNGKey],
    deterministic: bool,
    cache: Optional[Tuple[chex.Array, chex.Array]] = None,
    pos: chex.Numeric = 0,
) -> Tuple[chex.Array, Optional[Tuple[chex.Array, chex.Array]]]:
  """One pre-LayerNorm transformer block: `[batch, time, embd]` -> same."""
  keys = (None, None, None) if deterministic else jax.random.split(key, 3)
  attn_out, cache = causal_self_attention(
      params["attn"], nn.layer_norm(params["ln_1"], x), config,
      key=keys[0], deterministic=deterministic, cache=cache, pos=pos)
  x = x + nn.dropout(keys[1], attn_out, config.dropout, deterministic=deterministic)
  mlp_out = mlp(params["mlp"], nn.layer_norm(params["ln_2"], x), config)
  x = x + nn.dropout(keys[2], mlp_out, config.dropout, deterministic=deterministic)
  return x, cache


def _path_shapes(tree, prefix: str = "") -> Dict[str, Tuple[int, ...]]:
  """{pytree path: shape} of every leaf of `tree`."""
  return {prefix + jax.tree_util.keystr(path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@functools.lru_cache(maxsize=16)
def _expected_param_shapes(config: GPTConfig) -> Dict[str, Tuple[int, ...]]:
  """`_path_shapes` of `init_params(config, ...)`, without running it."""
  return _path_shapes(jax.eval_shape(lambda key: init_params(config, key),
                                     jax.random.PRNGKey(0)))


def check_params(params: Params, config: GPTConfig) -> None:
  """Raises ValueError unless `params` have the shapes `config` describes.

  Params of another config would otherwise run silently (a scan simply runs
  over however many layers are stacked) or fail deep inside XLA. Accepts
  stacked blocks and the per-layer tuple of `unstack_layers`. Only shapes
  are checked, so it costs nothing inside a jit.
  """
  expected = _expected_param_shapes(config)
  blocks = params.get("blocks") if isinstance(params, dict) else None
  if isinstance(blocks, tuple):  # per-layer params: compare as if stacked
    if len(blocks) != config.n_layer:
      raise ValueError(f"params have {len(blocks)} layers but config.n_layer="
                       f"{config.n_layer}; pass the GPTConfig the params were made with.")
    layers = [_path_shapes(layer, "['blocks']") for layer in blocks]
    actual = _path_shapes({k: v for k, v in params.items() if k != "blocks"})
    actual.update({path: (len(blocks),) + shape for path, shape in layers[0].items()})
    if any(layer != layers[0] for layer in layers):
      raise ValueError("per-layer params differ in shape between layers.")
  else:
    actual = _path_shapes(params)
  if actual.keys() != expected.keys():
    missing = sorted(expected.keys() - actual.keys())
    extra = sorted(actual.keys() - expected.keys())
    raise ValueError(
        f"params do not match the config (bias={config.bias}): missing {missing[:4]}, "
        f"unexpected {extra[:4]}; pass the GPTConfig the params were made with "
        f"(train.py saves it in each checkpoint's metadata).")
  for path, shape in expected.items():
    if actual[path] != shape:
      raise ValueError(
          f"params{path} has shape {actual[path]}, but the config (n_layer="
          f"{config.n_layer}, n_embd={config.n_embd}, vocab_size={config.vocab_size}, "
          f"block_size={config.block_size}) needs {shape}; pass the GPTConfig the "
          f"params were made with.")


def _check_tokens(tokens: chex.Array, config: GPTConfig) -> None:
  chex.assert_rank(tokens, 2)
  chex.assert_type(tokens, int)
  if tokens.shape[1] > config.block_size:
    raise ValueError(f"sequence length {tokens.shape[1]} exceeds block_size "
                     f"{config.block_size}; crop the input to the last "
                     f"{config.block_size} tokens.")


def _run_blocks(params, x, config, *, key, deterministic, cache=None, pos=0):
  """Scans `block` over the stacked layer params (and per-layer caches)."""
  layer_keys = None if deterministic else rng.layer_keys(key, config.n_layer)

  def body(h, layer):
    layer_params, layer_key, layer_cache = layer
    h, layer_cache = block(layer_params, h, config, key=layer_key,
                           deterministic=deterministic, cache=layer_cache, pos=pos)
    return h, layer_cache

  if cache is None:
    if config.remat != "none":
      body = jax.checkpoint(body, policy=REMAT_POLICIES[config.remat])
    x, _ = jax.lax.scan(body, x, (params["blocks"], layer_keys, None))
    return x, None
  # Decoding does little work per layer, so a plain Python loop over the
  # layers (unrolled in the compiled program) beats a scan's overhead.
  ks, vs = [], []
  for layer, k, v in zip(unstack_layers(params)["blocks"], cache.k, cache.v):
    x, (k, v) = block(layer, x, config, key=None, deterministic=True, cache=(k, v), pos=pos)
    ks.append(k)
    vs.append(v)
  return x, KVCache(tuple(ks), tuple(vs))


def forward(
    params: Params,
    tokens: chex.Array,
    config: GPTConfig,
    *,
    key: Optional[chex.PRNGKey] = None,
    deterministic: bool = True,
) -> chex.Array:
  """Next-token logits for every position.

  Args:
    params: from `init_params`.
    tokens: `[batch, time]` integer ids, `time <= block_size`.
    config: model config.
    key: dropout key; required when `deterministic=False` and dropout > 0.
    deterministic: True for evaluation (no dropout; `key` is ignored).

  Returns:
    `[batch, time, vocab_size]` float32 logits; position t depends only on
    tokens at positions <= t.
  """
  _check_tokens(tokens, config)
  check_params(params, config)
  b, t = tokens.shape
  deterministic = deterministic or config.dropout == 0.0
  if not deterministic and key is None:
    raise ValueError("forward: pass key=... for dropout, or deterministic=True.")
  keys = (None, None) if deterministic else jax.random.split(key)
  x = nn.embed(params["wte"], tokens) + params["wpe"]["embedding"][:t]  # [b, t, c]
  x = nn.dropout(keys[0], x, config.dropout, deterministic=deterministic)
  x, _ = _run_blocks(params, x, config, key=keys[1], deterministic=deterministic)
  x = nn.layer_norm(params["ln_f"], x)
  logits = nn.embedding_logits(params["wte"], x, compute_dtype=config.matmul_dtype)
  chex.assert_shape(logits, (b, t, config.vocab_size))
  return logits.astype(jnp.float32)


def _check_cache(cache: KVCache, config: GPTConfig, batch: int) -> None:
  layer_shape = _kv_cache_layer_shape(config, batch)
  want = KVCache(*[(layer_shape,) * config.n_layer] * 2)
  got = jax.tree.map(jnp.shape, cache)
  if got != want:
    raise ValueError(f"KV cache of shapes {got}, but this config and batch need "
                     f"{config.n_layer} layers of {layer_shape}; build it with "
                     f"init_kv_cache(config, batch).")


def forward_with_cache(
    params: Params,
    tokens: chex.Array,
    cache: KVCache,
    pos: chex.Numeric,
    config: GPTConfig,
) -> Tuple[chex.Array, KVCache]:
  """Runs `tokens` at positions `pos, pos+1, ...` against a KV cache.

  Args:
    params: model params (stacked, or per layer from `unstack_layers`).
    tokens: `[batch, time]` ids; `pos + time <= block_size`.
    cache: keys and values of positions `< pos` (later slots are ignored).
    pos: position of `tokens[:, 0]` (may be traced).
    config: model config.

  Returns:
    `(logits of the last token [batch, vocab], cache updated with tokens)`.
  """
  _check_tokens(tokens, config)
  check_params(params, config)
  t = tokens.shape[1]
  _check_cache(cache, config, tokens.shape[0])
  positions = jax.lax.dynamic_slice_in_dim(params["wpe"]["embedding"], pos, t)
  x = nn.embed(params["wte"], tokens) + positions
  x, cache = _run_blocks(params, x, config, key=None, deterministic=True,
                         cache=cache, pos=pos)
  x = nn.layer_norm(params["ln_f"], x[:, -1])
  logits = nn.embedding_logits(params["wte"], x, compute_dtype=config.matmul_dtype)
  return logits.astype(jnp.float32), cache


def loss(
    params: Params,
    tokens: chex.Array,
    targets: chex.Array,
    config: GPTConfig,
    *,
    key: Optional[chex.PRNGKey] = None,
    deterministic: bool = True,
) -> chex.Array:
  """Mean next-token cross-entropy: tokens and targets `[batch, time]`."""
  chex.assert_equal_shape((tokens, targets))
  logits = forward(params, tokens, config, key=key, deterministic=deterministic)
  return nn.cross_entropy(logits, targets)


# ----------------------------------------------------------------------------
# Sampling


def sample_logits(
    key: Optional[chex.PRNGKey],
    logits: chex.Array,
    temperature: chex.Numeric = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    *,
    gumbel: Optional[chex.Array] = None,
) -> chex.Array:
  """Draws one token per row of `logits` `[batch, vocab]` -> `[batch]` int32.

  `temperature <= 0` means greedy (argmax). `top_k` keeps the k most likely
  tokens; `top_p` keeps the smallest set whose probability reaches p
  (nucleus sampling). Both filters may be combined. The draw is the
  Gumbel-max trick, `argmax(logits / temperature + g)` with
  `g = jax.random.gumbel(key, logits.shape)`; pass `gumbel` instead of `key`
  to supply `g` drawn ahead of time.
  """
  chex.assert_rank(logits, 2)
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
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # The smallest logit still inside the nucleus: tokens whose mass before
    # them is below top_p are kept (always at least the most likely one).
    inside = (cum - jax.nn.softmax(sorted_logits, axis=-1)) < top_p
    cutoff = jnp.min(jnp.where(inside, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
  drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "top_k"))
def generate(
    params: Params,
    prompt: chex.Array,
    config: GPTConfig,
    key: chex.PRNGKey,
    max_new_tokens: int,
    temperature: chex.Numeric = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> chex.Array:
  """Continues `prompt` by `max_new_tokens` sampled tokens, with a KV cache.

  The whole decode loop is one `lax.scan` inside this jit. Each step feeds
  one token through the cache. Context handling:

  * A prompt longer than `block_size` is conditioned on its last
    `block_size` tokens (as nanoGPT crops).
  * When the cache is full, the window slides: the cache is rebuilt from the
    last `block_size // 2` tokens (positions restart at 0) and decoding goes
    on. So every token sees between `block_size // 2` and `block_size`
    tokens of context; nanoGPT instead recomputes the last `block_size`
    tokens for every new token, which costs `block_size` times more.
    Within `block_size` tokens the two are identical.

  Args:
    params: model params.
    prompt: `[batch, prompt_len]` or `[prompt_len]` int ids, prompt_len >= 1.
    config: model config.
    key: PRNG key; step i uses `fold_in(key, i)`.
    max_new_tokens: tokens to add (>= 1).
    temperature: softmax temperature; <= 0 for greedy decoding.
    top_k: optional top-k filter.
    top_p: optional nucleus filter.

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
  params = unstack_layers(params)  # once, outside the decode loop
  window, refill = min(p, config.block_size), max(config.block_size // 2, 1)
  buffer = jnp.concatenate([prompt, jnp.zeros((b, max_new_tokens), jnp.int32)], axis=1)
  logits, cache = forward_with_cache(params, prompt[:, p - window:],
                                     init_kv_cache(config, b), 0, config)

  # Each new token is sampled, written, then fed back: fed through the cache
  # ("decode") while it has room, else by sliding the window ("slide"). The
  # prompt length is static, so when the slides fall is known here: decode
  # steps run as scans of fixed length, slides sit between them, and the
  # loop needs no branch. (The last token's feed is wasted work, one step.)
  #
  # Token i's noise is `gumbel(fold_in(key, i))`. Drawing it inside the loop
  # would run JAX's CPU threefry (a rolled loop) once per token, which took a
  # third of the time; each scan draws its tokens' noise in one batch first.
  vocab = config.vocab_size
  step_noise = jax.vmap(lambda i: jax.random.gumbel(jax.random.fold_in(key, i), (b, vocab)))

  def sample_and_write(carry, noise):
    buffer, cache, cache_len, logits, i = carry
    token = sample_logits(None, logits, temperature, top_k, top_p, gumbel=noise)
    buffer = jax.lax.dynamic_update_slice(buffer, token[:, None], (0, p + i))
    return buffer, cache, cache_len, token, i

  def decode(carry, noise):
    buffer, cache, cache_len, token, i = sample_and_write(carry, noise)
    logits, cache = forward_with_cache(params, token[:, None], cache, cache_len, config)
    return (buffer, cache, cache_len + 1, logits, i + 1), None

  def slide(carry):
    noise = step_noise(carry[-1][None])[0]
    buffer, cache, _, _, i = sample_and_write(carry, noise)
    recent = jax.lax.dynamic_slice(buffer, (0, p + i + 1 - refill), (b, refill))
    logits, cache = forward_with_cache(params, recent, cache, 0, config)
    return buffer, cache, jnp.int32(refill), logits, i + 1

  def decodes(carry, n):
    if n == 0:
      return carry
    noise = step_noise(carry[-1] + jnp.arange(n))  # [n, batch, vocab]
    return jax.lax.scan(decode, carry, noise)[0]

  carry = (buffer, cache, jnp.int32(window), logits, jnp.int32(0))
  first = min(max_new_tokens, config.block_size - window)
  carry = decodes(carry, first)
  period = 1 + config.block_size - refill  # one slide, then decodes until full
  full_periods, tail = divmod(max_new_tokens - first, period)
  if full_periods:
    carry = jax.lax.scan(
        lambda c, _: (decodes(slide(c), period - 1), None), carry, None,
        length=full_periods)[0]
  if tail:
    carry = decodes(slide(carry), tail - 1)
  buffer = carry[0]
  return buffer[0] if unbatched else buffer


# ----------------------------------------------------------------------------
# Training


def sample_batch(
    key: chex.PRNGKey, data: chex.Array, block_size: int, batch_size: int
) -> Tuple[chex.Array, chex.Array]:
  """Random windows of a token stream, drawn on the device.

  Args:
    key: PRNG key.
    data: `[num_tokens]` int ids, with `num_tokens > block_size`.
    block_size: window length.
    batch_size: windows per batch.

  Returns:
    `(inputs, targets)`, each `[batch_size, block_size]`; targets are the
    inputs shifted one token ahead.
  """
  starts = jax.random.randint(key, (batch_size,), 0, data.shape[0] - block_size)
  take = jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(data, s, block_size + 1))
  windows = take(starts)  # [batch, block + 1]
  return windows[:, :-1], windows[:, 1:]


@functools.partial(
    jax.jit,
    static_argnames=("config", "optimizer", "batch_size", "num_steps",
                     "grad_accum_steps", "plan"),
    donate_argnums=(0, 1))
def train_steps(
    params: Params,
    opt_state: optax.OptState,
    data: chex.Array,
    key: chex.PRNGKey,
    step: chex.Numeric,
    *,
    config: GPTConfig,
    optimizer: optax.GradientTransformation,
    batch_size: int,
    num_steps: int,
    grad_accum_steps: int = 1,
    plan: Optional[parallel.ShardingPlan] = None,
) -> Tuple[Params, Any, chex.Array]:
  """Runs `num_steps` optimisation steps in one jitted `lax.scan`.

  Step `s` draws its batch and dropout keys from `fold_in(key, s)`, so the
  whole run is a function of `(key, step)`: chunking the steps differently,
  or resuming at any step, gives the same result.

  Args:
    params: model params (donated).
    opt_state: optax state (donated).
    data: `[num_tokens]` training ids, on the device.
    key: base key of the run's training stream.
    step: global index of the first step.
    config: model config.
    optimizer: optax `GradientTransformation`.
    batch_size: sequences per step (the global batch).
    num_steps: steps to run.
    grad_accum_steps: microbatches per step (`parallel.accumulate_gradients`);
      must divide `batch_size`. Each draws its dropout from its own key.
    plan: how the step is spread over devices (`parallel.ShardingPlan`);
      None on one device. Wrap the call in a `jax.jit` with the plan's in/out
      shardings, as `purejax.train` does, to keep the state's layout.

  Returns:
    `(params, opt_state, losses [num_steps])`, each loss measured before its
    step's update.
  """
  def one_step(carry, s):
    params, opt_state = carry
    batch_key, dropout_key = jax.random.split(rng.fold_in_step(key, s))

    def microbatch_loss(params, xy, index):
      x, y = xy
      return loss(params, x, y, config, key=jax.random.fold_in(dropout_key, index),
                  deterministic=False)

    batch = sample_batch(batch_key, data, config.block_size, batch_size)
    value, grads = parallel.accumulate_gradients(
        microbatch_loss, params, batch, grad_accum_steps, plan=plan)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), value

  steps = step + jnp.arange(num_steps)
  (params, opt_state), losses = jax.lax.scan(one_step, (params, opt_state), steps)
  return params, opt_state, losses


@functools.partial(jax.jit,
                   static_argnames=("config", "batch_size", "num_batches", "plan"))
def evaluate(
    params: Params,
    data: chex.Array,
    key: chex.PRNGKey,
    *,
    config: GPTConfig,
    batch_size: int,
    num_batches: int,
    plan: Optional[parallel.ShardingPlan] = None,
) -> chex.Array:
  """Mean loss over `num_batches` random batches of `data` (no dropout).

  Pass the same `key` at every evaluation so the batches are fixed and the
  numbers compare across steps. `plan` splits each batch across devices, as
  in `train_steps`.
  """
  def body(total, k):
    x, y = sample_batch(k, data, config.block_size, batch_size)
    if plan is not None:
      x, y = parallel.constrain((x, y), plan.batch)
    return total + loss(params, x, y, config), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          jax.random.split(key, num_batches))
  return total / num_batches

"""NanoGPT as pure functions over a params pytree.

    config = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    params = init_params(config, jax.random.PRNGKey(0))
    logits = forward(params, tokens, config)                   # [batch, time, vocab]
    value = loss(params, tokens, targets, config, key=key, deterministic=False,
                 forms=kernels.select("cpu", remat="full"))  # how it runs, not what

The architecture is GPT-2's: learned token and position embeddings,
pre-LayerNorm blocks of causal self-attention and a tanh-GELU MLP, a final
LayerNorm and an output head tied to the token embedding. Other families are
the same model with other options (`GPTConfig` and the named `ARCHITECTURES`,
in `gpt/config.py`), each one small function: the Llama family's RMSNorm,
rotary positions, SwiGLU, grouped-query attention, untied head and Qwen2's
query/key/value biases; nanochat's parameter-free norms, QK-norm, ReLU^2,
soft-capped logits and value embeddings. Each layer's params are made
by its `init_*` beside the function that applies them.

The `n_layer` blocks share one structure, so their params are stacked on a
leading `[n_layer]` axis and the blocks run as one `jax.lax.scan`: XLA
compiles one block, not `n_layer` copies, so compile time barely grows with
depth. Dropout keys are threaded explicitly, one per layer.

The config is the math alone. How it runs (attention form, remat, scan or
unrolled layers, the mixed-precision matmul's backward, loss chunking) is a
`kernels.Forms` passed as `forms=`; `forward` and `loss` called without one
use the forms of the platform the params live on (`kernels.select`); every
other function takes them as an argument. Sampling (a KV cache through the
same `block`) is in `purejax/decode.py`, training steps in
`purejax/training/pure/steps.py`.
"""

import functools
import math
from typing import Any, Callable, Dict, Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from purejax import nn
from purejax import rng
from purejax.gpt import config as gpt_config
from purejax.gpt.config import GPTConfig
from purejax.ops import attention
from purejax.ops import dropout as dropouts
from purejax.ops import kernels
from purejax.ops.loss import tied_head_cross_entropy
from purejax.ops.matmul import LowRankWeight

Params = Dict[str, Any]

_DTYPES = gpt_config.DTYPES


# ----------------------------------------------------------------------------
# The model

# `attend(q, k, v) -> (y, carry)`: attention of queries `q` `[batch, time,
# n_head, head_dim]` over keys `k` and values `v` `[batch, time, kv_heads,
# head_dim]`, with whatever it carries out (decoding's updated KV cache; None
# in training).
Attend = Callable[[chex.Array, chex.Array, chex.Array], Tuple[chex.Array, Any]]


def init_norm(config: GPTConfig) -> Params:
  """Params of one of the model's norms (`config.norm`); with `norm_scale=False` it has none."""
  dtype = _DTYPES[config.param_dtype]
  if config.norm == "rmsnorm":
    if config.norm_offset:  # Gemma's norm scales by (1 + scale): zero is the identity
      return {"scale": jnp.zeros((config.n_embd,), dtype)}
    return nn.init_rms_norm(config.n_embd, dtype=dtype)
  return nn.init_layer_norm(config.n_embd, bias=config.bias, dtype=dtype)


def norm(params: Optional[Params], x: chex.Array, config: GPTConfig) -> chex.Array:
  """The model's norm (`config.norm`) over the last axis of `x`; `params` None with `norm_scale=False`."""
  if not config.norm_scale:
    return nn.rms_normalize(x, eps=config.norm_eps)
  if config.norm == "rmsnorm":
    return nn.rms_norm(params, x, eps=config.norm_eps, offset=config.norm_offset)
  return nn.layer_norm(params, x, eps=config.norm_eps)


# A layer's value embedding (`value_embedding`): its rows for the tokens
# `[batch, time, kv_heads * head_dim]` and its gate `[12, kv_heads]`.
ValueEmbed = Tuple[chex.Array, chex.Array]


def rope_frequencies(config: GPTConfig, kind: chex.Numeric = 0) -> chex.Array:
  """RoPE's `[head_dim // 2]` frequencies in a layer of kind `kind` (`GPTConfig.layer_kinds`).

  A traced `kind` (the layer scan over layers that differ) selects between
  the two kinds' tables.
  """
  tables = [nn.rope_frequencies(config.head_dim, *config.kind_rope(k)) for k in (0, 1)]
  if isinstance(kind, int):
    return tables[kind]
  return jnp.where(kind == 1, tables[1], tables[0])


def qkv_heads(params: Params, x: chex.Array, config: GPTConfig, forms: kernels.Forms,
              start: chex.Numeric = 0, value_embed: Optional[ValueEmbed] = None,
              kind: chex.Numeric = 0) -> Tuple[chex.Array, chex.Array, chex.Array]:
  """Queries `[batch, time, n_head, head_dim]`, keys and values `[batch, time, kv_heads, head_dim]`.

  With `position="rope"`, queries and keys are rotated by their positions
  `start, start + 1, ...` (`start` may be traced), at the RoPE base of the
  layer's `kind`; with `qk_norm`, each head's queries and keys are then
  RMS-normalised (with `qk_norm_scale`, before RoPE, each with its learned
  scale, as Gemma 3). With `value_embed`, the values get its rows, gated per
  key/value head by `3 * sigmoid(x[..., :12] @ gate)` (nanochat's value
  embeddings).
  """
  b, t, _ = x.shape
  h, kv, d = config.n_head, config.kv_heads, config.head_dim
  qkv = nn.dense(params["qkv"], x, compute_dtype=config.matmul_dtype, forms=forms)
  if kv == h:  # sliced as [b, t, 3, h, d]: XLA compiles GPT-2 as it always has
    qkv = qkv.reshape(b, t, 3, h, d)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  else:
    q, k, v = jnp.split(qkv, (h * d, (h + kv) * d), axis=-1)  # [b, t, (h | kv) d]
    q, k, v = q.reshape(b, t, h, d), k.reshape(b, t, kv, d), v.reshape(b, t, kv, d)
  if config.qk_norm_scale:
    q = nn.rms_norm(params["q_norm"], q, eps=config.norm_eps, offset=config.norm_offset)
    k = nn.rms_norm(params["k_norm"], k, eps=config.norm_eps, offset=config.norm_offset)
  if config.position == "rope":
    # `[time]`, or `[batch, time]` where each row has its own start (decoding a batch
    # of prompts of different lengths)
    positions = (start[:, None] if jnp.ndim(start) == 1 else start) + jnp.arange(t)
    frequencies = rope_frequencies(config, kind)
    q, k = nn.rope(q, positions, frequencies), nn.rope(k, positions, frequencies)
  if config.qk_norm and not config.qk_norm_scale:
    q, k = (nn.rms_normalize(a, eps=config.norm_eps) for a in (q, k))
  if value_embed is not None:
    rows, gate = value_embed
    logits = nn.dense({"w": gate}, x[..., :gate.shape[0]], compute_dtype=config.matmul_dtype,
                      forms=forms)  # [b, t, kv]
    scale = gpt_config.VALUE_GATE_RANGE * jax.nn.sigmoid(logits.astype(jnp.float32))
    v = v + (scale[..., None] * rows.reshape(b, t, kv, d)).astype(v.dtype)
  return q, k, v


def merge_heads(params: Params, y: chex.Array, config: GPTConfig, forms: kernels.Forms
                ) -> chex.Array:
  """`[batch, time, head, head_dim]` attention outputs -> `[batch, time, embd]`, projected."""
  b, t = y.shape[:2]
  return nn.dense(params["proj"], y.reshape(b, t, config.attn_width),
                  compute_dtype=config.matmul_dtype, forms=forms)


def causal_attend(config: GPTConfig, forms: kernels.Forms, *, key: Optional[chex.PRNGKey],
                  deterministic: bool, dropout: Optional[chex.Numeric] = None,
                  kind: chex.Numeric = 0) -> Attend:
  """Causal self-attention over the block's own positions, in `forms.attention`.

  A layer of kind 1 (`GPTConfig.layer_kinds`) attends within `config.window`.
  A traced `kind` (the layer scan over layers that differ) runs the layer's
  form through `lax.cond`, so each form keeps its static window (the
  blocked form still skips the keys outside it) and the scan compiles both
  once.
  """
  def attend_within(window, q, k, v):
    return attention.causal_attention(
        q, k, v, form=forms.attention, block=forms.attn_block,
        dropout=_rate(config, dropout),
        key=key, deterministic=deterministic, compute_dtype=config.matmul_dtype, forms=forms,
        window=window, softcap=config.attn_softcap,
        scale=None if config.attn_scalar is None else config.attn_scale)

  def attend(q, k, v):
    if isinstance(kind, int):
      return attend_within(config.kind_window(kind), q, k, v), None
    y = jax.lax.cond(kind == 1, functools.partial(attend_within, config.window),
                     functools.partial(attend_within, None), q, k, v)
    return y, None
  return attend


def self_attention(params: Params, x: chex.Array, config: GPTConfig, forms: kernels.Forms,
                   attend: Attend, start: chex.Numeric = 0,
                   value_embed: Optional[ValueEmbed] = None,
                   kind: chex.Numeric = 0) -> Tuple[chex.Array, Any]:
  """Multi-head self-attention of `x` `[batch, time, embd]` through `attend`.

  Args:
    params: `{"qkv", "proj"}` dense params.
    x: `[batch, time, embd]`.
    config: model config.
    forms: execution forms (the dense layers' matmul).
    attend: the attention proper (`causal_attend`, or decoding's through a
      KV cache).
    start: position of `x[:, 0]` (RoPE's; may be traced).
    value_embed: this layer's value embedding (`value_embedding`), or None.
    kind: the layer's kind (`GPTConfig.layer_kinds`: its RoPE base).

  Returns:
    `([batch, time, embd], what attend carries out)`.
  """
  q, k, v = qkv_heads(params, x, config, forms, start, value_embed, kind)
  y, carry = attend(q, k, v)
  return merge_heads(params, y, config, forms), carry


def mlp(params: Params, x: chex.Array, config: GPTConfig, forms: kernels.Forms) -> chex.Array:
  """Position-wise `proj(act(fc(x)))`: `[..., embd] -> [..., embd]`; act is GELU, SwiGLU, GeGLU or ReLU^2."""
  dense = functools.partial(nn.dense, compute_dtype=config.matmul_dtype, forms=forms)
  activation = {"swiglu": nn.swiglu, "geglu": nn.geglu,
                "relu2": nn.relu_squared}.get(config.mlp, nn.gelu)
  if forms.recompute_activation:
    activation = jax.checkpoint(activation)  # saves its input only (`Forms`)
  return dense(params["proj"], activation(dense(params["fc"], x)))


def init_block(config: GPTConfig, key: chex.PRNGKey) -> Params:
  """Params of one transformer block (unstacked).

  GPT-2 initialisation: weights N(0, 0.02^2), except the two projections that
  write into the residual stream, scaled by 1/sqrt(2 * n_layer) so the
  residual variance does not grow with depth (with `zero_init_proj`, zero).
  With `norm_scale=False` there are no `ln_1`, `ln_2`; with `sandwich_norm`
  there are also `ln_attn_out`, `ln_mlp_out`; with `qk_norm_scale`,
  `attn.q_norm` and `attn.k_norm` (`[head_dim]` scales). The key comes last, as
  in every init function (`init_block(key, config)` works for one release,
  deprecated).
  """
  config, key = rng.key_last("init_block", (config, key))
  c, dtype = config.n_embd, _DTYPES[config.param_dtype]
  keys = rng.split_named(key, ("qkv", "attn_proj", "fc", "mlp_proj"))
  resid_scale = 0.0 if config.zero_init_proj else 0.02 / math.sqrt(2 * config.n_layer)
  dense = functools.partial(nn.init_dense, bias=config.bias, dtype=dtype)
  qkv_width = (config.n_head + 2 * config.kv_heads) * config.head_dim
  gated = config.mlp in ("swiglu", "geglu")
  fc_width = config.mlp_width * (2 if gated else 1)  # gated: gate, up
  params = {
      "ln_1": init_norm(config),
      "attn": {
          "qkv": nn.init_dense(c, qkv_width, keys["qkv"], scale=0.02, dtype=dtype,
                               bias=config.bias or config.qkv_bias),
          "proj": dense(config.attn_width, c, keys["attn_proj"], scale=resid_scale),
      },
      "ln_2": init_norm(config),
      "mlp": {
          "fc": dense(c, fc_width, keys["fc"], scale=0.02),
          "proj": dense(config.mlp_width, c, keys["mlp_proj"], scale=resid_scale),
      },
  }
  if not config.norm_scale:
    del params["ln_1"], params["ln_2"]
  if config.sandwich_norm:
    params["ln_attn_out"], params["ln_mlp_out"] = init_norm(config), init_norm(config)
  if config.qk_norm_scale:
    head_norm = {"scale": jnp.full((config.head_dim,), 0.0 if config.norm_offset else 1.0,
                                   dtype)}
    params["attn"]["q_norm"], params["attn"]["k_norm"] = head_norm, dict(head_norm)
  return params


def block(
    params: Params,
    x: chex.Array,
    config: GPTConfig,
    *,
    forms: kernels.Forms,
    key: Optional[chex.PRNGKey] = None,
    deterministic: bool = True,
    attend: Optional[Attend] = None,
    start: chex.Numeric = 0,
    dropout: Optional[chex.Numeric] = None,
    value_embed: Optional[ValueEmbed] = None,
    kind: chex.Numeric = 0,
) -> Tuple[chex.Array, Any]:
  """One pre-norm transformer block: `[batch, time, embd]` -> same.

  With `sandwich_norm`, each sublayer's output is normed again before its
  residual add (Gemma 2 and 3).

  Args:
    params: one layer's params (`init_block`).
    x: `[batch, time, embd]`.
    config: model config.
    forms: execution forms.
    key: dropout key (unused when deterministic).
    deterministic: disables dropout.
    attend: the attention (default: `causal_attend`, causal over `x`'s own
      positions); decoding passes one that reads and writes a KV cache.
    start: position of `x[:, 0]`, for RoPE (decoding's cache position).
    dropout: the drop rate, a float or a scalar array (`forward`); None:
      `config.dropout`.
    value_embed: this layer's value embedding (`value_embedding`), or None.
    kind: the layer's kind (`GPTConfig.layer_kinds`: window and RoPE base); a
      Python int, or traced in the layer scan over layers that differ.

  Returns:
    `(block output [batch, time, embd], what attend carries out)`.
  """
  keys = (None, None, None) if deterministic else jax.random.split(key, 3)
  if attend is None:
    attend = causal_attend(config, forms, key=keys[0], deterministic=deterministic,
                           dropout=dropout, kind=kind)
  attn_out, carry = self_attention(params["attn"], norm(params.get("ln_1"), x, config), config,
                                   forms, attend, start, value_embed, kind)
  if config.sandwich_norm:
    attn_out = norm(params["ln_attn_out"], attn_out, config)
  rate = _rate(config, dropout)
  x = x + dropouts.dropout(keys[1], attn_out, rate, deterministic=deterministic)
  mlp_out = mlp(params["mlp"], norm(params.get("ln_2"), x, config), config, forms)
  if config.sandwich_norm:
    mlp_out = norm(params["ln_mlp_out"], mlp_out, config)
  return x + dropouts.dropout(keys[2], mlp_out, rate, deterministic=deterministic), carry


def _rate(config: GPTConfig, dropout: Optional[chex.Numeric]) -> chex.Numeric:
  return config.dropout if dropout is None else dropout


def init_params(config: GPTConfig, key: chex.PRNGKey) -> Params:
  """All model params; block params are stacked on a leading `[n_layer]` axis.

  Returns:
    `{"wte": {"embedding": [vocab, embd]}, "wpe": {"embedding": [block, embd]},
      "blocks": <init_block tree, each leaf with a leading [n_layer] axis>,
      "ln_f": {...}}`. The output head reuses `wte` (tied embeddings); with
    `tie_embeddings=False` it is `"lm_head": {"w": [embd, vocab]}`. With
    `position="rope"` there is no `"wpe"`. With `norm_scale=False` there is
    no `"ln_f"`; with `embed_norm` (and `norm_scale`) the embedding's norm is
    `"ln_e"`; with `value_embeds`, `"value_embeds"` holds `"embedding"`
    `[n_value_embeds, vocab, kv_heads * head_dim]`, N(0, 0.02^2), and
    `"gate"` `[n_value_embeds, 12, kv_heads]`, zero (each gate starts at 1.5).
  """
  keys = rng.split_named(key, ("wte", "wpe", "blocks"))
  dtype = _DTYPES[config.param_dtype]
  block_keys = rng.layer_keys(keys["blocks"], config.n_layer)
  params = {
      "wte": nn.init_embedding(config.vocab_size, config.n_embd, keys["wte"], dtype=dtype),
      "wpe": nn.init_embedding(config.block_size, config.n_embd, keys["wpe"], dtype=dtype),
      "blocks": jax.vmap(lambda k: init_block(config, k))(block_keys),
      "ln_f": init_norm(config),
  }
  if config.position != "learned":
    del params["wpe"]
  if not config.tie_embeddings:
    params["lm_head"] = nn.init_dense(config.n_embd, config.vocab_size,
                                      jax.random.fold_in(keys["wte"], 1), bias=False,
                                      dtype=dtype)
  if not config.norm_scale:
    del params["ln_f"]
  elif config.embed_norm:
    params["ln_e"] = init_norm(config)
  if config.value_embeds:
    n, kv = config.n_value_embeds, config.kv_heads
    table = nn.init_embedding(n * config.vocab_size, kv * config.head_dim,
                              jax.random.fold_in(keys["wte"], 2), dtype=dtype)["embedding"]
    params["value_embeds"] = {
        "embedding": table.reshape(n, config.vocab_size, kv * config.head_dim),
        "gate": jnp.zeros((n, gpt_config.VALUE_GATE_CHANNELS, kv), dtype)}
  return params


def num_params(params: Params, *, non_embedding: bool = True) -> int:
  """Parameter count; like nanoGPT, leaves out position embeddings by default."""
  total = sum(x.size for x in jax.tree.leaves(params))
  if non_embedding and "wpe" in params:
    total -= params["wpe"]["embedding"].size
  return total


def _path_shapes(tree, prefix: str = "") -> Dict[str, Tuple[int, ...]]:
  """{pytree path: shape} of every leaf of `tree` (a `LowRankWeight` is one weight)."""
  leaves = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, LowRankWeight))[0]
  return {prefix + jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in leaves}


@functools.lru_cache(maxsize=16)
def _expected_param_shapes(config: GPTConfig) -> Dict[str, Tuple[int, ...]]:
  """`_path_shapes` of `init_params(config, ...)`, without running it."""
  return _path_shapes(jax.eval_shape(lambda key: init_params(config, key),
                                     jax.random.PRNGKey(0)))


def check_params(params: Params, config: GPTConfig) -> None:
  """Raises ValueError unless `params` have the shapes `config` describes.

  Params of another config would otherwise run silently (a scan simply runs
  over however many layers are stacked) or fail deep inside XLA. Only shapes
  are checked, so it costs nothing inside a jit.
  """
  expected = _expected_param_shapes(config)
  actual = _path_shapes(params)
  if actual.keys() != expected.keys():
    missing = sorted(expected.keys() - actual.keys())
    extra = sorted(actual.keys() - expected.keys())
    raise ValueError(
        f"params do not match the config (bias={config.bias}, norm={config.norm}, "
        f"position={config.position}, tie_embeddings={config.tie_embeddings}): missing {missing[:4]}, "
        f"unexpected {extra[:4]}; pass the GPTConfig the params were made with "
        f"(train.py saves it in each checkpoint's metadata).")
  for path, shape in expected.items():
    if actual[path] != shape:
      raise ValueError(
          f"params{path} has shape {actual[path]}, but the config (n_layer="
          f"{config.n_layer}, n_embd={config.n_embd}, vocab_size={config.vocab_size}, "
          f"block_size={config.block_size}) needs {shape}; pass the GPTConfig the "
          f"params were made with.")


def check_tokens(tokens: chex.Array, config: GPTConfig) -> None:
  """Raises unless `tokens` are `[batch, time]` integers with `time <= block_size`."""
  chex.assert_rank(tokens, 2)
  chex.assert_type(tokens, int)
  if tokens.shape[1] > config.block_size:
    raise ValueError(f"sequence length {tokens.shape[1]} exceeds block_size "
                     f"{config.block_size}; crop the input to the last "
                     f"{config.block_size} tokens.")


def embed(params: Params, tokens: chex.Array, start: chex.Numeric = 0) -> chex.Array:
  """Token plus position embeddings of `tokens` `[batch, time]` at positions `start, ...`.

  A RoPE model has no position table (`"wpe"`): its positions enter in the
  attention (`qkv_heads`).

  Returns:
    `[batch, time, embd]`; `start` may be traced (decoding), or `[batch]`: each
    row's own (a batch of prompts of different lengths, left-padded: a pad's
    negative position reads row 0, and no real token attends to it).
  """
  if "wpe" not in params:
    return nn.embed(params["wte"], tokens)
  t = tokens.shape[1]
  if isinstance(start, int):
    positions = params["wpe"]["embedding"][start:start + t]
  elif jnp.ndim(start) == 1:
    rows = jnp.maximum(start[:, None] + jnp.arange(t), 0)  # [batch, time]
    positions = params["wpe"]["embedding"][rows]
  else:
    positions = jax.lax.dynamic_slice_in_dim(params["wpe"]["embedding"], start, t)
  return nn.embed(params["wte"], tokens) + positions


def input_states(params: Params, tokens: chex.Array, config: GPTConfig,
                 start: chex.Numeric = 0) -> chex.Array:
  """What the first block reads: `embed` (times `sqrt(n_embd)` with `embed_scale`), then the
  norm with `embed_norm`: `[batch, time, embd]`."""
  x = embed(params, tokens, start)
  if config.embed_scale:  # rounded to the table's dtype, as Gemma's reference does
    x = x * jnp.asarray(math.sqrt(config.n_embd), params["wte"]["embedding"].dtype)
  if config.embed_norm:
    x = norm(params.get("ln_e"), x, config)
  return x


def final_norm(params: Params, x: chex.Array, config: GPTConfig) -> chex.Array:
  """The norm after the last block (`ln_f`), over `[..., embd]`."""
  return norm(params.get("ln_f"), x, config)


def value_embedding(params: Params, tokens: chex.Array, config: GPTConfig,
                    layer: chex.Numeric) -> Optional[ValueEmbed]:
  """Layer `layer`'s value embedding of `tokens` `[batch, time]` (table `layer // 2`), or None.

  A traced `layer` (the layer scan) gets rows on every layer, zero where
  `config.has_value_embed` says it has none.
  """
  if not config.value_embeds or (isinstance(layer, int) and not config.has_value_embed(layer)):
    return None
  chex.assert_rank(tokens, 2)
  tables = params["value_embeds"]
  rows = tables["embedding"][layer // 2, tokens]  # a gather of the rows, not a table copy
  if not isinstance(layer, int):
    rows = rows * (layer % 2 == (config.n_layer - 1) % 2).astype(rows.dtype)
  return rows, tables["gate"][layer // 2]


def logits_of(params: Params, x: chex.Array, config: GPTConfig, forms: kernels.Forms
              ) -> chex.Array:
  """The output head over final hidden states `[..., embd]`: float32 `[..., vocab]`.

  With `logit_softcap`, soft-capped (`nn.softcap`).
  """
  logits = nn.embedding_logits({"embedding": head_table(params)}, x,
                               compute_dtype=config.matmul_dtype, forms=forms)
  logits = logits.astype(jnp.float32)
  if config.logit_softcap is not None:
    logits = nn.softcap(logits, config.logit_softcap)
  return logits


def head_table(params: Params) -> chex.Array:
  """The output head as a `[vocab, embd]` table: the token embedding, or the untied head."""
  if "lm_head" in params:
    w = params["lm_head"]["w"]
    return (w.merged() if isinstance(w, LowRankWeight) else w).T
  return params["wte"]["embedding"]


def run_blocks(params: Params, x: chex.Array, config: GPTConfig, *, forms: kernels.Forms,
               key: Optional[chex.PRNGKey], deterministic: bool,
               dropout: Optional[chex.Numeric] = None,
               tokens: Optional[chex.Array] = None) -> chex.Array:
  """Every block over `x`: one `lax.scan` over the stacked layers, or an unrolled loop.

  `tokens` `[batch, time]` are read only with `value_embeds`. Layers that
  differ (`GPTConfig.mixed_layers`: sliding-window and global layers) stay
  one scan: each layer's kind is a scanned array, so the program holds one
  block whatever the depth.
  """
  layer_keys = None if deterministic else rng.layer_keys(key, config.n_layer)
  same_kind = config.layer_kinds[0]

  def layer(layer_params, h, layer_key, rate, index=None, kind=None):  # rate: see remat
    value_embed = None if index is None else value_embedding(params, tokens, config, index)
    return block(layer_params, h, config, forms=forms, key=layer_key,
                 deterministic=deterministic, dropout=rate, value_embed=value_embed,
                 kind=same_kind if kind is None else kind)[0]

  if config.value_embeds and forms.remat == "full_compute_dtype":  # they read params in a closure
    raise ValueError("remat='full_compute_dtype' does not take value_embeds; use remat='full'.")
  layer = kernels.remat(layer, forms, config.matmul_dtype,
                        static_argnums=() if forms.scan_layers else (4, 5))
  if forms.scan_layers:
    if not (config.value_embeds or config.mixed_layers):  # GPT-2's and Llama's scan
      x, _ = jax.lax.scan(lambda h, xs: (layer(xs[0], h, xs[1], dropout), None), x,
                          (params["blocks"], layer_keys))
    else:
      indices = jnp.arange(config.n_layer) if config.value_embeds else None
      kinds = jnp.asarray(config.layer_kinds, jnp.int32) if config.mixed_layers else None
      x, _ = jax.lax.scan(lambda h, xs: (layer(xs[0], h, xs[1], dropout, xs[2], xs[3]), None),
                          x, (params["blocks"], layer_keys, indices, kinds))
    return x
  for i in range(config.n_layer):
    layer_params = jax.tree.map(lambda p, i=i: p[i], params["blocks"])
    x = layer(layer_params, x, None if layer_keys is None else layer_keys[i], dropout,
              i if config.value_embeds else None, config.layer_kinds[i])
  return x


def _hidden_states(params, tokens, config, forms, key, deterministic, dropout) -> chex.Array:
  """The final norm's output `[batch, time, embd]`: what the head reads."""
  check_tokens(tokens, config)
  check_params(params, config)
  rate = _rate(config, dropout)
  deterministic = not dropouts.drops(rate, deterministic)
  if not deterministic and key is None:
    raise ValueError("forward: pass key=... for dropout, or deterministic=True.")
  keys = (None, None) if deterministic else jax.random.split(key)
  x = input_states(params, tokens, config)  # [b, t, c]
  x = dropouts.dropout(keys[0], x, rate, deterministic=deterministic)
  x = run_blocks(params, x, config, forms=forms, key=keys[1], deterministic=deterministic,
                 dropout=dropout, tokens=tokens)
  return final_norm(params, x, config)


def forward(
    params: Params,
    tokens: chex.Array,
    config: GPTConfig,
    *,
    key: Optional[chex.PRNGKey] = None,
    deterministic: bool = True,
    forms: Optional[kernels.Forms] = None,
    dropout: Optional[chex.Numeric] = None,
) -> chex.Array:
  """Next-token logits for every position.

  Args:
    params: from `init_params`.
    tokens: `[batch, time]` integer ids, `time <= block_size`.
    config: model config.
    key: dropout key; required when `deterministic=False` and dropout > 0.
    deterministic: True for evaluation (no dropout; `key` is ignored).
    forms: execution forms; None (a call by hand): those of the platform
      `params` live on (`kernels.select`). Training and sampling pass theirs.
    dropout: the drop rate of embeddings, attention and residuals: None for
      `config.dropout`, or a float, or a scalar array (a traced rate, e.g.
      one per run of a vmapped sweep; with `deterministic=False` it always
      draws masks, and a rate of 0 then equals no dropout).

  Returns:
    `[batch, time, vocab_size]` float32 logits; position t depends only on
    tokens at positions <= t.
  """
  forms = forms or kernels.select(kernels.platform_of(params))
  x = _hidden_states(params, tokens, config, forms, key, deterministic, dropout)
  logits = logits_of(params, x, config, forms)
  chex.assert_shape(logits, (*tokens.shape, config.vocab_size))
  return logits


def loss(
    params: Params,
    tokens: chex.Array,
    targets: chex.Array,
    config: GPTConfig,
    *,
    key: Optional[chex.PRNGKey] = None,
    deterministic: bool = True,
    forms: Optional[kernels.Forms] = None,
    dropout: Optional[chex.Numeric] = None,
    weights: Optional[chex.Array] = None,
) -> chex.Array:
  """Mean next-token cross-entropy: tokens and targets `[batch, time]`.

  Equals `cross_entropy(forward(...), targets)`; a large vocabulary's head and
  loss may run in chunks of rows (`tied_head_cross_entropy`). `forms`
  and `dropout` as in `forward`. `weights` `[batch, time]`: the loss is
  `mean(weights * losses)`; 0 takes a target out of loss and gradient (user
  turns, padding); weights of mean 1 (`batches.normalized_weights`) average
  the targets kept.
  """
  chex.assert_equal_shape((tokens, targets))
  forms = forms or kernels.select(kernels.platform_of(params))
  x = _hidden_states(params, tokens, config, forms, key, deterministic, dropout)
  return tied_head_cross_entropy(
      x, head_table(params), targets, compute_dtype=config.matmul_dtype,
      chunk_rows=forms.loss_chunk(tokens.size, config.vocab_size), forms=forms,
      softcap=config.logit_softcap, weights=weights)

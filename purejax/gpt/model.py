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
depth. What differs between layers is data too (`layer_consts`: each layer's
dropout key, Gemma 3's sliding windows and their RoPE bases, nanochat's value
embeddings), scanned beside the params: `block(x, layer, consts, ctx)` reads a
layer's params, its constants and the pass's `Context` (config, forms,
dropout, positions, the attention).

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
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

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
from purejax.ops import quant
from purejax.ops import loss as loss_ops
from purejax.ops.loss import head_cross_entropy
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


# ----------------------------------------------------------------------------
# What a layer is: its params, the constants that set it apart, and the pass


class Context(NamedTuple):
  """What every layer of one pass over the model shares (`block`'s `ctx`).

  Attributes:
    config: the model.
    forms: how it runs.
    deterministic: no dropout (evaluation, sampling).
    dropout: the drop rate of attention and residuals: a float, or a scalar
      array (a traced rate: one per run of a vmapped sweep).
    starts: `[batch]` position of each row's `x[:, 0]` (decoding: each row at
      its own place in the cache); None: every row starts at 0.
    attend: the attention proper, `attend(q, k, v) -> (y, carry)` (decoding's,
      through the KV cache); None: causal self-attention over the block's
      own positions (`causal_attend`).
    value_embeds: nanochat's value embeddings, `(params["value_embeds"], tokens
      [batch, time])`; None without them.
  """
  config: GPTConfig
  forms: kernels.Forms
  deterministic: bool = True
  dropout: chex.Numeric = 0.0
  starts: Optional[chex.Array] = None
  attend: Optional[Attend] = None
  value_embeds: Optional[Tuple[Params, chex.Array]] = None


# A layer's constants (`shared_consts`, `layer_consts`), by name:
#   "key":     its dropout key (only where the pass drops);
#   "sliding": True where it attends within `config.window` (mixed layers only);
#   "rope":    its RoPE frequencies `[head_dim // 2]` (RoPE models only);
#   "layer":   its index (value embeddings only: its table and whether it has one).
Consts = Dict[str, chex.Array]


def shared_consts(config: GPTConfig) -> Consts:
  """What every layer holds alike: the RoPE frequencies where all layers share one base."""
  if config.position != "rope" or config.mixed_layers:
    return {}
  return {"rope": _rope_table(config, config.layer_kinds[0])}


def _rope_table(config: GPTConfig, kind: int) -> chex.Array:
  return nn.rope_frequencies(config.head_dim, *config.kind_rope(kind))


def layer_consts(config: GPTConfig, key: Optional[chex.PRNGKey] = None) -> Consts:
  """What differs between the layers, as data stacked on a leading `[n_layer]` axis.

  The layer scan reads it beside the stacked params; layer `i` sees
  `{**shared_consts(config), **layer_at(consts, i)}`.

  Args:
    config: the model.
    key: the blocks' dropout key (one per layer is drawn from it); None: no
      dropout.
  """
  stacked = {}
  if key is not None:
    stacked["key"] = rng.layer_keys(key, config.n_layer)
  if config.mixed_layers:
    stacked["sliding"] = jnp.asarray(config.layer_kinds, bool)
    if config.position == "rope":
      tables = [_rope_table(config, kind) for kind in (0, 1)]
      stacked["rope"] = jnp.stack([tables[kind] for kind in config.layer_kinds])
  if config.value_embeds:
    stacked["layer"] = jnp.arange(config.n_layer, dtype=jnp.int32)
  return stacked


def layer_at(stacked: Consts, index: int) -> Consts:
  """Layer `index`'s row of each of `stacked`'s values (`layer_consts`)."""
  return {name: value[index] for name, value in stacked.items()}


def one_layer_consts(config: GPTConfig, index: int) -> Consts:
  """Layer `index`'s constants without dropout, built for it alone: where the layers run one
  by one (decoding's unrolled loop), each layer's program holds only its own."""
  consts = shared_consts(config)
  kind = config.layer_kinds[index]
  if config.mixed_layers:
    consts["sliding"] = jnp.asarray(kind == 1)
    if config.position == "rope":
      consts["rope"] = _rope_table(config, kind)
  if config.value_embeds:
    consts["layer"] = index  # a Python int: the layer's table is sliced where it compiles
  return consts


# A layer's value embedding (`value_embedding`): its rows for the tokens
# `[batch, time, kv_heads * head_dim]` and its gate `[12, kv_heads]`.
ValueEmbed = Tuple[chex.Array, chex.Array]


def qkv_heads(params: Params, x: chex.Array, consts: Consts, ctx: Context
              ) -> Tuple[chex.Array, chex.Array, chex.Array]:
  """Queries `[batch, time, n_head, head_dim]`, keys and values `[batch, time, kv_heads, head_dim]`.

  With `position="rope"`, queries and keys are rotated by their positions
  (`ctx.starts`, or 0, onwards) with the layer's frequencies; with `qk_norm`,
  each head's queries and keys are then RMS-normalised (with `qk_norm_scale`,
  before RoPE, each with its learned scale, as Gemma 3). With value
  embeddings, the values get the layer's rows, gated per key/value head by
  `3 * sigmoid(x[..., :12] @ gate)` (nanochat's).
  """
  config, forms = ctx.config, ctx.forms
  b, t, _ = x.shape
  h, kv, d = config.n_head, config.kv_heads, config.head_dim
  qkv = nn.dense(params["qkv"], x, compute_dtype=config.matmul_dtype, forms=forms)
  if kv == h:  # [b, t, 3, h, d]: GPT-2's fused queries, keys and values
    qkv = qkv.reshape(b, t, 3, h, d)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  else:
    q, k, v = jnp.split(qkv, (h * d, (h + kv) * d), axis=-1)  # [b, t, (h | kv) d]
    q, k, v = q.reshape(b, t, h, d), k.reshape(b, t, kv, d), v.reshape(b, t, kv, d)
  if config.qk_norm_scale:
    q = nn.rms_norm(params["q_norm"], q, eps=config.norm_eps, offset=config.norm_offset)
    k = nn.rms_norm(params["k_norm"], k, eps=config.norm_eps, offset=config.norm_offset)
  if config.position == "rope":
    positions = jnp.arange(t)  # [time], or [batch, time] where each row has its own start
    if ctx.starts is not None:
      positions = ctx.starts[:, None] + positions
    q, k = nn.rope(q, positions, consts["rope"]), nn.rope(k, positions, consts["rope"])
  if config.qk_norm and not config.qk_norm_scale:
    q, k = (nn.rms_normalize(a, eps=config.norm_eps) for a in (q, k))
  if ctx.value_embeds is not None:
    rows, gate = value_embedding(*ctx.value_embeds, config, consts["layer"])
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


def causal_attend(consts: Consts, ctx: Context, key: Optional[chex.PRNGKey]) -> Attend:
  """Causal self-attention over the block's own positions, in `ctx.forms.attention`.

  Where layers differ (`GPTConfig.mixed_layers`), a sliding layer attends within
  `config.window`: its `consts["sliding"]` picks the form through `lax.cond`, so
  each form keeps its window static (the blocked form still skips the keys
  outside it) and the layer scan compiles both once.
  """
  config, forms = ctx.config, ctx.forms

  def attend_within(window, q, k, v):
    return attention.causal_attention(
        q, k, v, form=forms.attention, block=forms.attn_block, dropout=ctx.dropout,
        key=key, deterministic=ctx.deterministic, compute_dtype=config.matmul_dtype,
        forms=forms, window=window, softcap=config.attn_softcap,
        scale=None if config.attn_scalar is None else config.attn_scale)

  def attend(q, k, v):
    if not config.mixed_layers:
      return attend_within(config.kind_window(config.layer_kinds[0]), q, k, v), None
    y = jax.lax.cond(consts["sliding"], functools.partial(attend_within, config.window),
                     functools.partial(attend_within, None), q, k, v)
    return y, None
  return attend


def self_attention(params: Params, x: chex.Array, consts: Consts, ctx: Context,
                   attend: Attend) -> Tuple[chex.Array, Any]:
  """Multi-head self-attention of `x` `[batch, time, embd]` through `attend`.

  Args:
    params: `{"qkv", "proj"}` dense params (and `q_norm`, `k_norm`).
    x: `[batch, time, embd]`.
    consts: the layer's (`layer_consts`).
    ctx: the pass's.
    attend: the attention proper (`causal_attend`, or decoding's through a
      KV cache).

  Returns:
    `([batch, time, embd], what attend carries out)`.
  """
  q, k, v = qkv_heads(params, x, consts, ctx)
  y, carry = attend(q, k, v)
  return merge_heads(params, y, ctx.config, ctx.forms), carry


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
  `attn.q_norm` and `attn.k_norm` (`[head_dim]` scales).
  """
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


def block(x: chex.Array, layer: Params, consts: Consts, ctx: Context
          ) -> Tuple[chex.Array, Any]:
  """One pre-norm transformer block: `[batch, time, embd]` -> same.

  With `sandwich_norm`, each sublayer's output is normed again before its
  residual add (Gemma 2 and 3).

  Args:
    x: `[batch, time, embd]`.
    layer: the layer's params (`init_block`).
    consts: what sets the layer apart (`layer_consts`: its dropout key,
      window, RoPE frequencies, value embedding).
    ctx: what every layer of the pass shares (`Context`).

  Returns:
    `(block output [batch, time, embd], what the attention carries out)`.
  """
  config = ctx.config
  keys = (None, None, None) if ctx.deterministic else jax.random.split(consts["key"], 3)
  attend = ctx.attend or causal_attend(consts, ctx, keys[0])
  attn_out, carry = self_attention(layer["attn"], norm(layer.get("ln_1"), x, config), consts,
                                   ctx, attend)
  if config.sandwich_norm:
    attn_out = norm(layer["ln_attn_out"], attn_out, config)
  x = x + dropouts.dropout(keys[1], attn_out, ctx.dropout, deterministic=ctx.deterministic)
  mlp_out = mlp(layer["mlp"], norm(layer.get("ln_2"), x, config), config, ctx.forms)
  if config.sandwich_norm:
    mlp_out = norm(layer["ln_mlp_out"], mlp_out, config)
  return x + dropouts.dropout(keys[2], mlp_out, ctx.dropout,
                              deterministic=ctx.deterministic), carry


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
  """{pytree path: shape} of every leaf of `tree` (a `LowRankWeight` or a
  `quant.QuantizedWeight` is one weight)."""
  leaves = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, (LowRankWeight, quant.QuantizedWeight)))[0]
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


def embed(params: Params, tokens: chex.Array, starts: Optional[chex.Array] = None
          ) -> chex.Array:
  """Token plus position embeddings of `tokens` `[batch, time]`.

  A RoPE model has no position table (`"wpe"`): its positions enter in the
  attention (`qkv_heads`).

  Args:
    params: the model's.
    tokens: `[batch, time]` ids.
    starts: `[batch]` position of each row's first token (a batch of prompts
      of different lengths, left-padded: a pad's negative position reads row
      0, and no real token attends to it); None: every row starts at 0.

  Returns:
    `[batch, time, embd]`.
  """
  if "wpe" not in params:
    return nn.embed(params["wte"], tokens)
  t = tokens.shape[1]
  if starts is None:
    positions = params["wpe"]["embedding"][:t]
  else:
    rows = jnp.maximum(starts[:, None] + jnp.arange(t), 0)  # [batch, time]
    positions = params["wpe"]["embedding"][rows]
  return nn.embed(params["wte"], tokens) + positions


def input_states(params: Params, tokens: chex.Array, config: GPTConfig,
                 starts: Optional[chex.Array] = None) -> chex.Array:
  """What the first block reads: `embed` (times `sqrt(n_embd)` with `embed_scale`), then the
  norm with `embed_norm`: `[batch, time, embd]`."""
  x = embed(params, tokens, starts)
  x = x.astype(_DTYPES[config.param_dtype])  # rows of a table held otherwise (quantized, bf16)
  if config.embed_scale:  # rounded to the table's dtype, as Gemma's reference does
    x = x * jnp.asarray(math.sqrt(config.n_embd), params["wte"]["embedding"].dtype)
  if config.embed_norm:
    x = norm(params.get("ln_e"), x, config)
  return x


def final_norm(params: Params, x: chex.Array, config: GPTConfig) -> chex.Array:
  """The norm after the last block (`ln_f`), over `[..., embd]`."""
  return norm(params.get("ln_f"), x, config)


def value_embedding(tables: Params, tokens: chex.Array, config: GPTConfig,
                    layer: chex.Numeric) -> ValueEmbed:
  """Layer `layer`'s value embedding of `tokens` `[batch, time]`: table `layer // 2`'s rows,
  zero where `config.has_value_embed` says the layer has none (every layer reads one, so
  the layers stay one scan), and its gate."""
  chex.assert_rank(tokens, 2)
  rows = tables["embedding"][layer // 2, tokens]  # a gather of the rows, not a table copy
  rows = rows * jnp.asarray(layer % 2 == (config.n_layer - 1) % 2, rows.dtype)
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

  What differs between layers (`layer_consts`: dropout keys, sliding windows,
  RoPE bases, value embeddings) is scanned beside their params, so the
  program holds one block whatever the depth and the layers' kinds. `tokens`
  `[batch, time]` are read only with `value_embeds`.
  """
  stacked = layer_consts(config, None if deterministic else key)
  value_embeds = (params["value_embeds"], tokens) if config.value_embeds else None
  if value_embeds is not None and forms.remat == "full_compute_dtype":
    raise ValueError("remat='full_compute_dtype' does not take value_embeds (they read "
                     "params outside the layer's); use remat='full'.")

  # The rate is an argument, not read from a closure: remat's "full_compute_dtype"
  # differentiates the layer at saved inputs and may not close over traced values.
  def layer(layer_params, h, consts, rate):
    ctx = Context(config, forms, deterministic, _rate(config, rate),
                  value_embeds=value_embeds)
    # The shared constants are built inside the layer, where XLA folds them into its body.
    return block(h, layer_params, {**shared_consts(config), **consts}, ctx)[0]

  layer = kernels.remat(layer, forms, config.matmul_dtype)
  if forms.scan_layers:
    x, _ = jax.lax.scan(lambda h, xs: (layer(xs[0], h, xs[1], dropout), None), x,
                        (params["blocks"], stacked))
    return x
  for i in range(config.n_layer):
    x = layer(jax.tree.map(lambda p, i=i: p[i], params["blocks"]), x, layer_at(stacked, i),
              dropout)
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


def _chunked_head_table(params: Params, config: GPTConfig) -> chex.Array:
  """The head's table as the chunked head reads it: a quantized one, which every chunk
  reads whole, dequantized once (frozen)."""
  table = head_table(params)
  if isinstance(table, quant.QuantizedWeight):
    table = jax.lax.stop_gradient(table.dequantized(config.matmul_dtype or jnp.float32))
  return table


def target_log_probs(
    params: Params,
    tokens: chex.Array,
    targets: chex.Array,
    config: GPTConfig,
    *,
    key: Optional[chex.PRNGKey] = None,
    deterministic: bool = True,
    forms: Optional[kernels.Forms] = None,
    dropout: Optional[chex.Numeric] = None,
    temperature: float = 1.0,
) -> chex.Array:
  """`[batch, time]` float32: `log p(targets[:, t] | tokens[:, :t + 1])`, under the logits
  over `temperature`: what preference and policy losses read of the model.

  Equals `ops.loss.target_log_probs(forward(...) / temperature, targets)`; where the forms
  run `loss`'s head in chunks of rows (a large vocabulary), this runs in the same
  chunks (`head_target_log_probs`), and the whole logits never exist. `forms` and
  `dropout` as in `forward`.
  """
  chex.assert_equal_shape((tokens, targets))
  forms = forms or kernels.select(kernels.platform_of(params))
  x = _hidden_states(params, tokens, config, forms, key, deterministic, dropout)
  chunk_rows = forms.loss_chunk(tokens.size, config.vocab_size)
  if chunk_rows is None:
    logits = logits_of(params, x, config, forms)
    return loss_ops.target_log_probs(
        logits if temperature == 1.0 else logits / temperature, targets)
  return loss_ops.head_target_log_probs(
      x, _chunked_head_table(params, config), targets, chunk_rows=chunk_rows, compute_dtype=config.matmul_dtype,
      forms=forms, softcap=config.logit_softcap, temperature=temperature)


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
  loss may run in chunks of rows (`head_cross_entropy`). `forms`
  and `dropout` as in `forward`. `weights` `[batch, time]`: the loss is
  `mean(weights * losses)`; 0 takes a target out of loss and gradient (user
  turns, padding); weights of mean 1 (`batches.normalized_weights`) average
  the targets kept.
  """
  chex.assert_equal_shape((tokens, targets))
  forms = forms or kernels.select(kernels.platform_of(params))
  x = _hidden_states(params, tokens, config, forms, key, deterministic, dropout)
  chunk_rows = forms.loss_chunk(tokens.size, config.vocab_size)
  table = head_table(params) if chunk_rows is None else _chunked_head_table(params, config)
  return head_cross_entropy(
      x, table, targets, compute_dtype=config.matmul_dtype, chunk_rows=chunk_rows,
      forms=forms, softcap=config.logit_softcap, weights=weights)

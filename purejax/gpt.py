"""NanoGPT as pure functions over a params pytree.

    config = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    params = init_params(config, jax.random.PRNGKey(0))
    logits = forward(params, tokens, config)                   # [batch, time, vocab]
    value = loss(params, tokens, targets, config, key=key, deterministic=False)

The architecture is GPT-2's: learned token and position embeddings,
pre-LayerNorm blocks of causal self-attention and a tanh-GELU MLP, a final
LayerNorm and an output head tied to the token embedding.

The `n_layer` blocks share one structure, so their params are stacked on a
leading `[n_layer]` axis and the blocks run as one `jax.lax.scan`: XLA
compiles one block, not `n_layer` copies, so compile time barely grows with
depth. Dropout keys are threaded explicitly, one per layer.

Sampling with a KV cache is in `purejax/decode.py`, training steps in
`purejax/training/steps.py`; the backend-dependent forms of attention, the
mixed-precision matmul and the loss are chosen in `purejax/ops/kernels.py`.
"""

import dataclasses
import functools
import math
from typing import Any, Dict, Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from purejax.ops import attention
from purejax.ops import kernels
from purejax import nn
from purejax import rng

Params = Dict[str, Any]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = ("auto",) + tuple(kernels.REMAT_POLICIES)
ATTENTION_FORMS = ("auto",) + kernels.ATTENTION_FORMS


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Model hyperparameters (hashable, so it can be a static jit argument).

  The defaults are GPT-2's architecture choices at a small size (`bias=True`,
  as GPT-2 has). `python -m purejax.train` trains nanoGPT's CPU recipe
  instead, which turns biases off (`--bias=False`, as nanoGPT's train.py).

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
    remat: what each block keeps for the backward pass: "none" stores every
      activation; "full" stores only the block's input and recomputes the
      rest; "dots" stores the matmul outputs and recomputes the cheap
      elementwise ops; "auto" takes the backend's measured best
      (`kernels.select`: "dots" on CPU; on GPU "full" scanned, "none" unrolled).
    attn_block: queries per block of the "blocked" attention form; only speed
      depends on it.
    attention: form of causal attention (`purejax/ops/attention.py`): "plain",
      "blocked", "fused", or "auto" for the backend's (`kernels.select`).
      All compute the same function.
    scan_layers: run the blocks as one `lax.scan` (compile time flat in
      depth); False unrolls them into a Python loop, which compiles
      `n_layer` copies and can run faster on GPUs.
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
  remat: str = "auto"
  attn_block: int = 64
  attention: str = "auto"
  scan_layers: bool = True

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
      raise ValueError(f"remat={self.remat!r} is not one of {list(REMAT_POLICIES)}.")
    if self.attention not in ATTENTION_FORMS:
      raise ValueError(f"attention={self.attention!r} is not one of {list(ATTENTION_FORMS)}.")
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

  def forms(self) -> kernels.Forms:
    """The backend's forms (`kernels.select`), read when a function is traced."""
    return kernels.select(None, self.matmul_dtype)

  def attention_form(self) -> str:
    return self.forms().attention if self.attention == "auto" else self.attention

  def remat_policy(self) -> str:
    if self.remat != "auto":
      return self.remat
    forms = self.forms()
    return forms.remat_scanned if self.scan_layers else forms.remat_unrolled


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


def qkv_heads(params: Params, x: chex.Array, config: GPTConfig
              ) -> Tuple[chex.Array, chex.Array, chex.Array]:
  """Queries, keys and values of `x` `[batch, time, embd]`, each `[batch, time, head, head_dim]`."""
  b, t, _ = x.shape
  qkv = nn.dense(params["qkv"], x, compute_dtype=config.matmul_dtype)  # [b, t, 3c]
  qkv = qkv.reshape(b, t, 3, config.n_head, config.head_dim)
  return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def merge_heads(params: Params, y: chex.Array, config: GPTConfig) -> chex.Array:
  """`[batch, time, head, head_dim]` attention outputs -> `[batch, time, embd]`, projected."""
  b, t = y.shape[:2]
  return nn.dense(params["proj"], y.reshape(b, t, config.n_embd),
                  compute_dtype=config.matmul_dtype)


def causal_self_attention(
    params: Params,
    x: chex.Array,
    config: GPTConfig,
    *,
    key: Optional[chex.PRNGKey],
    deterministic: bool,
) -> chex.Array:
  """Multi-head causal self-attention: position t attends to positions <= t.

  Args:
    params: `{"qkv", "proj"}` dense params.
    x: `[batch, time, embd]`.
    config: model config (`attention` picks the form; all are exact).
    key: dropout key for the attention weights (unused if deterministic).
    deterministic: disables dropout.

  Returns:
    `[batch, time, embd]`.
  """
  q, k, v = qkv_heads(params, x, config)
  y = attention.causal_attention(
      q, k, v, form=config.attention_form(), block=config.attn_block,
      dropout=config.dropout, key=key, deterministic=deterministic,
      compute_dtype=config.matmul_dtype)
  return merge_heads(params, y, config)


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
) -> chex.Array:
  """One pre-LayerNorm transformer block: `[batch, time, embd]` -> same."""
  keys = (None, None, None) if deterministic else jax.random.split(key, 3)
  attn_out = causal_self_attention(params["attn"], nn.layer_norm(params["ln_1"], x), config,
                                   key=keys[0], deterministic=deterministic)
  x = x + nn.dropout(keys[1], attn_out, config.dropout, deterministic=deterministic)
  mlp_out = mlp(params["mlp"], nn.layer_norm(params["ln_2"], x), config)
  return x + nn.dropout(keys[2], mlp_out, config.dropout, deterministic=deterministic)


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
  stacked blocks and the per-layer tuple of `decode.unstack_layers`. Only shapes
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


def check_tokens(tokens: chex.Array, config: GPTConfig) -> None:
  """Raises unless `tokens` are `[batch, time]` integers with `time <= block_size`."""
  chex.assert_rank(tokens, 2)
  chex.assert_type(tokens, int)
  if tokens.shape[1] > config.block_size:
    raise ValueError(f"sequence length {tokens.shape[1]} exceeds block_size "
                     f"{config.block_size}; crop the input to the last "
                     f"{config.block_size} tokens.")


def run_blocks(params: Params, x: chex.Array, config: GPTConfig, *,
               key: Optional[chex.PRNGKey], deterministic: bool) -> chex.Array:
  """Every block over `x`: one `lax.scan` over the stacked layers, or an unrolled loop."""
  layer_keys = None if deterministic else rng.layer_keys(key, config.n_layer)

  def layer(layer_params, h, layer_key):
    return block(layer_params, h, config, key=layer_key, deterministic=deterministic)

  if config.remat_policy() != "none":
    layer = jax.checkpoint(layer, policy=kernels.REMAT_POLICIES[config.remat_policy()])
  if config.scan_layers:
    x, _ = jax.lax.scan(lambda h, xs: (layer(xs[0], h, xs[1]), None), x,
                        (params["blocks"], layer_keys))
    return x
  for i in range(config.n_layer):
    layer_params = jax.tree.map(lambda p, i=i: p[i], params["blocks"])
    x = layer(layer_params, x, None if layer_keys is None else layer_keys[i])
  return x


def _hidden_states(params, tokens, config, key, deterministic) -> chex.Array:
  """The final LayerNorm's output `[batch, time, embd]`: what the head reads."""
  check_tokens(tokens, config)
  check_params(params, config)
  t = tokens.shape[1]
  deterministic = deterministic or config.dropout == 0.0
  if not deterministic and key is None:
    raise ValueError("forward: pass key=... for dropout, or deterministic=True.")
  keys = (None, None) if deterministic else jax.random.split(key)
  x = nn.embed(params["wte"], tokens) + params["wpe"]["embedding"][:t]  # [b, t, c]
  x = nn.dropout(keys[0], x, config.dropout, deterministic=deterministic)
  x = run_blocks(params, x, config, key=keys[1], deterministic=deterministic)
  return nn.layer_norm(params["ln_f"], x)


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
  x = _hidden_states(params, tokens, config, key, deterministic)
  logits = nn.embedding_logits(params["wte"], x, compute_dtype=config.matmul_dtype)
  chex.assert_shape(logits, (*tokens.shape, config.vocab_size))
  return logits.astype(jnp.float32)


def loss(
    params: Params,
    tokens: chex.Array,
    targets: chex.Array,
    config: GPTConfig,
    *,
    key: Optional[chex.PRNGKey] = None,
    deterministic: bool = True,
) -> chex.Array:
  """Mean next-token cross-entropy: tokens and targets `[batch, time]`.

  Equals `cross_entropy(forward(...), targets)`; for a large vocabulary the
  head and loss run in chunks of rows (`kernels.tied_head_cross_entropy`),
  so the whole float32 logits never exist at once.
  """
  chex.assert_equal_shape((tokens, targets))
  x = _hidden_states(params, tokens, config, key, deterministic)
  forms = config.forms()
  return kernels.tied_head_cross_entropy(
      x, params["wte"]["embedding"], targets, compute_dtype=config.matmul_dtype,
      chunk_rows=forms.loss_chunk(tokens.size, config.vocab_size), forms=forms)

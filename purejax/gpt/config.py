"""The GPT's config: its architecture, named options and all (`gpt.GPTConfig`).

    config = GPTConfig(vocab_size=65, block_size=64)                  # GPT-2's block
    config = GPTConfig(vocab_size=65, **ARCHITECTURES["llama"])        # the Llama block

The config is the math alone; how a model runs is `kernels.Forms`. `gpt`
re-exports `GPTConfig`, `ARCHITECTURES` and `EXECUTION_FIELDS`, so
`gpt.GPTConfig` is the name to use.
"""

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional

import jax.numpy as jnp

from purejax import nn

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Execution options that older configs held; now in `kernels.Forms`, and
# ignored where a saved config still names them.
EXECUTION_FIELDS = ("remat", "attn_block", "attention", "scan_layers")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu", "relu2")
# Value embeddings (`value_embeds=True`): each gate reads this many leading
# channels of the attention's input, and its sigmoid is scaled to (0, 3).
VALUE_GATE_CHANNELS = 12
VALUE_GATE_RANGE = 3.0


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Model hyperparameters: the math, nothing about how it runs (hashable, so
  it can be a static jit argument; the execution options are `kernels.Forms`).

  The defaults are GPT-2's architecture choices at a small size (`bias=True`,
  as GPT-2 has). `python -m purejax.train` trains nanoGPT's CPU recipe
  instead, which turns biases off (`bias=False`, as nanoGPT's train.py).

  Attributes:
    vocab_size: number of token ids.
    block_size: longest context the model sees (size of the position table).
    n_layer: transformer blocks.
    n_head: attention heads; must divide `n_embd`.
    n_embd: model width.
    dropout: drop rate in [0, 1) for embeddings, attention and residuals.
    bias: whether dense layers and LayerNorms have biases (RMSNorm has none).
    norm: "layernorm" (GPT-2) or "rmsnorm" (Llama), before each sublayer and
      at the end.
    norm_eps: added to the variance (or mean square) in every norm.
    position: "learned" (a `[block_size, n_embd]` table added to the token
      embeddings, GPT-2) or "rope" (queries and keys rotated by position,
      `nn.rope`; no table).
    rope_theta: RoPE's base wavelength.
    rope_scaling: None, or how RoPE's frequencies are stretched
      (`nn.RopeScaling`; a Hugging Face `rope_scaling` dict is accepted).
    mlp: "gelu" (`proj(gelu(fc(x)))`, GPT-2), "swiglu"
      (`proj(silu(gate(x)) * up(x))`, Llama; gate and up are one matmul) or
      "relu2" (`proj(relu(fc(x))^2)`, nanochat and modded-nanogpt).
    mlp_hidden: the MLP's hidden width; None: 4 * n_embd for "gelu" and
      "relu2", and for
      "swiglu" 8/3 * n_embd rounded up to a multiple of 8, which keeps the
      parameter count of the 4x GELU MLP (as the Llama paper does).
    n_kv_head: key/value heads, dividing `n_head` (grouped-query attention:
      each serves `n_head // n_kv_head` query heads; 1 is multi-query);
      None: `n_head`.
    tie_embeddings: the output head is the token embedding (GPT-2); False
      gives it its own `[n_embd, vocab_size]` weights (`params["lm_head"]`).
    qkv_bias: biases on the query/key/value projection even when `bias` is
      False (Qwen2).
    norm_scale: whether the norms have a learned scale (`"scale"`); False:
      nanochat's parameter-free RMSNorm (`nn.rms_normalize`), and the params
      hold no `ln_1`, `ln_2`, `ln_f`. Only with `norm="rmsnorm"`.
    embed_norm: normalise the token embeddings before the first block
      (nanochat; with `norm_scale`, its scale is `params["ln_e"]`).
    qk_norm: RMS-normalise each head's queries and keys (after RoPE, as
      nanochat; RoPE keeps a head's norm, so before is the same) without a
      learned scale: attention logits are then bounded by `sqrt(head_dim)`.
    logit_softcap: None, or `c` in `c * tanh(logits / c)`, which bounds the
      output logits to (-c, c) (Gemma 2; nanochat uses 15).
    zero_init_proj: start the two projections that write into the residual
      stream (attention's and the MLP's `proj`) at zero, so every block begins
      as the identity (nanochat, modded-nanogpt).
    value_embeds: nanochat's value embeddings (ResFormer-style value
      residuals): every other layer, counting back from the last, adds a token
      embedding of its own to the attention values, per key/value head
      gated by `3 * sigmoid(x[..., :12] @ gate)` of the block's normed input
      (`params["value_embeds"]`: `"embedding"` `[n_value_embeds, vocab,
      kv_heads * head_dim]` and `"gate"` `[n_value_embeds, 12, kv_heads]`).
    param_dtype: dtype of the stored params ("float32").
    compute_dtype: dtype of the matmuls ("float32" or "bfloat16"); LayerNorm,
      softmax and the loss always run in float32.
  """
  vocab_size: int = 65
  block_size: int = 64
  n_layer: int = 4
  n_head: int = 4
  n_embd: int = 128
  dropout: float = 0.0
  bias: bool = True
  norm: str = "layernorm"
  norm_eps: float = 1e-5
  position: str = "learned"
  rope_theta: float = 10000.0
  rope_scaling: Optional[nn.RopeScaling] = None
  mlp: str = "gelu"
  mlp_hidden: Optional[int] = None
  n_kv_head: Optional[int] = None
  tie_embeddings: bool = True
  qkv_bias: bool = False
  norm_scale: bool = True
  embed_norm: bool = False
  qk_norm: bool = False
  logit_softcap: Optional[float] = None
  zero_init_proj: bool = False
  value_embeds: bool = False
  param_dtype: str = "float32"
  compute_dtype: str = "float32"

  def __post_init__(self):
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
    if self.n_embd % self.n_head:
      raise ValueError(
          f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; choose "
          f"n_head among the divisors of n_embd (e.g. n_head="
          f"{math.gcd(self.n_embd, self.n_head)}).")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {self.dropout}.")
    self._check_architecture()
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is not one of "
                         f"{sorted(DTYPES)}.")

  def _check_architecture(self) -> None:
    for name, allowed in (("norm", NORMS), ("position", POSITIONS), ("mlp", MLPS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is not one of "
                         f"{list(allowed)}.")
    if not self.norm_eps > 0:
      raise ValueError(f"GPTConfig.norm_eps must be positive, got {self.norm_eps}.")
    if not self.rope_theta > 0:
      raise ValueError(f"GPTConfig.rope_theta must be positive, got {self.rope_theta}.")
    if isinstance(self.rope_scaling, dict):  # as Hugging Face and saved configs hold it
      object.__setattr__(self, "rope_scaling", nn.RopeScaling.from_dict(self.rope_scaling))
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, nn.RopeScaling):
      raise ValueError(f"GPTConfig.rope_scaling must be None, an nn.RopeScaling or a dict, "
                       f"got {self.rope_scaling!r}.")
    if self.position == "rope" and self.head_dim % 2:
      raise ValueError(f"position='rope' needs an even head size, but n_embd={self.n_embd} "
                       f"/ n_head={self.n_head} = {self.head_dim}; change n_head.")
    for name in ("mlp_hidden", "n_kv_head"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"GPTConfig.{name} must be None or a positive integer, got "
                         f"{value!r}.")
    if not self.norm_scale and self.norm != "rmsnorm":
      raise ValueError("norm_scale=False is a parameter-free RMSNorm; add norm='rmsnorm' "
                       "or drop norm_scale=False.")
    if self.logit_softcap is not None and not self.logit_softcap > 0:
      raise ValueError(f"GPTConfig.logit_softcap must be None or positive, got "
                       f"{self.logit_softcap!r} (nanochat uses 15.0).")
    if self.value_embeds and self.n_embd < VALUE_GATE_CHANNELS:
      raise ValueError(f"value_embeds' gates read {VALUE_GATE_CHANNELS} channels, but "
                       f"n_embd={self.n_embd}; widen the model or drop value_embeds.")
    if self.n_head % self.kv_heads:
      raise ValueError(f"n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}; "
                       f"each key/value head serves a whole group of query heads.")

  @property
  def head_dim(self) -> int:
    return self.n_embd // self.n_head

  @property
  def kv_heads(self) -> int:
    """Key/value heads (`n_kv_head`, or `n_head` when that is None)."""
    return self.n_kv_head or self.n_head

  @property
  def mlp_width(self) -> int:
    """The MLP's hidden width (see `mlp_hidden`)."""
    if self.mlp_hidden is not None:
      return self.mlp_hidden
    if self.mlp == "swiglu":
      return -(-(8 * self.n_embd) // (3 * 8)) * 8
    return 4 * self.n_embd

  @property
  def nanochat_options(self) -> tuple:
    """The names of the nanochat options that change the math and are on (weight formats
    of GPT-2 and Llama hold none of them)."""
    on = dict(norm_scale=not self.norm_scale, embed_norm=self.embed_norm,
              qk_norm=self.qk_norm, logit_softcap=self.logit_softcap is not None,
              value_embeds=self.value_embeds, mlp=self.mlp == "relu2")
    return tuple(name for name, is_on in on.items() if is_on)

  @property
  def n_value_embeds(self) -> int:
    """Layers with a value embedding: every other one, counting back from the last."""
    return (self.n_layer + 1) // 2 if self.value_embeds else 0

  def has_value_embed(self, layer: int) -> bool:
    """Whether layer `layer` (0-based) adds a value embedding; its table is `layer // 2`."""
    return self.value_embeds and layer % 2 == (self.n_layer - 1) % 2

  @property
  def matmul_dtype(self):
    """Operand dtype of the matmuls; None when they run in float32."""
    return None if self.compute_dtype == "float32" else DTYPES[self.compute_dtype]

  @classmethod
  def from_dict(cls, saved: Mapping[str, Any]) -> "GPTConfig":
    """The config a checkpoint saved (`dataclasses.asdict`), older ones included.

    Configs saved before the execution options moved to `kernels.Forms` also
    hold `EXECUTION_FIELDS`; they do not change the model, so they are left out.
    """
    return cls(**{k: v for k, v in saved.items() if k not in EXECUTION_FIELDS})


# The architectures by name: GPTConfig options (`GPTConfig(**ARCHITECTURES[name], ...)`).
# "llama" is the Llama block at the size it is given: RMSNorm, rotary
# positions, SwiGLU, no biases; its head stays tied, as in SmolLM and Llama
# 3.2's small models, so at a small vocabulary it has the GPT's parameter count.
# "nanochat" is nanochat's GPT (karpathy/nanochat, nanochat/gpt.py): rotary
# positions, parameter-free RMSNorm (also right after the token embedding),
# QK-norm, a ReLU^2 MLP, no biases, zero-initialised residual projections, an
# untied head, logits soft-capped at 15, and value embeddings. Its sliding
# windows, per-layer residual scalars, smear and backout are not options here.
ARCHITECTURES: Dict[str, Dict[str, Any]] = {
    "gpt2": {},
    "llama": dict(norm="rmsnorm", norm_eps=1e-5, position="rope", mlp="swiglu", bias=False),
    "nanochat": dict(norm="rmsnorm", norm_scale=False, embed_norm=True, position="rope",
                     mlp="relu2", bias=False, qk_norm=True, logit_softcap=15.0,
                     zero_init_proj=True, tie_embeddings=False, value_embeds=True),
}

# nanochat's depth rule (scripts/base_train.py): width = depth * 64 rounded up
# to whole 128-wide heads; as many heads as fit; AdamW rates scaled by
# (width / 768) ** -0.5, the width its rates were tuned at.
DEPTH_ASPECT_RATIO = 64
DEPTH_HEAD_DIM = 128
DEPTH_REFERENCE_WIDTH = 768


def depth_shape(depth: int) -> Dict[str, int]:
  """`n_layer`, `n_embd` and `n_head` of a model `depth` blocks deep (nanochat's rule).

  `n_embd = ceil(depth * 64 / 128) * 128`, `n_head = n_embd / 128`: every head
  is 128 wide, e.g. depth 12 -> width 768, 6 heads; depth 20 -> 1280, 10.
  """
  if not isinstance(depth, int) or depth < 1:
    raise ValueError(f"depth must be a positive integer, got {depth!r}.")
  width = -(-depth * DEPTH_ASPECT_RATIO // DEPTH_HEAD_DIM) * DEPTH_HEAD_DIM
  return dict(n_layer=depth, n_embd=width, n_head=width // DEPTH_HEAD_DIM)


def depth_lr_scale(n_embd: int) -> float:
  """The learning-rate factor at width `n_embd`: `(n_embd / 768) ** -0.5` (nanochat's AdamW rule)."""
  return (n_embd / DEPTH_REFERENCE_WIDTH) ** -0.5

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
# How a model runs, which belongs to `kernels.Forms`, not to its config: a saved
# config that names these fields loads with them left out.
EXECUTION_FIELDS = ("remat", "attn_block", "attention", "scan_layers")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu", "relu2", "geglu")
# `window_pattern`'s letters: a layer attends over a sliding window ("S") or
# over the whole context ("L"), nanochat's spelling.
SLIDING, FULL = "S", "L"
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
    n_head: attention heads; must divide `n_embd` unless `head_size` is set.
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
      (`proj(silu(gate(x)) * up(x))`, Llama; gate and up are one matmul),
      "geglu" (`proj(gelu_tanh(gate(x)) * up(x))`, Gemma) or "relu2"
      (`proj(relu(fc(x))^2)`, nanochat and modded-nanogpt).
    mlp_hidden: the MLP's hidden width; None: 4 * n_embd for "gelu" and
      "relu2", and for
      "swiglu" and "geglu" 8/3 * n_embd rounded up to a multiple of 8, which keeps the
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
    window: None, or the keys a sliding-window layer's query sees, itself
      included: position `t` attends to `t - window + 1 .. t` (Mistral's and
      Gemma's `sliding_window`). With `window_pattern` None, every layer
      slides.
    window_pattern: None, or which layers slide: one letter per layer, "S"
      (a sliding window of `window`) or "L" (the whole context), tiled over
      the layers ("SSSSSL": Gemma 3's five local layers per global one;
      "SSSL": nanochat's), its first `n_layer` letters when longer. Needs
      `window`.
    rope_local_theta: None, or the RoPE base of the sliding layers, which
      then take no `rope_scaling` (Gemma 3: 10000 local, `rope_theta` and
      the scaling on the global layers); None: every layer has `rope_theta`.
    head_size: None, or each head's width independent of `n_embd` (Gemma:
      256 heads of a 640-wide model); None: `n_embd // n_head`.
    attn_scalar: None, or `s` in the attention scale `s ** -0.5` (Gemma's
      `query_pre_attn_scalar`); None: the head size.
    attn_softcap: None, or `c` in `c * tanh(scores / c)` on the attention
      scores before the mask and softmax (Gemma 2).
    norm_offset: RMSNorm scales by `1 + scale`, all in float32, with the
      scale stored (and initialised) as 0 (Gemma's RMSNorm).
    sandwich_norm: two more norms per block, on the attention's and the
      MLP's outputs before each residual add (`ln_attn_out`, `ln_mlp_out`;
      Gemma 2 and 3).
    qk_norm_scale: QK-norm with a learned `[head_size]` scale per projection
      (`attn.q_norm`, `attn.k_norm`), applied before RoPE (Gemma 3); needs
      `qk_norm`.
    embed_scale: the token embeddings are multiplied by `sqrt(n_embd)`,
      rounded to the table's dtype (Gemma).
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
  window: Optional[int] = None
  window_pattern: Optional[str] = None
  rope_local_theta: Optional[float] = None
  head_size: Optional[int] = None
  attn_scalar: Optional[float] = None
  attn_softcap: Optional[float] = None
  norm_offset: bool = False
  sandwich_norm: bool = False
  qk_norm_scale: bool = False
  embed_scale: bool = False
  param_dtype: str = "float32"
  compute_dtype: str = "float32"

  def __post_init__(self):
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
    if self.head_size is None and self.n_embd % self.n_head:
      raise ValueError(
          f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; choose "
          f"n_head among the divisors of n_embd (e.g. n_head="
          f"{math.gcd(self.n_embd, self.n_head)}), or set head_size.")
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
    for name in ("mlp_hidden", "n_kv_head", "head_size", "window"):
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
    self._check_gemma_options()
    if self.n_head % self.kv_heads:
      raise ValueError(f"n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}; "
                       f"each key/value head serves a whole group of query heads.")

  def _check_gemma_options(self) -> None:
    """Sliding windows and the Gemma block's options."""
    if self.window_pattern is not None:
      if (not isinstance(self.window_pattern, str) or not self.window_pattern
          or set(self.window_pattern) - {SLIDING, FULL}):
        raise ValueError(f"GPTConfig.window_pattern={self.window_pattern!r} must be letters "
                         f"{SLIDING!r} (sliding window) and {FULL!r} (full context), e.g. "
                         f"'SSSL'.")
      if self.window is None:
        raise ValueError(f"window_pattern={self.window_pattern!r} needs window=N, the keys a "
                         f"sliding layer sees.")
    for name in ("rope_local_theta", "attn_scalar", "attn_softcap"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"GPTConfig.{name} must be None or positive, got {value!r}.")
    if self.rope_local_theta is not None and self.position != "rope":
      raise ValueError("rope_local_theta is a RoPE base; add position='rope' or drop it.")
    if self.norm_offset and not (self.norm == "rmsnorm" and self.norm_scale):
      raise ValueError("norm_offset is Gemma's RMSNorm, (1 + scale); it needs "
                       "norm='rmsnorm' with a scale (norm_scale=True).")
    if self.sandwich_norm and not self.norm_scale:
      raise ValueError("sandwich_norm adds two norms with scales; drop norm_scale=False.")
    if self.qk_norm_scale and not self.qk_norm:
      raise ValueError("qk_norm_scale gives QK-norm a learned scale; add qk_norm=True.")

  @property
  def head_dim(self) -> int:
    """Each head's width: `head_size`, or `n_embd // n_head`."""
    return self.head_size or self.n_embd // self.n_head

  @property
  def attn_width(self) -> int:
    """Width of the concatenated heads: `n_head * head_dim` (the output projection's input)."""
    return self.n_head * self.head_dim

  @property
  def attn_scale(self) -> float:
    """The queries' scale: `attn_scalar ** -0.5`, or `head_dim ** -0.5`."""
    return (self.attn_scalar or self.head_dim) ** -0.5

  @property
  def layer_kinds(self) -> tuple:
    """Per layer, 1 where it attends over a sliding window, 0 where over the whole context."""
    if self.window is None:
      return (0,) * self.n_layer
    pattern = self.window_pattern or SLIDING
    return tuple(int(pattern[i % len(pattern)] == SLIDING) for i in range(self.n_layer))

  @property
  def mixed_layers(self) -> bool:
    """Whether layers differ in window (and so RoPE base): the layer scan reads each one's kind."""
    return len(set(self.layer_kinds)) > 1

  def kind_window(self, kind: int) -> Optional[int]:
    """The window of a layer of kind `kind` (`layer_kinds`): `window`, or None (all keys)."""
    return self.window if kind else None

  def kind_rope(self, kind: int) -> tuple:
    """`(theta, scaling)` of RoPE in a layer of kind `kind` (`rope_local_theta`)."""
    if kind and self.rope_local_theta is not None:
      return float(self.rope_local_theta), None
    return self.rope_theta, self.rope_scaling

  @property
  def kv_heads(self) -> int:
    """Key/value heads (`n_kv_head`, or `n_head` when that is None)."""
    return self.n_kv_head or self.n_head

  @property
  def mlp_width(self) -> int:
    """The MLP's hidden width (see `mlp_hidden`)."""
    if self.mlp_hidden is not None:
      return self.mlp_hidden
    if self.mlp in ("swiglu", "geglu"):
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
  def gemma_options(self) -> tuple:
    """The names of the Gemma options (and windows) that are on: the GPT-2 and Llama
    formats hold none of them, except a window (Mistral, Qwen2)."""
    on = dict(window=self.window is not None, rope_local_theta=self.rope_local_theta is not None,
              head_size=self.head_size not in (None, self.n_embd // self.n_head),
              attn_scalar=self.attn_scalar not in (None, self.head_dim),
              attn_softcap=self.attn_softcap is not None, norm_offset=self.norm_offset,
              sandwich_norm=self.sandwich_norm, qk_norm_scale=self.qk_norm_scale,
              embed_scale=self.embed_scale, mlp=self.mlp == "geglu")
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
# "gemma3" is Gemma 3's text model (Hugging Face's Gemma3ForCausalLM): a
# window of 512 on five layers of six (the last of each six sees the whole
# context), RoPE base 10000 on the local layers and 1e6 on the global ones,
# Gemma's (1 + scale) RMSNorm before and after each sublayer, QK-norm with
# scales before RoPE, GeGLU, embeddings scaled by sqrt(width), a tied head.
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
    "gemma3": dict(norm="rmsnorm", norm_eps=1e-6, norm_offset=True, sandwich_norm=True,
                   position="rope", rope_theta=1_000_000.0, rope_local_theta=10_000.0,
                   qk_norm=True, qk_norm_scale=True, mlp="geglu", bias=False,
                   embed_scale=True, window=512, window_pattern="SSSSSL",
                   tie_embeddings=True),
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

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
MLPS = ("gelu", "swiglu")


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
    mlp: "gelu" (`proj(gelu(fc(x)))`, GPT-2) or "swiglu"
      (`proj(silu(gate(x)) * up(x))`, Llama; gate and up are one matmul).
    mlp_hidden: the MLP's hidden width; None: 4 * n_embd for "gelu", and for
      "swiglu" 8/3 * n_embd rounded up to a multiple of 8, which keeps the
      parameter count of the 4x GELU MLP (as the Llama paper does).
    n_kv_head: key/value heads, dividing `n_head` (grouped-query attention:
      each serves `n_head // n_kv_head` query heads; 1 is multi-query);
      None: `n_head`.
    tie_embeddings: the output head is the token embedding (GPT-2); False
      gives it its own `[n_embd, vocab_size]` weights (`params["lm_head"]`).
    qkv_bias: biases on the query/key/value projection even when `bias` is
      False (Qwen2).
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
ARCHITECTURES: Dict[str, Dict[str, Any]] = {
    "gpt2": {},
    "llama": dict(norm="rmsnorm", norm_eps=1e-5, position="rope", mlp="swiglu", bias=False),
}

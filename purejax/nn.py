"""Layers as pure functions over params dicts.

Every layer is a pair: `init_<layer>(..., key) -> params` builds a dict of
arrays, and `<layer>(params, x, ...)` applies it. Layers without params
(rotary position embeddings, activations) are plain functions. Nothing holds state; compose
layers with plain function calls and keep their params in named dicts, so a
model's params read like its architecture (`params["blocks"]["attn"]["w"]`).
"""

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional

import chex
import jax
import jax.numpy as jnp

from purejax.ops import kernels
from purejax.ops import quant
from purejax.ops.matmul import matmul

Params = Dict[str, chex.Array]


# ----------------------------------------------------------------------------
# Dense


def init_dense(
    in_dim: int,
    out_dim: int,
    key: chex.PRNGKey,
    *,
    scale: float = 0.02,
    bias: bool = True,
    dtype=jnp.float32,
) -> Params:
  """Initialises a dense layer: weights ~ N(0, scale^2), biases zero.

  Args:
    in_dim: input features.
    out_dim: output features.
    key: PRNG key for the weights (last, as in every init function).
    scale: standard deviation of the weights.
    bias: whether to create a bias.
    dtype: dtype of the params.

  Returns:
    `{"w": [in_dim, out_dim]}` plus `{"b": [out_dim]}` when `bias`.
  """
  params = {"w": scale * jax.random.normal(key, (in_dim, out_dim), dtype)}
  if bias:
    params["b"] = jnp.zeros((out_dim,), dtype)
  return params


def dense(params: Params, x: chex.Array, *, compute_dtype=None,
          forms: Optional[kernels.Forms] = None) -> chex.Array:
  """Applies `x @ w + b` over the last axis of `x`.

  Args:
    params: from `init_dense`.
    x: `[..., in_dim]`.
    compute_dtype: if given, the matmul's operands are cast to this dtype
      (e.g. bfloat16) and the result is float32, or the compute dtype where
      `forms.matmul_output` says so (see `matmul.matmul`); params stay in
      their own dtype (mixed precision).
    forms: the backend forms of the matmul (default: see `matmul.matmul`).

  Returns:
    `[..., out_dim]`: as `matmul.matmul`'s output.
  """
  y = matmul(x, params["w"], compute_dtype=compute_dtype, forms=forms)
  if "b" in params:
    y = y + params["b"].astype(y.dtype)
  return y


# ----------------------------------------------------------------------------
# Layer norm


def init_layer_norm(dim: int, *, bias: bool = True, dtype=jnp.float32) -> Params:
  """Initialises layer norm: scale ones, bias zeros (omitted if not `bias`)."""
  params = {"scale": jnp.ones((dim,), dtype)}
  if bias:
    params["bias"] = jnp.zeros((dim,), dtype)
  return params


def layer_norm(params: Params, x: chex.Array, *, eps: float = 1e-5) -> chex.Array:
  """Normalises the last axis of `x` to zero mean and unit variance.

  The statistics are computed in float32 whatever the input dtype, since
  bfloat16 sums lose precision; the result is cast back to `x.dtype`.

  Args:
    params: from `init_layer_norm`.
    x: `[..., dim]`.
    eps: added to the variance.

  Returns:
    `[..., dim]`, same dtype as `x`.
  """
  chex.assert_axis_dimension(x, -1, params["scale"].shape[0])
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps) * params["scale"]
  if "bias" in params:
    y = y + params["bias"]
  return y.astype(x.dtype)


def init_rms_norm(dim: int, *, dtype=jnp.float32) -> Params:
  """Initialises RMSNorm: `{"scale": ones [dim]}` (it has no bias)."""
  return {"scale": jnp.ones((dim,), dtype)}


def rms_norm(params: Params, x: chex.Array, *, eps: float = 1e-6,
             offset: bool = False) -> chex.Array:
  """Scales the last axis of `x` to unit root mean square (Llama's RMSNorm).

  `x / sqrt(mean(x^2) + eps) * scale`: no mean is subtracted and there is no
  bias. As in Hugging Face's `LlamaRMSNorm`, the statistics are float32 and
  the normalised input is cast back to `x.dtype` before the scale. With
  `offset` (Gemma's RMSNorm) it is `normed * (1 + scale)`, all in float32,
  cast back at the end.

  Args:
    params: from `init_rms_norm` (with `offset`, a scale of zeros is the identity).
    x: `[..., dim]`.
    eps: added to the mean square.
    offset: scale by `1 + scale` in float32.

  Returns:
    `[..., dim]`, same dtype as `x`.
  """
  chex.assert_axis_dimension(x, -1, params["scale"].shape[0])
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  if offset:
    return (normed * (1.0 + params["scale"].astype(jnp.float32))).astype(x.dtype)
  return (normed.astype(x.dtype) * params["scale"]).astype(x.dtype)


def rms_normalize(x: chex.Array, *, eps: float = 1e-6) -> chex.Array:
  """RMSNorm without a learned scale: `x / sqrt(mean(x^2) + eps)` over the last axis.

  nanochat's norm (`F.rms_norm` with no weight), and QK-norm's over each
  head. Statistics in float32, as `rms_norm`; returns `x.dtype`.

  Args:
    x: `[..., dim]`.
    eps: added to the mean square.

  Returns:
    `[..., dim]`, same dtype as `x`.
  """
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
          ).astype(x.dtype)


# ----------------------------------------------------------------------------
# Embedding


def init_embedding(
    num_embeddings: int, dim: int, key: chex.PRNGKey, *, scale: float = 0.02,
    dtype=jnp.float32,
) -> Params:
  """Initialises an embedding table `{"embedding": [num_embeddings, dim]}`, N(0, scale^2)."""
  return {"embedding": scale * jax.random.normal(key, (num_embeddings, dim), dtype)}


def embed(params: Params, ids: chex.Array) -> chex.Array:
  """Looks up integer `ids` (any shape) -> `[*ids.shape, dim]`."""
  chex.assert_type(ids, int)
  table = params["embedding"]
  if isinstance(table, quant.QuantizedWeight):  # only the rows looked up are dequantized
    return quant.take_rows(table, ids)
  return jnp.take(table, ids, axis=0)


def embedding_logits(params: Params, x: chex.Array, *, compute_dtype=None,
                     forms: Optional[kernels.Forms] = None) -> chex.Array:
  """Projects `[..., dim]` onto the embedding table: `[..., num_embeddings]`.

  This is the output head of a model with tied input/output embeddings.
  `compute_dtype` and `forms` as in `matmul.matmul`.
  """
  return matmul(x, params["embedding"].T, compute_dtype=compute_dtype, forms=forms,
                output="float32")


# ----------------------------------------------------------------------------
# Rotary position embeddings (RoPE)


ROPE_SCALING_TYPES = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How RoPE's frequencies are stretched for contexts longer than pretraining's.

  The two kinds real checkpoints of the Llama family use, with Hugging
  Face's field names (`rope_scaling` in their `config.json`):

  * "linear": every frequency divided by `factor` (positions interpolated).
  * "llama3": Llama 3.1's: wavelengths longer than
    `original_max_position_embeddings / low_freq_factor` are divided by
    `factor`, those shorter than `... / high_freq_factor` kept, and the band
    between interpolated smoothly.

  Attributes:
    rope_type: "linear" or "llama3".
    factor: how much longer the context is than pretraining's.
    low_freq_factor, high_freq_factor: "llama3"'s band edges.
    original_max_position_embeddings: "llama3"'s pretraining context.
  """
  rope_type: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in ROPE_SCALING_TYPES:
      raise ValueError(f"rope_scaling.rope_type={self.rope_type!r} is not supported; "
                       f"purejax has {' and '.join(ROPE_SCALING_TYPES)} (or no scaling).")
    if not self.factor > 0:
      raise ValueError(f"rope_scaling.factor must be positive, got {self.factor}.")
    if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                       f"low_freq_factor={self.low_freq_factor}.")

  @classmethod
  def from_dict(cls, spec: Mapping[str, Any]) -> Optional["RopeScaling"]:
    """From Hugging Face's `rope_scaling` dict (`"rope_type"` or `"type"`); None for default.

    Raises:
      ValueError: another kind of scaling, or a field it needs is missing.
    """
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type == "default":
      return None
    if rope_type not in ROPE_SCALING_TYPES:
      raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not supported; purejax "
                       f"has {' and '.join(ROPE_SCALING_TYPES)} (or no scaling).")
    needed = ["factor"]
    if rope_type == "llama3":
      needed += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    for name in needed:
      if spec.get(name) is None:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs rope_scaling.{name}.")
    return cls(rope_type=rope_type, **{name: spec[name] for name in needed})


def rope_frequencies(head_dim: int, theta: float = 10000.0,
                     scaling: Optional[RopeScaling] = None) -> chex.Array:
  """RoPE's inverse frequencies `theta^(-2i / head_dim)`, `[head_dim // 2]` float32.

  Pair `i` of each head turns by `position * frequencies[i]` radians.
  `scaling` stretches them (see `RopeScaling`).
  """
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head dimension, got {head_dim}; choose n_embd "
                     f"and n_head so that n_embd // n_head is even.")
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling is None:
    return inv_freq
  if scaling.rope_type == "linear":
    return inv_freq / scaling.factor
  context = scaling.original_max_position_embeddings
  wavelength = 2 * math.pi / inv_freq
  smooth = ((context / wavelength - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor))
  interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  long_waves = wavelength > context / scaling.low_freq_factor
  short_waves = wavelength < context / scaling.high_freq_factor
  return jnp.where(long_waves, inv_freq / scaling.factor,
                   jnp.where(short_waves, inv_freq, interpolated))


def rope(x: chex.Array, positions: chex.Array, frequencies: chex.Array) -> chex.Array:
  """Rotates queries or keys by their positions (Hugging Face's RoPE layout).

  The head's first and second halves form the pairs (`rotate_half`, as in
  Hugging Face's Llama, not GPT-J's interleaved pairs): element `i` and
  `i + d/2` turn together by `position * frequencies[i]`. The angles are
  float32; the result is in x's dtype.

  Args:
    x: `[batch, time, heads, head_dim]`.
    positions: `[time]` or `[batch, time]` integer positions.
    frequencies: `[head_dim // 2]`, from `rope_frequencies`.

  Returns:
    `[batch, time, heads, head_dim]`.
  """
  chex.assert_rank(x, 4)
  chex.assert_axis_dimension(frequencies, 0, x.shape[-1] // 2)
  angles = positions.astype(jnp.float32)[..., None] * frequencies  # [(b,) t, d/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [(b,) t, 1, d]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  first, second = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-second, first], axis=-1) * sin


# ----------------------------------------------------------------------------
# Activations (dropout, shared with ops/attention.py, lives in ops/dropout.py)


def relu(x: chex.Array) -> chex.Array:
  return jnp.maximum(x, 0)


def relu_squared(x: chex.Array) -> chex.Array:
  """`relu(x)^2`, the MLP activation of modded-nanogpt and nanochat."""
  return jnp.square(jnp.maximum(x, 0))


def softcap(logits: chex.Array, cap: float) -> chex.Array:
  """`cap * tanh(logits / cap)`: logits smoothly bounded to (-cap, cap) (Gemma 2, nanochat)."""
  return cap * jnp.tanh(logits / cap)


def gelu(x: chex.Array) -> chex.Array:
  """GELU with the tanh approximation, as in GPT-2."""
  return jax.nn.gelu(x, approximate=True)


def geglu(x: chex.Array) -> chex.Array:
  """GeGLU on a fused projection: `gelu_tanh(gate) * up`, `[..., 2 * hidden] -> [..., hidden]` (Gemma)."""
  gate, up = jnp.split(x, 2, axis=-1)
  return jax.nn.gelu(gate, approximate=True) * up


def swiglu(x: chex.Array) -> chex.Array:
  """SwiGLU on a fused projection: `silu(gate) * up`, `[..., 2 * hidden] -> [..., hidden]`.

  `x` holds the gate's projection in its first half and the up projection
  in its second (one matmul computes both).
  """
  gate, up = jnp.split(x, 2, axis=-1)
  return jax.nn.silu(gate) * up


# ----------------------------------------------------------------------------
# Metrics (the losses: `ops.loss`)


def accuracy(logits: chex.Array, labels: chex.Array) -> chex.Array:
  """Fraction of positions where `argmax(logits) == labels`."""
  chex.assert_equal_shape_prefix((logits, labels), labels.ndim)
  chex.assert_rank(logits, labels.ndim + 1)
  return jnp.mean(jnp.argmax(logits, axis=-1) == labels)

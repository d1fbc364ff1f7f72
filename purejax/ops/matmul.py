"""The matrix products: mixed precision, row-major backward forms, and low-rank weights.

    y = matmul(x, w, compute_dtype=jnp.bfloat16, forms=forms)   # bf16 products, float32
                                                                  # out (bf16: matmul_output)
    y = matmul(x, LowRankWeight(w, a, b, scale))                  # x @ w + scale (x @ a) @ b
    y = matmul(x, quant.quantize(w, "q4_1"))                      # x @ w's dequantized matrix

The layers import them from here; `kernels.Forms` chooses their backward form; this module holds the products alone, so it takes any
object with a `matmul_backward` attribute as its forms.
"""

import dataclasses
import functools
from typing import Any, Optional

import chex
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from purejax.ops import quant

# The name a low-rank product's output carries for remat policies.
LOW_RANK_OUTPUT = "low_rank_product"


def row_major_transpose(a: chex.Array) -> chex.Array:
  """Swaps the last two axes of `a`, writing the data out in row-major order.

  XLA's CPU backend runs a low-precision dot natively only when both operands
  are row-major `[..., m, k] @ [..., k, n]`. A plain transpose becomes a
  layout change, and the dot is then quietly upcast to float32 (3-4x slower
  with AMX-BF16). Splitting the last axis before transposing makes XLA copy
  the data instead. An odd last axis falls back to a plain transpose.
  """
  *lead, rows, cols = a.shape
  if cols % 2:
    return jnp.swapaxes(a, -1, -2)
  split = a.reshape(*lead, rows, cols // 2, 2)
  return jnp.moveaxis(split, -3, -1).reshape(*lead, cols, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _low_precision_matmul(x, w, dtype, row_major):
  """`[..., n, k] @ [..., k, m]` computed from `dtype` operands with float32
  accumulation, output in `x`'s dtype (float32, or `dtype` itself)."""
  del row_major
  return _dot(x.astype(dtype), w.astype(dtype), x.dtype)


def _dot(a, b, out=jnp.float32):
  """`a @ b` accumulated in float32, output `out`; `jnp.dot` for 2-D operands."""
  product = jnp.dot if a.ndim == 2 else jnp.matmul
  return product(a, b, preferred_element_type=out)


def _low_precision_matmul_fwd(x, w, dtype, row_major):
  del row_major
  xc, wc = x.astype(dtype), w.astype(dtype)
  # xc's dtype is x's when x already is `dtype`: then the output is `dtype` too.
  return _dot(xc, wc, x.dtype), (xc, wc, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _low_precision_matmul_bwd(dtype, row_major, residuals, g):
  # JAX's own transpose of a dot with preferred_element_type would multiply
  # float32 by bfloat16 and round the result to bfloat16; both run at a
  # fraction of the speed of bfloat16 operands with float32 accumulation.
  xc, wc, x_like, w_like = residuals  # the empty arrays carry x's and w's dtypes
  gc = g.astype(dtype)
  transpose = row_major_transpose if row_major else lambda a: jnp.swapaxes(a, -1, -2)
  dx = _dot(gc, transpose(wc), x_like.dtype)
  dw = _dot(transpose(xc), gc, w_like.dtype)
  if row_major:
    # Stops XLA CPU from folding a later transpose of a gradient (e.g. of the
    # tied head's `embedding.T`) into these dots: that would recreate a
    # non-row-major low-precision dot after the pass that upcasts such dots,
    # and XLA's CPU runtime cannot execute it.
    dx, dw = jax.lax.optimization_barrier((dx, dw))
  return dx, dw


_low_precision_matmul.defvjp(_low_precision_matmul_fwd, _low_precision_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _low_precision_matmul_frozen(x, w, dtype, row_major):
  """`_low_precision_matmul` of a weight that gets no gradient: no weight product."""
  return _low_precision_matmul(x, w, dtype, row_major)


def _low_precision_matmul_frozen_fwd(x, w, dtype, row_major):
  del row_major
  wc = w.astype(dtype)
  return _dot(x.astype(dtype), wc, x.dtype), (wc, jnp.zeros((0,), x.dtype))


def _low_precision_matmul_frozen_bwd(dtype, row_major, residuals, g):
  wc, x_like = residuals
  transpose = row_major_transpose if row_major else lambda a: jnp.swapaxes(a, -1, -2)
  dx = _dot(g.astype(dtype), transpose(wc), x_like.dtype)
  if row_major:
    dx = jax.lax.optimization_barrier(dx)  # as in `_low_precision_matmul_bwd`
  return dx, jnp.zeros(wc.shape, jnp.float32)  # the caller passes w as float32


_low_precision_matmul_frozen.defvjp(_low_precision_matmul_frozen_fwd,
                                    _low_precision_matmul_frozen_bwd)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("base", "a", "b"),
                   meta_fields=("scale",))
@dataclasses.dataclass(frozen=True)
class LowRankWeight:
  """A frozen weight plus a trained low-rank update, `base + scale * a @ b`, kept apart.

  `matmul(x, LowRankWeight(...))` computes `x @ base + scale * (x @ a) @ b`
  without forming the sum, and differentiates only the factors: the frozen
  base gets no `[in, out]` weight gradient, which is a third of a dense
  layer's training FLOPs. LoRA's training view (`lora.View`) passes the
  model these in place of its adapted weights. A pytree whose leaves are
  the three arrays (stacked layers slice like any weight).

  Attributes:
    base: `[..., in_dim, out_dim]`, frozen (no gradient flows to it).
    a: `[..., in_dim, rank]`.
    b: `[..., rank, out_dim]`.
    scale: the update's factor (LoRA's `alpha / rank`).
  """
  base: chex.Array
  a: chex.Array
  b: chex.Array
  scale: float

  @property
  def shape(self):
    return self.base.shape

  @property
  def ndim(self):
    return self.base.ndim

  def merged(self) -> chex.Array:
    """`base + scale * a @ b` as one array of `base`'s dtype (where a whole matrix is read)."""
    delta = jnp.matmul(self.a.astype(jnp.float32), self.b.astype(jnp.float32))
    if isinstance(self.base, quant.QuantizedWeight):  # a merged quantized base is float32
      return quant.dense(self.base) + self.scale * delta
    return (self.base.astype(jnp.float32) + self.scale * delta).astype(self.base.dtype)


def matmul(x: chex.Array, w, *, compute_dtype=None,
           forms: Optional[Any] = None, output: Optional[str] = None) -> chex.Array:
  """`x @ w` over the last axis of `x`, with optional mixed precision.

  With `compute_dtype` (e.g. bfloat16), the operands of the product and of
  its two gradient products are cast to it, and all three accumulate in
  float32. CPUs with AMX/AVX512-BF16, GPUs and TPUs run these 2-3x faster
  than float32 matmuls. The product and the gradient of `x` are float32, or
  rounded to `compute_dtype` with `forms.matmul_output == "compute"` (as
  PyTorch's autocast rounds them; half the bytes for the work around them);
  the weight's gradient is always float32.

  Args:
    x: `[..., in_dim]` float.
    w: `[in_dim, out_dim]` float, a `quant.QuantizedWeight` of that shape (frozen:
      dequantized inside the program, no gradient), or a `LowRankWeight` of that
      shape (its rank-wide adapter products run in float32 whatever
      `compute_dtype`; its base may be quantized: QLoRA).
    compute_dtype: operand dtype, or None to multiply in the inputs' dtype.
    forms: the backward form (`Forms.matmul_backward`) and the output's
      dtype (`Forms.matmul_output`); None: the plain form, float32 output.
      Models pass the forms their entry point chose.
    output: the product's dtype, "float32" or "compute", whatever
      `forms.matmul_output` says (the output head's logits); None: as `forms`.

  Returns:
    `[..., out_dim]`: float32 or `compute_dtype` (above) when `compute_dtype`
    is given, else x's dtype.
  """
  if isinstance(w, quant.QuantizedWeight) or isinstance(w, LowRankWeight) and isinstance(
      w.base, quant.QuantizedWeight):
    if len(w.shape) != 2:
      raise ValueError(f"matmul takes a [in, out] weight, got shape {w.shape}.")
  else:
    chex.assert_rank(w.base if isinstance(w, LowRankWeight) else w, 2)
  chex.assert_axis_dimension(x, -1, w.shape[0])
  # A 2-D [rows, in] @ [in, out] product: its weight gradient then contracts
  # over one axis. Contracting over several (batch and time) sends XLA's CPU
  # backend to a slow generic loop instead of its GEMM kernel.
  x2 = x.reshape(-1, x.shape[-1])
  if isinstance(w, quant.QuantizedWeight):
    # Frozen: its float matrix formed inside the program (a wide one a slice of
    # columns at a time); no gradient reaches the codes.
    y = quant.map_columns(
        lambda m: _matmul_2d(x2, jax.lax.stop_gradient(m), compute_dtype=compute_dtype,
                             forms=forms, frozen=True, output=output), w)
  elif isinstance(w, LowRankWeight):
    # The adapters' products are rank-wide, a percent or two of the layer's
    # FLOPs: float32, where a low-precision product's row-major transposes
    # of `[rows, in]` activations cost more than the products themselves.
    def product(a, b):
      return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32))

    # Inside a checkpoint that saves nothing, then named: a remat policy that
    # keeps products (`kernels.REMAT_POLICIES["dots"]`) keeps the one sum,
    # not `x @ base` and `(x @ a) @ b` apart (twice the bytes, and the sum
    # recomputed). The backward needs neither term: only `x @ a` ([rows,
    # rank]), which it recomputes.
    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def low_rank_product(x2, base, a, b):
      frozen = _matmul_2d(x2, jax.lax.stop_gradient(quant.dense(base)),
                          compute_dtype=compute_dtype, forms=forms, frozen=True,
                          output=output)
      return frozen + (w.scale * product(product(x2, a), b)).astype(frozen.dtype)

    y = checkpoint_name(low_rank_product(x2, w.base, w.a, w.b), LOW_RANK_OUTPUT)
  else:
    y = _matmul_2d(x2, w, compute_dtype=compute_dtype, forms=forms, output=output)
  return y.reshape(*x.shape[:-1], w.shape[-1])


def _matmul_2d(x2, w, *, compute_dtype, forms, frozen=False, output=None):
  if compute_dtype is None or jnp.dtype(compute_dtype) == jnp.float32:
    return x2 @ w
  row_major = forms is not None and forms.matmul_backward == "row_major"
  rounded = (output or getattr(forms, "matmul_output", "float32")) == "compute"
  product = _low_precision_matmul_frozen if frozen else _low_precision_matmul
  # The output (and x's gradient) take x's dtype here: float32, or the compute dtype.
  out = jnp.dtype(compute_dtype) if rounded else jnp.float32
  return product(x2.astype(out), w.astype(jnp.float32), jnp.dtype(compute_dtype), row_major)


def batched_matmul(a: chex.Array, b: chex.Array, *, compute_dtype=None,
                   forms: Optional[Any] = None) -> chex.Array:
  """`a @ b` over matching leading axes: `[..., m, k] @ [..., k, n] -> [..., m, n]`.

  As `matmul`, with mixed precision in the product and both gradient
  products when `compute_dtype` is given (float32 output), and `forms` as there.
  """
  chex.assert_rank(b, a.ndim)
  if compute_dtype is None or jnp.dtype(compute_dtype) == jnp.float32:
    return a @ b
  row_major = forms is not None and forms.matmul_backward == "row_major"
  return _low_precision_matmul(a.astype(jnp.float32), b.astype(jnp.float32),
                               jnp.dtype(compute_dtype), row_major)

"""Weights kept quantized: a matrix as packed integers and scales, dequantized inside
the product.

    w8 = quantize(w, "int8")                 # [in, out] float -> int8 and a scale per column
    w4 = quantize(w, "q4_1")                 # 4-bit codes, a scale and a minimum per 32 rows
    y = matmul(x, w4)                        # x @ dequantize(w4), dequantized in the program

A `QuantizedWeight` is a pytree (its arrays the leaves, its format static), so it sits
in a params dict where a float matrix would, slices along stacked layers like one, and
`ops.matmul` takes it as its weight: the product reads the integers and scales and
forms the float matrix inside the compiled program, where XLA may fuse the
dequantization into the product's operand. It is frozen: no gradient flows to it (a
LoRA run trains adapters beside it, `LowRankWeight`'s base may be one).

Formats (both along the matrix's input axis, the one the product contracts):

- "int8": symmetric per output column, `w = scale[j] * q[i, j]`, `q` in [-127, 127],
  `scale = max |w[:, j]| / 127` (0.5 bytes of error per 127 levels: |error| <= scale / 2);
- "q8_0": GGUF's Q8_0 arithmetic, blocks of 32 input rows per output column,
  `w = d * q`, `q` in [-127, 127], `d` float16 per block (`d = max |w| / 127`);
- "q4_1": GGUF's Q4_1 arithmetic, blocks of 32 input rows per output column,
  `w = d * q + m` with `q` in [0, 15] and `d`, `m` float16 per block (`d = (max - min)
  / 15`, `m = min`); two codes a byte (low nibble: the even input row).
"""

import dataclasses
import functools
from typing import Tuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("int8", "q8_0", "q4_1")
BLOCK = 32  # the block formats' input rows per scale (GGUF's QK8_0, QK4_1)


class QuantizeError(ValueError):
  """A matrix that cannot take the format asked for; the message says why."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=("codes", "scale", "offset"),
                   meta_fields=("format",))
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A `[..., in_dim, out_dim]` matrix as integer codes and their scales (see the module).

  Attributes:
    codes: int8 `[..., in, out]` ("int8", "q8_0"), or uint8 `[..., in / 2, out]`
      holding two 4-bit codes each ("q4_1").
    scale: float32 `[..., out]` ("int8"), or float16 `[..., in / 32, out]`.
    offset: float16 `[..., in / 32, out]`, each block's minimum ("q4_1"); else an
      empty `[..., 0]` (a leaf that slices along stacked layers as the others do).
    format: one of `FORMATS`.
  """
  codes: chex.Array
  scale: chex.Array
  offset: chex.Array
  format: str

  @property
  def shape(self) -> Tuple[int, ...]:
    lead, (rows, cols) = self.codes.shape[:-2], self.codes.shape[-2:]
    return (*lead, rows * (2 if self.format == "q4_1" else 1), cols)

  @property
  def ndim(self) -> int:
    return self.codes.ndim

  @property
  def nbytes(self) -> int:
    """The bytes it holds (codes, scales and offsets)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
               for a in (self.codes, self.scale, self.offset))

  def dequantized(self, dtype=jnp.float32) -> chex.Array:
    """The float matrix, `[..., in, out]` of `dtype` (computed in float32, then cast)."""
    if self.format == "int8":
      w = self.codes.astype(jnp.float32) * self.scale.astype(jnp.float32)[..., None, :]
      return w.astype(dtype)
    if self.format == "q8_0":
      *lead, rows, cols = self.codes.shape
      blocks = self.codes.astype(jnp.float32).reshape(*lead, rows // BLOCK, BLOCK, cols)
      return (blocks * self.scale.astype(jnp.float32)[..., None, :]).reshape(
          *lead, rows, cols).astype(dtype)
    low = (self.codes & 0xF).astype(jnp.float32)
    high = (self.codes >> 4).astype(jnp.float32)
    *lead, half, cols = self.codes.shape
    q = jnp.stack([low, high], axis=-2).reshape(*lead, 2 * half, cols)  # rows interleaved
    blocks = q.reshape(*lead, 2 * half // BLOCK, BLOCK, cols)
    w = (blocks * self.scale.astype(jnp.float32)[..., None, :]
         + self.offset.astype(jnp.float32)[..., None, :])
    return w.reshape(*lead, 2 * half, cols).astype(dtype)


def _no_offset(lead) -> chex.Array:
  return jnp.zeros((*lead, 0), jnp.float16)


def quantize(w, format: str) -> QuantizedWeight:  # pylint: disable=redefined-builtin
  """`w` (`[..., in, out]` float) in `format` (`FORMATS`), computed on the host.

  Raises:
    QuantizeError: an unknown format, or a block format for an input axis that is not
      a multiple of 32.
  """
  if format not in FORMATS:
    raise QuantizeError(f"unknown quantized format {format!r}; choose one of {FORMATS}.")
  w = np.asarray(w, np.float32)
  if w.ndim < 2:
    raise QuantizeError(f"only matrices are quantized, got shape {w.shape}.")
  if format == "int8":
    scale = np.max(np.abs(w), axis=-2) / 127.0
    safe = np.where(scale > 0, scale, 1.0)
    codes = np.clip(np.rint(w / safe[..., None, :]), -127, 127).astype(np.int8)
    return QuantizedWeight(jnp.asarray(codes), jnp.asarray(scale, jnp.float32),
                           _no_offset(w.shape[:-2]), "int8")
  *lead, rows, cols = w.shape
  if rows % BLOCK:
    raise QuantizeError(f"{format} quantizes blocks of {BLOCK} input rows; this matrix has "
                        f"{rows}. Keep it in float, or use int8.")
  blocks = w.reshape(*lead, rows // BLOCK, BLOCK, cols)
  if format == "q8_0":
    d = (np.max(np.abs(blocks), axis=-2) / 127.0).astype(np.float16)
    safe = np.where(d.astype(np.float32) > 0, d.astype(np.float32), 1.0)
    codes = np.clip(np.rint(blocks / safe[..., None, :]), -127, 127).astype(np.int8)
    return QuantizedWeight(jnp.asarray(codes.reshape(*lead, rows, cols)), jnp.asarray(d),
                           _no_offset(lead), "q8_0")
  low, high = blocks.min(axis=-2), blocks.max(axis=-2)
  # The stored (float16) scale and minimum are what the codes are chosen against.
  d = ((high - low) / 15.0).astype(np.float16)
  m = low.astype(np.float16)
  d32 = d.astype(np.float32)
  safe = np.where(d32 > 0, d32, 1.0)
  q = np.clip(np.rint((blocks - m.astype(np.float32)[..., None, :]) / safe[..., None, :]),
              0, 15).astype(np.uint8).reshape(*lead, rows, cols)
  codes = q[..., 0::2, :] | (q[..., 1::2, :] << 4)
  return QuantizedWeight(jnp.asarray(codes), jnp.asarray(d), jnp.asarray(m), "q4_1")


# GGUF's block layouts (ggml-common.h), per row of a `[out, in]` tensor, 32 values a
# block: Q8_0 = float16 d, int8 q[32]; Q4_1 = float16 d, float16 m, uint8 qs[16] with
# values 0..15 in the low nibbles and 16..31 in the high ones.
GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_1": 20}


def from_gguf_blocks(raw: np.ndarray, format: str, shape: Tuple[int, int]  # pylint: disable=redefined-builtin
                     ) -> QuantizedWeight:
  """A GGUF tensor's blocks kept as they are: the same codes, scales and minimums,
  laid out as a `[in, out]` `QuantizedWeight` (GGUF stores the `[out, in]` matrix).

  Args:
    raw: the tensor's bytes, `[out, in / 32 * block bytes]` uint8 (gguf's reader's
      `tensor.data`).
    format: "q8_0" or "q4_1".
    shape: `(out, in)`, the GGUF tensor's shape.

  Returns:
    A weight whose `dequantized()` equals `gguf.quants.dequantize(raw, ...)`'s
    transpose (float32 rounding of `d * q + m` aside).
  """
  if format not in GGUF_BLOCK_BYTES:
    raise QuantizeError(f"GGUF {format!r} blocks are not kept quantized; only "
                        f"{tuple(GGUF_BLOCK_BYTES)}.")
  out, rows = shape
  blocks = np.asarray(raw, np.uint8).reshape(out, rows // BLOCK, GGUF_BLOCK_BYTES[format])
  d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [out, in / 32]
  if format == "q8_0":
    q = blocks[..., 2:].copy().view(np.int8).reshape(out, rows)
    return QuantizedWeight(jnp.asarray(np.ascontiguousarray(q.T)),
                           jnp.asarray(np.ascontiguousarray(d.T)), _no_offset(()), "q8_0")
  m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
  qs = blocks[..., 4:]  # [out, in / 32, 16]
  q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(out, rows)  # values in order
  codes = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # two rows a byte, as ours
  return QuantizedWeight(jnp.asarray(np.ascontiguousarray(codes.T)),
                         jnp.asarray(np.ascontiguousarray(d.T)),
                         jnp.asarray(np.ascontiguousarray(m.T)), "q4_1")


def quantize_matrices(params, format: str):  # pylint: disable=redefined-builtin
  """`params` with every dense layer's matrix (a leaf named `w` of two or more axes)
  quantized to `format`; embeddings, norms and biases stay as they are.

  Returns:
    `(params, left)`: `left` the dotted paths of the matrices the format cannot take
    (a block format's input axis not a multiple of 32), kept in float.
  """
  left = []

  def one(path, leaf):
    name = ".".join(str(getattr(k, "key", k)) for k in path)
    if not name.endswith(".w") and name != "w" or np.ndim(leaf) < 2:
      return leaf
    if format != "int8" and np.shape(leaf)[-2] % BLOCK:
      left.append(name)
      return leaf
    return quantize(leaf, format)

  return jax.tree_util.tree_map_with_path(one, params), left


def dense(w, dtype=None):
  """`w` as a float array: a `QuantizedWeight` dequantized (to `dtype`, else float32),
  anything else as it is."""
  if isinstance(w, QuantizedWeight):
    return w.dequantized(jnp.float32 if dtype is None else dtype)
  return w

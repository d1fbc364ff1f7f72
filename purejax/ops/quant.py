"""Weights kept quantized: a matrix as integer codes and scales, dequantized inside
the product.

    w8 = quantize(w, "int8")                 # [in, out] float -> int8 and a scale per column
    w4 = quantize(w, "q4_1")                 # 4-bit codes, a scale and a minimum per 32 rows
    y = matmul(x, w4)                        # x @ dequantize(w4), dequantized in the program

A `QuantizedWeight` is a pytree (its arrays the leaves; its code width and orientation
static), so it sits in a params dict where a float matrix would, slices along stacked
layers like one, and `ops.matmul` takes it as its weight: the product reads the
integers and scales and forms the float matrix inside the compiled program (a wide
one a slice of columns at a time, `map_columns`). It is frozen: no gradient flows to
it (a LoRA run trains adapters beside it; `LowRankWeight`'s base may be one).

One arithmetic covers every format: the stored matrix `[..., rows, cols]` is cut into
blocks of `block` consecutive rows per column, and

    w[i, j] = scale[i // block, j] * q[i, j] + offset[i // block, j]

(`offset` absent: 0), computed in float32. What differs is how many bits a code has
(8: int8; 4: two codes a byte, the even row in the low nibble; 5: a nibble plane, then
a plane of fifth bits, 8 rows a byte), the block (`rows` for one scale per column) and
the scales' dtype (float16 as GGUF stores them, or float32 where a scale is a product
of two stored numbers).

Made by `quantize` (`FORMATS`):

- "int8": symmetric per output column, `q` in [-127, 127], `scale = max |w[:, j]| / 127`;
- "q8_0": GGUF's Q8_0, blocks of 32 rows, `q` in [-127, 127], float16 `scale = max |w| / 127`;
- "q4_1": GGUF's Q4_1, blocks of 32 rows, 4-bit `q` in [0, 15], float16 `scale = (max -
  min) / 15` and `offset = min`.

Kept from GGUF files as they are (`from_gguf_blocks`, `GGUF_KEPT`), the same numbers in
this arithmetic, so the dequantized matrix equals the `gguf` package's reference bit
for bit: Q8_0; Q4_1; Q5_0 (its 5-bit codes, `-16..15`; float16 scale per 32); Q4_K
(4-bit codes; its 6-bit sub-scales and minimums times the super-block's float16 `d` and
`dmin`: a float32 scale and offset per 32 rows); Q6_K (6-bit codes held as int8
`q - 32`; a float32 scale per 16 rows). Layers of one stacked weight stored in
different types (llama.cpp's K-quant mixes give some layers more bits) share one
container (`common`: 8-bit codes where widths differ, the smaller block, a zero
offset, float32 scales): a lossless re-expression of each layer's numbers.

An embedding table `[vocab, embd]` whose blocks run along `embd` (a GGUF token
embedding) is the transpose of a `[embd, vocab]` matrix in this layout: `transposed`
says so. Its rows are looked up without forming the table (`take_rows`), and its `.T`
is the tied output head's `[embd, vocab]` weight, the same arrays.
"""

import dataclasses
import functools
import math
from typing import Callable, Optional, Sequence, Tuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from purejax import host_memory

FORMATS = ("int8", "q8_0", "q4_1")
GGUF_KEPT = ("Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")
BLOCK = 32  # the block formats' rows per scale (GGUF's QK8_0, QK4_1)
# A product whose dequantized weight would pass this many bytes forms it a slice of
# columns at a time (a 262144-token tied head is 671 MB of float32 in one piece).
CHUNK_BYTES = 128 << 20


class QuantizeError(ValueError):
  """A matrix that cannot take the format asked for; the message says why."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=("codes", "scale", "offset"),
                   meta_fields=("bits", "transposed"))
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A matrix as integer codes and their scales (see the module for the arithmetic).

  Attributes:
    codes: int8 `[..., rows, cols]` (`bits=8`); uint8 `[..., rows / 2, cols]` holding
      two 4-bit codes each (`bits=4`); or uint8 `[..., rows / 2 + rows / 8, cols]`
      (`bits=5`, signed codes `-16..15` held as `q + 16`: the low 4 bits as `bits=4`'s,
      then the fifth bits, 8 rows a byte, the first row in the lowest bit).
    scale: float16 or float32 `[..., rows / block, cols]`.
    offset: as `scale` (added after the scale), or an empty `[..., 0]` for none (a leaf
      that slices along stacked layers as the others do).
    bits: 8 or 4.
    transposed: the weight is the stored matrix's transpose (`shape` swaps its last two
      axes): an embedding table whose blocks run along a row.
  """
  codes: chex.Array
  scale: chex.Array
  offset: chex.Array
  bits: int
  transposed: bool = False

  @property
  def stored_shape(self) -> Tuple[int, ...]:
    lead, (rows, cols) = self.codes.shape[:-2], self.codes.shape[-2:]
    return (*lead, {8: rows, 4: rows * 2, 5: rows * 8 // 5}[self.bits], cols)

  @property
  def shape(self) -> Tuple[int, ...]:
    *lead, rows, cols = self.stored_shape
    return (*lead, cols, rows) if self.transposed else (*lead, rows, cols)

  @property
  def ndim(self) -> int:
    return self.codes.ndim

  @property
  def dtype(self):
    """The dtype it dequantizes to (float32)."""
    return jnp.dtype(jnp.float32)

  @property
  def block(self) -> int:
    """Stored rows per scale."""
    return self.stored_shape[-2] // self.scale.shape[-2]

  @property
  def has_offset(self) -> bool:
    return self.offset.shape[-1] != 0

  @property
  def T(self) -> "QuantizedWeight":  # pylint: disable=invalid-name
    """The transpose (of the last two axes): the same arrays, `transposed` flipped."""
    return dataclasses.replace(self, transposed=not self.transposed)

  @property
  def nbytes(self) -> int:
    """The bytes it holds (codes, scales and offsets)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
               for a in (self.codes, self.scale, self.offset))

  def dequantized(self, dtype=jnp.float32) -> chex.Array:
    """The float matrix, `shape` of `dtype` (computed in float32, then cast)."""
    w = _dequantize(self.codes, self.scale, self.offset if self.has_offset else None,
                    self.bits).astype(dtype)
    return jnp.swapaxes(w, -1, -2) if self.transposed else w


def _codes_as_float(codes, bits: int) -> chex.Array:
  """`[..., rows, cols]` float32 codes (4-bit ones unpacked, even rows from the low nibble)."""
  if bits == 8:
    return codes.astype(jnp.float32)
  if bits == 5:
    rows = codes.shape[-2] * 8 // 5
    low = _codes_as_float(codes[..., :rows // 2, :], 4)
    fifth = codes[..., rows // 2:, :]  # [..., rows / 8, cols]
    shifts = jnp.arange(8, dtype=jnp.uint8)[:, None]
    high = ((fifth[..., :, None, :] >> shifts) & 1).reshape(*codes.shape[:-2], rows, -1)
    return low + 16.0 * high.astype(jnp.float32) - 16.0
  *lead, half, cols = codes.shape
  low, high = (codes & 0xF).astype(jnp.float32), (codes >> 4).astype(jnp.float32)
  return jnp.stack([low, high], axis=-2).reshape(*lead, 2 * half, cols)


def _dequantize(codes, scale, offset, bits: int) -> chex.Array:
  q = _codes_as_float(codes, bits)
  *lead, rows, cols = q.shape
  blocks = scale.shape[-2]
  w = q.reshape(*lead, blocks, rows // blocks, cols) * scale.astype(jnp.float32)[..., None, :]
  if offset is not None:
    w = w + offset.astype(jnp.float32)[..., None, :]
  return w.reshape(*lead, rows, cols)


def _no_offset(lead) -> np.ndarray:
  return np.zeros((*lead, 0), np.float16)


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
  *lead, rows, cols = w.shape
  if format == "int8":
    scale = np.max(np.abs(w), axis=-2, keepdims=True) / 127.0  # [..., 1, out]
    safe = np.where(scale > 0, scale, 1.0)
    codes = np.clip(np.rint(w / safe), -127, 127).astype(np.int8)
    return to_device(QuantizedWeight(codes, scale.astype(np.float32), _no_offset(lead), 8))
  if rows % BLOCK:
    raise QuantizeError(f"{format} quantizes blocks of {BLOCK} input rows; this matrix has "
                        f"{rows}. Keep it in float, or use int8.")
  blocks = w.reshape(*lead, rows // BLOCK, BLOCK, cols)
  if format == "q8_0":
    d = (np.max(np.abs(blocks), axis=-2) / 127.0).astype(np.float16)
    safe = np.where(d.astype(np.float32) > 0, d.astype(np.float32), 1.0)
    codes = np.clip(np.rint(blocks / safe[..., None, :]), -127, 127).astype(np.int8)
    return to_device(QuantizedWeight(codes.reshape(*lead, rows, cols), d, _no_offset(lead), 8))
  low, high = blocks.min(axis=-2), blocks.max(axis=-2)
  # The stored (float16) scale and minimum are what the codes are chosen against.
  d = ((high - low) / 15.0).astype(np.float16)
  m = low.astype(np.float16)
  d32 = d.astype(np.float32)
  safe = np.where(d32 > 0, d32, 1.0)
  q = np.clip(np.rint((blocks - m.astype(np.float32)[..., None, :]) / safe[..., None, :]),
              0, 15).astype(np.uint8).reshape(*lead, rows, cols)
  return to_device(QuantizedWeight(_pack4(q), d, m, 4))


def _pack4(q: np.ndarray) -> np.ndarray:
  """4-bit codes `[..., rows, cols]` (values 0..15) two a byte: `[..., rows / 2, cols]`."""
  return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).astype(np.uint8)


def _pack5(q: np.ndarray) -> np.ndarray:
  """5-bit signed codes `[..., rows, cols]` (-16..15) as `bits=5` holds them."""
  u = (q.astype(np.int16) + 16).astype(np.uint8)
  *lead, rows, cols = u.shape
  fifth = np.packbits((u >> 4).reshape(*lead, rows // 8, 8, cols), axis=-2,
                      bitorder="little").reshape(*lead, rows // 8, cols)
  return np.concatenate([_pack4(u & 0xF), fifth], axis=-2)


def _unpack(codes: np.ndarray, bits: int) -> np.ndarray:
  """int8 codes `[..., rows, cols]` of any width (4-bit: 0..15; 5-bit: -16..15)."""
  if bits == 4:
    return _unpack4(np.asarray(codes)).astype(np.int8)
  if bits == 5:
    codes = np.asarray(codes)
    rows = codes.shape[-2] * 8 // 5
    *lead, _, cols = codes.shape
    fifth = np.unpackbits(codes[..., rows // 2:, :][..., None, :], axis=-2, bitorder="little")
    high = fifth.reshape(*lead, rows, cols)
    return ((_unpack4(codes[..., :rows // 2, :]) | (high << 4)).astype(np.int16) - 16).astype(
        np.int8)
  return np.asarray(codes)


def _unpack4(codes: np.ndarray) -> np.ndarray:
  *lead, half, cols = codes.shape
  return np.stack([codes & 0xF, codes >> 4], axis=-2).reshape(*lead, 2 * half, cols)


def to_device(w: QuantizedWeight) -> QuantizedWeight:
  """`w` with its arrays on the default device (`host_memory.to_device`)."""
  return jax.tree.map(host_memory.to_device, w)


# ----------------------------------------------------------------------------
# GGUF's blocks (ggml-common.h's layouts, per row of a `[out, in]` tensor)

# (values a block holds, bytes a block takes)
GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q4_K": (256, 144),
               "Q6_K": (256, 210)}


def _f16(raw: np.ndarray) -> np.ndarray:
  """Little-endian float16s from the last axis' byte pairs, as float16 `[...]`."""
  return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _q8_0(b):  # d f16, q int8[32]
  return b[..., 2:].copy().view(np.int8), _f16(b[..., 0:2])[..., None], None


def _q4_1(b):  # d f16, m f16, qs[16]: values 0..15 low nibbles, 16..31 high
  qs = b[..., 4:]
  q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
  return q, _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]


def _q5_0(b):  # d f16, qh u32 (the 5th bits), qs[16] as Q4_1's; q - 16
  qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [..., 1]
  high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [..., 32]
  qs = b[..., 6:]
  low = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
  q = (low | (high << 4)).astype(np.int16) - 16
  return q.astype(np.int8), _f16(b[..., 0:2])[..., None], None


def _q4_k_scales(s: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """Q4_K's 12 bytes -> eight 6-bit sub-block scales and minimums: bytes 0-3 hold
  scales 0-3 (low 6 bits), 4-7 minimums 0-3; scales/minimums 4-7 are bytes 8-11's
  low/high nibbles, topped by the 2 high bits of bytes 0-3 / 4-7."""
  first, second, third = s[..., 0:4], s[..., 4:8], s[..., 8:12]
  scales = np.concatenate([first & 63, (third & 0xF) | ((first >> 6) << 4)], axis=-1)
  mins = np.concatenate([second & 63, (third >> 4) | ((second >> 6) << 4)], axis=-1)
  return scales, mins


def _q4_k(b):  # d f16, dmin f16, scales[12], qs[128]: 32-byte chunks, low then high nibbles
  scales, mins = _q4_k_scales(b[..., 4:16])
  d, dmin = _f16(b[..., 0:2]).astype(np.float32), _f16(b[..., 2:4]).astype(np.float32)
  chunks = b[..., 16:].reshape(*b.shape[:-1], 4, 32)
  q = np.stack([chunks & 0xF, chunks >> 4], axis=-2).reshape(*b.shape[:-1], 256)
  scale = d[..., None] * scales.astype(np.float32)   # [..., 8], as gguf: f32(d) * sc
  offset = -(dmin[..., None] * mins.astype(np.float32))  # w = scale * q - dmin * m
  return q, scale, offset


def _q6_k(b):  # ql[128], qh[64], scales int8[16], d f16; per half of 128 values
  ql, qh = b[..., 0:128], b[..., 128:192]
  halves = []
  for h in range(2):
    low, high = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
    first, second = low[..., :32], low[..., 32:]
    parts = [(first & 0xF) | ((high & 3) << 4), (second & 0xF) | (((high >> 2) & 3) << 4),
             (first >> 4) | (((high >> 4) & 3) << 4), (second >> 4) | (((high >> 6) & 3) << 4)]
    halves.extend(parts)
  q = (np.concatenate(halves, axis=-1).astype(np.int16) - 32).astype(np.int8)
  d = _f16(b[..., 208:210]).astype(np.float32)
  scale = d[..., None] * b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [..., 16]
  return q, scale, None


_DECODERS = {"Q8_0": (_q8_0, 8), "Q4_1": (_q4_1, 4), "Q5_0": (_q5_0, 5), "Q4_K": (_q4_k, 4),
             "Q6_K": (_q6_k, 8)}


def from_gguf_blocks(raw: np.ndarray, ggml_type: str, shape: Tuple[int, int]
                     ) -> QuantizedWeight:
  """A GGUF tensor's blocks kept as they are, as a host (numpy) `[in, out]` weight (GGUF
  stores the `[out, in]` matrix; `.T` gives that orientation, the same arrays).

  Args:
    raw: the tensor's bytes, `[out, in / values * bytes]` uint8 (gguf's reader's
      `tensor.data`, any shape holding them in order).
    ggml_type: its type's name, one of `GGUF_KEPT`.
    shape: `(out, in)`, the GGUF tensor's shape.

  Returns:
    A weight whose `dequantized()` equals `gguf.quants.dequantize(raw, ...)`'s
    transpose bit for bit.

  Raises:
    QuantizeError: a type outside `GGUF_KEPT`, or a row that is not whole blocks.
  """
  if ggml_type not in GGUF_BLOCKS:
    raise QuantizeError(f"GGUF {ggml_type} blocks are not kept quantized; only "
                        f"{', '.join(GGUF_KEPT)}.")
  values, nbytes = GGUF_BLOCKS[ggml_type]
  out, rows = shape
  if rows % values:
    raise QuantizeError(f"a {ggml_type} row holds blocks of {values} values; {rows} is not "
                        f"a multiple.")
  blocks = np.asarray(raw, np.uint8).reshape(out, rows // values, nbytes)
  decode, bits = _DECODERS[ggml_type]
  q, scale, offset = decode(blocks)  # [out, blocks, values], [out, blocks, per block]
  q = q.reshape(out, rows).T  # [in, out]
  codes = {4: _pack4, 5: _pack5, 8: lambda q: q}[bits](q)
  scale = scale.reshape(out, -1).T
  offset = offset.reshape(out, -1).T if offset is not None else _no_offset(())
  return QuantizedWeight(np.ascontiguousarray(codes), np.ascontiguousarray(scale),
                         np.ascontiguousarray(offset), bits)


# ----------------------------------------------------------------------------
# Containers: layers of one stacked weight, and projections side by side


def widen(w: QuantizedWeight, bits: int, block: int, offset: bool, scale_dtype
          ) -> QuantizedWeight:
  """`w` re-expressed, losslessly, with `bits`-bit codes (>= its own), scales every
  `block` rows (dividing its own block), an offset if `offset`, `scale_dtype` scales."""
  codes = w.codes
  if bits != w.bits:
    if bits != 8:
      raise QuantizeError(f"{w.bits}-bit codes widen to 8 bits only, not {bits}.")
    codes = _unpack(codes, w.bits)  # every width's codes fit int8
  repeat = w.block // block
  if repeat * block != w.block:
    raise QuantizeError(f"a block of {block} rows does not divide {w.block}.")
  scale = np.repeat(np.asarray(w.scale), repeat, axis=-2).astype(scale_dtype)
  if w.has_offset:
    off = np.repeat(np.asarray(w.offset), repeat, axis=-2).astype(scale_dtype)
  elif offset:
    off = np.zeros_like(scale)
  else:
    off = _no_offset(scale.shape[:-2])
  return QuantizedWeight(codes, scale, off, bits, w.transposed)


def _container(ws: Sequence[QuantizedWeight]):
  """`(bits, block, offset, scale_dtype)` of the one container `ws` fit losslessly."""
  widths = {w.bits for w in ws}
  bits = widths.pop() if len(widths) == 1 else 8
  block = math.gcd(*(w.block for w in ws))
  offset = any(w.has_offset for w in ws)
  dtypes = {jnp.dtype(w.scale.dtype) for w in ws}
  scale_dtype = np.float16 if dtypes == {jnp.dtype(np.float16)} else np.float32
  return bits, block, offset, scale_dtype


def _in(w: QuantizedWeight, bits, block, offset, scale_dtype) -> QuantizedWeight:
  """`w` in the container, widened only where it differs."""
  if (w.bits == bits and w.block == block and w.has_offset == offset
      and jnp.dtype(w.scale.dtype) == scale_dtype):
    return w
  return widen(w, bits, block, offset, scale_dtype)


def common(ws: Sequence[QuantizedWeight]) -> Tuple[QuantizedWeight, ...]:
  """`ws` in one container: the most bits, the smallest block, an offset if any has one,
  float32 scales unless all are float16 (`widen`)."""
  spec = _container(ws)
  return tuple(_in(w, *spec) for w in ws)


_FIELDS = ("codes", "scale", "offset")


def _check_orientation(ws) -> None:
  if len({w.transposed for w in ws}) != 1:
    raise QuantizeError("cannot join a transposed weight with an upright one.")


def stack(ws: Sequence[QuantizedWeight]) -> QuantizedWeight:
  """Layers' weights of one shape as one `[layers, ...]` weight (`stack_side_by_side`)."""
  return stack_side_by_side([ws])


def stack_side_by_side(groups: Sequence[Sequence[QuantizedWeight]]) -> QuantizedWeight:
  """`groups[g][i]`, weight `g` of layer `i`, as one `[layers, rows, sum of cols]`
  weight: each layer's weights side by side (a fused q/k/v), the layers stacked, in
  one container (`common`). Host arrays from `host_memory.empty`, each layer's piece
  widened and written in turn (no second copy of the whole), for `to_device` to adopt.
  """
  everyone = [w for ws in groups for w in ws]
  _check_orientation(everyone)
  if len(groups) > 1 and everyone[0].transposed:
    raise QuantizeError("only upright weights are joined along their columns.")
  if len({len(ws) for ws in groups}) != 1:
    raise QuantizeError("every weight side by side needs one piece per layer.")
  spec = _container(everyone)
  widths = [ws[0].codes.shape[-1] for ws in groups]
  starts, out = np.cumsum([0] + widths), None
  for i in range(len(groups[0])):  # layer by layer: a layer's slice is its own pages
    for ws, at, cols in zip(groups, starts, widths):
      arrays = [np.asarray(getattr(_in(ws[i], *spec), f)) for f in _FIELDS]
      if out is None:
        out = [host_memory.empty((len(ws), *a.shape[:-1], sum(widths) if a.shape[-1] else 0),
                                 a.dtype) for a in arrays]
      for buffer, a in zip(out, arrays):
        if a.shape[-1]:  # (an absent offset is an empty placeholder)
          buffer[i, ..., at:at + cols] = a
  return QuantizedWeight(*out, spec[0], everyone[0].transposed)


def concatenate(ws: Sequence[QuantizedWeight]) -> QuantizedWeight:
  """Upright weights of one row count side by side: `[..., rows, sum of cols]` (host
  arrays; `stack_side_by_side` of one layer)."""
  return jax.tree.map(lambda a: a[0], stack_side_by_side([[w] for w in ws]))


# ----------------------------------------------------------------------------
# Reading them inside a program


def take_rows(table: QuantizedWeight, ids: chex.Array) -> chex.Array:
  """Rows `ids` (any shape) of a transposed `[vocab, embd]` table: `[*ids.shape, embd]`
  float32, dequantizing only those rows (columns of the stored matrix)."""
  if not table.transposed or table.ndim != 2:
    raise QuantizeError("take_rows reads a transposed [vocab, embd] table.")
  flat = ids.reshape(-1)
  codes = jnp.take(table.codes, flat, axis=-1)
  scale = jnp.take(table.scale, flat, axis=-1)
  offset = jnp.take(table.offset, flat, axis=-1) if table.has_offset else None
  rows = _dequantize(codes, scale, offset, table.bits)  # [embd, n]
  return rows.T.reshape(*ids.shape, -1)


def map_columns(fn: Callable[[chex.Array], chex.Array], w: QuantizedWeight) -> chex.Array:
  """`fn(w.dequantized())` for an upright `[rows, cols]` `w` and an `fn` whose result's
  last axis is the matrix's columns (a product `x @ m`), formed a slice of columns at
  a time when the float matrix would pass `CHUNK_BYTES`, so it is never whole."""
  if w.transposed:
    raise QuantizeError(f"a transposed quantized weight of shape {w.shape} is read by row "
                        f"lookups (`take_rows`) or as its `.T`, not by columns.")
  rows, cols = w.shape
  pieces = 1
  while rows * (cols // pieces) * 4 > CHUNK_BYTES and cols % (2 * pieces) == 0:
    pieces *= 2
  if pieces == 1:
    return fn(w.dequantized())
  width = cols // pieces
  outs = []
  for i in range(pieces):  # static slices, read by the dequantization itself
    part = jax.tree.map(lambda a: a[..., i * width:(i + 1) * width], w)
    if outs:  # after the slice before it: one slice's float matrix at a time
      part = tied_to(part, outs[-1])
    outs.append(fn(part.dequantized()))
  return jnp.concatenate(outs, axis=-1)


def tied_to(tree, x: chex.Array):
  """`tree` with each `QuantizedWeight`'s codes and scales made to depend on `x` (`+ 0 *
  x[0]`, the same values): its dequantization cannot run before `x` exists. An
  unrolled stack of layers uses it so that each layer's float matrices are formed as
  the layer runs, not all ahead of the first (where XLA's scheduler may put them), nor
  hoisted out of a decoding loop (loop-invariant code motion moves the codes'
  conversion to float out of a loop whose weights do not change)."""
  tie = 0.0 * x.reshape(-1)[0]

  def one(w):
    if not isinstance(w, QuantizedWeight):
      return w
    return dataclasses.replace(w, codes=w.codes + tie.astype(w.codes.dtype),
                               scale=w.scale + tie.astype(w.scale.dtype))

  return jax.tree.map(one, tree, is_leaf=lambda w: isinstance(w, QuantizedWeight))


TOKEN_TABLE = "wte.embedding"  # the token embedding's dotted path (`gpt.init_params`)


def _held_kind(path, shape) -> Tuple[Optional[str], str]:
  """"table" (the token embedding), "matrix" (a dense layer's `w`, two or more axes) or
  None (kept as it is) for the leaf at pytree `path` of `shape`; and its dotted name."""
  name = ".".join(str(getattr(k, "key", k)) for k in path)
  if name == TOKEN_TABLE and len(shape) == 2:
    return "table", name
  if (name.endswith(".w") or name == "w") and len(shape) >= 2:
    return "matrix", name
  return None, name


def quantize_matrices(params, format: str):  # pylint: disable=redefined-builtin
  """`params` with every dense layer's matrix (a leaf named `w` of two or more axes)
  and the token embedding (transposed: blocks along a row, `take_rows`) quantized to
  `format`; position embeddings, norms and biases stay as they are.

  Returns:
    `(params, left)`: `left` the dotted paths of the matrices the format cannot take
    (a block format's input axis not a multiple of 32), kept in float.
  """
  left = []

  def one(path, leaf):
    if isinstance(leaf, QuantizedWeight):  # already quantized (a GGUF file's blocks)
      return leaf
    kind, name = _held_kind(path, np.shape(leaf))
    table = kind == "table"
    if kind is None:
      return leaf
    rows = np.shape(leaf)[-1] if table else np.shape(leaf)[-2]
    if format != "int8" and rows % BLOCK:
      left.append(name)
      return leaf
    return quantize(np.asarray(leaf).T, format).T if table else quantize(leaf, format)

  return jax.tree_util.tree_map_with_path(
      one, params, is_leaf=lambda x: isinstance(x, QuantizedWeight)), left


def hold_matrices(params, format: str):  # pylint: disable=redefined-builtin
  """A frozen base's dense matrices and token embedding held in `format`: one of
  `FORMATS` (`quantize_matrices`), or "bfloat16" (cast; the rows looked up are float32
  again in a float32 model, `gpt.input_states`); the rest stays as it is.

  Returns:
    `(params, left)` as `quantize_matrices`.
  """
  if format != "bfloat16":
    return quantize_matrices(params, format)

  def one(path, leaf):
    held = _held_kind(path, np.shape(leaf))[0] is not None
    return jnp.asarray(leaf, jnp.bfloat16) if held else leaf

  return jax.tree_util.tree_map_with_path(
      one, params, is_leaf=lambda x: isinstance(x, QuantizedWeight)), []


def _abstract(shape, format: str, transposed: bool = False) -> QuantizedWeight:  # pylint: disable=redefined-builtin
  """The shapes and dtypes `quantize` gives a `[..., in, out]` matrix (`shape`), as
  `jax.ShapeDtypeStruct`s."""
  *lead, rows, cols = shape
  s = jax.ShapeDtypeStruct
  if format == "int8":
    return QuantizedWeight(s(shape, jnp.int8), s((*lead, 1, cols), jnp.float32),
                           s((*lead, 0), jnp.float16), 8, transposed)
  blocks = (*lead, rows // BLOCK, cols)
  if format == "q8_0":
    return QuantizedWeight(s(shape, jnp.int8), s(blocks, jnp.float16), s((*lead, 0), jnp.float16),
                           8, transposed)
  return QuantizedWeight(s((*lead, rows // 2, cols), jnp.uint8), s(blocks, jnp.float16),
                         s(blocks, jnp.float16), 4, transposed)


def held_shapes(params, format: str):  # pylint: disable=redefined-builtin
  """`hold_matrices(params, format)`'s shapes and dtypes, from `params`' shapes alone
  (`jax.eval_shape`'s structs: nothing is computed), for planning memory."""
  if format not in (*FORMATS, "bfloat16"):
    raise QuantizeError(f"unknown held format {format!r}; choose one of "
                        f"{(*FORMATS, 'bfloat16')}.")

  def one(path, leaf):
    kind, _ = _held_kind(path, leaf.shape)
    table = kind == "table"
    if kind is None:
      return leaf
    if format == "bfloat16":
      return jax.ShapeDtypeStruct(leaf.shape, jnp.bfloat16)
    shape = tuple(leaf.shape[::-1]) if table else tuple(leaf.shape)
    if format != "int8" and shape[-2] % BLOCK:
      return leaf
    return _abstract(shape, format, transposed=table)

  return jax.tree_util.tree_map_with_path(one, params)


def dense(w, dtype=None):
  """`w` as a float array: a `QuantizedWeight` dequantized (to `dtype`, else float32),
  anything else as it is."""
  if isinstance(w, QuantizedWeight):
    return w.dequantized(jnp.float32 if dtype is None else dtype)
  return w

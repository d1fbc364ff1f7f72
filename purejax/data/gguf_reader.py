"""A GGUF file's header (metadata and tensor table) read straight into Python values,
and its tensors read from the file when asked for.

    header = gguf_reader.read("model.gguf")
    header.meta["general.architecture"]           # "llama"
    for tensor in gguf_reader.tensors("model.gguf", header):
      tensor.name, tensor.tensor_type, tensor.data  # data: the tensor's bytes, read now
      tensor.rows(0, 1024)                          # or a range of its rows

The `gguf` package's own reader keeps every metadata value as numpy views, a few
small arrays per string: a 262144-token vocabulary is ~700 MB of them, and what is
left of them after the values are copied out fragments the heap. This reader parses
the same layout (GGUF v2/v3: magic, version, tensor and key counts, key/value pairs,
tensor infos, data aligned to `general.alignment`) into plain values (arrays as
lists, as `gguf`'s `ReaderField.contents()` gives them). Tensors are read into
arrays of their own rather than mapped: a mapped file's pages count in
the process's resident memory until the mapping goes, so a loader reading tensor by
tensor would hold the whole file beside what it made of it. The tensor types and
their block sizes are `gguf`'s.
"""

import mmap
import pathlib
import struct
from typing import Any, Dict, Iterator, List, NamedTuple, Tuple

import numpy as np

from purejax.data.errors import TokenizerError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
# Types read as plain elements; the rest (block types, BF16) as their bytes.
_ELEMENTS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
             "I16": np.int16, "I32": np.int32, "I64": np.int64}


def import_gguf():
  """llama.cpp's `gguf` package, or a one-line error saying how to install it."""
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise TokenizerError("GGUF files need the gguf package: pip install gguf.") from None
  return gguf


class TensorInfo(NamedTuple):
  """One tensor's entry: `shape` in GGUF's order (fastest axis first), `type_id` the
  ggml type's number, `offset` from the data's start."""
  name: str
  shape: Tuple[int, ...]
  type_id: int
  offset: int


class Header(NamedTuple):
  """A GGUF file's metadata (`{key: value}`, arrays as lists), tensor table, and where
  its tensor data starts."""
  meta: Dict[str, Any]
  tensors: Tuple[TensorInfo, ...]
  data_start: int

  @property
  def tensor_names(self) -> frozenset:
    return frozenset(t.name for t in self.tensors)


class Tensor(NamedTuple):
  """A tensor as `gguf`'s reader gives it: `tensor_type` a `gguf.GGMLQuantizationType`,
  `shape` fastest axis first; `data` (and `rows`) read it from the file: its element
  dtype for float and integer types, `[..., row bytes]` uint8 for block types."""
  name: str
  shape: Tuple[int, ...]
  tensor_type: Any
  path: pathlib.Path
  start: int      # the file offset of its first byte
  elements: Any   # numpy dtype of an element, or None for a block type
  block: Tuple[int, int]  # (values a block holds, its bytes)

  @property
  def dims(self) -> List[int]:
    """The shape slowest axis first (numpy's order)."""
    return list(reversed(self.shape))

  @property
  def data(self) -> np.ndarray:
    return self.rows(0, self.dims[0])

  def rows(self, start: int, stop: int) -> np.ndarray:
    """Rows `start:stop` of its slowest axis, read now into an array of their own (a
    vector of blocks is read whole)."""
    dims = self.dims
    values, nbytes = self.block
    if self.elements is not None:
      row_bytes = int(np.prod(dims[1:], dtype=np.int64)) * self.elements.itemsize
    elif len(dims) > 1:
      row_bytes = int(np.prod(dims[1:], dtype=np.int64)) // values * nbytes
    else:
      if (start, stop) != (0, dims[0]):
        raise ValueError(f"{self.name} is a vector of blocks: it is read whole.")
      start, stop, row_bytes = 0, 1, dims[0] // values * nbytes
    out = np.empty((stop - start) * row_bytes, np.uint8)
    with open(self.path, "rb", buffering=0) as f:
      f.seek(self.start + start * row_bytes)
      done, view = 0, memoryview(out)
      while done < out.size:
        n = f.readinto(view[done:])
        if not n:
          raise TokenizerError(f"{self.path} ends inside tensor {self.name}; it is truncated: "
                               f"download it again.")
        done += n
    if self.elements is not None:
      return out.view(self.elements).reshape(stop - start, *dims[1:])
    if len(dims) == 1:
      return out
    return out.reshape(stop - start, *dims[1:-1], dims[-1] // values * nbytes)


class _Cursor:
  def __init__(self, buffer):
    self.buffer, self.at = buffer, 0

  def scalar(self, fmt: str):
    value = struct.unpack_from(fmt, self.buffer, self.at)[0]
    self.at += struct.calcsize(fmt)
    return value

  def string(self) -> str:
    n = self.scalar("<Q")
    text = bytes(self.buffer[self.at:self.at + n]).decode("utf-8", errors="replace")
    self.at += n
    return text

  def value(self, kind: int):
    if kind in _SCALARS:
      return self.scalar(_SCALARS[kind])
    if kind == _STRING:
      return self.string()
    if kind == _ARRAY:
      item, n = self.scalar("<I"), self.scalar("<Q")
      if item in _SCALARS and item != 7:  # numbers: one read
        dtype = np.dtype(_SCALARS[item])
        values = np.frombuffer(self.buffer, dtype, n, self.at).tolist()
        self.at += n * dtype.itemsize
        return values
      return [self.value(item) for _ in range(n)]
    raise ValueError(f"unknown metadata value type {kind}")


def read(path: str) -> Header:
  """`path`'s header.

  Raises:
    TokenizerError: a missing file, or one that is not a GGUF file (one line).
  """
  file = pathlib.Path(path).expanduser()
  if not file.is_file():
    raise TokenizerError(f"{file} is missing; pass the path of a .gguf file.")
  try:
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      if m[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
      cursor = _Cursor(memoryview(m))
      try:
        cursor.at = 4
        version = cursor.scalar("<I")
        if version not in (2, 3):
          raise ValueError(f"GGUF version {version}")
        n_tensors, n_keys = cursor.scalar("<Q"), cursor.scalar("<Q")
        meta = {}
        for _ in range(n_keys):
          key = cursor.string()
          meta[key] = cursor.value(cursor.scalar("<I"))
        tensors = []
        for _ in range(n_tensors):
          name = cursor.string()
          dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
          tensors.append(TensorInfo(name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))
        align = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cursor.at // align) * align
      finally:
        cursor.buffer.release()
  except (ValueError, struct.error, UnicodeDecodeError, OverflowError) as e:
    raise TokenizerError(f"{file} is not a GGUF file purejax reads ({e}); download it "
                         f"again.") from None
  return Header(meta, tuple(tensors), start)


def tensors(path: str, header: Header) -> Iterator[Tensor]:
  """`path`'s tensors in the file's order (each read when its `data` or `rows` is)."""
  gguf = import_gguf()
  file = pathlib.Path(path).expanduser()
  for t in header.tensors:
    kind = gguf.GGMLQuantizationType(t.type_id)
    elements = _ELEMENTS.get(kind.name)
    yield Tensor(t.name, t.shape, kind, file, header.data_start + t.offset,
                 None if elements is None else np.dtype(elements),
                 tuple(gguf.GGML_QUANT_SIZES[kind]))

"""Host memory: freed memory handed back to the system, and host arrays placed on the
device without a second copy.

    host_memory.release_freed()   # after a load or a compile that freed hundreds of MB
    buf = host_memory.empty((layers, d_in, d_out), np.float32)   # a loader fills it ...
    w = host_memory.to_device(buf)   # ... and hands it over: on CPU, the same memory

glibc's allocator keeps memory a program frees for reuse (the heap's free blocks, and
its per-thread arenas, which it never trims by itself), and that memory counts in the
process's resident size. Loading a quantized GGUF file (blocks decoded and dropped
tensor by tensor) and XLA's compiles (working memory in its threads) free hundreds of
MB that then sit idle: 0.33 GB after Gemma 3 270M's first 64 tokens. `malloc_trim`
returns it. Off glibc this does nothing.

A loader that builds a model's weights on the host and then puts them on the device
holds every weight twice at the end (XLA copies a host array into its own buffer),
unless the host buffer is one XLA can adopt: on the CPU backend, a C-ordered buffer
aligned to 64 bytes becomes the device array's memory (`jax.device_put(...,
may_alias=True)`). `empty` makes such buffers, and `to_device` hands them over; any
other array is copied into one first (its owner may still change it). On an
accelerator the buffer is transferred and then freed.
"""

import ctypes
import functools
import weakref
from typing import Any, Sequence

import jax
import numpy as np

ALIGNMENT = 64  # bytes: what XLA:CPU needs to adopt a host buffer without copying it
_HANDED = weakref.WeakValueDictionary()  # {id: buffer} from `empty`, to be handed over


@functools.lru_cache(maxsize=1)
def _trim():
  try:
    return ctypes.CDLL("libc.so.6").malloc_trim
  except (OSError, AttributeError):
    return None


def release_freed() -> None:
  """Returns the allocator's free memory to the system (glibc's `malloc_trim(0)`)."""
  trim = _trim()
  if trim is not None:
    trim(0)


def empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
  """An uninitialised C-ordered host array aligned for `to_device` to adopt.

  Its filler hands it over: once passed to `to_device` it must not change (on the
  CPU backend it is the device array's memory)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % ALIGNMENT
  out = raw[start:start + nbytes].view(dtype).reshape(shape)
  _HANDED[id(out)] = out
  return out


def to_device(x) -> jax.Array:
  """`x` as a device array in C order: a buffer from `empty` adopted as it is (on CPU
  no copy), any other host array copied into one first; device arrays unchanged."""
  if isinstance(x, jax.Array):
    return x
  if _HANDED.get(id(x)) is not x:
    x = np.asarray(x)
    buffer = empty(x.shape, x.dtype)
    np.copyto(buffer, x)
    x = buffer
  _HANDED.pop(id(x), None)
  return jax.device_put(x, may_alias=True)

"""Handing freed host memory back to the system.

    host_memory.release_freed()   # after a load or a compile that freed hundreds of MB

glibc's allocator keeps memory a program frees for reuse (the heap's free blocks, and
its per-thread arenas, which it never trims by itself), and that memory counts in the
process's resident size. Loading a quantized GGUF file (blocks decoded and dropped
tensor by tensor) and XLA's compiles (working memory in its threads) free hundreds of
MB that then sit idle: 0.33 GB after Gemma 3 270M's first 64 tokens. `malloc_trim`
returns it. Off glibc this does nothing.
"""

import ctypes
import functools


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

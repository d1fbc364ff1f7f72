"""Tokenizing large text files: cut into pieces where that is exact, encoded in parallel.

    ids = tokenize_files.encode_file(tok, "corpus.txt")   # == tok.encode(whole text)
    ids = tokenize_files.encode_chunks(tok, tokenize_files.iter_text_chunks("a.txt"))

Works with any `tokenizers.Tokenizer`. The text is cut only right after a
newline between two visible ASCII characters (`last_safe_cut`), where GPT-2's
pre-tokenizer encodes the two sides apart exactly as together; tiktoken
releases the GIL, so threads encode the pieces on all cores.
"""

import concurrent.futures
import os
import re
import sys
from typing import Iterable, Iterator, Optional

import numpy as np

from purejax.data import tokenizers


def _show_progress(progress: Optional[bool]) -> bool:
  return sys.stderr.isatty() if progress is None else progress


# A newline between two visible ASCII characters. GPT-2's pre-tokenizer (and
# cl100k's) always ends a piece at such a newline and starts the next piece
# right after it, so the text on either side encodes the same apart as
# together. Next to other whitespace that fails ("\n\n" is one token).
_SAFE_CUT = re.compile(rb"[\x21-\x7e]\n(?=[\x21-\x7e])")


def last_safe_cut(buf: bytes, start: int) -> Optional[int]:
  """Index just past the last safe newline in `buf[start:]`, or None."""
  last = None
  for match in _SAFE_CUT.finditer(buf, start):
    last = match
  return None if last is None else last.end()


def iter_text_chunks(path: str, chunk_bytes: int = 1 << 20) -> Iterator[str]:
  """A UTF-8 text file in pieces of about `chunk_bytes`, cut only where tokenizing apart is exact.

  Each cut falls right after a newline that sits between two visible ASCII
  characters; a piece with no such newline grows until one comes.
  Concatenated, the pieces are the file.
  """
  with open(path, "rb") as f:
    buf = b""
    while True:
      block = f.read(chunk_bytes)
      if not block:
        if buf:
          yield buf.decode("utf-8")
        return
      # Cut points before the last two old bytes were rejected already.
      start = max(len(buf) - 2, 0)
      buf += block
      cut = last_safe_cut(buf, start)
      if cut is not None:
        yield buf[:cut].decode("utf-8")
        buf = buf[cut:]


def encode_chunks(
    tokenizer: tokenizers.Tokenizer,
    chunks: Iterable[str],
    *,
    num_threads: Optional[int] = None,
    progress: Optional[bool] = None,
    total_chars: Optional[int] = None,
) -> np.ndarray:
  """Encodes pieces of one text in parallel and joins their ids in order.

  tiktoken's core releases the GIL, so threads run BPE on all cores; at most
  `2 * num_threads` pieces are held at once. The pieces must be cut where
  encoding apart equals encoding together (`iter_text_chunks` cuts so).

  Args:
    tokenizer: any `Tokenizer`.
    chunks: consecutive pieces of the text.
    num_threads: worker threads (default: the CPU count).
    progress: show a tqdm bar; default only when stderr is a terminal.
    total_chars: the text's length, for the bar.

  Returns:
    `[num_tokens]` int32 ids of the whole text.
  """
  num_threads = num_threads or os.cpu_count() or 1
  bar = _progress_bar(progress, total_chars, "chars")
  pieces = []
  try:
    with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
      pending = []
      for chunk in chunks:
        pending.append((pool.submit(tokenizer.encode, chunk), len(chunk)))
        while len(pending) >= 2 * num_threads:
          pieces.append(_collect(pending.pop(0), bar))
      pieces.extend(_collect(item, bar) for item in pending)
  finally:
    bar.close()
  return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def _collect(item, bar) -> np.ndarray:
  future, size = item
  ids = future.result()
  bar.update(size)
  return ids


class _NoBar:
  def update(self, n):
    del n

  def close(self):
    pass


def _progress_bar(progress: Optional[bool], total: Optional[int], unit: str):
  if not _show_progress(progress):
    return _NoBar()
  import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm.tqdm(total=total, unit=unit, unit_scale=True, desc="tokenizing",
                   file=sys.stderr)


def encode_file(
    tokenizer: tokenizers.Tokenizer,
    path: str,
    *,
    num_threads: Optional[int] = None,
    chunk_bytes: int = 1 << 20,
    progress: Optional[bool] = None,
) -> np.ndarray:
  """Encodes a UTF-8 text file in parallel; the same ids as `tokenizer.encode(whole text)`.

  Args:
    tokenizer: any `Tokenizer`.
    path: the text file.
    num_threads: worker threads (default: the CPU count).
    chunk_bytes: size of the pieces handed to the threads.
    progress: show a tqdm bar; default only when stderr is a terminal.

  Returns:
    `[num_tokens]` int32 ids.
  """
  size = os.path.getsize(path)
  # The bar counts characters; for mostly-ASCII text that is about the bytes.
  return encode_chunks(tokenizer, iter_text_chunks(path, chunk_bytes),
                       num_threads=num_threads, progress=progress, total_chars=size)

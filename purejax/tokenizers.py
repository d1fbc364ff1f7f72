"""Tokenizers: text <-> int32 ids, rebuilt from a JSON spec stored with a model.

    tok = get_tokenizer("gpt2")                   # GPT-2's byte-level BPE (tiktoken)
    ids = tok.encode("Hello world")               # np.ndarray int32: [15496, 995]
    text = tok.decode(ids)
    tok = from_spec(json.loads(json.dumps(tok.spec())))  # what a checkpoint stores
    ids = encode_file(tok, "corpus.txt")          # large files, in parallel

Every tokenizer has `name`, `vocab_size` (the number of real ids), `encode`,
`decode` and `spec()`; see `Tokenizer`.

GPT-2's encoding, offline: tiktoken downloads GPT-2's `vocab.bpe` and
`encoder.json` once and caches them (under `TIKTOKEN_CACHE_DIR`, default
`<tmp>/data-gym-cache`). Without the cache and the network,
`gpt2_tokenizer` fails at once with a `TokenizerError` saying what to
provide: a folder with `vocab.bpe` + `encoder.json`, or a `.tiktoken` file
(tiktoken's `r50k_base.tiktoken` holds the same merges). PyPI's
`openai-whisper` source package ships that very file as
`whisper/assets/gpt2.tiktoken` (`pip download openai-whisper --no-deps
--no-binary :all:`). Whatever the source, the merges are checked against
GPT-2's fingerprint, so a wrong file is an error, not a silently different
tokenizer.
"""

import base64
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import sys
import tempfile
import threading
from typing import (Any, ClassVar, Dict, Iterable, Iterator, Optional, Protocol, Tuple,
                    runtime_checkable)

import numpy as np

# GPT-2's pre-tokenizer: tiktoken's faster equivalent of the original
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
GPT2_PAT_STR = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""")
GPT2_VOCAB_SIZE = 50257  # 50256 merges and byte tokens, then <|endoftext|>
ENDOFTEXT = "<|endoftext|>"
# sha256 of GPT-2's merges in tiktoken's file format (`_fingerprint`); it is
# also the published hash of tiktoken's r50k_base.tiktoken.
GPT2_FINGERPRINT = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"

# Where tiktoken's "gpt2" and "r50k_base" encodings (the same merges) come from;
# tiktoken caches each under the sha1 of its URL.
_GPT2_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)
_R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
_NETWORK_PROBE_TIMEOUT_S = 3.0

TOKENIZERS = ("char", "gpt2")


class TokenizerError(ValueError):
  """A tokenizer cannot be built or used; the message says how to fix it."""


@runtime_checkable
class Tokenizer(Protocol):
  """What every tokenizer provides.

  Attributes:
    name: short name, e.g. "char" or "gpt2".
    vocab_size: number of real ids, `0 .. vocab_size - 1`. A model's
      embedding table may be larger (padded); ids past this are never valid.
  """
  name: str

  @property
  def vocab_size(self) -> int: ...

  def encode(self, text: str) -> np.ndarray:
    """Text -> `[num_tokens]` int32 ids."""

  def decode(self, ids: Any) -> str:
    """Ids (any int array-like) -> text."""

  def spec(self) -> Dict[str, Any]:
    """JSON-able dict from which `from_spec` rebuilds this tokenizer."""


# ----------------------------------------------------------------------------
# Characters


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """A character vocabulary: id `i` is `chars[i]` (like `data.CharVocab`)."""
  chars: str
  name: ClassVar[str] = "char"

  def __post_init__(self):
    if not self.chars:
      raise TokenizerError("a character tokenizer needs at least one character.")
    if len(set(self.chars)) != len(self.chars):
      repeated = sorted({c for c in self.chars if self.chars.count(c) > 1})
      raise TokenizerError(f"characters {repeated!r} appear more than once in the "
                           f"vocabulary; each character needs exactly one id.")

  @classmethod
  def from_text(cls, text: str) -> "CharTokenizer":
    """The sorted characters of `text`."""
    return cls("".join(sorted(set(text))))

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    """Text -> int32 ids. Raises TokenizerError naming any unknown characters."""
    # Code points through a sorted table: a Python loop per character takes
    # ~10 s per 100 MB, this takes well under one.
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    table = np.frombuffer(self.chars.encode("utf-32-le"), np.uint32)
    order = np.argsort(table)
    slots = np.minimum(np.searchsorted(table[order], codes), len(table) - 1)
    if not np.array_equal(table[order][slots], codes):
      unknown = sorted(set(text) - set(self.chars))
      raise TokenizerError(
          f"characters {unknown!r} are not in the model's vocabulary "
          f"({self.chars!r}); remove or replace them.")
    return order[slots].astype(np.int32)

  def decode(self, ids: Any) -> str:
    ids = _check_ids(ids, self.vocab_size)
    return "".join(self.chars[i] for i in ids.tolist())

  def spec(self) -> Dict[str, Any]:
    return {"type": "char", "name": self.name, "vocab_size": self.vocab_size,
            "chars": self.chars}


def _check_ids(ids: Any, vocab_size: int) -> np.ndarray:
  ids = np.asarray(ids).reshape(-1)
  if ids.size and not np.issubdtype(ids.dtype, np.integer):
    raise TokenizerError(f"token ids must be integers, got {ids.dtype}.")
  ids = ids.astype(np.int64)
  bad = ids[(ids < 0) | (ids >= vocab_size)]
  if bad.size:
    raise TokenizerError(
        f"token id {int(bad[0])} is outside the tokenizer's {vocab_size} ids (an id "
        f"of the model's padded vocabulary?); mask ids >= {vocab_size} when sampling.")
  return ids


# ----------------------------------------------------------------------------
# Byte-level BPE through tiktoken


@dataclasses.dataclass(frozen=True)
class BPETokenizer:
  """A byte-level BPE (GPT-2's algorithm) run by tiktoken.

  Build it with `gpt2_tokenizer` or `bpe_tokenizer`, not directly.

  Attributes:
    name: "gpt2", or the name given to `bpe_tokenizer`.
    encoding: the `tiktoken.Encoding`.
    fingerprint: sha256 of the merges (`_fingerprint`): identifies them
      whatever file they were read from.
    pat_str: the pre-tokenizer's regex.
    special_tokens: `(text, id)` pairs, e.g. `(("<|endoftext|>", 50256),)`.
    encoding_file: the file or folder the merges were read from, if any.
  """
  name: str
  encoding: Any = dataclasses.field(repr=False, compare=False)
  fingerprint: str
  pat_str: str = dataclasses.field(repr=False)
  special_tokens: Tuple[Tuple[str, int], ...] = ()
  encoding_file: Optional[str] = None

  @property
  def vocab_size(self) -> int:
    return self.encoding.n_vocab

  @property
  def eot_id(self) -> Optional[int]:
    """Id of `<|endoftext|>` (the document separator), if the encoding has it."""
    return dict(self.special_tokens).get(ENDOFTEXT)

  def encode(self, text: str) -> np.ndarray:
    """Text -> int32 ids; special-token strings in `text` are plain text.

    A corpus that happens to contain "<|endoftext|>" must not inject
    separators (tiktoken's `encode_ordinary`); add `eot_id` yourself.
    """
    try:
      ids = self.encoding.encode_to_numpy(text, disallowed_special=())
    except UnicodeEncodeError:
      # Lone surrogates cannot go to the Rust core; tiktoken's own fix-up.
      text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
      ids = self.encoding.encode_to_numpy(text, disallowed_special=())
    return ids.astype(np.int32)

  def decode(self, ids: Any) -> str:
    """Ids -> text; bytes that are not valid UTF-8 decode to U+FFFD."""
    return self.encoding.decode(_check_ids(ids, self.vocab_size).tolist())

  def spec(self) -> Dict[str, Any]:
    return {"type": "bpe", "name": self.name, "vocab_size": self.vocab_size,
            "fingerprint": self.fingerprint, "pat_str": self.pat_str,
            "special_tokens": dict(self.special_tokens),
            "encoding_file": self.encoding_file}


def gpt2_spec() -> Dict[str, Any]:
  """The spec of GPT-2's tokenizer, without loading it (for imported models)."""
  return {"type": "bpe", "name": "gpt2", "vocab_size": GPT2_VOCAB_SIZE,
          "fingerprint": GPT2_FINGERPRINT, "pat_str": GPT2_PAT_STR,
          "special_tokens": {ENDOFTEXT: GPT2_VOCAB_SIZE - 1}, "encoding_file": None}


def _import_tiktoken():
  try:
    import tiktoken  # pylint: disable=g-import-not-at-top
    import tiktoken.load  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise TokenizerError("BPE tokenizers need tiktoken: pip install tiktoken.") from e
  return tiktoken


def _fingerprint(ranks: Dict[bytes, int]) -> str:
  """sha256 of `ranks` written as tiktoken's `.tiktoken` file (one line per rank)."""
  sha = hashlib.sha256()
  for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
    sha.update(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
  return sha.hexdigest()


@contextlib.contextmanager
def _tiktoken_cache_off():
  """Stops tiktoken's loaders from copying local files into its cache.

  `tiktoken.load` caches every file it reads, local ones too, keyed by
  path: a side effect in the user's cache, and an error when the cache dir
  is read-only. An empty TIKTOKEN_CACHE_DIR turns caching off.
  """
  saved = os.environ.get("TIKTOKEN_CACHE_DIR")
  os.environ["TIKTOKEN_CACHE_DIR"] = ""
  try:
    yield
  finally:
    if saved is None:
      del os.environ["TIKTOKEN_CACHE_DIR"]
    else:
      os.environ["TIKTOKEN_CACHE_DIR"] = saved


def _resolve_encoding_file(path: str) -> Tuple[str, Optional[pathlib.Path], pathlib.Path]:
  """`("tiktoken", None, file)` or `("data_gym", vocab.bpe, encoder.json)` for `path`."""
  p = pathlib.Path(path).expanduser()
  if p.is_dir():
    vocab, encoder = p / "vocab.bpe", p / "encoder.json"
    tiktoken_files = sorted(p.glob("*.tiktoken"))
    if vocab.is_file() and encoder.is_file():
      return "data_gym", vocab, encoder
    if len(tiktoken_files) == 1:
      return "tiktoken", None, tiktoken_files[0]
    raise TokenizerError(
        f"--tokenizer_file={path} is a folder without vocab.bpe and encoder.json (or "
        f"one .tiktoken file); put GPT-2's vocab.bpe and encoder.json there.")
  if not p.is_file():
    raise TokenizerError(
        f"--tokenizer_file={path} does not exist; pass a folder with vocab.bpe and "
        f"encoder.json, or a .tiktoken file.")
  if p.name == "vocab.bpe" or p.name == "encoder.json":
    vocab, encoder = p.parent / "vocab.bpe", p.parent / "encoder.json"
    if not (vocab.is_file() and encoder.is_file()):
      raise TokenizerError(f"{p.parent} needs both vocab.bpe and encoder.json; one of "
                           f"them is missing.")
    return "data_gym", vocab, encoder
  return "tiktoken", None, p


def _load_ranks(path: str) -> Dict[bytes, int]:
  """The mergeable ranks in a `.tiktoken` file or a vocab.bpe + encoder.json pair."""
  tiktoken = _import_tiktoken()
  kind, vocab, target = _resolve_encoding_file(path)
  try:
    with _tiktoken_cache_off():
      if kind == "data_gym":
        return tiktoken.load.data_gym_to_mergeable_bpe_ranks(str(vocab), str(target))
      return tiktoken.load.load_tiktoken_bpe(str(target))
  except (ValueError, KeyError, AssertionError, UnicodeDecodeError) as e:
    what = f"{vocab} + {target}" if kind == "data_gym" else str(target)
    raise TokenizerError(
        f"{what} is not a readable BPE encoding ({type(e).__name__}: "
        f"{str(e)[:120]}); pass GPT-2's vocab.bpe + encoder.json or a .tiktoken "
        f"file.") from e
  except OSError as e:
    raise TokenizerError(f"cannot read {target}: {e.strerror or e}.") from e


def _make_encoding(name: str, ranks: Dict[bytes, int], pat_str: str,
                   special_tokens: Dict[str, int]):
  tiktoken = _import_tiktoken()
  missing = [b for b in range(256) if bytes([b]) not in ranks]
  if missing:
    raise TokenizerError(f"the {name} encoding lacks single-byte tokens for "
                         f"{len(missing)} byte values (e.g. {missing[0]}); a byte-level BPE "
                         f"needs all 256.")
  return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks,
                           special_tokens=dict(special_tokens))


def bpe_tokenizer(
    encoding_file: str,
    *,
    name: str = "bpe",
    pat_str: str = GPT2_PAT_STR,
    special_tokens: Optional[Dict[str, int]] = None,
) -> BPETokenizer:
  """A byte-level BPE tokenizer from a local encoding file.

  Args:
    encoding_file: a `.tiktoken` file (base64 token and rank per line), a
      folder holding `vocab.bpe` + `encoder.json` (GPT-2's release format)
      or one `.tiktoken` file, or the path of `vocab.bpe` itself.
    name: the tokenizer's name.
    pat_str: pre-tokenizer regex (default GPT-2's).
    special_tokens: `{text: id}`; default `{"<|endoftext|>": <next free id>}`.

  Returns:
    `BPETokenizer`.

  Raises:
    TokenizerError: the file is missing, unreadable, or lacks byte tokens.
  """
  ranks = _load_ranks(encoding_file)
  if special_tokens is None:
    special_tokens = {ENDOFTEXT: max(ranks.values()) + 1}
  encoding = _make_encoding(name, ranks, pat_str, special_tokens)
  return BPETokenizer(name=name, encoding=encoding, fingerprint=_fingerprint(ranks),
                      pat_str=pat_str, special_tokens=tuple(sorted(special_tokens.items())),
                      encoding_file=str(encoding_file))


def _tiktoken_cache_dir() -> Optional[pathlib.Path]:
  """tiktoken's cache folder, by its own rules; None when caching is off."""
  for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
    if var in os.environ:
      return pathlib.Path(os.environ[var]) if os.environ[var] else None
  return pathlib.Path(tempfile.gettempdir()) / "data-gym-cache"


def _cached(url: str) -> Optional[pathlib.Path]:
  cache = _tiktoken_cache_dir()
  if cache is None:
    return None
  path = cache / hashlib.sha1(url.encode()).hexdigest()
  return path if path.is_file() else None


def _host_reachable(url: str, timeout: float = _NETWORK_PROBE_TIMEOUT_S) -> bool:
  """Whether `url`'s host accepts a connection within `timeout` seconds.

  tiktoken downloads without a timeout, and a DNS lookup ignores socket
  timeouts: the probe runs in a daemon thread so a dead network costs at
  most `timeout`.
  """
  import socket  # pylint: disable=g-import-not-at-top
  from urllib import parse  # pylint: disable=g-import-not-at-top
  result = []

  def probe():
    try:
      socket.create_connection((parse.urlparse(url).hostname, 443), timeout=timeout).close()
      result.append(True)
    except OSError:
      pass

  thread = threading.Thread(target=probe, daemon=True)
  thread.start()
  thread.join(timeout)
  return bool(result)


def _gpt2_missing_message() -> str:
  cache = _tiktoken_cache_dir()
  where = f"tiktoken's cache ({cache})" if cache else "tiktoken's cache (turned off)"
  return (f"GPT-2's BPE files are not available: {where} has neither GPT-2's vocab.bpe "
          f"and encoder.json nor r50k_base.tiktoken, and the download host cannot be "
          f"reached. Pass --tokenizer_file=PATH (a folder with vocab.bpe and "
          f"encoder.json, or a .tiktoken file), or set TIKTOKEN_CACHE_DIR to a tiktoken "
          f"cache that has them.")


def _gpt2_ranks_from_data_gym_cache(vocab: pathlib.Path, encoder: pathlib.Path
                                    ) -> Dict[bytes, int]:
  with tempfile.TemporaryDirectory(prefix="purejax-gpt2-") as folder:
    # The loader wants the two files under their real names.
    os.symlink(vocab, os.path.join(folder, "vocab.bpe"))
    os.symlink(encoder, os.path.join(folder, "encoder.json"))
    return _load_ranks(folder)


def _gpt2_from_cache() -> Optional[BPETokenizer]:
  """GPT-2's tokenizer from tiktoken's cache, without any network access."""
  vocab, encoder = (_cached(url) for url in _GPT2_URLS)
  r50k = _cached(_R50K_URL)
  candidates = []
  if vocab and encoder:
    candidates.append(lambda: _gpt2_ranks_from_data_gym_cache(vocab, encoder))
  if r50k:
    candidates.append(lambda: _load_ranks(str(r50k)))
  for load in candidates:
    try:
      ranks = load()
    except (TokenizerError, OSError):
      continue  # a damaged cache entry: try the next, then the network
    if _fingerprint(ranks) == GPT2_FINGERPRINT:
      return _gpt2_from_ranks(ranks, None)
  return None


def _gpt2_from_ranks(ranks: Dict[bytes, int], source: Optional[str]) -> BPETokenizer:
  special = {ENDOFTEXT: GPT2_VOCAB_SIZE - 1}
  return BPETokenizer(name="gpt2", encoding=_make_encoding("gpt2", ranks, GPT2_PAT_STR, special),
                      fingerprint=GPT2_FINGERPRINT, pat_str=GPT2_PAT_STR,
                      special_tokens=tuple(special.items()), encoding_file=source)


def gpt2_tokenizer(encoding_file: Optional[str] = None) -> BPETokenizer:
  """GPT-2's BPE tokenizer (50257 ids, `<|endoftext|>` = 50256).

  Sources, in order: `encoding_file` if given; tiktoken's cache; tiktoken's
  download (only when its host answers within a few seconds).

  Args:
    encoding_file: a folder with GPT-2's `vocab.bpe` + `encoder.json`, or a
      `.tiktoken` file with the same merges (e.g. `r50k_base.tiktoken`).

  Returns:
    `BPETokenizer` named "gpt2".

  Raises:
    TokenizerError: the files cannot be had, or `encoding_file` holds
      another encoding than GPT-2's.
  """
  if encoding_file is not None:
    ranks = _load_ranks(encoding_file)
    if len(ranks) != GPT2_VOCAB_SIZE - 1 or _fingerprint(ranks) != GPT2_FINGERPRINT:
      raise TokenizerError(
          f"{encoding_file} is not GPT-2's encoding ({len(ranks)} merges and byte tokens, "
          f"GPT-2 has {GPT2_VOCAB_SIZE - 1}, or different merges); pass GPT-2's vocab.bpe "
          f"+ encoder.json or r50k_base.tiktoken.")
    return _gpt2_from_ranks(ranks, str(encoding_file))
  cached = _gpt2_from_cache()
  if cached is not None:
    return cached
  if not _host_reachable(_GPT2_URLS[0]):
    raise TokenizerError(_gpt2_missing_message())
  tiktoken = _import_tiktoken()
  try:
    encoding = tiktoken.get_encoding("gpt2")
  except Exception as e:  # requests' and tiktoken's errors: the download failed
    raise TokenizerError(f"downloading GPT-2's BPE files failed ({type(e).__name__}: "
                         f"{str(e)[:120]}). {_gpt2_missing_message()}") from e
  special = {ENDOFTEXT: GPT2_VOCAB_SIZE - 1}
  return BPETokenizer(name="gpt2", encoding=encoding, fingerprint=GPT2_FINGERPRINT,
                      pat_str=GPT2_PAT_STR, special_tokens=tuple(special.items()))


# ----------------------------------------------------------------------------
# Lookup by name and from a spec


def get_tokenizer(name: str, **kwargs) -> Tokenizer:
  """A tokenizer by name.

  Args:
    name: "char" (pass `chars=` or `text=`) or "gpt2" (optional
      `encoding_file=`).
    **kwargs: as above.

  Raises:
    TokenizerError: unknown name or arguments.
  """
  if name == "char":
    if ("chars" in kwargs) == ("text" in kwargs) or set(kwargs) - {"chars", "text"}:
      raise TokenizerError("get_tokenizer('char', ...) takes chars=... or text=..., one "
                           f"of them; got {sorted(kwargs)}.")
    if "chars" in kwargs:
      return CharTokenizer(kwargs["chars"])
    return CharTokenizer.from_text(kwargs["text"])
  if name == "gpt2":
    if set(kwargs) - {"encoding_file"}:
      raise TokenizerError(f"get_tokenizer('gpt2', ...) takes only encoding_file=...; got "
                           f"{sorted(kwargs)}.")
    return gpt2_tokenizer(kwargs.get("encoding_file"))
  raise TokenizerError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZERS)}.")


def from_spec(spec: Dict[str, Any], *, encoding_file: Optional[str] = None) -> Tokenizer:
  """Rebuilds a tokenizer from its `spec()`.

  Args:
    spec: a dict from `Tokenizer.spec()` (e.g. read from a checkpoint).
    encoding_file: where to read a BPE encoding from, overriding the path in
      the spec (which may be from another machine). Either way, the merges
      must match the spec's fingerprint.

  Raises:
    TokenizerError: a malformed spec, a model without a tokenizer, or an
      encoding other than the one the spec records.
  """
  kind = spec.get("type") if isinstance(spec, dict) else None
  if kind == "char":
    return CharTokenizer(spec["chars"])
  if kind == "bpe":
    if spec.get("name") == "gpt2" and spec.get("fingerprint") == GPT2_FINGERPRINT:
      recorded = spec.get("encoding_file")
      if encoding_file is None and recorded and os.path.exists(recorded):
        encoding_file = recorded
      return gpt2_tokenizer(encoding_file)
    source = encoding_file or spec.get("encoding_file")
    if not source:
      raise TokenizerError(f"the {spec.get('name')!r} BPE encoding is recorded without a "
                           f"file; pass --tokenizer_file=PATH.")
    tok = bpe_tokenizer(source, name=spec["name"], pat_str=spec["pat_str"],
                        special_tokens=spec["special_tokens"])
    if tok.fingerprint != spec.get("fingerprint"):
      raise TokenizerError(
          f"{source} holds other merges than the {spec['name']!r} encoding the model was "
          f"trained with (fingerprint {tok.fingerprint[:12]}, expected "
          f"{str(spec.get('fingerprint'))[:12]}); pass --tokenizer_file=PATH of the "
          f"original file.")
    return tok
  if kind == "ids":
    raise TokenizerError(
        f"this model records no tokenizer, only {spec.get('vocab_size')} ids; pass "
        f"--tokenizer={'|'.join(TOKENIZERS)} explicitly.")
  raise TokenizerError(f"not a tokenizer spec: {json.dumps(spec)[:100]} (its 'type' must "
                       f"be 'char', 'bpe' or 'ids').")


def ids_spec(vocab_size: int) -> Dict[str, Any]:
  """The spec of a model whose tokenizer is unknown: only its number of real ids."""
  return {"type": "ids", "name": "ids", "vocab_size": int(vocab_size)}


# ----------------------------------------------------------------------------
# Large inputs


def _show_progress(progress: Optional[bool]) -> bool:
  return sys.stderr.isatty() if progress is None else progress


# A newline between two visible ASCII characters. GPT-2's pre-tokenizer (and
# cl100k's) always ends a piece at such a newline and starts the next piece
# right after it, so the text on either side encodes the same apart as
# together. Next to other whitespace that fails ("\n\n" is one token).
_SAFE_CUT = re.compile(rb"[\x21-\x7e]\n(?=[\x21-\x7e])")


def _last_safe_cut(buf: bytes, start: int) -> Optional[int]:
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
      cut = _last_safe_cut(buf, start)
      if cut is not None:
        yield buf[:cut].decode("utf-8")
        buf = buf[cut:]


def encode_chunks(
    tokenizer: Tokenizer,
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
    tokenizer: Tokenizer,
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

"""Tokenizers: text <-> int32 ids, rebuilt from a JSON spec stored with a model.

    tok = get_tokenizer("gpt2")                   # GPT-2's byte-level BPE (tiktoken)
    ids = tok.encode("Hello world")               # np.ndarray int32: [15496, 995]
    text = tok.decode(ids)
    spec = tok.spec()                             # TokenizerSpec, for a checkpoint
    tok = from_spec(TokenizerSpec.from_dict(spec.to_dict()))

Every tokenizer has `name`, `vocab_size` (the number of real ids), `encode`,
`decode` and `spec()`; see `Tokenizer`. Large files are tokenized in parallel
by `purejax.data.tokenize_files`; BPE encoding files are found and read by
`purejax.data.bpe_files`; Hugging Face `tokenizer.json` files (the Llama
family's) are read by `purejax.data.tokenizer_json`.

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

import dataclasses
import os
import pickle
from typing import Any, ClassVar, Dict, List, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from purejax.data import bpe_files
from purejax.data import gguf_tokenizer
from purejax.data import tokenizer_json
from purejax.data.errors import TokenizerError
from purejax.data.tokenizer_spec import TokenizerSpec

# GPT-2's pre-tokenizer: tiktoken's faster equivalent of the original
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
GPT2_PAT_STR = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""")
GPT2_VOCAB_SIZE = 50257  # 50256 merges and byte tokens, then <|endoftext|>
ENDOFTEXT = "<|endoftext|>"
# sha256 of GPT-2's merges in tiktoken's file format (`bpe_files.fingerprint`); it is
# also the published hash of tiktoken's r50k_base.tiktoken.
GPT2_FINGERPRINT = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"

TOKENIZERS = ("char", "gpt2")


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

  def spec(self) -> TokenizerSpec:
    """What `from_spec` rebuilds this tokenizer from (`to_dict()` for JSON)."""


# ----------------------------------------------------------------------------
# Characters


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """A character vocabulary: id `i` is `chars[i]`."""
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

  def spec(self) -> TokenizerSpec:
    return TokenizerSpec("char", self.name, self.vocab_size, chars=self.chars)

  def byte_lengths(self) -> np.ndarray:
    """`[vocab_size]` int32: the UTF-8 bytes of each id's character."""
    return np.asarray([len(c.encode("utf-8")) for c in self.chars], np.int32)


def byte_lengths(tokenizer: Tokenizer) -> Optional[np.ndarray]:
  """`[vocab_size]` int32: how many UTF-8 bytes each id decodes to, for bits per byte.

  A byte-level BPE token's own bytes (which may be part of a character);
  special tokens, which stand for no text, count 0. None for a tokenizer that
  cannot say (ids without text).
  """
  lengths = getattr(tokenizer, "byte_lengths", None)
  return None if lengths is None else lengths()


def prompt_ids(tokenizer: Tokenizer, text: str) -> List[int]:
  """A plain prompt's ids as the model reads them: BOS first where the tokenizer says
  a prompt starts with it (a GGUF file's `add_bos_token`, as llama.cpp prepends it;
  not when `text` already begins with it), then `text`'s ids."""
  ids = [int(i) for i in tokenizer.encode(text)]
  bos = getattr(tokenizer, "bos_token", None)
  if getattr(tokenizer, "add_bos", False) and bos is not None:
    first = [int(i) for i in tokenizer.encode(bos)]
    if ids[:len(first)] != first:
      ids = first + ids
  return ids


def token_texts(tokenizer: Tokenizer) -> List[str]:
  """Each id's text as it reads inside a longer text, for matching stop strings.

  Decoded after another token, less that token's own text: decoded alone, a
  SentencePiece token drops its leading space (`"▁def"` reads `"def"`), which
  would make `"\ndef"` seem to follow `"\n def"`. A token holding part of a
  UTF-8 character reads as U+FFFD.
  """
  try:
    anchor = [int(tokenizer.encode("a")[0])]
  except (TokenizerError, IndexError):
    anchor = [0]
  before = tokenizer.decode(anchor)
  texts = []
  for i in range(tokenizer.vocab_size):
    text = tokenizer.decode(anchor + [i])
    texts.append(text[len(before):] if text.startswith(before) else tokenizer.decode([i]))
  return texts


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
    fingerprint: sha256 of the merges (`bpe_files.fingerprint`): identifies
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

  def byte_lengths(self) -> np.ndarray:
    """`[vocab_size]` int32: the bytes each id decodes to; 0 for special tokens
    (`<|endoftext|>` stands for no text)."""
    special = {i for _, i in self.special_tokens} | set(
        getattr(self.encoding, "_special_tokens", {}).values())
    return np.asarray([0 if i in special else len(self.encoding.decode_single_token_bytes(i))
                       for i in range(self.vocab_size)], np.int32)

  def spec(self) -> TokenizerSpec:
    return TokenizerSpec("bpe", self.name, self.vocab_size, fingerprint=self.fingerprint,
                         pat_str=self.pat_str, special_tokens=self.special_tokens,
                         encoding_file=self.encoding_file)


def gpt2_spec() -> TokenizerSpec:
  """The spec of GPT-2's tokenizer, without loading it (for imported models)."""
  return TokenizerSpec("bpe", "gpt2", GPT2_VOCAB_SIZE, fingerprint=GPT2_FINGERPRINT,
                       pat_str=GPT2_PAT_STR,
                       special_tokens=((ENDOFTEXT, GPT2_VOCAB_SIZE - 1),))


def _make_encoding(name: str, ranks: Dict[bytes, int], pat_str: str,
                   special_tokens: Dict[str, int]):
  tiktoken = bpe_files.import_tiktoken()
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
  ranks = bpe_files.load_ranks(encoding_file)
  if special_tokens is None:
    special_tokens = {ENDOFTEXT: max(ranks.values()) + 1}
  encoding = _make_encoding(name, ranks, pat_str, special_tokens)
  return BPETokenizer(name=name, encoding=encoding, fingerprint=bpe_files.fingerprint(ranks),
                      pat_str=pat_str, special_tokens=tuple(sorted(special_tokens.items())),
                      encoding_file=str(encoding_file))


def _gpt2_from_cache() -> Optional[BPETokenizer]:
  """GPT-2's tokenizer from tiktoken's cache, without any network access."""
  ranks = bpe_files.cached_gpt2_ranks(GPT2_FINGERPRINT)
  return None if ranks is None else _gpt2_from_ranks(ranks, None)


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
    ranks = bpe_files.load_ranks(encoding_file)
    if len(ranks) != GPT2_VOCAB_SIZE - 1 or bpe_files.fingerprint(ranks) != GPT2_FINGERPRINT:
      raise TokenizerError(
          f"{encoding_file} is not GPT-2's encoding ({len(ranks)} merges and byte tokens, "
          f"GPT-2 has {GPT2_VOCAB_SIZE - 1}, or different merges); pass GPT-2's vocab.bpe "
          f"+ encoder.json or r50k_base.tiktoken.")
    return _gpt2_from_ranks(ranks, str(encoding_file))
  cached = _gpt2_from_cache()
  if cached is not None:
    return cached
  if not bpe_files.host_reachable(bpe_files.GPT2_URLS[0]):
    raise TokenizerError(bpe_files.gpt2_missing_message())
  tiktoken = bpe_files.import_tiktoken()
  try:
    encoding = tiktoken.get_encoding("gpt2")
  except Exception as e:  # requests' and tiktoken's errors: the download failed
    raise TokenizerError(f"downloading GPT-2's BPE files failed ({type(e).__name__}: "
                         f"{str(e)[:120]}). {bpe_files.gpt2_missing_message()}") from e
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


def from_spec(spec: TokenizerSpec, *, encoding_file: Optional[str] = None) -> Tokenizer:
  """Rebuilds a tokenizer from its `spec()`.

  Args:
    spec: from `Tokenizer.spec()`, or `TokenizerSpec.from_dict` of a
      checkpoint's record.
    encoding_file: where to read a BPE encoding from, overriding the path in
      the spec (which may be from another machine). Either way, the merges
      must match the spec's fingerprint.

  Raises:
    TokenizerError: a model without a tokenizer (kind "ids"), or an encoding
      other than the one the spec records.
  """
  if spec.kind == "char":
    return CharTokenizer(spec.chars)
  if spec.kind == "bpe":
    if spec.name == "gpt2" and spec.fingerprint == GPT2_FINGERPRINT:
      recorded = spec.encoding_file
      if encoding_file is None and recorded and os.path.exists(recorded):
        encoding_file = recorded
      return gpt2_tokenizer(encoding_file)
    source = encoding_file or spec.encoding_file
    if not source:
      raise TokenizerError(f"the {spec.name!r} BPE encoding is recorded without a "
                           f"file; pass `encoding_file=PATH`.")
    tok = bpe_tokenizer(source, name=spec.name, pat_str=spec.pat_str,
                        special_tokens=dict(spec.special_tokens))
    if tok.fingerprint != spec.fingerprint:
      raise TokenizerError(
          f"{source} holds other merges than the {spec.name!r} encoding the model was "
          f"trained with (fingerprint {tok.fingerprint[:12]}, expected "
          f"{str(spec.fingerprint)[:12]}); pass `encoding_file=PATH` of the original file.")
    return tok
  if spec.kind == "tokenizer.json":
    return tokenizer_json.from_spec(spec, encoding_file=encoding_file)
  if spec.kind == "gguf":
    return gguf_tokenizer.from_spec(spec, encoding_file=encoding_file)
  raise TokenizerError(
      f"this model records no tokenizer, only {spec.vocab_size} ids; name one "
      f"explicitly (`tokenizer`: {', '.join(TOKENIZERS)}).")


def ids_spec(vocab_size: int) -> TokenizerSpec:
  """The spec of a model whose tokenizer is unknown: only its number of real ids."""
  return TokenizerSpec("ids", "ids", int(vocab_size))


# ----------------------------------------------------------------------------
# nanoGPT's character vocabularies


class _PlainUnpickler(pickle.Unpickler):
  """Unpickles only plain containers, strings and numbers: no code runs."""

  def find_class(self, module, name):
    raise pickle.UnpicklingError(f"meta.pkl refers to {module}.{name}; only plain "
                                 f"dicts of strings and ints are read.")


def read_nanogpt_meta(path: str) -> CharTokenizer:
  """nanoGPT's `meta.pkl` (`{"vocab_size", "itos", "stoi"}`) as a `CharTokenizer`."""
  try:
    with open(path, "rb") as f:
      meta = _PlainUnpickler(f).load()
  except FileNotFoundError:
    raise TokenizerError(f"{path} is missing.") from None
  except (pickle.UnpicklingError, EOFError, ValueError) as e:
    raise TokenizerError(f"{path} is not a readable nanoGPT meta.pkl ({e}).") from e
  itos = meta.get("itos") if isinstance(meta, dict) else None
  if not isinstance(itos, dict) or sorted(itos) != list(range(len(itos))):
    raise TokenizerError(f"{path} has no 'itos' table of ids 0..n-1; only nanoGPT's "
                          f"character vocabularies are read.")
  return CharTokenizer("".join(itos[i] for i in range(len(itos))))

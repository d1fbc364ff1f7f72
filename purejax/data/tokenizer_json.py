"""Hugging Face `tokenizer.json` files, run by the `tokenizers` library, offline.

    tok = tokenizer_json.load("path/to/model")        # a folder with tokenizer.json, or the file
    ids = tok.encode("Hello world")                   # np.ndarray int32
    text = tok.decode(ids)
    tok = tokenizer_json.from_spec(tok.spec())        # what a checkpoint stores

This is how the Llama family's models (Llama, Mistral, Qwen2, SmolLM, ...)
ship their tokenizers. The file is read from disk only: nothing is
downloaded. The spec records the file's path and its sha256, so a model is
never run with another tokenizer than the one it was trained with; a
moved file is found again through `encoding_file=`. Text is encoded without
special tokens (no BOS is prepended): a corpus is plain text. Chat templates
are not applied.
"""

import dataclasses
import functools
import hashlib
import pathlib
import re
from typing import Any, ClassVar, Optional

import numpy as np

from purejax.data.errors import TokenizerError
from purejax.data.tokenizer_spec import TokenizerSpec

FILE_NAME = "tokenizer.json"


def _import_tokenizers():
  try:
    import tokenizers  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise TokenizerError("tokenizer.json files need the tokenizers package: pip install "
                         "tokenizers.") from None
  return tokenizers


def _file_of(path: str) -> pathlib.Path:
  """`path` itself, or the `tokenizer.json` inside the folder `path`."""
  p = pathlib.Path(path).expanduser()
  if p.is_dir():
    p = p / FILE_NAME
  if not p.is_file():
    raise TokenizerError(f"{p} is missing; pass a folder holding {FILE_NAME} (a Hugging Face "
                         f"model folder) or the file itself.")
  return p


def is_tokenizer_json(path: str) -> bool:
  """Whether `path` names a tokenizer.json: a .json file other than GPT-2's
  `encoder.json`, or a folder holding `tokenizer.json`."""
  p = pathlib.Path(path).expanduser()
  if p.is_dir():  # GPT-2's own files (vocab.bpe) come first
    return (p / FILE_NAME).is_file() and not (p / "vocab.bpe").is_file()
  return p.suffix == ".json" and p.name != "encoder.json"


def fingerprint(path: pathlib.Path) -> str:
  """sha256 of the file's bytes."""
  return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class JSONTokenizer:
  """A Hugging Face `tokenizer.json`. Build it with `load`, not directly.

  Attributes:
    tokenizer: the `tokenizers.Tokenizer`.
    encoding_file: the file it was read from.
    fingerprint: sha256 of that file.
  """
  tokenizer: Any = dataclasses.field(repr=False, compare=False)
  encoding_file: str
  fingerprint: str
  name: ClassVar[str] = "tokenizer.json"

  @property
  def vocab_size(self) -> int:
    """Every id the file defines, added (special) tokens included."""
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> np.ndarray:
    """Text -> int32 ids, without special tokens (no BOS/EOS added).

    Raises:
      TokenizerError: `text` holds a byte the tokenizer has no token for (a
        byte-level BPE trained with only its corpus's bytes; some released ones,
        e.g. SmolLM2's, lack a few control characters), which the `tokenizers`
        library would drop silently.
    """
    lacking = self._lacking_bytes
    if lacking is not None and lacking.search(text.encode("utf-8")):
      chars = sorted({c for c in text if lacking.search(c.encode("utf-8"))})
      raise TokenizerError(
          f"the text holds {len(chars)} character(s) {self.encoding_file} has no tokens "
          f"for, e.g. {', '.join(map(repr, chars[:5]))} (its byte-level vocabulary lacks "
          f"their bytes, and they would be dropped silently); remove them from the text, "
          f"or use a tokenizer trained with every byte (`alphabet=bytes`).")
    return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  @property
  def _byte_level(self) -> bool:
    decoder = self.tokenizer.decoder
    return decoder is not None and "ByteLevel" in f"{type(decoder).__name__} {decoder}"

  @functools.cached_property
  def _lacking_bytes(self) -> Optional["re.Pattern[bytes]"]:
    """A byte-level BPE's bytes that have no token, as a pattern; None if it has all 256."""
    if not self._byte_level:
      return None
    vocab = self.tokenizer.get_vocab(with_added_tokens=False)
    lacking = [b for b, c in enumerate(_byte_level_alphabet()) if c not in vocab]
    return re.compile(b"[" + b"".join(re.escape(bytes([b])) for b in lacking) + b"]"
                      ) if lacking else None

  def decode(self, ids: Any) -> str:
    ids = np.asarray(ids).reshape(-1)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
      raise TokenizerError(f"token ids must be integers, got {ids.dtype}.")
    bad = ids[(ids < 0) | (ids >= self.vocab_size)]
    if bad.size:
      raise TokenizerError(
          f"token id {int(bad[0])} is outside the tokenizer's {self.vocab_size} ids (an id "
          f"of the model's padded vocabulary?); mask ids >= {self.vocab_size} when sampling.")
    return self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)

  def byte_lengths(self) -> np.ndarray:
    """`[vocab_size]` int32: the bytes each id decodes to; 0 for added special tokens.

    A byte-level BPE's token spells one byte per character (GPT-2's
    printable alphabet); a byte-fallback token `<0xHH>` is one byte; any other
    token counts the UTF-8 bytes of its decoded text.
    """
    special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()
               if t.special}
    alphabet = set(_byte_level_alphabet())
    byte_level = self._byte_level
    lengths = []
    for i in range(self.vocab_size):
      token = self.tokenizer.id_to_token(i)
      if token is None or token in special:
        lengths.append(0)
      elif byte_level and set(token) <= alphabet:
        lengths.append(len(token))
      elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        lengths.append(1)
      else:
        lengths.append(len(self.tokenizer.decode([i], skip_special_tokens=False)
                           .encode("utf-8")))
    return np.asarray(lengths, np.int32)

  def spec(self) -> TokenizerSpec:
    return TokenizerSpec("tokenizer.json", self.name, self.vocab_size,
                         fingerprint=self.fingerprint, encoding_file=self.encoding_file)


def _byte_level_alphabet() -> str:
  """GPT-2's byte-level alphabet: character `i` stands for byte value `i`."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  extra = [b for b in range(256) if b not in printable]
  chars = dict(zip(printable + extra, map(chr, printable + [256 + n for n in range(len(extra))])))
  return "".join(chars[b] for b in range(256))


def load(path: str) -> JSONTokenizer:
  """The tokenizer of `path`: a folder holding `tokenizer.json`, or the file.

  Raises:
    TokenizerError: the file is missing or not one the `tokenizers` library
      reads, or the library is not installed.
  """
  file = _file_of(path)
  tokenizers = _import_tokenizers()
  try:
    tokenizer = tokenizers.Tokenizer.from_file(str(file))
  except Exception as e:  # pylint: disable=broad-except  # the library raises plain Exceptions
    raise TokenizerError(f"{file} is not a tokenizer.json the tokenizers library reads "
                         f"({str(e).splitlines()[0][:120]}); download it again.") from e
  return JSONTokenizer(tokenizer, str(file.absolute()), fingerprint(file))


def spec_of_folder(folder: str) -> Optional[TokenizerSpec]:
  """The spec of `folder/tokenizer.json` if there is one (read and checked), else None."""
  if not (pathlib.Path(folder).expanduser() / FILE_NAME).is_file():
    return None
  return load(folder).spec()


def from_spec(spec: TokenizerSpec, *, encoding_file: Optional[str] = None) -> JSONTokenizer:
  """Rebuilds the tokenizer of `spec`, from `encoding_file` if given (a moved file).

  Raises:
    TokenizerError: the file is missing, or holds another tokenizer than the
      one the spec records.
  """
  source = encoding_file or spec.encoding_file
  if not source:
    raise TokenizerError("the tokenizer.json is recorded without a path; pass "
                         "`encoding_file=PATH` of the model's tokenizer.json.")
  try:
    tok = load(source)
  except TokenizerError as e:
    raise TokenizerError(f"{e} (the model's tokenizer; pass `encoding_file=PATH` if it "
                         f"moved)") from e
  if tok.fingerprint != spec.fingerprint:
    raise TokenizerError(
        f"{tok.encoding_file} is another tokenizer than the model was made with (sha256 "
        f"{tok.fingerprint[:12]}, expected {str(spec.fingerprint)[:12]}); pass "
        f"`encoding_file=PATH` of the original tokenizer.json.")
  return tok

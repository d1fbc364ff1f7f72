"""The tokenizer a GGUF file describes, as a `tokenizers` tokenizer, offline.

    tok = gguf_tokenizer.load("model.gguf")      # a JSONTokenizer: encode, decode, spec
    ids = tok.encode("Hello world")
    fields = gguf_tokenizer.read_fields("model.gguf")   # the file's tokenizer.* metadata

A GGUF (llama.cpp's file format) has no `tokenizer.json`: its metadata holds
the vocabulary (`tokenizer.ggml.tokens`), the merges, each token's type,
the special ids, whether a BOS is prepended, the pre-tokenizer's name and
the chat template. Two tokenizer models are rebuilt here, as transformers'
GGUF loader builds them, so both give the same ids:

- `gpt2`: a byte-level BPE (SmolLM, Qwen2, Llama 3): GPT-2's byte alphabet,
  the file's merges, the pre-tokenizer's split regex named by
  `tokenizer.ggml.pre` (GPT-2's when the name is not one of `SPLITS`);
- `llama`: a SentencePiece BPE (Llama 2, Mistral, Gemma): `▁` for spaces,
  byte fallback, merges from the file or else from the tokens' scores, and
  a `▁` before the text unless `add_space_prefix` is false (Gemma's).

Control tokens (type 3) become special tokens and user-defined ones (type 4)
added tokens, so they are matched whole in text. The spec records the file
and a fingerprint of its tokenizer metadata; the chat template, the BOS and
EOS tokens and whether to prepend BOS travel in the spec too.
"""

import collections
import dataclasses
import hashlib
import json
import pathlib
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from purejax.data import gguf_reader
from purejax.data import tokenizer_json
from purejax.data.errors import TokenizerError
from purejax.data.tokenizer_spec import TokenizerSpec

MODELS = ("gpt2", "llama")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex the vocabulary's merges were learned on.
SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
          "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
          "deepseek-r1-qwen": _QWEN2_SPLIT}

# The metadata keys a tokenizer is made of (the fingerprint's input).
_KEYS = ("model", "pre", "tokens", "token_type", "merges", "scores")


_HEADERS: "collections.OrderedDict[Tuple[str, int, int], gguf_reader.Header]" = (
    collections.OrderedDict())
_KEPT_HEADERS = 2


def read_header(path: str) -> gguf_reader.Header:
  """`path`'s header (`gguf_reader.read`: metadata, tensor table). Importing, training on
  and exporting one model read its file several times, so the last two files' headers
  are kept, each for as long as its size and modification time stay the same.

  Raises:
    TokenizerError: a missing file or not a GGUF file (one line).
  """
  file = pathlib.Path(path).expanduser()
  if not file.is_file():
    raise TokenizerError(f"{file} is missing; pass the path of a .gguf file.")
  stat = file.stat()
  key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
  if key not in _HEADERS:
    _HEADERS[key] = gguf_reader.read(str(file))
    while len(_HEADERS) > _KEPT_HEADERS:
      _HEADERS.popitem(last=False)
  _HEADERS.move_to_end(key)
  return _HEADERS[key]


def fields_of(meta: Dict[str, Any]) -> Dict[str, Any]:
  """The tokenizer part of a GGUF's metadata, as `{short name: value}`."""
  g = "tokenizer.ggml."
  fields = {key[len(g):]: value for key, value in meta.items() if key.startswith(g)}
  if "tokenizer.chat_template" in meta:
    fields["chat_template"] = meta["tokenizer.chat_template"]
  return fields


def read_fields(path: str) -> Dict[str, Any]:
  """The tokenizer metadata of the GGUF file `path` (`fields_of`)."""
  return fields_of({key: value for key, value in read_header(path).meta.items()
                    if key.startswith("tokenizer.")})


def fingerprint(fields: Dict[str, Any]) -> str:
  """sha256 of the metadata that makes the tokenizer (vocabulary, merges, types, model)."""
  values = [fields.get(key) for key in _KEYS]
  if fields.get("add_space_prefix") is False:  # it changes the ids (Gemma's files)
    values.append({"add_space_prefix": False})
  text = json.dumps(values, ensure_ascii=False, default=float)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _bytes_to_unicode() -> Dict[int, str]:
  """GPT-2's byte alphabet: each byte as a printable character."""
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


def _sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> List[tuple]:
  """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
  best score first (as transformers rebuilds them)."""
  vocab = {token: i for i, token in enumerate(tokens)}
  merges = []
  for token, score in zip(tokens, scores):
    local = [(token[:i], token[i:], score) for i in range(1, len(token))
             if token[:i] in vocab and token[i:] in vocab]
    merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(left, right) for left, right, _ in merges]


def _vocab(fields: Dict[str, Any], source: str) -> Dict[str, int]:
  """`{token as the tokenizer spells it: id}` (GPT-2's byte alphabet for a "gpt2" model).

  Raises:
    TokenizerError: no vocabulary, or a tokenizer model other than `MODELS`.
  """
  model, tokens = fields.get("model"), fields.get("tokens")
  if not tokens:
    raise TokenizerError(f"{source} holds no tokenizer (no tokenizer.ggml.tokens); use a "
                         f"GGUF converted with its tokenizer.")
  if model not in MODELS:
    raise TokenizerError(f"{source}: tokenizer.ggml.model={model!r} is not one purejax "
                         f"rebuilds ({', '.join(MODELS)}).")
  if model == "gpt2":
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    return {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)}
  return {t: i for i, t in enumerate(tokens)}


def build(fields: Dict[str, Any], source: str = "the GGUF file"):
  """The `tokenizers.Tokenizer` of a GGUF's tokenizer metadata (`fields_of`).

  Raises:
    TokenizerError: no vocabulary, or a tokenizer model other than `MODELS`.
  """
  tk = tokenizer_json._import_tokenizers()  # pylint: disable=protected-access
  vocab = _vocab(fields, source)
  model, tokens = fields.get("model"), fields.get("tokens")
  types = list(fields.get("token_type") or [])
  if model == "gpt2":
    alphabet = set(_bytes_to_unicode().values())
    merges = [tuple(m.split(" ")) for m in fields.get("merges") or []]
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, dropout=None,
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False))
    split = SPLITS.get(fields.get("pre"))
    if split is None:
      tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
      tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
          tk.pre_tokenizers.Split(tk.Regex(split), behavior="isolated"),
          tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = tk.decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a converter's mislabel.
    control_ok = lambda t: set(t) <= alphabet
  else:
    if fields.get("merges"):
      merges = [tuple(m.split(" ")) for m in fields["merges"]]
    else:
      merges = _sentencepiece_merges(tokens, fields.get("scores") or [0.0] * len(tokens))
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                     byte_fallback=True, dropout=None, unk_token=tokens[
                                         fields.get("unknown_token_id", 0)]))
    # llama.cpp prepends a space unless the file says otherwise (Gemma's: add_space_prefix false).
    prefix = bool(fields.get("add_space_prefix", True))
    tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    tok.decoder = tk.decoders.Sequence([tk.decoders.Replace("▁", " "),
                                        tk.decoders.ByteFallback(), tk.decoders.Fuse()]
                                       + ([tk.decoders.Strip(content=" ", left=1)] if prefix
                                          else []))
    control_ok = lambda t: True
  if types:
    tok.add_special_tokens([tk.AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, types)
                            if kind == CONTROL and control_ok(t)])
    tok.add_tokens([tk.AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
  return tok


def _special(fields: Dict[str, Any], key: str) -> Optional[str]:
  i = fields.get(key)
  tokens = fields.get("tokens") or []
  return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer(tokenizer_json.JSONTokenizer):
  """A GGUF file's tokenizer. Build it with `load`.

  Attributes (beyond `JSONTokenizer`'s):
    chat_template: `tokenizer.chat_template`, or None.
    bos_token, eos_token: the tokens of the file's BOS and EOS ids, or None.
    add_bos: whether llama.cpp prepends BOS to a prompt (`add_bos_token`).
  """
  chat_template: Optional[str] = None
  bos_token: Optional[str] = None
  eos_token: Optional[str] = None
  add_bos: bool = False
  name: ClassVar[str] = "gguf"

  def spec(self) -> TokenizerSpec:
    return TokenizerSpec("gguf", self.name, self.vocab_size, fingerprint=self.fingerprint,
                         encoding_file=self.encoding_file, chat_template=self.chat_template,
                         bos_token=self.bos_token, eos_token=self.eos_token,
                         add_bos=self.add_bos)


def _record(fields: Dict[str, Any], path: str) -> Dict[str, Any]:
  """What a tokenizer's spec records beside its size: the file, the fingerprint, and
  the chat fields."""
  # llama.cpp prepends BOS to a SentencePiece vocabulary that does not say otherwise.
  add_bos = bool(fields.get("add_bos_token", fields.get("model") == "llama"))
  return dict(encoding_file=str(pathlib.Path(path).expanduser().absolute()),
              fingerprint=fingerprint(fields), chat_template=fields.get("chat_template"),
              bos_token=_special(fields, "bos_token_id"),
              eos_token=_special(fields, "eos_token_id"), add_bos=add_bos)


def from_fields(fields: Dict[str, Any], path: str) -> GGUFTokenizer:
  """The tokenizer of `fields` (read from the GGUF file `path`)."""
  return GGUFTokenizer(build(fields, path), **_record(fields, path))


def spec_of_fields(fields: Dict[str, Any], path: str) -> TokenizerSpec:
  """`from_fields(fields, path).spec()` without building the tokenizer (which takes a
  262144-token SentencePiece vocabulary 2 s and 0.2 GB while its merges are derived):
  the same checks, and the same size.

  Raises:
    TokenizerError: as `build`.
  """
  vocab = _vocab(fields, path)
  # `build` adds the user-defined tokens by their own spelling: one outside the vocabulary
  # (a GPT-2 model's token spelled outside its byte alphabet) takes a new id.
  added = {t for t, kind in zip(fields["tokens"], fields.get("token_type") or [])
           if kind == USER_DEFINED and t not in vocab}
  return TokenizerSpec("gguf", GGUFTokenizer.name, len(vocab) + len(added),
                       **_record(fields, path))


def load(path: str) -> GGUFTokenizer:
  """The tokenizer of the GGUF file `path`.

  Raises:
    TokenizerError: not a GGUF file, no tokenizer in it, or one of another model.
  """
  return from_fields(read_fields(path), path)


def from_spec(spec: TokenizerSpec, *, encoding_file: Optional[str] = None) -> GGUFTokenizer:
  """Rebuilds the tokenizer of a "gguf" spec, from `encoding_file` if given (a moved file).

  Raises:
    TokenizerError: the file is missing, or holds another tokenizer than the spec's.
  """
  source = encoding_file or spec.encoding_file
  if not source:
    raise TokenizerError("the GGUF tokenizer is recorded without a path; pass "
                         "`encoding_file=PATH` of the model's .gguf file.")
  tok = load(source)
  if tok.fingerprint != spec.fingerprint:
    raise TokenizerError(
        f"{source} holds another tokenizer than the model was made with (fingerprint "
        f"{tok.fingerprint[:12]}, expected {str(spec.fingerprint)[:12]}); pass "
        f"`encoding_file=PATH` of the original .gguf file.")
  return tok

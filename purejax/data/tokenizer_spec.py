"""What a model records of its tokenizer: enough to rebuild it, as a typed value.

    spec = tokenizer.spec()                     # TokenizerSpec(kind="char", ...)
    meta["tokenizer"] = spec.to_dict()          # JSON, in a checkpoint
    spec = TokenizerSpec.from_dict(meta["tokenizer"])
    tokenizer = tokenizers.from_spec(spec)

The dict layout is the one checkpoints have always stored, so files of
every version read back.
"""

import dataclasses
import json
from typing import Any, Dict, Optional, Tuple

from purejax.data.errors import TokenizerError

# What a chat format needs of the tokenizer, recorded when the model came with it.
_CHAT_FIELDS = ("chat_template", "bos_token", "eos_token", "add_bos")

KINDS = ("char", "bpe", "tokenizer.json", "gguf", "ids")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
  """A tokenizer, as a checkpoint records it.

  Attributes:
    kind: "char" (a character vocabulary), "bpe" (a byte-level BPE),
      "tokenizer.json" (a Hugging Face tokenizer file), "gguf" (the tokenizer
      in a GGUF file's metadata), or "ids" (a model
      whose tokenizer is unknown: only its number of ids).
    name: the tokenizer's name, e.g. "char", "gpt2".
    vocab_size: number of real ids (a model's table may be larger, padded).
    chars: "char": the vocabulary, id `i` being `chars[i]`.
    fingerprint: "bpe": sha256 of the merges (`bpe_files.fingerprint`);
      "tokenizer.json": sha256 of the file; "gguf": of its tokenizer metadata
      (`gguf_tokenizer.fingerprint`).
    pat_str: "bpe": the pre-tokenizer's regex.
    special_tokens: "bpe": `(text, id)` pairs, e.g. `(("<|endoftext|>", 50256),)`.
    encoding_file: "bpe", "tokenizer.json", "gguf": the file read, if any.
    chat_template: the model's chat template (Jinja), if it came with one.
    bos_token, eos_token: the model's BOS and EOS tokens, if known.
    add_bos: whether a prompt starts with BOS (a chat format prepends it).
  """
  kind: str
  name: str
  vocab_size: int
  chars: Optional[str] = None
  fingerprint: Optional[str] = None
  pat_str: Optional[str] = None
  special_tokens: Tuple[Tuple[str, int], ...] = ()
  encoding_file: Optional[str] = None
  chat_template: Optional[str] = None
  bos_token: Optional[str] = None
  eos_token: Optional[str] = None
  add_bos: bool = False

  def __post_init__(self):
    if self.kind not in KINDS:
      raise TokenizerError(f"a tokenizer spec's kind must be one of {', '.join(KINDS)}; "
                           f"got {self.kind!r}.")
    needed = {"char": ("chars",), "bpe": ("fingerprint", "pat_str"),
              "tokenizer.json": ("fingerprint",), "gguf": ("fingerprint",), "ids": ()}[self.kind]
    missing = [name for name in needed if getattr(self, name) is None]
    if missing:
      raise TokenizerError(f"a {self.kind!r} tokenizer spec needs {', '.join(missing)}.")

  def to_dict(self) -> Dict[str, Any]:
    """The JSON-able dict a checkpoint stores (only this kind's fields)."""
    spec = {"type": self.kind, "name": self.name, "vocab_size": self.vocab_size}
    if self.kind == "char":
      spec["chars"] = self.chars
    elif self.kind == "bpe":
      spec.update(fingerprint=self.fingerprint, pat_str=self.pat_str,
                  special_tokens=dict(self.special_tokens),
                  encoding_file=self.encoding_file)
    elif self.kind in ("tokenizer.json", "gguf"):
      spec.update(fingerprint=self.fingerprint, encoding_file=self.encoding_file)
    for name in _CHAT_FIELDS:  # only when set, so older records read back unchanged
      if getattr(self, name):
        spec[name] = getattr(self, name)
    return spec

  @classmethod
  def from_dict(cls, spec: Any) -> "TokenizerSpec":
    """`to_dict`'s inverse, for a dict read from a checkpoint or a file.

    Raises:
      TokenizerError: `spec` is not a tokenizer spec.
    """
    try:
      return cls(kind=spec["type"], name=spec.get("name", spec["type"]),
                 vocab_size=int(spec["vocab_size"]), chars=spec.get("chars"),
                 fingerprint=spec.get("fingerprint"), pat_str=spec.get("pat_str"),
                 special_tokens=tuple(sorted((str(text), int(i)) for text, i in
                                             (spec.get("special_tokens") or {}).items())),
                 encoding_file=spec.get("encoding_file"),
                 **{name: spec[name] for name in _CHAT_FIELDS if spec.get(name)})
    except (KeyError, TypeError, ValueError, AttributeError, TokenizerError):
      raise TokenizerError(f"not a tokenizer spec: {json.dumps(spec, default=str)[:100]} "
                           f"(it needs 'type' ({', '.join(KINDS)}), 'vocab_size' and "
                           f"its kind's fields).") from None

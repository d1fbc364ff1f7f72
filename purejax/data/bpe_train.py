"""Training a byte-level BPE tokenizer on a corpus, with the `tokenizers` library.

    tok = bpe_train.train(texts, vocab_size=4096)                # a tokenizers.Tokenizer
    tok = bpe_train.train(texts, vocab_size=4096, split="nanochat")
    tok = bpe_train.train(texts, vocab_size=256, alphabet="corpus")  # a small corpus's own bytes
    tok.save("tok.json")            # a tokenizer.json: tokenizer_json.load("tok.json") reads it
    bpe_train.bytes_per_token(tok, texts)                        # its compression

The result is GPT-2's kind of tokenizer: text is cut into pieces by a
regex, each piece's UTF-8 bytes are mapped to 256 printable characters, and
BPE merges are learnt over them, so every string encodes (no unknown
token) and decodes back to itself. With `alphabet="corpus"` the base
tokens are only the bytes the corpus holds: a small vocabulary then spends
no rows on bytes the text never uses (Tiny Shakespeare uses 65 of the 256),
and encoding text with any other byte raises `TokenizerError`. The
`tokenizers` library's trainer (Rust) does the counting and merging; it is
already the package that runs `tokenizer.json` files (`tokenizer_json`).
"""

import contextlib
import os
import pathlib
import tempfile
from typing import Iterable, Iterator, Optional, Tuple

from purejax.data import corpus
from purejax.data import tokenizer_json
from purejax.data.errors import TokenizerError

# The pre-tokenizer's regexes. "gpt2" is GPT-2's (the `tokenizers` library's
# ByteLevel split); "nanochat" is nanochat's (karpathy/nanochat,
# nanochat/tokenizer.py): GPT-4's pattern with digits in runs of at most two,
# which it found best for small vocabularies.
NANOCHAT_SPLIT = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?"""
                  r"""[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
SPLITS = ("gpt2", "nanochat")
# The base tokens: all 256 bytes, or only those the corpus holds.
ALPHABETS = ("bytes", "corpus")
SPECIAL_TOKENS: Tuple[str, ...] = ("<|endoftext|>",)
BYTES = 256
# tokenizers' trainer stores ids as u32; larger vocabularies would not fit a model anyway.
MAX_VOCAB_SIZE = 1 << 22


def check_vocab_size(vocab_size: int, alphabet: str = "bytes") -> None:
  """Raises TokenizerError unless a byte-level BPE can have `vocab_size` tokens.

  With `alphabet="corpus"` the least size depends on the corpus; `train`
  checks it once the corpus is read.
  """
  if alphabet not in ALPHABETS:
    raise TokenizerError(f"`alphabet={alphabet}` is not one of {', '.join(ALPHABETS)}.")
  least = (BYTES if alphabet == "bytes" else 1) + len(SPECIAL_TOKENS)
  if not isinstance(vocab_size, int) or not least <= vocab_size <= MAX_VOCAB_SIZE:
    holds = (f"the {BYTES} bytes" if alphabet == "bytes" else "at least one byte")
    raise TokenizerError(
        f"`vocab_size={vocab_size}` is out of range: a byte-level BPE holds {holds} "
        f"and {', '.join(SPECIAL_TOKENS)}, so at least {least}, and at most "
        f"{MAX_VOCAB_SIZE:,}; choose e.g. 4096.")


def train(texts: Iterable[str], vocab_size: int, *, split: str = "gpt2",
          alphabet: str = "bytes"):
  """A byte-level BPE with up to `vocab_size` tokens, learnt from `texts`.

  Args:
    texts: the corpus, in chunks of any size.
    vocab_size: tokens wanted, counting the 256 bytes and `<|endoftext|>`
      (id 0). A small corpus may run out of pairs to merge first: the
      result's `get_vocab_size()` says how many it has.
    split: the pre-tokenizer, "gpt2" or "nanochat" (`NANOCHAT_SPLIT`).
    alphabet: the base tokens: "bytes" (all 256, so any text encodes) or
      "corpus" (only the bytes `texts` holds; other text cannot be encoded).

  Returns:
    A `tokenizers.Tokenizer` (`.save(path)` writes its tokenizer.json).

  Raises:
    TokenizerError: a bad `vocab_size`, `split` or `alphabet`, `texts` holds no
      text, or (alphabet "corpus") more distinct bytes than `vocab_size` leaves room for.
  """
  check_vocab_size(vocab_size, alphabet)
  if split not in SPLITS:
    raise TokenizerError(f"`split={split}` is not one of {', '.join(SPLITS)}.")
  lib = tokenizer_json._import_tokenizers()  # pylint: disable=protected-access
  tok = lib.Tokenizer(lib.models.BPE())
  byte_level = lib.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                            use_regex=split == "gpt2")
  if split == "nanochat":
    byte_level = lib.pre_tokenizers.Sequence([
        lib.pre_tokenizers.Split(lib.Regex(NANOCHAT_SPLIT), behavior="isolated"), byte_level])
  tok.pre_tokenizer = byte_level
  tok.decoder = lib.decoders.ByteLevel()
  trainer = lib.trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=0, show_progress=False,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet() if alphabet == "bytes" else [])
  seen = [0]

  def counted(chunks):
    for chunk in chunks:
      seen[0] += len(chunk)
      yield chunk

  tok.train_from_iterator(counted(texts), trainer=trainer)
  if not seen[0]:
    raise TokenizerError("the corpus holds no text; a tokenizer needs text to learn from.")
  if tok.get_vocab_size() > vocab_size:  # the trainer keeps every byte it saw
    raise TokenizerError(
        f"`vocab_size={vocab_size}` is too small for this corpus's alphabet: it holds "
        f"{tok.get_vocab_size() - len(SPECIAL_TOKENS)} distinct bytes, so at least "
        f"{tok.get_vocab_size()} with {', '.join(SPECIAL_TOKENS)}; raise it.")
  return tok


def bytes_per_token(tok, texts: Iterable[str]) -> Tuple[float, int, int]:
  """`(bytes per token, bytes, tokens)` of `texts` encoded by the `tokenizers.Tokenizer` `tok`.

  Counted in UTF-8 bytes, so tokenizers of any vocabulary compare (higher
  compresses more).
  """
  total_bytes = total_tokens = 0
  for chunk in texts:
    total_bytes += len(chunk.encode("utf-8"))
    total_tokens += len(tok.encode(chunk, add_special_tokens=False).ids)
  if not total_tokens:
    raise TokenizerError("the corpus holds no text to measure the tokenizer on.")
  return total_bytes / total_tokens, total_bytes, total_tokens


@contextlib.contextmanager
def corpus_text(dataset: str, *, tfds_data_dir: Optional[str] = None,
                tfds_manual_dir: Optional[str] = None) -> Iterator[Iterator[str]]:
  """The text `corpus.load_corpus(dataset)` trains on, as chunks of `str`, read by its own readers.

  A .txt file or a folder of them is its whole text (`load_corpus` keeps
  the last tenth of its tokens for validation); a TFDS dataset gives its
  train split.

  Yields:
    An iterator of text chunks, valid inside the `with`.

  Raises:
    CorpusError: `dataset` is missing, empty, or already token ids (a nanoGPT
      folder).
  """
  # pylint: disable=protected-access  # corpus's readers, so the text is what it tokenizes
  path = pathlib.Path(dataset).expanduser()
  if not path.exists():
    if dataset.endswith((".txt", ".bin", os.sep)) or dataset.startswith((os.sep, ".", "~")):
      raise corpus.CorpusError(f"`dataset={dataset}` does not exist; pass an existing .txt "
                               f"file or folder, or a TFDS name.")
    source = corpus._tfds_source(dataset, tfds_data_dir, tfds_manual_dir)
  elif path.is_dir() and any((path / f).exists() for f in ("train.bin", "val.bin")):
    raise corpus.CorpusError(f"`dataset={dataset}` is a nanoGPT folder of token ids, not "
                             f"text; pass the text it was made from (a .txt file or folder).")
  else:
    source = corpus._file_source(path)
  with tempfile.TemporaryDirectory() as scratch, source.open(pathlib.Path(scratch)) as parts:
    yield corpus._text_chunks(parts[0])

"""Bring your own corpus: text files, nanoGPT `.bin` folders or TFDS text, as token ids.

    corpus = load_corpus("tiny_shakespeare")             # TFDS, or the embedded copy
    corpus = load_corpus("notes/", tokenizer="gpt2")     # a folder of .txt files
    corpus = load_corpus("nanoGPT/data/openwebtext")     # train.bin + val.bin (+ meta.pkl)
    corpus.train, corpus.val, corpus.tokenizer, corpus.source

Text (files or TFDS) is tokenized once into `cache_dir` and read back with
`np.memmap` afterwards; the cache file is named by a hash of the text (or of
the TFDS dataset's name and version) and of the tokenizer, so a changed file
or another tokenizer re-tokenizes. Corpora too large for the device
(`fits_on_device`) are sampled on the host: `batches.sample_windows`,
`batches.BatchPrefetcher`.
"""

import codecs
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import tempfile
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from purejax import _files
from purejax.data import batches
from purejax.data import datasets
from purejax.data import tokenize_files
from purejax.data import tokenizers
from purejax.data.tokenizer_spec import TokenizerSpec

SHAKESPEARE = "tiny_shakespeare"
TRAIN_FRACTION = 0.9  # nanoGPT's split of a single text
DEVICE_BYTES = 256 << 20  # `fits_on_device`'s default budget for both splits
_CACHE_FORMAT = 1  # bump when the cache layout changes, so old files are not read
_BLOCK_BYTES = 1 << 20
_MAX_ID_CHUNK = 1 << 24  # ids per read when checking a .bin (32 MiB of uint16)

Piece = Union[pathlib.Path, bytes]  # a text file, or text already in memory


class CorpusError(ValueError):
  """A corpus that cannot be loaded; the message says what to change."""


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
  """A tokenized corpus split for language modelling.

  Attributes:
    tokenizer: turns text into these ids and back; `tokenizer.spec()` is
      what a checkpoint stores.
    train: `[n_train]` token ids, uint16 (vocabularies up to 65536) or int32;
      an `np.memmap` when read from disk.
    val: `[n_val]` token ids, same dtype.
    source: one line for the log.
    name: the dataset's short name: the TFDS name, or the name of the file
      (without suffix) or folder; a checkpoint records it (nanoGPT looks for a
      model's vocabulary in `data/<name>/meta.pkl`).
  """
  tokenizer: tokenizers.Tokenizer
  train: np.ndarray
  val: np.ndarray
  source: str
  name: str = ""

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.vocab_size

  def check_block_size(self, block_size: int) -> None:
    """Raises ValueError where a window of `block_size + 1` tokens does not fit a split."""
    if block_size >= min(len(self.train), len(self.val)):
      raise ValueError(f"`block_size={block_size}` must be shorter than the validation "
                       f"text ({len(self.val)} tokens) and the training text "
                       f"({len(self.train)} tokens).")

  def on_device(self) -> bool:
    """Whether its batches are drawn on the device (`fits_on_device`), not read by the host."""
    return fits_on_device(self)

  def sample_prompt(self) -> Tuple[str, None]:
    """What a run's closing sample continues (a new line, as nanoGPT's), with no
    stop id."""
    return "\n", None

  def byte_lengths(self) -> Optional[np.ndarray]:
    """`[vocab]` UTF-8 bytes per id, for bits per byte (`tokenizers.byte_lengths`)."""
    return tokenizers.byte_lengths(self.tokenizer)

  def feed(self, put: Callable, *, block_size: int, batch_size: int, eval_batches: int,
           seed: int, start_step: int, end_step: int,
           steps_per_call: Callable[[int], int]) -> batches.Feed:
    """Its batches for a training loop: both splits on every device (`put`) where they
    fit (`batches.device_feed`), else windows read by the host one call ahead
    (`batches.host_feed`, with the loop's call lengths `steps_per_call`)."""
    if self.on_device():
      return batches.device_feed(self.train, self.val, put)
    return batches.host_feed(
        self.train, self.val, put, block_size=block_size, batch_size=batch_size,
        eval_batches=eval_batches, seed=seed, start_step=start_step, end_step=end_step,
        steps_per_call=steps_per_call)


def default_cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("PUREJAX_CACHE_DIR") or "~/.cache/purejax").expanduser()


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 while every id fits (halves disk and transfers), else int32."""
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


# ----------------------------------------------------------------------------
# Where the text comes from


@dataclasses.dataclass(frozen=True)
class _TextSource:
  """Text to tokenize.

  Attributes:
    name: short name for the cache file.
    label: how the log names the source.
    key: identifies the text (a content hash, or a TFDS dataset's version).
    open: context manager factory `open(scratch_dir)` giving `(train, val)`
      lists of pieces (joined with "\\n"); `val` None: split the tokens 90/10.
  """
  name: str
  label: str
  key: Dict[str, Any]
  open: Any


def _blocks(pieces: List[Piece]) -> Iterator[bytes]:
  """The pieces joined with "\\n", as byte blocks."""
  for i, piece in enumerate(pieces):
    if i:
      yield b"\n"
    if isinstance(piece, bytes):
      yield piece
      continue
    with open(piece, "rb") as f:
      yield from iter(lambda f=f: f.read(_BLOCK_BYTES), b"")


def _text_chunks(pieces: List[Piece]) -> Iterator[str]:
  """The joined text in pieces cut where BPE encodes apart as together (see tokenize_files)."""
  buf = b""
  for block in _blocks(pieces):
    start = max(len(buf) - 2, 0)  # earlier cut points were rejected already
    buf += block
    cut = tokenize_files.last_safe_cut(buf, start)
    if cut is not None:
      yield buf[:cut].decode("utf-8")
      buf = buf[cut:]
  if buf:
    yield buf.decode("utf-8")


def _hash_files(files: List[pathlib.Path]) -> str:
  """sha256 of the files joined with "\\n"; checks each is UTF-8 on the way."""
  sha = hashlib.sha256()
  for i, path in enumerate(files):
    sha.update(b"\n" if i else b"")
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    try:
      for block in _blocks([path]):
        sha.update(block)
        decoder.decode(block)
        offset += len(block)
      decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
      raise CorpusError(f"{path} is not UTF-8 text ({e.reason} near byte {offset + e.start}); "
                        f"convert it to UTF-8.") from None
  return sha.hexdigest()


def _file_source(path: pathlib.Path) -> _TextSource:
  """A .txt file, or a folder of .txt files joined in name order."""
  if path.is_file():
    files, label = [path], f"{path} (text)"
  else:
    files = sorted((p for p in path.glob("*.txt") if p.is_file()), key=lambda p: p.name)
    if not files:
      has = "is an empty folder" if not any(path.iterdir()) else "has no .txt files"
      raise CorpusError(f"`dataset={path}` {has} and no nanoGPT train.bin + val.bin; put "
                        f".txt files (or train.bin and val.bin) there.")
    label = f"{path} ({len(files)} .txt files)"
  if all(p.stat().st_size == 0 for p in files):
    raise CorpusError(f"`dataset={path}` is empty; it needs text to train on.")
  key = {"text_sha256": _hash_files(files)}
  return _TextSource(path.stem or path.name, label, key,
                     lambda scratch: contextlib.nullcontext((files, None)))


def _tfds_source(name: str, data_dir: Optional[str], manual_dir: Optional[str]) -> _TextSource:
  """A TFDS dataset's text; tiny_shakespeare falls back to the embedded copy without TFDS."""
  if manual_dir is not None and not pathlib.Path(manual_dir).expanduser().is_dir():
    raise CorpusError(f"`tfds_manual_dir={manual_dir}` does not exist; point it at the folder "
                      f"holding {name}'s original files, or drop it.")
  try:
    # TFDS imports without TensorFlow (a stock JAX image) but cannot read data then.
    if importlib.util.find_spec("tensorflow") is None:
      raise ImportError("tensorflow")
    tfds = datasets._import_tfds()  # pylint: disable=protected-access
  except ImportError:
    if name != SHAKESPEARE:
      raise CorpusError(f"`dataset={name}` is not an existing file or folder, and TFDS names "
                        f"need tensorflow-datasets and tensorflow (not installed): pip install "
                        f"tensorflow-datasets tensorflow-cpu, or pass a path.") from None
    train, val = (t.encode("utf-8") for t in datasets.shakespeare_texts(manual_dir))
    key = {"split_text_sha256": [hashlib.sha256(t).hexdigest() for t in (train, val)]}
    return _TextSource(SHAKESPEARE, f"{SHAKESPEARE} (embedded text; TFDS not installed)", key,
                       lambda scratch: contextlib.nullcontext(([train], [val])))
  try:  # registered datasets are looked up locally: no network
    builder = tfds.builder(name, data_dir=data_dir)
  except ValueError as e:  # DatasetNotFoundError, or a malformed name
    raise CorpusError(f"`dataset={name}` is neither an existing file or folder nor a TFDS "
                      f"dataset ({str(e).splitlines()[0]}); pass a .txt file, a folder of "
                      f".txt files, a nanoGPT folder or a TFDS name.") from None
  feature = datasets.tfds_text_feature(builder.info.features, name)
  if manual_dir is None and builder.name == SHAKESPEARE:
    manual_dir = str(datasets.EMBEDDED_SHAKESPEARE_DIR)  # the package's copy: offline

  @contextlib.contextmanager
  def open_parts(scratch: pathlib.Path):
    datasets.load_tfds_splits(name, (), data_dir=data_dir, manual_dir=manual_dir)  # prepares
    prepared = tfds.builder(name, data_dir=data_dir)  # its splits are known only now
    parts = datasets.tfds_text_splits(prepared.name, prepared.info.splits)
    files = []
    try:
      for splits in parts:
        with tempfile.NamedTemporaryFile("wb", dir=scratch, prefix=f"{prepared.name}-text-",
                                         suffix=".tmp", delete=False) as f:
          files.append(pathlib.Path(f.name))
          datasets.write_tfds_text(prepared, splits, feature, f)
      yield [files[0]], [files[1]]
    finally:
      for path in files:
        path.unlink(missing_ok=True)

  # A TFDS version's data never changes: its full name identifies the text.
  key = {"tfds": builder.info.full_name, "feature": feature}
  return _TextSource(builder.name, f"{name} (TFDS)", key, open_parts)


# ----------------------------------------------------------------------------
# Tokenizing, through the cache


def _check_tokenizer(tokenizer, tokenizer_file: Optional[str]) -> None:
  """Rejects a bad tokenizer argument before any slow work."""
  if isinstance(tokenizer, str) and tokenizer not in tokenizers.TOKENIZERS:
    raise tokenizers.TokenizerError(f"unknown tokenizer {tokenizer!r}; choose one of: "
                                    f"{', '.join(tokenizers.TOKENIZERS)}.")
  if not (tokenizer is None or isinstance(tokenizer, (str, tokenizers.Tokenizer))):
    raise CorpusError(f"tokenizer must be a name ({', '.join(tokenizers.TOKENIZERS)}) or a "
                      f"Tokenizer, got {type(tokenizer).__name__}.")
  if tokenizer_file is not None and not (tokenizer is None or tokenizer == "gpt2"):
    raise CorpusError(f"`tokenizer_file` applies to `tokenizer=gpt2`, not {tokenizer!r}; "
                      f"drop one of them.")


def _resolve_tokenizer(tokenizer, tokenizer_file: Optional[str]) -> Optional[tokenizers.Tokenizer]:
  """The tokenizer asked for (a file implies "gpt2"); None for "char", built from the text."""
  if isinstance(tokenizer, tokenizers.Tokenizer):
    return tokenizer
  if (tokenizer or ("gpt2" if tokenizer_file else "char")) == "char":
    return None
  return tokenizers.gpt2_tokenizer(tokenizer_file)


def _cache_paths(cache_dir: pathlib.Path, source: _TextSource,
                 tok_key) -> Tuple[pathlib.Path, pathlib.Path]:
  """`<name>-<hash>.tokens` and its `.json` sidecar; the hash covers text and tokenizer."""
  material = json.dumps({"format": _CACHE_FORMAT, "text": source.key, "tokenizer": tok_key},
                        sort_keys=True)
  digest = hashlib.sha256(material.encode()).hexdigest()[:16]
  stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", source.name)[:64] + "-" + digest
  return cache_dir / (stem + ".tokens"), cache_dir / (stem + ".json")


def _read_cache(tokens_path: pathlib.Path, meta_path: pathlib.Path):
  """`(spec, train, val)` memmaps, or None when the cache is missing or incomplete."""
  try:
    meta = json.loads(meta_path.read_text())
    dtype, n_train, n_val = np.dtype(meta["dtype"]), meta["train_tokens"], meta["val_tokens"]
    if tokens_path.stat().st_size != (n_train + n_val) * dtype.itemsize:
      return None
    TokenizerSpec.from_dict(meta["tokenizer"])
  except (OSError, ValueError, KeyError, TypeError, tokenizers.TokenizerError):
    return None
  ids = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(n_train + n_val,))
  return TokenizerSpec.from_dict(meta["tokenizer"]), ids[:n_train], ids[n_train:]


def _encode(tok, pieces: List[Piece], progress: Optional[bool]) -> np.ndarray:
  total = sum(len(p) if isinstance(p, bytes) else p.stat().st_size for p in pieces)
  return tokenize_files.encode_chunks(tok, _text_chunks(pieces), progress=progress,
                                      total_chars=total)


def _tokenize(source: _TextSource, tok, scratch: pathlib.Path, progress: Optional[bool]):
  """`(tokenizer, train ids, val ids)` of the source's text."""
  with source.open(scratch) as (train_pieces, val_pieces):
    pieces = train_pieces + (val_pieces or [])
    if tok is None:  # "char": the characters of the whole text, train and val
      chars = set()
      for chunk in _text_chunks(pieces):
        chars.update(chunk)
      tok = tokenizers.CharTokenizer("".join(sorted(chars)))
    if val_pieces is None:
      ids = _encode(tok, train_pieces, progress)
      cut = int(len(ids) * TRAIN_FRACTION)
      train, val = ids[:cut], ids[cut:]
    else:
      train, val = _encode(tok, train_pieces, progress), _encode(tok, val_pieces, progress)
  if not len(train) or not len(val):
    raise CorpusError(f"{source.label} is too short to split: {len(train)} train and "
                      f"{len(val)} val tokens; give it more text.")
  return tok, train, val


def _text_corpus(source: _TextSource, tok, cache_dir: pathlib.Path,
                 progress: Optional[bool]) -> Corpus:
  # An explicit tokenizer is known by its spec (not where its file was read);
  # "char" by its rule, the characters being a function of the text.
  tok_key = ({"type": "char", "from": "text"} if tok is None else
             {k: v for k, v in tok.spec().to_dict().items() if k != "encoding_file"})
  tokens_path, meta_path = _cache_paths(cache_dir, source, tok_key)
  cached = _read_cache(tokens_path, meta_path)
  if cached is None:
    try:
      cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise CorpusError(f"cannot create the token cache {cache_dir} ({e.strerror}); pass "
                        f"`cache_dir=DIR` or set PUREJAX_CACHE_DIR.") from None
    built, train, val = _tokenize(source, tok, cache_dir, progress)
    dtype = token_dtype(built.vocab_size)
    meta = {"format": _CACHE_FORMAT, "source": source.label, "tokenizer": built.spec().to_dict(),
            "dtype": dtype.name, "train_tokens": len(train), "val_tokens": len(val)}
    # The sidecar goes last: it marks the ids complete.
    _files.atomic_write_bytes(tokens_path, np.concatenate([train, val]).astype(dtype).tobytes())
    _files.atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())
    cached = _read_cache(tokens_path, meta_path)
  spec, train, val = cached
  tok = tok if tok is not None else tokenizers.from_spec(spec)
  return Corpus(tok, train, val, _source_line(source.label, tok, train, val))


def _source_line(label: str, tok, train, val) -> str:
  return f"{label}, {tok.name}, {len(train):,} train / {len(val):,} val tokens"


# ----------------------------------------------------------------------------
# nanoGPT folders: train.bin / val.bin (+ meta.pkl)


def _bin_tokenizer(folder: pathlib.Path, tokenizer, tokenizer_file) -> tokenizers.Tokenizer:
  """meta.pkl's characters, else GPT-2 (nanoGPT's convention); a given one must agree."""
  meta = folder / "meta.pkl"
  if not meta.is_file():
    if tokenizer == "char":
      raise CorpusError(f"{folder} has no meta.pkl, so its ids are GPT-2 BPE (nanoGPT's "
                        f"convention), not characters; drop `tokenizer=char`.")
    return _resolve_tokenizer(tokenizer or "gpt2", tokenizer_file)
  chars = tokenizers.read_nanogpt_meta(str(meta))
  if isinstance(tokenizer, tokenizers.Tokenizer):
    if isinstance(tokenizer, tokenizers.CharTokenizer) and tokenizer.chars == chars.chars:
      return chars
    raise CorpusError(f"the tokenizer {tokenizer.name!r} ({tokenizer.vocab_size} ids) "
                      f"disagrees with {meta} ({chars.vocab_size} characters); use the "
                      f"model trained on this data, or drop the tokenizer.")
  if tokenizer == "gpt2" or tokenizer_file is not None:
    raise CorpusError(f"{meta} makes {folder} a character corpus ({chars.vocab_size} ids), "
                      f"not GPT-2's; drop `tokenizer` and `tokenizer_file`.")
  return chars


def _read_bin(path: pathlib.Path, vocab_size: int) -> np.memmap:
  """A .bin of uint16 ids as a memmap, its ids checked in chunks against the vocabulary."""
  size = path.stat().st_size
  if size == 0 or size % 2:
    what = "is empty" if size == 0 else f"has an odd size ({size} bytes)"
    raise CorpusError(f"{path} {what}; nanoGPT's .bin files hold uint16 token ids.")
  ids = np.memmap(path, dtype=np.uint16, mode="r")
  top = max(int(ids[i:i + _MAX_ID_CHUNK].max()) for i in range(0, len(ids), _MAX_ID_CHUNK))
  if top >= vocab_size:
    raise CorpusError(f"{path} holds token id {top}, past the tokenizer's vocabulary of "
                      f"{vocab_size}; it was made with another tokenizer: pass that one.")
  return ids


def _bin_corpus(folder: pathlib.Path, tokenizer, tokenizer_file) -> Corpus:
  tok = _bin_tokenizer(folder, tokenizer, tokenizer_file)
  train, val = (_read_bin(folder / f, tok.vocab_size) for f in ("train.bin", "val.bin"))
  return Corpus(tok, train, val, _source_line(f"{folder} (nanoGPT .bin)", tok, train, val))


# ----------------------------------------------------------------------------
# The one entry point


def load_corpus(
    dataset: str = SHAKESPEARE,
    *,
    tokenizer: Optional[Union[str, tokenizers.Tokenizer]] = None,
    tokenizer_file: Optional[str] = None,
    cache_dir: Optional[str] = None,
    tfds_data_dir: Optional[str] = None,
    tfds_manual_dir: Optional[str] = None,
    progress: Optional[bool] = None,
) -> Corpus:
  """Loads a corpus as train and val token ids.

  Args:
    dataset: a `.txt` file; a folder of `.txt` files (joined in name order
      with "\\n"); a nanoGPT folder with `train.bin` + `val.bin` (uint16 ids,
      GPT-2's unless a `meta.pkl` gives characters); or a TFDS dataset with a
      text feature (e.g. "tiny_shakespeare", read from the package's own copy
      when TFDS is not installed). Text files split 90/10 by tokens; TFDS
      datasets by their own splits.
    tokenizer: None for the source's own ("char" for text, meta.pkl or GPT-2
      for .bin folders); "char" (the characters of the whole text) or "gpt2";
      or a `Tokenizer`, e.g. a checkpoint's (`tokenizers.from_spec`).
    tokenizer_file: GPT-2's encoding files, for "gpt2" offline.
    cache_dir: where tokenized text is kept (default `$PUREJAX_CACHE_DIR`,
      else `~/.cache/purejax`).
    tfds_data_dir: TFDS's data dir (TFDS datasets only).
    tfds_manual_dir: folder with a TFDS dataset's original files.
    progress: tqdm bar while tokenizing; default only when stderr is a terminal.

  Returns:
    `Corpus`.

  Raises:
    CorpusError: unknown or empty dataset, misplaced flags, ids past the
      vocabulary, text too short (all ValueErrors).
    tokenizers.TokenizerError: unknown tokenizer, characters it lacks.
    datasets.DataUnavailableError: TFDS data that cannot be had offline.
  """
  path = pathlib.Path(dataset).expanduser()
  name = path.stem if path.is_file() else path.name if path.exists() else dataset
  return dataclasses.replace(_load(dataset, tokenizer, tokenizer_file, cache_dir,
                                   tfds_data_dir, tfds_manual_dir, progress), name=name)


def _load(dataset, tokenizer, tokenizer_file, cache_dir, tfds_data_dir, tfds_manual_dir,
          progress) -> Corpus:
  _check_tokenizer(tokenizer, tokenizer_file)
  cache = pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
  path = pathlib.Path(dataset).expanduser()
  if not path.exists():
    if dataset.endswith((".txt", ".bin", os.sep)) or dataset.startswith((os.sep, ".", "~")):
      raise CorpusError(f"`dataset={dataset}` does not exist; pass an existing .txt file or "
                        f"folder, or a TFDS name.")
    tok = _resolve_tokenizer(tokenizer, tokenizer_file)  # before TFDS's slow import
    return _text_corpus(_tfds_source(dataset, tfds_data_dir, tfds_manual_dir), tok, cache,
                        progress)
  for flag, value in (("tfds_data_dir", tfds_data_dir), ("tfds_manual_dir", tfds_manual_dir)):
    if value is not None:
      raise CorpusError(f"`{flag}` has no effect on `dataset={dataset}` (a path, not a TFDS "
                        f"dataset); drop it.")
  if path.is_dir() and (path / "train.bin").is_file() and (path / "val.bin").is_file():
    return _bin_corpus(path, tokenizer, tokenizer_file)
  if path.is_dir() and any((path / f).exists() for f in ("train.bin", "val.bin")):
    raise CorpusError(f"{path} needs both train.bin and val.bin (nanoGPT's layout); one is "
                      f"missing.")
  tok = _resolve_tokenizer(tokenizer, tokenizer_file)
  return _text_corpus(_file_source(path), tok, cache, progress)


def fits_on_device(corpus: Corpus, max_bytes: int = DEVICE_BYTES) -> bool:
  """Whether both splits, in their stored dtype, fit in `max_bytes`: sample on the device.

  Otherwise draw batches on the host: `batches.sample_windows`, `batches.BatchPrefetcher`.
  """
  return corpus.train.nbytes + corpus.val.nbytes <= max_bytes

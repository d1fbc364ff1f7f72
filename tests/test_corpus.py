"""corpus: text files, nanoGPT folders, TFDS text and its offline fallback; host batches.

Offline: the `no_network` fixture (helpers/data.py), used by every test, fails any test
that opens a connection. The BPE tests use the tests' tiny encoding (helpers/data.py).
"""

import pickle
import sys
import types

import numpy as np
import pytest

from purejax.data import corpus
from purejax.data import datasets
from purejax.data import tokenize_files
from purejax.data import tokenizers
from helpers.data import SHAKESPEARE, tiny_ranks, write_tiktoken_file

pytestmark = pytest.mark.usefixtures("no_network")

TEXT = SHAKESPEARE[:3000]


@pytest.fixture
def tiny(tmp_path):
  path = write_tiktoken_file(tmp_path / "tiny.tiktoken", tiny_ranks())
  return tokenizers.bpe_tokenizer(str(path), name="tiny")


@pytest.fixture
def encode_calls(monkeypatch):
  """Counts tokenizing passes (each `encode_chunks` call)."""
  calls = []
  real = tokenize_files.encode_chunks

  def counting(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)

  monkeypatch.setattr(tokenize_files, "encode_chunks", counting)
  return calls


def load(dataset, tmp_path, **kwargs):
  return corpus.load_corpus(str(dataset), cache_dir=str(tmp_path / "cache"), **kwargs)


def write_nanogpt(folder, train, val, chars=None):
  """train.bin / val.bin as nanoGPT's prepare.py writes them, and meta.pkl for characters."""
  folder.mkdir(parents=True, exist_ok=True)
  np.asarray(train, np.uint16).tofile(folder / "train.bin")
  np.asarray(val, np.uint16).tofile(folder / "val.bin")
  if chars is not None:
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)),
            "stoi": {c: i for i, c in enumerate(chars)}}
    with open(folder / "meta.pkl", "wb") as f:
      pickle.dump(meta, f)
  return folder


# ----------------------------------------------------------------------------
# Text files


def test_txt_file_is_split_90_10_by_tokens_with_char_vocab(tmp_path):
  (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
  c = load(tmp_path / "a.txt", tmp_path)
  assert isinstance(c.tokenizer, tokenizers.CharTokenizer)
  assert c.tokenizer.chars == "".join(sorted(set(TEXT))) and c.vocab_size == len(set(TEXT))
  assert len(c.train) == int(len(TEXT) * 0.9) and len(c.train) + len(c.val) == len(TEXT)
  assert c.tokenizer.decode(c.train) + c.tokenizer.decode(c.val) == TEXT
  assert isinstance(c.train, np.memmap) and c.train.dtype == np.uint16
  assert c.source == f"{tmp_path / 'a.txt'} (text), char, 2,700 train / 300 val tokens"
  assert c.name == "a"  # what a checkpoint records as the dataset


def test_folder_of_txt_files_joined_in_name_order(tmp_path):
  folder = tmp_path / "docs"
  folder.mkdir()
  (folder / "b.txt").write_text("second file", encoding="utf-8")
  (folder / "a.txt").write_text("first file", encoding="utf-8")
  (folder / "notes.md").write_text("not text for us", encoding="utf-8")
  c = load(folder, tmp_path)
  whole = c.tokenizer.decode(np.concatenate([c.train, c.val]))
  assert whole == "first file\nsecond file"
  assert "(2 .txt files)" in c.source


def test_cache_is_reused_and_redone_when_text_or_tokenizer_change(tmp_path, tiny, encode_calls):
  path = tmp_path / "a.txt"
  path.write_text(TEXT, encoding="utf-8")
  first = load(path, tmp_path)
  assert len(encode_calls) == 1  # tokenized once (train and val split after)
  again = load(path, tmp_path)
  assert len(encode_calls) == 1  # read from the cache
  assert again.train.filename == first.train.filename
  np.testing.assert_array_equal(again.train, first.train)
  assert again.tokenizer == first.tokenizer

  path.write_text(TEXT + " more", encoding="utf-8")
  changed = load(path, tmp_path)
  assert len(encode_calls) == 2 and changed.train.filename != first.train.filename
  load(path, tmp_path, tokenizer=tiny)
  assert len(encode_calls) == 3
  load(path, tmp_path, tokenizer=tiny)
  assert len(encode_calls) == 3
  # Same content elsewhere shares the cache: it is named by content, not path.
  (tmp_path / "copy").mkdir()
  (tmp_path / "copy" / "a.txt").write_text(TEXT + " more", encoding="utf-8")
  assert load(tmp_path / "copy" / "a.txt", tmp_path).train.filename == changed.train.filename
  assert len(encode_calls) == 3


def test_half_written_cache_is_never_read(tmp_path, encode_calls):
  path = tmp_path / "a.txt"
  path.write_text(TEXT, encoding="utf-8")
  first = load(path, tmp_path)
  tokens = first.train.filename
  del first
  with open(tokens, "r+b") as f:  # as if a crash had cut the file short
    f.truncate(100)
  again = load(path, tmp_path)
  assert len(encode_calls) == 2 and len(again.train) + len(again.val) == len(TEXT)
  assert not list((tmp_path / "cache").glob("*.tmp"))  # temp files renamed or removed


def test_bpe_tokenizer_gives_its_ids_across_many_chunks(tmp_path, tiny, monkeypatch):
  monkeypatch.setattr(corpus, "_BLOCK_BYTES", 64)  # many pieces, cut at safe newlines
  folder = tmp_path / "plays"
  folder.mkdir()
  (folder / "1.txt").write_text(TEXT[:1500], encoding="utf-8")
  (folder / "2.txt").write_text(TEXT[1500:], encoding="utf-8")
  c = load(folder, tmp_path, tokenizer=tiny)
  expected = tiny.encode(TEXT[:1500] + "\n" + TEXT[1500:])
  cut = int(len(expected) * 0.9)
  np.testing.assert_array_equal(c.train, expected[:cut])
  np.testing.assert_array_equal(c.val, expected[cut:])
  assert c.tokenizer is tiny and c.train.dtype == np.uint16
  assert ", tiny, " in c.source


def test_progress_bar_only_when_asked(tmp_path, capfd):
  (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
  load(tmp_path / "a.txt", tmp_path, progress=True)
  assert "tokenizing" in capfd.readouterr().err


def test_given_char_tokenizer_lacking_characters_is_its_error(tmp_path):
  (tmp_path / "a.txt").write_text("hello world", encoding="utf-8")
  with pytest.raises(tokenizers.TokenizerError, match=r"\['d', 'r', 'w'\] are not in the model's"):
    load(tmp_path / "a.txt", tmp_path, tokenizer=tokenizers.CharTokenizer("helo "))


def test_token_dtype_widens_past_65536_ids():
  assert corpus.token_dtype(65536) == np.uint16 and corpus.token_dtype(65537) == np.int32


# ----------------------------------------------------------------------------
# nanoGPT folders


def test_nanogpt_folder_with_meta_pkl_is_a_char_corpus(tmp_path):
  folder = write_nanogpt(tmp_path / "shakespeare_char", [0, 1, 2, 3, 2, 1], [3, 0], chars="\n ab")
  c = load(folder, tmp_path)
  assert c.tokenizer == tokenizers.CharTokenizer("\n ab")
  assert isinstance(c.train, np.memmap) and c.train.dtype == np.uint16
  np.testing.assert_array_equal(c.train, [0, 1, 2, 3, 2, 1])
  assert c.tokenizer.decode(c.val) == "b\n"
  assert c.source.endswith("(nanoGPT .bin), char, 6 train / 2 val tokens")
  assert c.name == "shakespeare_char"  # nanoGPT's data/<name>/meta.pkl
  same = load(folder, tmp_path, tokenizer=tokenizers.CharTokenizer("\n ab"))
  assert same.vocab_size == 4


def test_nanogpt_folder_without_meta_is_gpt2(tmp_path, monkeypatch):
  asked = []

  def fake_gpt2(encoding_file=None):
    asked.append(encoding_file)
    return types.SimpleNamespace(name="gpt2", vocab_size=tokenizers.GPT2_VOCAB_SIZE)

  monkeypatch.setattr(tokenizers, "gpt2_tokenizer", fake_gpt2)
  folder = write_nanogpt(tmp_path / "owt", [50256, 15496, 995], [11])
  c = load(folder, tmp_path, tokenizer_file="/x/gpt2")
  assert asked == ["/x/gpt2"] and c.vocab_size == 50257
  np.testing.assert_array_equal(c.train, [50256, 15496, 995])


def test_nanogpt_ids_past_the_vocabulary_name_file_id_and_vocab(tmp_path, tiny, monkeypatch):
  monkeypatch.setattr(corpus, "_MAX_ID_CHUNK", 3)  # the bad id sits in a later chunk
  ids = [1, 2, 3, 4, 5, 6, tiny.vocab_size + 4, 7]
  folder = write_nanogpt(tmp_path / "ids", ids, [1])
  with pytest.raises(corpus.CorpusError) as e:
    load(folder, tmp_path, tokenizer=tiny)
  message = str(e.value)
  assert "train.bin" in message and str(tiny.vocab_size + 4) in message
  assert f"vocabulary of {tiny.vocab_size}" in message and "\n" not in message


def test_nanogpt_tokenizer_must_agree_with_meta_pkl(tmp_path, tiny):
  folder = write_nanogpt(tmp_path / "chars", [0, 1], [1], chars="ab")
  with pytest.raises(corpus.CorpusError, match="disagrees with .*meta.pkl"):
    load(folder, tmp_path, tokenizer=tiny)
  with pytest.raises(corpus.CorpusError, match="disagrees with .*meta.pkl"):
    load(folder, tmp_path, tokenizer=tokenizers.CharTokenizer("abc"))
  with pytest.raises(corpus.CorpusError, match="a character corpus .* drop `tokenizer`"):
    load(folder, tmp_path, tokenizer="gpt2")
  bare = write_nanogpt(tmp_path / "bare", [0, 1], [1])
  with pytest.raises(corpus.CorpusError, match="no meta.pkl, so its ids are GPT-2 BPE"):
    load(bare, tmp_path, tokenizer="char")


def test_nanogpt_bad_bin_files(tmp_path, tiny):
  folder = write_nanogpt(tmp_path / "odd", [1, 2], [1])
  (folder / "val.bin").write_bytes(b"\x01\x00\x02")
  with pytest.raises(corpus.CorpusError, match=r"val.bin has an odd size \(3 bytes\)"):
    load(folder, tmp_path, tokenizer=tiny)
  (folder / "val.bin").write_bytes(b"")
  with pytest.raises(corpus.CorpusError, match="val.bin is empty"):
    load(folder, tmp_path, tokenizer=tiny)
  (folder / "val.bin").unlink()
  with pytest.raises(corpus.CorpusError, match="needs both train.bin and val.bin"):
    load(folder, tmp_path, tokenizer=tiny)


# ----------------------------------------------------------------------------
# TFDS, and Tiny Shakespeare without it


@pytest.mark.slow
def test_embedded_shakespeare_equals_tfds_without_tfds(tfds_data_dir, tmp_path, monkeypatch):
  splits = datasets.load_tfds_splits("tiny_shakespeare", ("train", "validation", "test"),
                                 data_dir=tfds_data_dir,
                                 manual_dir=str(datasets.EMBEDDED_SHAKESPEARE_DIR))
  text = {s: splits[s]["text"][0].decode("utf-8") for s in splits}
  assert datasets.shakespeare_texts() == (text["train"], text["validation"] + text["test"])

  with_tfds = corpus.load_corpus(cache_dir=str(tmp_path / "a"), tfds_data_dir=tfds_data_dir)
  assert with_tfds.tokenizer.decode(with_tfds.train) == text["train"]
  assert with_tfds.tokenizer.decode(with_tfds.val) == text["validation"] + text["test"]
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # as if not installed
  without = corpus.load_corpus(cache_dir=str(tmp_path / "b"))
  assert with_tfds.source == "tiny_shakespeare (TFDS), char, 1,003,854 train / 111,540 val tokens"
  assert without.source.startswith("tiny_shakespeare (embedded text; TFDS not installed), char")
  assert with_tfds.tokenizer == without.tokenizer and with_tfds.vocab_size == 65
  np.testing.assert_array_equal(with_tfds.train, without.train)
  np.testing.assert_array_equal(with_tfds.val, without.val)

  with pytest.raises(corpus.CorpusError, match="need tensorflow-datasets .* or pass a path"):
    corpus.load_corpus("lm1b", cache_dir=str(tmp_path / "c"))
  monkeypatch.undo()
  monkeypatch.setitem(sys.modules, "tensorflow", None)  # TFDS alone cannot read data
  no_tf = corpus.load_corpus(cache_dir=str(tmp_path / "b"))
  assert no_tf.source == without.source
  np.testing.assert_array_equal(no_tf.train, without.train)


@pytest.mark.parametrize("prepared", [pytest.param(True, marks=pytest.mark.slow), False])
def test_tfds_unknown_dataset_and_missing_manual_dir(prepared, tmp_path, request):
  with pytest.raises(corpus.CorpusError, match="neither an existing file or folder nor a TFDS"):
    corpus.load_corpus("no_such_dataset_zz", cache_dir=str(tmp_path))
  # With the data prepared (or cached) or not, a wrong manual dir is reported.
  data_dir = request.getfixturevalue("tfds_data_dir") if prepared else str(tmp_path / "tfds")
  with pytest.raises(corpus.CorpusError, match="`tfds_manual_dir=.*nowhere` does not exist"):
    corpus.load_corpus(tfds_data_dir=data_dir, tfds_manual_dir=str(tmp_path / "nowhere"),
                       cache_dir=str(tmp_path))


def test_tfds_text_feature_and_splits():
  feat = lambda dtype, shape=(): types.SimpleNamespace(np_dtype=np.dtype(dtype), shape=shape)
  pick = datasets.tfds_text_feature
  assert pick({"id": feat(np.int64), "text": feat(object)}, "x") == "text"
  assert pick({"label": feat(np.int64), "sentence": feat(object)}, "x") == "sentence"
  assert pick({"tokens": feat(object, (None,)), "body": feat(object)}, "x") == "body"
  with pytest.raises(ValueError, match=r"has no text feature \(its features: \['image'"):
    pick({"image": feat(np.uint8, (28, 28, 1)), "label": feat(np.int64)}, "mnist")
  splits = datasets.tfds_text_splits
  assert splits("lm1b", {"train": 1, "test": 1}) == (["train"], ["test"])
  assert splits("x", {"train": 1, "validation": 1, "test": 1}) == (["train"], ["validation"])
  assert splits("tiny_shakespeare", {}) == (["train"], ["validation", "test"])
  with pytest.raises(ValueError, match="needs a train split"):
    splits("x", {"train": 1})


# ----------------------------------------------------------------------------
# Errors: one line each, naming the fix


@pytest.mark.parametrize("setup, kwargs, error, message", [
    (lambda p: p / "nope.txt", {}, corpus.CorpusError, "nope.txt` does not exist"),
    (lambda p: (p / "e.txt").write_text("") and None or p / "e.txt", {}, corpus.CorpusError,
     "e.txt` is empty"),
    (lambda p: p, {}, corpus.CorpusError, "is an empty folder and no nanoGPT train.bin"),
    (lambda p: (p / "x.csv").write_text("a,b") and None or p, {}, corpus.CorpusError,
     "has no .txt files and no nanoGPT train.bin"),
    (lambda p: (p / "a").write_text("a") and None or p / "a", {"tokenizer": "chars"},
     tokenizers.TokenizerError, "unknown tokenizer 'chars'; choose one of: char, gpt2."),
    (lambda p: (p / "a").write_text("a") and None or p / "a", {"tokenizer": "char",
     "tokenizer_file": "x"}, corpus.CorpusError, "`tokenizer_file` applies to `tokenizer=gpt2`"),
    (lambda p: (p / "a").write_text("a") and None or p / "a", {"tfds_manual_dir": "m"},
     corpus.CorpusError, "`tfds_manual_dir` has no effect on `dataset="),
    (lambda p: (p / "a").write_text("a") and None or p / "a", {"tfds_data_dir": "d"},
     corpus.CorpusError, "`tfds_data_dir` has no effect"),
    (lambda p: (p / "a").write_text("a") and None or p / "a", {}, corpus.CorpusError,
     "too short to split: 0 train and 1 val tokens"),
    (lambda p: (p / "a").write_bytes(b"ok \xff\xfe") and None or p / "a", {}, corpus.CorpusError,
     "is not UTF-8 text"),
])
def test_errors_are_one_clear_line(tmp_path, setup, kwargs, error, message):
  folder = tmp_path / "data"
  folder.mkdir()
  dataset = setup(folder)
  with pytest.raises(error) as e:
    corpus.load_corpus(str(dataset), cache_dir=str(tmp_path / "cache"), **kwargs)
  assert message in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------
# Host batches


def test_fits_on_device(tmp_path):
  (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
  c = load(tmp_path / "a.txt", tmp_path)
  assert corpus.fits_on_device(c) and corpus.fits_on_device(c, max_bytes=6000)
  assert not corpus.fits_on_device(c, max_bytes=5999)  # 3000 uint16 ids

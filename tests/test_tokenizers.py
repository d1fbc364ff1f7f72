"""tokenizers, bpe_files, tokenize_files: characters, BPE through tiktoken, specs, large files.

No test here touches the network: the `no_network` fixture (helpers/data.py), used by
every test, fails any test that opens a connection or looks up a host. The
BPE tests run on the tests' tiny encoding (helpers/data.py), written by the tests themselves in both file formats tiktoken reads (a
`.tiktoken` file, and GPT-2's `vocab.bpe` + `encoder.json`). GPT-2's real
encoding is tested only when tiktoken's cache already holds it.
"""

import hashlib
import json
import pathlib
import socket
import time

import numpy as np
import pytest

from purejax.data import bpe_files
from purejax.data import tokenize_files
from purejax.data import tokenizers
from purejax.data.tokenizer_spec import TokenizerSpec
from helpers.data import (MERGES, SHAKESPEARE, gpt2_byte_order, need, tiny_ranks,
                          write_tiktoken_file)

pytestmark = pytest.mark.usefixtures("no_network")


def data_gym_char(b: int) -> str:
  """GPT-2's reversible byte -> unicode character map (`bytes_to_unicode`)."""
  order = gpt2_byte_order()
  n_printable = sum(1 for x in range(256) if chr(x).isprintable() and chr(x) != " ")
  index = order.index(b)
  return chr(b) if index < n_printable else chr(256 + index - n_printable)


def write_data_gym_pair(folder: pathlib.Path, ranks, merges) -> pathlib.Path:
  """GPT-2's release format: vocab.bpe (merges) and encoder.json (token -> id)."""
  folder.mkdir(parents=True, exist_ok=True)
  encode = lambda token: "".join(data_gym_char(b) for b in token)
  lines = ["#version: 0.2"] + [f"{encode(a)} {encode(b)}" for a, b in merges]
  (folder / "vocab.bpe").write_text("\n".join(lines) + "\n", encoding="utf-8")
  encoder = {encode(t): r for t, r in ranks.items()}
  encoder[tokenizers.ENDOFTEXT] = len(ranks)
  (folder / "encoder.json").write_text(json.dumps(encoder), encoding="utf-8")
  return folder


@pytest.fixture
def tiny_file(tmp_path):
  return write_tiktoken_file(tmp_path / "tiny.tiktoken", tiny_ranks())


@pytest.fixture
def tiny(tiny_file):
  return tokenizers.bpe_tokenizer(str(tiny_file), name="tiny")


# ----------------------------------------------------------------------------
# Characters


def test_char_tokenizer_is_the_sorted_characters_of_the_text():
  text = SHAKESPEARE[:5000]
  tok = tokenizers.CharTokenizer.from_text(text)
  assert tok.chars == "".join(sorted(set(text))) and tok.vocab_size == len(set(text))
  assert tokenizers.CharTokenizer.from_text("hello world").chars == " dehlorw"
  ids = tok.encode(text)
  assert ids.dtype == np.int32
  np.testing.assert_array_equal(ids, [tok.chars.index(c) for c in text])
  assert tok.decode(ids) == text
  assert isinstance(tok, tokenizers.Tokenizer)


def test_char_unknown_characters_are_a_clear_error():
  tok = tokenizers.CharTokenizer("abc ")
  with pytest.raises(tokenizers.TokenizerError) as got:
    tok.encode("a cab, é!")
  assert "characters ['!', ',', 'é'] are not in the model's vocabulary" in str(got.value)
  assert "remove or replace them." in str(got.value)
  assert isinstance(got.value, ValueError)


def test_char_encode_unsorted_vocabulary_and_empty_text():
  tok = tokenizers.CharTokenizer("zéa\n")
  np.testing.assert_array_equal(tok.encode("a\nzé"), [2, 3, 0, 1])
  assert tok.encode("").shape == (0,)
  with pytest.raises(tokenizers.TokenizerError, match="more than once"):
    tokenizers.CharTokenizer("abca")


def test_char_spec_round_trip():
  tok = tokenizers.CharTokenizer.from_text(SHAKESPEARE)
  record = json.loads(json.dumps(tok.spec().to_dict()))  # as a checkpoint stores it
  assert record == {"type": "char", "name": "char", "vocab_size": 65, "chars": tok.chars}
  spec = TokenizerSpec.from_dict(record)
  assert spec == tok.spec() and spec.vocab_size == 65
  assert tokenizers.from_spec(spec) == tok


# ----------------------------------------------------------------------------
# BPE on a tiny encoding


def test_bpe_round_trip_and_merges(tiny):
  text = "the other thing\n\n <|endoftext|> é ünïcode\tthe end"
  ids = tiny.encode(text)
  assert ids.dtype == np.int32
  assert tiny.decode(ids) == text
  ranks = tiny_ranks()
  assert tiny.encode("the").tolist() == [ranks[b"the"]]
  assert tiny.encode(" the").tolist() == [ranks[b" the"]]
  assert tiny.vocab_size == len(ranks) + 1 and tiny.eot_id == len(ranks)
  # A special token's text in a corpus stays text: no separator is injected.
  assert tiny.eot_id not in tiny.encode("<|endoftext|>").tolist()
  assert tiny.decode([tiny.eot_id]) == "<|endoftext|>"
  assert isinstance(tiny, tokenizers.Tokenizer)


def test_bpe_both_file_formats_give_the_same_encoding(tmp_path, tiny):
  folder = write_data_gym_pair(tmp_path / "gpt2-format", tiny_ranks(), MERGES)
  for path in (folder, folder / "vocab.bpe"):
    other = tokenizers.bpe_tokenizer(str(path), name="tiny")
    assert other.fingerprint == tiny.fingerprint
    np.testing.assert_array_equal(other.encode(SHAKESPEARE[:3000]),
                                  tiny.encode(SHAKESPEARE[:3000]))


def test_bpe_spec_round_trip(tmp_path, tiny, tiny_file):
  spec = TokenizerSpec.from_dict(json.loads(json.dumps(tiny.spec().to_dict())))
  assert spec == tiny.spec() and spec.kind == "bpe" and spec.vocab_size == tiny.vocab_size
  again = tokenizers.from_spec(spec)
  assert again == tiny
  np.testing.assert_array_equal(again.encode("the thing"), tiny.encode("the thing"))
  # The recorded path may be from another machine: another copy of the file works...
  copy = tmp_path / "elsewhere" / "copy.tiktoken"
  copy.parent.mkdir()
  copy.write_bytes(tiny_file.read_bytes())
  assert tokenizers.from_spec(spec, encoding_file=str(copy)).fingerprint == tiny.fingerprint
  # ...other merges do not.
  ranks = tiny_ranks()
  ranks[b"ou" + b"t"] = len(ranks)
  wrong = write_tiktoken_file(tmp_path / "wrong.tiktoken", ranks)
  with pytest.raises(tokenizers.TokenizerError, match="other merges"):
    tokenizers.from_spec(spec, encoding_file=str(wrong))


def test_decode_rejects_ids_past_the_vocabulary(tiny):
  with pytest.raises(tokenizers.TokenizerError, match=r"mask ids >= 267"):
    tiny.decode([5, tiny.vocab_size])
  with pytest.raises(tokenizers.TokenizerError, match="outside"):
    tokenizers.CharTokenizer("ab").decode([2])


def test_bad_encoding_files_are_clear_errors(tmp_path):
  with pytest.raises(tokenizers.TokenizerError, match="does not exist"):
    tokenizers.bpe_tokenizer(str(tmp_path / "nope.tiktoken"))
  (tmp_path / "garbage.tiktoken").write_text("not base64 and no rank\n")
  with pytest.raises(tokenizers.TokenizerError, match="not a readable BPE encoding"):
    tokenizers.bpe_tokenizer(str(tmp_path / "garbage.tiktoken"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(tokenizers.TokenizerError, match="vocab.bpe and encoder.json"):
    tokenizers.bpe_tokenizer(str(tmp_path / "empty"))
  partial = {bytes([b]): b for b in range(200)}
  with pytest.raises(tokenizers.TokenizerError, match="all 256"):
    tokenizers.bpe_tokenizer(str(write_tiktoken_file(tmp_path / "p.tiktoken", partial)))


# ----------------------------------------------------------------------------
# Lookup by name


def test_unknown_tokenizer_is_a_one_line_error():
  with pytest.raises(tokenizers.TokenizerError) as e:
    tokenizers.get_tokenizer("sentencepiece")
  assert str(e.value) == "unknown tokenizer 'sentencepiece'; choose one of: char, gpt2."


def test_get_tokenizer_char_and_bad_arguments():
  assert tokenizers.get_tokenizer("char", text="hello").chars == "ehlo"
  assert tokenizers.get_tokenizer("char", chars="ba").chars == "ba"
  with pytest.raises(tokenizers.TokenizerError, match="chars=... or text="):
    tokenizers.get_tokenizer("char")
  with pytest.raises(tokenizers.TokenizerError, match="only encoding_file"):
    tokenizers.get_tokenizer("gpt2", vocab="x")


def test_from_spec_rejects_models_without_a_tokenizer_and_junk():
  with pytest.raises(tokenizers.TokenizerError, match="records no tokenizer, only 101 ids"):
    tokenizers.from_spec(tokenizers.ids_spec(101))
  with pytest.raises(tokenizers.TokenizerError, match="not a tokenizer spec"):
    TokenizerSpec.from_dict({"kind": "char"})
  with pytest.raises(tokenizers.TokenizerError, match="not a tokenizer spec"):
    TokenizerSpec.from_dict({"type": "char", "vocab_size": 3})  # no chars
  with pytest.raises(tokenizers.TokenizerError, match="needs fingerprint, pat_str"):
    TokenizerSpec("bpe", "mine", 300)


# ----------------------------------------------------------------------------
# GPT-2: offline behaviour


def test_gpt2_missing_files_fail_fast_with_the_fix(tmp_path, monkeypatch):
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
  monkeypatch.setattr(bpe_files, "host_reachable", lambda url, timeout=3.0: False)
  start = time.perf_counter()
  with pytest.raises(tokenizers.TokenizerError) as e:
    tokenizers.get_tokenizer("gpt2")
  assert time.perf_counter() - start < 2.0
  message = str(e.value)
  assert "\n" not in message
  for needed in ("vocab.bpe", "encoder.json", "TIKTOKEN_CACHE_DIR", "`encoding_file=PATH`",
                 str(tmp_path / "empty-cache")):
    assert needed in message


def test_network_probe_gives_up_after_its_timeout(monkeypatch):
  # A dead network can hang a DNS lookup far past any socket timeout.
  def hang(*args, **kwargs):
    time.sleep(30)
    raise OSError("timed out")  # as a real lookup would, long after the probe gave up

  monkeypatch.setattr(socket, "create_connection", hang)
  start = time.perf_counter()
  assert not bpe_files.host_reachable("https://example.invalid/x", timeout=0.2)
  assert time.perf_counter() - start < 2.0


def test_gpt2_rejects_another_encoding(tiny_file):
  with pytest.raises(tokenizers.TokenizerError, match="is not GPT-2's encoding"):
    tokenizers.gpt2_tokenizer(str(tiny_file))


@pytest.mark.parametrize("layout", ["r50k_base", "data_gym"])
def test_gpt2_is_read_from_tiktoken_cache_without_network(tmp_path, monkeypatch, layout):
  # The tiny encoding plays GPT-2 here: both files are cached under the keys
  # tiktoken uses (sha1 of the download URL).
  ranks = tiny_ranks()
  cache = tmp_path / "cache"
  cache.mkdir()
  key = lambda url: cache / hashlib.sha1(url.encode()).hexdigest()
  if layout == "r50k_base":
    write_tiktoken_file(key(bpe_files.R50K_URL), ranks)
  else:
    folder = write_data_gym_pair(tmp_path / "dg", ranks, MERGES)
    key(bpe_files.GPT2_URLS[0]).write_bytes((folder / "vocab.bpe").read_bytes())
    key(bpe_files.GPT2_URLS[1]).write_bytes((folder / "encoder.json").read_bytes())
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
  monkeypatch.setattr(tokenizers, "GPT2_FINGERPRINT", bpe_files.fingerprint(ranks))
  monkeypatch.setattr(tokenizers, "GPT2_VOCAB_SIZE", len(ranks) + 1)
  cached_before = sorted(p.name for p in cache.iterdir())
  tok = tokenizers.gpt2_tokenizer()
  assert tok.name == "gpt2" and tok.eot_id == len(ranks)
  assert tok.decode(tok.encode("the other")) == "the other"
  assert sorted(p.name for p in cache.iterdir()) == cached_before  # no copies added


def _real_gpt2():
  tok = tokenizers._gpt2_from_cache()
  if tok is None:
    pytest.skip("GPT-2's encoding is not in tiktoken's cache (run "
                "`python -c 'import tiktoken; tiktoken.get_encoding(\"gpt2\")'` online, or "
                "copy r50k_base.tiktoken there)")
  return tok


def test_real_gpt2_encoding_if_cached():
  tok = _real_gpt2()
  assert tok.encode("Hello world").tolist() == [15496, 995]
  assert tok.vocab_size == 50257 and tok.eot_id == 50256
  # nanoGPT's shakespeare/prepare.py: 301,966 train + 36,059 val tokens.
  assert len(tok.encode(SHAKESPEARE)) == 338025
  record = json.loads(json.dumps(tokenizers.gpt2_spec().to_dict()))
  assert record["special_tokens"] == {"<|endoftext|>": 50256}
  assert tokenizers.from_spec(TokenizerSpec.from_dict(record)) == tok


# ----------------------------------------------------------------------------
# Large inputs


TRICKY = ("First line\nsecond  line\n\nthird\r\nfourth \n fifth\n\n\nsixth\ttab\n"
          "é\nünï\n \nend of para.\nA\nB\n" + "no newline for a while " * 20 + "\nlast")


@pytest.mark.parametrize("chunk_bytes", [8, 64, 1 << 20])
def test_encode_file_equals_encoding_the_whole_text(tmp_path, tiny, chunk_bytes):
  text = TRICKY * 5 + SHAKESPEARE[:20000]
  path = tmp_path / "corpus.txt"
  path.write_text(text, encoding="utf-8")
  chunks = list(tokenize_files.iter_text_chunks(str(path), chunk_bytes))
  assert "".join(chunks) == text
  if chunk_bytes < 100:
    assert len(chunks) > 50
  for tok in (tiny, tokenizers.CharTokenizer.from_text(text)):
    ids = tokenize_files.encode_file(tok, str(path), chunk_bytes=chunk_bytes, num_threads=2)
    np.testing.assert_array_equal(ids, tok.encode(text))


def test_encode_chunks_of_nothing_and_progress_only_when_asked(tmp_path, tiny, capfd):
  assert tokenize_files.encode_chunks(tiny, []).shape == (0,)
  path = tmp_path / "c.txt"
  path.write_text(SHAKESPEARE[:5000], encoding="utf-8")
  tokenize_files.encode_file(tiny, str(path), chunk_bytes=512)  # stderr is not a terminal
  assert "tokenizing" not in capfd.readouterr().err
  tokenize_files.encode_file(tiny, str(path), chunk_bytes=512, progress=True)
  assert "tokenizing" in capfd.readouterr().err


def test_token_texts_read_each_id_as_inside_a_text(tmp_path):
  # A SentencePiece-style word "▁def" drops its space when decoded alone; inside
  # a text it reads " def", so a stop string "\ndef" does not match "\n def".
  hf_tokenizers = need("tokenizers")
  from purejax.data import tokenizer_json  # pylint: disable=g-import-not-at-top
  model = hf_tokenizers.models.WordLevel({"<unk>": 0, "a": 1, "\n": 2, "▁def": 3},
                                         unk_token="<unk>")
  spm = hf_tokenizers.Tokenizer(model)
  spm.pre_tokenizer = hf_tokenizers.pre_tokenizers.Metaspace()
  spm.decoder = hf_tokenizers.decoders.Metaspace()
  spm.save(str(tmp_path / "tokenizer.json"))
  tokenizer = tokenizer_json.load(str(tmp_path / "tokenizer.json"))
  assert tokenizer.decode([3]) == "def"
  assert tokenizers.token_texts(tokenizer)[1:] == ["a", "\n", " def"]
  assert tokenizers.token_texts(tokenizers.CharTokenizer("ab\n")) == ["a", "b", "\n"]

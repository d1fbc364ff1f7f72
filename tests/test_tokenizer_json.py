"""tokenizer_json: Hugging Face tokenizer.json files through the tokenizers library, offline.

The tests train their own byte-level BPE `tokenizer.json` on a page of
Shakespeare (the format Llama-family folders ship), so nothing is
downloaded.
"""

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from helpers.data import SHAKESPEARE, train_tokenizer_json
from purejax.data import corpus
from purejax.data import tokenizer_json
from purejax.data import tokenizers
from purejax.data.tokenizer_spec import TokenizerSpec



@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> pathlib.Path:
  folder = tmp_path_factory.mktemp("model")
  train_tokenizer_json(folder, SHAKESPEARE[:20000])
  return folder


def test_encodes_as_the_tokenizers_library_and_decodes_back(model_folder):
  hf = pytest.importorskip("tokenizers")
  tok = tokenizer_json.load(str(model_folder))  # the folder, as a model folder is given
  text = "ROMEO:\nWhat light through yonder window breaks? Ünïcode too."
  ids = tok.encode(text)
  assert ids.dtype == np.int32
  reference = hf.Tokenizer.from_file(str(model_folder / "tokenizer.json"))
  assert ids.tolist() == reference.encode(text, add_special_tokens=False).ids
  assert len(ids) < len(text)  # merges were learned
  assert tok.decode(ids) == text
  assert tok.vocab_size == reference.get_vocab_size(with_added_tokens=True) == 300
  assert isinstance(tok, tokenizers.Tokenizer)


def test_spec_rebuilds_the_same_tokenizer_and_finds_a_moved_file(model_folder, tmp_path):
  tok = tokenizer_json.load(str(model_folder / "tokenizer.json"))
  record = json.loads(json.dumps(tok.spec().to_dict()))  # what a checkpoint stores
  assert record["type"] == "tokenizer.json" and record["vocab_size"] == 300
  spec = TokenizerSpec.from_dict(record)
  assert spec == tok.spec()
  rebuilt = tokenizers.from_spec(spec)
  assert rebuilt.encode("To be, or not to be").tolist() == tok.encode("To be, or not to be").tolist()
  moved = tmp_path / "moved" / "tokenizer.json"
  moved.parent.mkdir()
  moved.write_bytes((model_folder / "tokenizer.json").read_bytes())
  spec = dataclasses.replace(spec, encoding_file=str(tmp_path / "gone" / "tokenizer.json"))
  with pytest.raises(tokenizers.TokenizerError, match="is missing.*`encoding_file=PATH`"):
    tokenizers.from_spec(spec)
  assert tokenizers.from_spec(spec, encoding_file=str(moved)).fingerprint == tok.fingerprint


def test_another_tokenizer_file_is_refused(model_folder, tmp_path):
  other = train_tokenizer_json(tmp_path / "other", SHAKESPEARE[20000:40000])
  spec = tokenizer_json.load(str(model_folder)).spec()
  with pytest.raises(tokenizers.TokenizerError, match="another tokenizer than the model"):
    tokenizers.from_spec(spec, encoding_file=str(other))


def test_missing_and_damaged_files_are_one_line_errors(tmp_path):
  with pytest.raises(tokenizers.TokenizerError, match=r"tokenizer.json is missing; pass a "
                     r"folder holding tokenizer.json"):
    tokenizer_json.load(str(tmp_path))
  (tmp_path / "tokenizer.json").write_text('{"model": "not a tokenizer"')
  with pytest.raises(tokenizers.TokenizerError, match="not a tokenizer.json the tokenizers "
                     "library reads") as error:
    tokenizer_json.load(str(tmp_path))
  assert "\n" not in str(error.value)
  assert tokenizer_json.spec_of_folder(str(tmp_path / "nothing-here")) is None


def test_ids_past_the_vocabulary_are_refused(model_folder):
  tok = tokenizer_json.load(str(model_folder))
  with pytest.raises(tokenizers.TokenizerError, match="outside the tokenizer's 300 ids"):
    tok.decode([1, 300])


def test_a_corpus_tokenized_with_it(model_folder, tmp_path):
  notes = tmp_path / "notes.txt"
  notes.write_text(SHAKESPEARE[:5000], encoding="utf-8")
  tok = tokenizer_json.load(str(model_folder))
  text = corpus.load_corpus(str(notes), tokenizer=tok, cache_dir=str(tmp_path / "cache"))
  assert text.vocab_size == 300
  both = np.concatenate([np.asarray(text.train), np.asarray(text.val)])
  assert both.tolist() == tok.encode(SHAKESPEARE[:5000]).tolist()
  again = corpus.load_corpus(str(notes), tokenizer=tok, cache_dir=str(tmp_path / "cache"))
  assert np.array_equal(np.asarray(again.train), np.asarray(text.train))  # from the cache


def test_the_byte_level_alphabet_is_indexed_by_byte_value_as_tokenizers_maps_bytes():
  hf = pytest.importorskip("tokenizers")
  byte_level = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  alphabet = tokenizer_json._byte_level_alphabet()  # pylint: disable=protected-access
  # Every one- and two-byte character, and three- and four-byte ones for each
  # lead byte: every byte value valid UTF-8 can hold.
  chars = ([chr(c) for c in range(0x800)] + [chr(max(0x800, k << 12)) for k in range(16)]
           + [chr(0x10000 + (k << 18)) for k in range(4)] + ["\U0010ffff"])
  seen = set()
  for char in chars:
    (mapped, _), = byte_level.pre_tokenize_str(char)
    assert mapped == "".join(alphabet[b] for b in char.encode("utf-8")), char
    seen |= set(char.encode("utf-8"))
  assert seen == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 0x100)}
  assert set(alphabet) == set(hf.pre_tokenizers.ByteLevel.alphabet())

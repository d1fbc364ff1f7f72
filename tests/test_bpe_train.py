"""`python -m purejax.tokenizer`: a byte-level BPE trained on a corpus, and a model's data through it.

The trainer is the `tokenizers` library's; these tests check what purejax
adds: the corpus read as `python -m purejax.train` reads it, the split
pattern, the compression report, the file `--tokenizer_file` takes, and
one-line errors.
"""

import re

import numpy as np
import pytest

from purejax.cli import tokenizer as tokenizer_cli
from purejax.cli import train as train_cli
from purejax.data import bpe_train
from purejax.data import tokenizer_json

TEXT = ("First Citizen: Before we proceed any further, hear me speak. 12345 and 67890.\n"
        "All: Speak, speak. You are all resolved rather to die than to famish? 12345\n") * 40


@pytest.fixture
def text(tmp_path):
  path = tmp_path / "notes.txt"
  path.write_text(TEXT)
  return path


def report(capsys):
  """The command's one line on stdout, as {'tokens': ..., 'bytes_per_token': ...}."""
  line = capsys.readouterr().out.strip().splitlines()[-1]
  match = re.search(r": ([\d,]+) tokens.*; ([\d.]+) bytes/token on .* \(([\d,]+) bytes, "
                    r"([\d,]+) tokens\)", line)
  assert match, line
  size, ratio, total_bytes, tokens = match.groups()
  return dict(tokens=int(size.replace(",", "")), bytes_per_token=float(ratio),
              bytes=int(total_bytes.replace(",", "")), count=int(tokens.replace(",", "")))


def test_train_writes_a_tokenizer_json_that_round_trips_and_reports_compression(
    text, tmp_path, capsys):
  out = tmp_path / "tok.json"
  assert tokenizer_cli.run(["tokenizer", "--train", f"--dataset={text}", "--vocab_size=300",
                            f"--out={out}"]) == 0
  trained = report(capsys)
  tok = tokenizer_json.load(str(out))
  assert trained["tokens"] == tok.vocab_size == 300
  ids = tok.encode(TEXT)
  assert tok.decode(ids) == TEXT
  assert trained["bytes"] == len(TEXT.encode()) and trained["count"] == len(ids)
  assert trained["bytes_per_token"] == pytest.approx(len(TEXT.encode()) / len(ids), abs=1e-3)
  assert trained["bytes_per_token"] > 1.5  # bytes alone are 1; 43 merges of a repetitive text
  assert tok.decode(tok.encode("naïve ∑ 🙂")) == "naïve ∑ 🙂"  # unseen bytes still encode
  # Measuring the written file reads the same compression.
  assert tokenizer_cli.run(["tokenizer", f"--dataset={text}", f"--tokenizer_file={out}"]) == 0
  assert report(capsys) == trained


def test_nanochat_split_keeps_digits_in_runs_of_at_most_two(text, tmp_path, capsys):
  digits = {}
  for split in bpe_train.SPLITS:
    out = tmp_path / f"{split}.json"
    assert tokenizer_cli.run(["tokenizer", "--train", f"--dataset={text}", "--vocab_size=400",
                              f"--split={split}", f"--out={out}"]) == 0
    tok = tokenizer_json.load(str(out))
    pieces = [tok.decode([i]) for i in tok.encode("12345 and 67890")]
    digits[split] = max(len(re.sub(r"\D", "", piece)) for piece in pieces)
  assert digits["nanochat"] <= 2 < digits["gpt2"], digits


def test_a_model_corpus_reads_through_the_trained_file(text, tmp_path, capsys):
  out = tmp_path / "tok.json"
  assert tokenizer_cli.run(["tokenizer", "--train", f"--dataset={text}", "--vocab_size=280",
                            f"--out={out}"]) == 0
  # As `python -m purejax.train --dataset=notes.txt --tokenizer_file=tok.json` reads its data.
  args = train_cli.command.parse(
      ["train", f"--dataset={text}", f"--tokenizer_file={out}", f"--cache_dir={tmp_path}"],
      lambda a: train_cli.train_flags.define_flags(a, "gpt"))
  data = train_cli.load_corpus(args, tokenizer=None)
  assert data.vocab_size == 280 and data.tokenizer.spec().kind == "tokenizer.json"
  ids = np.concatenate([data.train, data.val])
  assert data.tokenizer.decode(ids) == TEXT


def test_a_corpus_alphabet_spends_no_tokens_on_bytes_the_text_lacks(text, tmp_path, capsys):
  # The text has 43 distinct bytes: 213 of the 256 byte tokens would be unused rows.
  assert len(set(TEXT.encode())) == 43
  measured = {}
  for alphabet, vocab_size in (("bytes", 280), ("corpus", 280 - 213)):
    out = tmp_path / f"{alphabet}.json"
    assert tokenizer_cli.run(["tokenizer", "--train", f"--dataset={text}",
                              f"--vocab_size={vocab_size}", f"--alphabet={alphabet}",
                              f"--out={out}"]) == 0
    measured[alphabet] = report(capsys)
  # The same 23 merges, so the same compression, in 67 tokens instead of 280.
  assert measured["corpus"]["tokens"] == 67
  assert measured["corpus"]["count"] == measured["bytes"]["count"], measured
  tok = tokenizer_json.load(str(tmp_path / "corpus.json"))
  assert tok.vocab_size == 67 and tok.decode(tok.encode(TEXT)) == TEXT
  # Text with bytes it never saw is refused, not silently dropped as `tokenizers` would.
  with pytest.raises(bpe_train.TokenizerError, match=r"2 character\(s\) .* has no tokens for, e.g. 'Q', 'é'"):
    tok.encode("Speak, Q é.")
  assert tokenizer_json.load(str(tmp_path / "bytes.json")).encode("Speak, Q é.").size


def test_a_model_corpus_with_bytes_its_tokenizer_lacks_is_an_error(text, tmp_path):
  out = tmp_path / "tok.json"
  with bpe_train.corpus_text(str(text)) as chunks:
    bpe_train.train(chunks, 100, alphabet="corpus").save(str(out))
  other = tmp_path / "other.txt"
  other.write_text(TEXT + "Zounds!\n")  # 'Z' and '!' are new
  args = train_cli.command.parse(
      ["train", f"--dataset={other}", f"--tokenizer_file={out}", f"--cache_dir={tmp_path}"],
      lambda a: train_cli.train_flags.define_flags(a, "gpt"))
  with pytest.raises(bpe_train.TokenizerError, match="e.g. '!', 'Z'"):
    train_cli.load_corpus(args, tokenizer=None)


@pytest.mark.parametrize("args, message", [
    (["--train", "--vocab_size=256"], "--vocab_size=256 is out of range: a byte-level BPE "
     "holds the 256 bytes and <|endoftext|>, so at least 257"),
    (["--train", "--vocab_size=300"], "--train needs --out"),
    (["--train", "--out=x.json"], "--train needs --vocab_size"),
    ([], "pass --train (with --vocab_size and --out) to train a tokenizer, or "
     "--tokenizer_file=tok.json to measure one."),
    (["--tokenizer_file=t.json", "--vocab_size=300"], "--vocab_size applies to --train"),
    (["--tokenizer_file=t.json", "--alphabet=corpus"], "--alphabet applies to --train"),
    (["--train", "--vocab_size=0", "--alphabet=corpus", "--out=x.json"],
     "--vocab_size=0 is out of range: a byte-level BPE holds at least one byte"),
    (["--train", "--vocab_size=20", "--alphabet=corpus", "--out=x.json"],
     "--vocab_size=20 is too small for this corpus's alphabet: it holds 43 distinct bytes, "
     "so at least 44"),
])
def test_bad_flags_are_one_line_errors(text, tmp_path, capsys, args, message):
  code = tokenizer_cli.run(["tokenizer", f"--dataset={text}", *args])
  assert code == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: " + message), err


def test_an_empty_corpus_and_a_token_id_folder_are_one_line_errors(tmp_path, capsys):
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / "ids").mkdir()
  (tmp_path / "ids" / "train.bin").write_bytes(b"\0\0")
  for dataset, message in ((tmp_path / "empty.txt", "is empty; it needs text to train on."),
                           (tmp_path / "ids", "is a nanoGPT folder of token ids, not text")):
    code = tokenizer_cli.run(["tokenizer", "--train", f"--dataset={dataset}",
                              "--vocab_size=300", f"--out={tmp_path / 'tok.json'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and message in err[0], err
  assert not (tmp_path / "tok.json").exists()

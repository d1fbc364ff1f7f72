"""Test data: the package's Tiny Shakespeare, the original files in $PUREJAX_TEST_DATA (skipped
without them, failed under CI=true), tiny BPE files, optional peers (`need`)."""

import base64
import os
import pathlib
import socket

import pytest

from purejax.data import datasets
from helpers.suite import built_once


REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


TEST_DATA = os.environ.get("PUREJAX_TEST_DATA")


IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


# The install that brings every optional dependency of the suite (torch,
# transformers, peft, wandb, tensorboard, matplotlib): setup.cfg's `test` extra.
TEST_EXTRA = 'pip install -e ".[test]"'


def need(module: str):
  """`module` imported, or the test skipped with the install that brings it."""
  return pytest.importorskip(module, reason=f"{module} is not installed: {TEST_EXTRA}")


DATA_FILES = {"mnist": "MNIST's four original .gz files",
              "tinyshakespeare": "Tiny Shakespeare's input.txt"}


def require_test_data(name: str) -> pathlib.Path:
  """Path of `$PUREJAX_TEST_DATA/<name>`; skips outside CI if absent, fails in CI."""
  path = pathlib.Path(TEST_DATA or "<PUREJAX_TEST_DATA unset>") / name
  if not path.is_dir():
    message = (f"{path} not found: set PUREJAX_TEST_DATA to a folder holding {name}/ "
               f"({DATA_FILES[name]})")
    if IN_CI:
      pytest.fail(message + "; integration tests must run under CI=true.")
    pytest.skip(message)
  return path


def tinyshakespeare_dir() -> pathlib.Path:
  """Tiny Shakespeare's folder: the test data's where `PUREJAX_TEST_DATA` is set, else
  the copy the package ships (the same file), so its tests run on any machine."""
  if TEST_DATA:
    return require_test_data("tinyshakespeare")
  return datasets.EMBEDDED_SHAKESPEARE_DIR


# Tiny Shakespeare as the package ships it: the tests' text for tokenizers and corpora.
SHAKESPEARE = (datasets.EMBEDDED_SHAKESPEARE_DIR / "input.txt").read_text(encoding="utf-8")


# The text of `text_file` and of the shared char GPT (`char_gpt_run`).
CHAR_GPT_TEXT = SHAKESPEARE[:40_000]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
  """A 40,000-character `.txt` corpus, as a user's own text file."""
  path = tmp_path_factory.mktemp("text") / "plays.txt"
  path.write_text(CHAR_GPT_TEXT)
  return path


@pytest.fixture(scope="session")
def tfds_data_dir() -> str:
  """A TFDS data dir holding tiny_shakespeare and mnist, prepared from the test data once
  per test run (`built_once`; TFDS's own preparation of mnist takes ~25 s)."""

  def prepare(folder):
    for name, manual_dir, splits in (
        ("tiny_shakespeare", tinyshakespeare_dir(), ("train",)),
        ("mnist", pathlib.Path(TEST_DATA or "<unset>") / "mnist", ("train", "test"))):
      if manual_dir.is_dir():  # where it is not, the tests that need it skip or fail
        datasets.load_tfds_splits(name, splits, data_dir=str(folder),
                                  manual_dir=str(manual_dir))

  return str(built_once("tfds", prepare, computed=False))


# Merges of a tiny byte-level BPE encoding, in rank order: each joins two
# existing tokens.
MERGES = [(b"t", b"h"), (b"th", b"e"), (b" ", b"t"), (b" t", b"he"), (b"e", b"r"),
          (b"o", b"u"), (b"\n", b"\n"), (b" ", b"a"), (b"i", b"n"), (b"in", b"g")]


def gpt2_byte_order():
  """Byte values in the order GPT-2's data-gym format ranks them (printable first)."""
  printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
  return printable + [b for b in range(256) if b not in printable]


def tiny_ranks():
  """The tiny encoding's `{token bytes: rank}`: 256 byte tokens, then `MERGES`."""
  ranks = {bytes([b]): i for i, b in enumerate(gpt2_byte_order())}
  for left, right in MERGES:
    ranks[left + right] = len(ranks)
  return ranks


def write_tiktoken_file(path: pathlib.Path, ranks) -> pathlib.Path:
  """`ranks` in tiktoken's file format (base64 token and rank per line)."""
  lines = [base64.b64encode(t) + b" " + str(r).encode()
           for t, r in sorted(ranks.items(), key=lambda item: item[1])]
  path.write_bytes(b"\n".join(lines) + b"\n")
  return path


@pytest.fixture
def no_network(monkeypatch):
  """Fails the test if anything opens a socket connection or resolves a host."""
  attempts = []

  def refuse(*args, **kwargs):
    attempts.append(args[:1])
    raise OSError("network disabled in tests")

  monkeypatch.setattr(socket, "create_connection", refuse)
  monkeypatch.setattr(socket, "getaddrinfo", refuse)
  monkeypatch.setattr(socket.socket, "connect", refuse)
  yield
  assert not attempts, f"a test touched the network: {attempts}"


def train_tokenizer_json(folder: pathlib.Path, text: str, vocab_size: int = 300
                         ) -> pathlib.Path:
  """Trains a byte-level BPE on `text` and saves it as `folder/tokenizer.json`."""
  hf = pytest.importorskip("tokenizers")
  tokenizer = hf.Tokenizer(hf.models.BPE())
  tokenizer.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = hf.decoders.ByteLevel()
  trainer = hf.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                   initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator([text], trainer)
  folder.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(folder / "tokenizer.json"))
  return folder / "tokenizer.json"

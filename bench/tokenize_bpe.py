"""Seconds to tokenize 100 MB of text with GPT-2's BPE (`tokenize_files.encode_file`).

    python -m bench.tokenize_bpe [--mb=100] [--tokenizer_file=PATH]

The text is Tiny Shakespeare's lines in shuffled orders, repeated to the
size asked, written to a temporary file. Three arms, one run each:

* `encode_file`, one thread per core: the corpus path (line-aligned
  pieces, tiktoken's GIL-free core on threads);
* `encode_file`, one thread: what the threads add;
* one `encode` call on the whole text: the plain tiktoken baseline. Its ids
  must equal `encode_file`'s, which the run checks.

GPT-2's encoding comes from `--tokenizer_file` or tiktoken's cache (see
`purejax.data.tokenizers`). Where neither has it, the run uses a stand-in of the
same algorithm and size, and says so in the output and the JSON: GPT-2's
pre-tokenizer regex and 50,256 byte-level BPE ranks built from the corpus's
most frequent words (each word's prefixes, so every merge joins two
existing tokens). Results go to `bench/results/<date>-tokenize.json`.
"""

import base64
import collections
import datetime
import os
import pathlib
import random
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np
import regex

from bench import harness
from purejax.data import datasets
from purejax.data import tokenize_files
from purejax.data import tokenizers

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_integer("mb", 100, "Megabytes of text to tokenize.", lower_bound=1)
  flags.DEFINE_string("tokenizer_file", None, "GPT-2's vocab.bpe + encoder.json folder or a "
                      ".tiktoken file (default: tiktoken's cache).")
  flags.DEFINE_integer("num_threads", os.cpu_count() or 1, "Threads of the parallel arm.",
                       lower_bound=1)
  flags.DEFINE_string("out", None, "Results file (default bench/results/"
                      "<date>-tokenize.json, or -2, -3, ... when that exists).")

def make_corpus(path: pathlib.Path, size_bytes: int, seed: int = 0) -> int:
  """Writes Tiny Shakespeare's lines, each pass in a new random order, up to `size_bytes`."""
  text = (datasets.EMBEDDED_SHAKESPEARE_DIR / "input.txt").read_text(encoding="utf-8")
  lines = text.splitlines(keepends=True)
  rng = random.Random(seed)
  written = 0
  with open(path, "w", encoding="utf-8") as f:
    while written < size_bytes:
      rng.shuffle(lines)
      block = "".join(lines)[:size_bytes - written]
      f.write(block)
      written += len(block.encode("utf-8"))
  return written


def stand_in_tokenizer(text: str, n_ranks: int = tokenizers.GPT2_VOCAB_SIZE - 1):
  """A byte-level BPE of GPT-2's algorithm and size, built from `text` (see module doc)."""
  words = collections.Counter(regex.findall(tokenizers.GPT2_PAT_STR, text))
  ranks = {bytes([b]): b for b in range(256)}
  for word, _ in words.most_common():
    encoded = word.encode("utf-8")
    for end in range(2, len(encoded) + 1):
      if len(ranks) >= n_ranks:
        break
      ranks.setdefault(encoded[:end], len(ranks))
  folder = tempfile.mkdtemp(prefix="bench-bpe-")
  path = os.path.join(folder, "stand_in.tiktoken")
  with open(path, "wb") as f:
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
      f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
  return tokenizers.bpe_tokenizer(path, name="gpt2-stand-in")


def timed(fn):
  wall, cpu = time.perf_counter(), time.process_time()
  out = fn()
  return out, time.perf_counter() - wall, time.process_time() - cpu


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    tok = tokenizers.gpt2_tokenizer(FLAGS.tokenizer_file)
    source = tok.encoding_file or "tiktoken's cache"
    encoding = f"GPT-2's own (fingerprint {tok.fingerprint[:12]}, from {source})"
  except tokenizers.TokenizerError as e:
    print(f"GPT-2's encoding is unavailable ({e}); using a stand-in.", file=sys.stderr)
    tok = None
  with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
    corpus = pathlib.Path(tmp) / "corpus.txt"
    size = make_corpus(corpus, FLAGS.mb * 1_000_000)
    if tok is None:
      tok = stand_in_tokenizer(corpus.read_text(encoding="utf-8")[:5_000_000])
      encoding = ("STAND-IN, not GPT-2's: GPT-2's regex and 50,256 word-prefix BPE ranks "
                  "built from the corpus (GPT-2's files were not available)")
    arms = {}
    ids = {}
    for name, fn in [
        (f"encode_file, {FLAGS.num_threads} threads",
         lambda: tokenize_files.encode_file(tok, str(corpus), num_threads=FLAGS.num_threads)),
        ("encode_file, 1 thread", lambda: tokenize_files.encode_file(tok, str(corpus),
                                                                     num_threads=1)),
        ("one encode() of the whole text",
         lambda: tok.encode(corpus.read_text(encoding="utf-8"))),
    ]:
      ids[name], wall, cpu = timed(fn)
      arms[name] = {"seconds": round(wall, 3), "mb_per_s": round(size / 1e6 / wall, 2),
                    "cpu_seconds": round(cpu, 3), "tokens": int(len(ids[name]))}
      print(f"{name}: {wall:.2f} s, {size / 1e6 / wall:.1f} MB/s "
            f"(cpu {cpu:.1f} s), {len(ids[name]):,} tokens")
  reference = ids["one encode() of the whole text"]
  same = all(np.array_equal(v, reference) for v in ids.values())
  print(f"encoding: {encoding}; all arms give identical ids: {same}")
  meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "machine": f"{os.cpu_count()} cpus", "text_bytes": size,
          "text": "Tiny Shakespeare lines, shuffled per pass, repeated",
          "encoding": encoding, "identical_ids": same,
          "tiktoken": __import__("tiktoken").__version__,
          "note": "one run per arm on a shared machine"}
  out = pathlib.Path(FLAGS.out) if FLAGS.out else harness.unused_results_path(
      harness.RESULTS_DIR, f"{datetime.date.today().isoformat()}-tokenize")
  harness.write_results(out, {"meta": meta, "results": arms})
  print(f"wrote {out}")
  if not same:
    sys.exit("error: encode_file's ids differ from encoding the whole text.")


if __name__ == "__main__":
  define_flags()
  app.run(main)

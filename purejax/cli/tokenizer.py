"""`python -m purejax.tokenizer`: train a byte-level BPE tokenizer on a corpus, or measure one.

    python -m purejax.tokenizer --train --dataset=notes.txt --vocab_size=4096 --out=tok.json
    python -m purejax.tokenizer --train --dataset=notes.txt --vocab_size=4096 --split=nanochat --out=tok.json
    python -m purejax.tokenizer --train --dataset=notes.txt --vocab_size=256 --alphabet=corpus --out=tok.json
    python -m purejax.tokenizer --dataset=notes.txt --tokenizer_file=tok.json   # its compression
    python -m purejax.train --dataset=notes.txt --tokenizer_file=tok.json       # train a model on it

`--dataset` is what `python -m purejax.train` reads: a .txt file, a folder
of them, or a TFDS name (its train split). Each run prints the tokenizer's
compression on that text, in UTF-8 bytes per token. The library behind it
is `purejax.data.bpe_train` (the `tokenizers` library's BPE trainer).
"""

import pathlib
from typing import Sequence

from absl import flags

from purejax.cli import command
from purejax.cli import errors
from purejax.data import bpe_train
from purejax.data import tokenizer_json
from purejax.data.errors import TokenizerError


def define_flags(args: flags.FlagValues) -> None:
  flags.DEFINE_bool("train", False, "Train a tokenizer on --dataset and write it to --out "
                    "(without it: measure --tokenizer_file on --dataset).", flag_values=args)
  flags.DEFINE_string("dataset", None, "The text: a .txt file, a folder of them, or a TFDS "
                      "name (as python -m purejax.train reads it).", flag_values=args)
  flags.DEFINE_integer("vocab_size", None, "Tokens, counting the base bytes and "
                       "<|endoftext|> (at least 257 with --alphabet=bytes).", flag_values=args)
  flags.DEFINE_enum("alphabet", "bytes", list(bpe_train.ALPHABETS), "The base tokens: all "
                    "256 bytes (any text encodes), or only the bytes --dataset holds (a small "
                    "vocabulary spends no rows on unused bytes; other text cannot be "
                    "encoded).", flag_values=args)
  flags.DEFINE_enum("split", "gpt2", list(bpe_train.SPLITS), "How text is cut before "
                    "merging: GPT-2's regex, or nanochat's (GPT-4's, digits in runs of at "
                    "most two).", flag_values=args)
  flags.DEFINE_string("out", None, "Where --train writes the tokenizer.json.", flag_values=args)
  flags.DEFINE_bool("overwrite", False, "Replace an existing --out.", flag_values=args)
  flags.DEFINE_string("tokenizer_file", None, "Without --train: the tokenizer.json to "
                      "measure.", flag_values=args)
  flags.DEFINE_string("tfds_data_dir", None, "TFDS data dir (default: TFDS's).",
                      flag_values=args)
  flags.DEFINE_string("tfds_manual_dir", None, "Folder with a TFDS dataset's original files.",
                      flag_values=args)


def _check(args: flags.FlagValues) -> None:
  """Bad flag combinations, before any reading."""
  if args.dataset is None:
    raise ValueError("--dataset is required: a .txt file, a folder of them, or a TFDS name.")
  if args.train:
    if args.vocab_size is not None:
      bpe_train.check_vocab_size(args.vocab_size, args.alphabet)
    for name in ("vocab_size", "out"):
      if args[name].value is None:
        raise ValueError(f"--train needs --{name} (e.g. --vocab_size=4096 --out=tok.json).")
    if args.tokenizer_file is not None:
      raise ValueError("--tokenizer_file is measured without --train; drop one of them.")
    out = pathlib.Path(args.out).expanduser()
    if out.exists() and not args.overwrite:
      raise ValueError(f"--out={args.out} exists; pass --overwrite to replace it.")
    if not out.parent.is_dir():
      raise ValueError(f"--out={args.out}: the folder {out.parent} does not exist.")
    return
  if args.tokenizer_file is None:
    raise ValueError("pass --train (with --vocab_size and --out) to train a tokenizer, or "
                     "--tokenizer_file=tok.json to measure one.")
  for name in ("vocab_size", "out", "alphabet", "split"):
    if args[name].present:
      raise ValueError(f"--{name} applies to --train; add --train or drop --{name}.")


def tokenizer(args: flags.FlagValues) -> int:
  """Trains (or loads) the tokenizer and prints its compression on --dataset."""
  text = lambda: bpe_train.corpus_text(args.dataset, tfds_data_dir=args.tfds_data_dir,
                                      tfds_manual_dir=args.tfds_manual_dir)
  try:
    _check(args)
    if args.train:
      with text() as chunks:
        tok = bpe_train.train(chunks, args.vocab_size, split=args.split,
                              alphabet=args.alphabet)
      tok.save(str(pathlib.Path(args.out).expanduser()))
      name = args.out
    else:
      tok = tokenizer_json.load(args.tokenizer_file).tokenizer
      name = args.tokenizer_file
    with text() as chunks:
      ratio, total_bytes, tokens = bpe_train.bytes_per_token(tok, chunks)
  except (ValueError, OSError, TokenizerError) as e:
    errors.fail(e, args)
  size = tok.get_vocab_size()
  short = (f" (asked for {args.vocab_size:,}: the text has no more pairs to merge)"
           if args.train and size < args.vocab_size else "")
  print(f"{'wrote' if args.train else 'read'} {name}: {size:,} tokens{short}; "
        f"{ratio:.3f} bytes/token on {args.dataset} ({total_bytes:,} bytes, {tokens:,} "
        f"tokens)")
  return 0


def run(argv: Sequence[str]) -> int:
  """`python -m purejax.tokenizer` with `argv` (the program's name first): the exit code."""
  return command.run(argv, define_flags, tokenizer, usage=__doc__)


def main() -> None:
  command.main(run)


if __name__ == "__main__":
  main()

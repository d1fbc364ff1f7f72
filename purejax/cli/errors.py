"""What the command lines share: one-line errors, told in the words of their flags.

The library names the Python arguments and config fields a user got wrong,
in backticks (`keep_checkpoints`, `dataset=notes.txt`,
`RunConfig.keep_checkpoints`); a command line shows each name that is one of
its flags as that flag (--keep_checkpoints, --dataset=notes.txt).
"""

import re
from typing import Container, NoReturn

# Python names whose flag is spelled otherwise.
FLAG_OF = {"decay_iters": "lr_decay_iters", "num_microbatches": "grad_accum_steps",
           "compute_dtype": "dtype", "manual_dir": "tfds_manual_dir",
           "data_dir": "tfds_data_dir", "encoding_file": "tokenizer_file",
           "source": "init_from", "allow_pickle": "trust_pickle"}

_NAME = re.compile(r"`(?:[A-Z]\w*\.)?(\w+)(=[^`]*)?`")


def in_flags(message: str, known: Container[str]) -> str:
  """`message` with every backticked Python name that is one of the `known` flags
  written as that flag; other backticked text stays as it is."""
  def flag(match):
    name = FLAG_OF.get(match.group(1), match.group(1))
    if name not in known:
      return match.group(0)
    return f"--{name}{match.group(2) or ''}"
  return _NAME.sub(flag, message)


def one_line(error: BaseException, known: Container[str] = ()) -> str:
  """`error` as the line a command line prints: `error: ...`, in the flags' words."""
  return "error: " + in_flags(" ".join(str(error).split()), known)


def fail(error: BaseException, known: Container[str] = ()) -> NoReturn:
  """Exits with `error` as one line (exit code 1); see `one_line`."""
  raise SystemExit(one_line(error, known))

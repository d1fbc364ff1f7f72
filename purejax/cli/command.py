"""How every absl command line runs: fresh flags per call, one line per error.

    sys.exit(command.run(argv, define_flags, body, usage=__doc__))   # the exit code

Each call defines the command's flags into a new `flags.FlagValues`, so a
program (or a test) may run a command line many times in one process and
no call sees another's values. What absl's `app.run` would print as usage
and a message (a value that is not a number, an unknown choice or flag) is
one `error: ...` line here, with exit code 1, as are the checks every
command shares: no positional arguments, finite numbers.
"""

import math
import sys
from typing import Callable, Optional, Sequence

from absl import flags
from absl import logging

from purejax.cli import errors

EXIT_ERROR = 1  # bad flags, missing data, an unusable checkpoint


def given(args: flags.FlagValues, name: str) -> bool:
  """Whether `--name` was written on the command line (not left at its default)."""
  return name in args and args[name].present > 0


def check_finite(args: flags.FlagValues) -> None:
  """Refuses a float flag set to nan or inf: it would surface later as a NaN loss."""
  for name in sorted(args):
    flag = args[name]
    if name == flag.name and isinstance(flag.value, float) and not math.isfinite(flag.value):
      default = "" if flag.default is None else f" such as its default, {flag.default:g}"
      raise ValueError(f"--{name}={flag.value} is not a finite number; pass a finite "
                       f"value{default}.")


def _define_own_flags(args: flags.FlagValues) -> None:
  flags.DEFINE_bool("help", False, "Show this help and exit.", short_name="?",
                    flag_values=args)
  flags.DEFINE_integer("verbosity", None, "Log level of absl and JAX (0: INFO; default: "
                       "WARNING).", short_name="v", flag_values=args)


def parse(argv: Sequence[str], define: Callable[[flags.FlagValues], None]
          ) -> flags.FlagValues:
  """`argv` (the program's name first) parsed into new flags that `define` defines.

  Raises:
    SystemExit: a flag absl cannot parse, an unknown flag, a missing required
      one, a positional argument or a non-finite number, with its `error:` line.
  """
  args = flags.FlagValues()
  define(args)
  _define_own_flags(args)
  try:
    rest = args(list(argv))
  except flags.Error as e:
    message = " ".join(str(e).split())
    message = message[len("flag "):] if message.startswith("flag --") else message
    raise SystemExit(f"error: {message} (--help lists the flags).") from None
  if args.help:
    return args
  if len(rest) > 1:
    raise SystemExit(f"error: unexpected arguments {rest[1:]}; flags are written "
                     f"--name=value (--help lists them).")
  try:
    check_finite(args)
  except ValueError as e:
    errors.fail(e)
  return args


def run(argv: Sequence[str], define: Callable[[flags.FlagValues], None],
        body: Callable[[flags.FlagValues], Optional[int]], usage: str) -> int:
  """Parses `argv` (see `parse`), then runs `body(args)`; returns the exit code.

  `--help` prints the first two paragraphs of `usage` (the command's
  docstring: what it does, and its examples) and the flags.

  `body` stops a run with `SystemExit` (`errors.fail` for its one-line
  errors); its message is printed to stderr and the code is 1, as Python
  does for `sys.exit(message)`.
  """
  try:
    args = parse(argv, define)
    if args.help:
      print("\n\n".join(usage.strip().split("\n\n")[:2]) + "\n" + args.get_help())
      return 0
    if args["verbosity"].present:
      logging.set_verbosity(args.verbosity)
    else:
      logging.set_verbosity(logging.WARNING)  # TFDS's and JAX's INFO lines
    code = body(args)
  except SystemExit as e:
    code = e.code
  if isinstance(code, str):
    print(code, file=sys.stderr)
    return EXIT_ERROR
  return code or 0


def main(run_command: Callable[[Sequence[str]], int]) -> None:
  """A program's entry point: `run_command(sys.argv)` with absl's log handler; exits."""
  logging.use_absl_handler()
  flags.FLAGS.mark_as_parsed()  # absl's own flags keep their defaults
  sys.exit(run_command(sys.argv))

"""`python -m purejax.plot`: the loss curves of training runs, in one PNG.

    python -m purejax.plot out-gpt out-gpt-bf16 --out=loss.png

The library behind it is `purejax.training.effects.plots`. Needs matplotlib, an
optional extra: `pip install purejax[plot]`.
"""

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from purejax.cli import command
from purejax.training.effects import plots


class _Parser(argparse.ArgumentParser):
  """argparse, with its errors as one `error: ...` line and exit code 1."""

  def error(self, message: str) -> NoReturn:
    raise SystemExit(f"error: {message} (--help lists the arguments).")


def run(argv: Optional[Sequence[str]] = None) -> int:
  """`python -m purejax.plot` with `argv` (without the program's name): the exit code."""
  parser = _Parser(prog="python -m purejax.plot",
                   description="The loss curves of training runs, in one PNG.")
  parser.add_argument("run_dirs", nargs="+", metavar="OUT_DIR", help="training run directories")
  parser.add_argument("--out", default="loss.png", help="PNG to write (default: loss.png)")
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:
    if isinstance(e.code, str):
      print(e.code, file=sys.stderr)
      return command.EXIT_ERROR
    return e.code or 0  # --help
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
  except ImportError:
    print(f"error: {plots.MATPLOTLIB_MISSING}", file=sys.stderr)
    return command.EXIT_ERROR
  del matplotlib  # only checked for here; plots.plot_runs imports the parts it uses
  try:
    for run_dir in args.run_dirs:
      if not any(c.steps for c in plots.run_curves(run_dir)):
        print(f"warning: {run_dir} has no loss values yet", file=sys.stderr)
    plots.plot_runs(args.run_dirs, args.out)
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return command.EXIT_ERROR
  print(f"wrote {args.out}")
  return 0


def main() -> None:
  sys.exit(run())


if __name__ == "__main__":
  main()

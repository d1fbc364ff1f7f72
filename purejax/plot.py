"""`python -m purejax.plot`: the loss curves of training runs, in one PNG.

    python -m purejax.plot out-gpt out-gpt-bf16 --out=loss.png

The library behind it is `purejax.training.plots`. Needs matplotlib, an
optional extra: `pip install purejax[plot]`.
"""

import argparse
import sys
from typing import Optional, Sequence

from purejax.training import plots


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m purejax.plot",
                                   description=__doc__.split("\n", 1)[0].replace('`python -m purejax.plot`: ', ''))
  parser.add_argument("run_dirs", nargs="+", metavar="OUT_DIR", help="training run directories")
  parser.add_argument("--out", default="loss.png", help="PNG to write (default: loss.png)")
  args = parser.parse_args(argv)
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
  except ImportError:
    print(f"error: {plots.MATPLOTLIB_MISSING}", file=sys.stderr)
    return 1
  del matplotlib  # only checked for here; plots.plot_runs imports the parts it uses
  try:
    for run_dir in args.run_dirs:
      if not any(c.steps for c in plots.run_curves(run_dir)):
        print(f"warning: {run_dir} has no loss values yet", file=sys.stderr)
    plots.plot_runs(args.run_dirs, args.out)
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""`python -m purejax.eval`: runs the command line `purejax.cli.eval` under its short name.

Only a program's name: the command line lives in `purejax/cli/eval.py`; the
library is `purejax.evaluation`.
"""

if __name__ == "__main__":
  from purejax.cli import eval as eval_cli
  eval_cli.main()

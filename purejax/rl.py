"""`python -m purejax.rl`: runs the command line `purejax.cli.rl` under its short name.

Only a program's name: the command line lives in `purejax/cli/rl.py`.
"""

if __name__ == "__main__":
  from purejax.cli import rl
  rl.main()

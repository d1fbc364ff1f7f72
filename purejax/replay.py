"""`python -m purejax.replay`: runs the command line `purejax.cli.replay` under its short name.

Only a program's name: the command line lives in `purejax/cli/replay.py`.
"""

if __name__ == "__main__":
  from purejax.cli import replay
  replay.main()

"""`python -m purejax.plot`: runs the command line `purejax.cli.plot` under its short name.

Only a program's name: the command line lives in `purejax/cli/plot.py`.
"""

if __name__ == "__main__":
  from purejax.cli import plot
  plot.main()

"""`python -m purejax.train`: runs the command line `purejax.cli.train` under its short name.

Only a program's name: the command line lives in `purejax/cli/train.py`.
"""

if __name__ == "__main__":
  from purejax.cli import train
  train.main()

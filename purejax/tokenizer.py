"""`python -m purejax.tokenizer`: runs the command line `purejax.cli.tokenizer` under its short name.

Only a program's name: the command line lives in `purejax/cli/tokenizer.py`.
"""

if __name__ == "__main__":
  from purejax.cli import tokenizer
  tokenizer.main()

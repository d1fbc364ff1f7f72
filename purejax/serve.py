"""`python -m purejax.serve`: runs the command line `purejax.cli.serve` under its short name.

Only a program's name: the command line lives in `purejax/cli/serve.py`.
"""

if __name__ == "__main__":
  from purejax.cli import serve
  serve.main()

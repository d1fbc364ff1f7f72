"""`python -m purejax.sample`: runs the command line `purejax.cli.sample` under its short name.

Only a program's name: the command line lives in `purejax/cli/sample.py`.
"""

if __name__ == "__main__":
  from purejax.cli import sample
  sample.main()

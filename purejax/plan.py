"""`python -m purejax.plan`: runs the command line `purejax.cli.plan` under its short name.

Only a program's name: the command line lives in `purejax/cli/plan.py`.
"""

if __name__ == "__main__":
  from purejax.cli import plan
  plan.main()

"""`python -m purejax.chat`: runs the command line `purejax.cli.chat` under its short name.

Only a program's name: the command line lives in `purejax/cli/chat.py`.
"""

if __name__ == "__main__":
  from purejax.cli import chat
  chat.main()

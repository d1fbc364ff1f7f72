"""`python -m purejax.convert`: runs the command line `purejax.cli.convert` under its short name.

Only a program's name: the command line lives in `purejax/cli/convert.py`.
`purejax.convert`, the package's attribute, is the function
`purejax.weights.convert`. Imported as a module, this file would replace
that attribute (Python sets a package's attribute to each submodule it
imports), so it refuses to be imported: it runs only as `python -m`.
"""

if __name__ == "__main__":
  from purejax.cli import convert
  convert.main()
else:
  raise ImportError("purejax.convert is the function purejax.weights.convert; the command "
                    "line's module is purejax.cli.convert (run: python -m purejax.convert).")

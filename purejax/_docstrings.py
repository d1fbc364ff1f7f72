"""What a docstring says of each attribute: the command lines' help comes from it.

    attributes(GPTConfig.__doc__)["n_head"]  # "attention heads; must divide `n_embd`."
"""

import re
from typing import Dict


def attributes(doc: str, prefix: str = "") -> Dict[str, str]:
  """`{prefix + name: its text}` from a Google-style docstring's `Attributes:` section
  (`name: text`, continued on deeper-indented lines; `a, b: text` names several)."""
  docs, names = {}, []
  sections = (doc or "").split("Attributes:", 1)
  for line in (sections[1] if len(sections) > 1 else "").splitlines():
    match = re.match(r"^    (\w+(?:, \w+)*): (.*)$", line)
    if match:
      names = [prefix + n for n in match.group(1).split(", ")]
      for name in names:
        docs[name] = match.group(2)
    elif names and line.startswith(" " * 6):
      for name in names:
        docs[name] += " " + line.strip()
    else:
      names = []
  return docs

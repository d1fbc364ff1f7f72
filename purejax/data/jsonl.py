"""The lines of a `.jsonl` file, each one JSON value, read with errors that name the line.

    records = read_records(path, ConversationError, 'one {"messages": [...]}')
    for number, record in records: ...             # 1-based line numbers, blank lines skipped

What a record must hold is each data kind's own check (conversations, preference pairs,
RL tasks); reading the file and parsing its lines is this one.
"""

import json
import pathlib
from typing import Any, List, Tuple, Type


def read_records(path: pathlib.Path, error: Type[Exception], line_holds: str
                 ) -> List[Tuple[int, Any]]:
  """`[(line number, parsed value)]` of the file's non-blank lines.

  Args:
    path: the `.jsonl` file.
    error: the exception class raised (the data kind's, a ValueError).
    line_holds: what a line holds, for the messages (`'one {"messages": [...]}'`).

  Raises:
    error: a missing or unreadable file, or a line that is not JSON (named by its number).
  """
  try:
    lines = path.read_text(encoding="utf-8").splitlines()
  except FileNotFoundError:
    raise error(f"{path} does not exist; pass a .jsonl file of {line_holds} per "
                f"line.") from None
  except (OSError, UnicodeDecodeError) as e:
    raise error(f"{path} does not read as UTF-8 text ({e}).") from e
  records = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      records.append((number, json.loads(line)))
    except ValueError as e:
      raise error(f"{path}:{number} is not JSON ({e}); each line holds {line_holds}.") from e
  return records

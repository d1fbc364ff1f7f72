"""The package's shape: layers that import only downward, no circles, no runaway modules,
the forms chosen only where a user starts, and no file that uses a name it never defines.

The layers are the ones `purejax/__init__.py`'s docstring draws, bottom to
top; a module may import from its own layer and the layers below it. These
tests read the source with `ast` (nothing is imported), so they name the
file and line of the import that breaks the rule.
"""

import ast
import pathlib
import re
from typing import Dict, List, Tuple

import purejax

from helpers.data import need

PACKAGE = pathlib.Path(purejax.__file__).parent
# Every folder of Python the repository ships or runs: the library, its benchmarks,
# examples and tests.
SOURCE_FOLDERS = ("purejax", "bench", "examples", "tests")
# A sanity bound, not a target: modules are split by job, and a long one is a
# signal to look at it, not a reason to cut it where the count falls.
MAX_LINES = 800


def layers() -> Dict[str, int]:
  """`{top-level name: layer}` from the docstring's drawing (0 is the bottom)."""
  drawing = purejax.__doc__.split("bottom to top")[1].split("\n\n")[1]
  rows = [line for line in drawing.splitlines() if re.match(r"^    \S", line)]
  order = {}
  for index, row in enumerate(rows):  # deeper-indented lines continue a row's text
    names = re.split(r"\s{2,}", row.strip())[0]
    for name in re.split(r"[,\s]+", names):
      order[name.strip("/")] = index
  return order


def modules() -> Dict[str, pathlib.Path]:
  """`{dotted name: file}` of every module of the package but its `__init__`."""
  found = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    name = ".".join(parts)
    if name != "purejax" and "_datasets" not in parts:
      found[name] = path
  return found


def imports_of(path: pathlib.Path, known) -> List[Tuple[str, int]]:
  """`(purejax module, line)` for every import in the file, wherever it stands."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      # `from purejax.data import corpus` imports purejax.data.corpus.
      names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known
               else node.module for alias in node.names]
    else:
      continue
    found += [(name, node.lineno) for name in names if name.split(".")[0] == "purejax"
              and name != "purejax"]
  return found


def layer_of(module: str, order: Dict[str, int]) -> int:
  return order[module.split(".")[1]]


def test_every_module_has_a_layer():
  order = layers()
  assert {"ops", "rng", "nn", "gpt", "mlp", "data", "training", "weights", "cli"} <= set(order)
  assert order["cli"] == max(order.values())  # the command lines are the top
  missing = sorted(name for name in modules() if name.split(".")[1] not in order)
  assert not missing, (f"{missing} belong to no layer: add them to the drawing in "
                       f"purejax/__init__.py's docstring")


def test_imports_go_only_downward():
  order, known = layers(), modules()
  upward = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            for name, path in known.items() for target, line in imports_of(path, known)
            if name.split(".")[1] in order and target.split(".")[1] in order
            and layer_of(target, order) > layer_of(name, order)]
  assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_import_circles():
  known = modules()
  graph = {name: {t for t, _ in imports_of(path, known) if t in known and t != name}
           for name, path in known.items()}
  # A package's __init__ importing its own modules is how packages work, not a circle.
  graph = {name: {t for t in targets if not t.startswith(name + ".")}
           for name, targets in graph.items()}
  done, stack = set(), []

  def visit(name):
    if name in stack:
      raise AssertionError("import circle: " + " -> ".join(stack[stack.index(name):] + [name]))
    if name in done:
      return
    stack.append(name)
    for target in sorted(graph[name]):
      visit(target)
    stack.pop()
    done.add(name)

  for name in sorted(graph):
    visit(name)


def test_no_module_runs_away():
  long = {str(path.relative_to(PACKAGE.parent)): n for path in modules().values()
          if (n := len(path.read_text().splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines (does each still do one job?): {long}"


def test_library_errors_name_arguments_not_flags():
  # Only the command lines speak of --flags (they show the library's
  # backticked names as their flags, purejax/cli/errors.py).
  order, cli_layer = layers(), max(layers().values())
  flagged = []
  for name, path in modules().items():
    if order.get(name.split(".")[1]) == cli_layer:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Raise):
        for part in ast.walk(node):
          if (isinstance(part, ast.Constant) and isinstance(part.value, str)
              and re.search(r"(?<![\w-])--[a-z_]+", part.value)):
            flagged.append(f"{path.relative_to(PACKAGE.parent)}:{part.lineno}: {part.value}")
  assert not flagged, "library errors that name --flags:\n" + "\n".join(flagged)


def test_the_top_level_command_names_only_run_their_cli_module():
  # `python -m purejax.train` is `purejax.cli.train`: the top-level file holds no code of its own.
  order, known = layers(), modules()
  names = [name for name in known
           if name.count(".") == 1 and order[name.split(".")[1]] == order["cli"]
           and name != "purejax.cli"]
  assert sorted(names) == ["purejax.chat", "purejax.convert", "purejax.eval", "purejax.plan",
                           "purejax.plot",
                           "purejax.replay", "purejax.rl", "purejax.sample", "purejax.serve",
                           "purejax.tokenizer", "purejax.train"]
  for name in names:
    command = name.split(".")[1]
    assert [target for target, _ in imports_of(known[name], known)] == [
        f"purejax.cli.{command}"], name
    assert len(known[name].read_text().splitlines()) <= 20, name


def test_ops_sit_below_the_layers_and_import_nothing_above_them():
  # The model's operations (forms, matmul, attention, dropout) are the floor
  # the layers stand on: `nn` uses them, never the reverse.
  order, known = layers(), modules()
  assert order["ops"] < order["nn"], "ops/ must be drawn below nn in purejax/__init__.py"
  upward = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            for name, path in known.items() if name.startswith("purejax.ops.")
            for target, line in imports_of(path, known)
            if target.split(".")[1] not in order or layer_of(target, order) > order["ops"]]
  assert not upward, "ops/ imports from above it:\n" + "\n".join(upward)


# Where a user starts, and so where the forms are chosen (`kernels.select`):
# the command lines, the training loops, and the interactive model calls
# (`gpt.forward`/`loss`, `engine.generate`) when given no forms. Everything
# below takes `forms` as an argument.
FORMS_ENTRY_POINTS = {
    "purejax.cli.forms_flags",        # purejax.train and purejax.sample's flags
    "purejax.cli.replay",             # the replay command line
    "purejax.cli.plan",               # the GPU plan's command line (always GPU forms)
    "purejax.training.loops.gpt_run",       # train_gpt, train_gpt_sweep, evaluate_gpt (forms_of)
    "purejax.training.loops.rl_loop",       # train_rl
    "purejax.gpt.model",              # forward, loss
    "purejax.decode",                 # forward_with_cache
    "purejax.engine",                 # Engine, generate, sample_text
    "purejax.evaluation.loglik",      # score (evaluation.evaluate called by hand)
}


def select_calls(path: pathlib.Path) -> List[int]:
  """Lines that call `kernels.select` (as `kernels.select(...)` or a bare `select(...)`)."""
  lines = []
  for node in ast.walk(ast.parse(path.read_text())):
    if not isinstance(node, ast.Call):
      continue
    func = node.func
    if (isinstance(func, ast.Attribute) and func.attr == "select"
        and isinstance(func.value, ast.Name) and func.value.id == "kernels") or (
            isinstance(func, ast.Name) and func.id in ("select", "select_forms")):
      lines.append(node.lineno)
  return lines


def test_forms_are_chosen_only_at_the_entry_points():
  calls = {name: select_calls(path) for name, path in modules().items()}
  elsewhere = [f"{modules()[name].relative_to(PACKAGE.parent)}:{line}"
               for name, lines in calls.items() if name not in FORMS_ENTRY_POINTS
               for line in lines]
  assert not elsewhere, ("kernels.select called below the entry points (take `forms` as an "
                         "argument instead):\n" + "\n".join(elsewhere))
  # The allow-list names real callers: a module that stops choosing leaves it.
  assert all(calls[name] for name in FORMS_ENTRY_POINTS), {
      name: calls[name] for name in FORMS_ENTRY_POINTS}


def undefined_names(path: pathlib.Path) -> List[str]:
  """pyflakes' `file:line: message` for each name the file uses and never defines.

  Only these messages: a name used but never bound fails only when its line runs,
  and a script's `main` or a benchmark's arm may run rarely (an unused import is
  harmless and is left to taste).
  """
  need("pyflakes")
  from pyflakes import checker, messages  # only where pyflakes is installed
  wanted = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)
  found = checker.Checker(ast.parse(path.read_text()), filename=str(path))
  return [f"{path}:{m.lineno}: {m.message % m.message_args}"
          for m in found.messages if isinstance(m, wanted)]


def test_no_file_uses_a_name_it_never_defines():
  # A benchmark once lost the tables its main loops over when its flags moved; nothing
  # ran that line until someone ran the benchmark.
  root = PACKAGE.parent
  found = [line for folder in SOURCE_FOLDERS for path in sorted((root / folder).rglob("*.py"))
           for line in undefined_names(path)]
  assert not found, "names used but never defined:\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path):
  # The ast checks above must be able to fail: a select call and an upward import.
  source = tmp_path / "module.py"
  source.write_text("from purejax import nn\nforms = kernels.select('cpu')\nselect()\n")
  assert select_calls(source) == [2, 3]
  assert imports_of(source, modules()) == [("purejax.nn", 1)]
  assert [line.split(": ", 1)[1] for line in undefined_names(source)] == [
      "undefined name 'kernels'", "undefined name 'select'"]

"""Several tasks on one model: the results as a dict, a table and a JSON file.

    results = suite.evaluate(params, config, tokenizer, [tasks.load_task("hellaswag.jsonl")])
    print(suite.table(results))
"""

import json
import pathlib
import sys
import time
from typing import Any, Dict, Optional, Sequence

from purejax import _files
from purejax.evaluation import tasks as tasks_lib


def _bar(name: str):
  """A progress line on a terminal (nothing when stderr is not one)."""
  if not sys.stderr.isatty():
    return None

  def show(done: int, total: int) -> None:
    end = "\n" if done >= total else ""
    print(f"\r{name}: {done}/{total} requests", end=end, file=sys.stderr, flush=True)
  return show


def evaluate(params, config, tokenizer, tasks: Sequence[tasks_lib.Task], *,
             batch_size: int = 8, limit: Optional[int] = None, forms=None,
             progress: bool = True) -> Dict[str, Dict[str, Any]]:
  """Runs each task (`tasks.run_task`); returns `{task name: its metrics}`, each with
  the `seconds` it took.

  Args:
    params, config, tokenizer: the model (`weights.from_pretrained`'s, or a run's).
    tasks: from `tasks.load_task`.
    batch_size: requests per compiled call.
    limit: score only each task's first `limit` items.
    forms: execution forms; None: those of the platform `params` live on.
    progress: show a progress line per task on a terminal.

  Raises:
    ValueError: two tasks of one name; what `run_task` raises.
  """
  tasks_lib.check_names(tasks)
  results = {}
  for task in tasks:
    start = time.perf_counter()
    results[task.name] = tasks_lib.run_task(
        task, params, config, tokenizer, batch_size=batch_size, limit=limit, forms=forms,
        progress=_bar(task.name) if progress else None)
    results[task.name]["seconds"] = round(time.perf_counter() - start, 2)
  return results


def table(results: Dict[str, Dict[str, Any]]) -> str:
  """The results as a Markdown table, one row per task."""
  lines = ["| task | kind | items | shots | accuracy | centered | acc (sum) | acc (per char) "
           "| seconds |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for name, r in results.items():
    lines.append(f"| {name} | {r['kind']} | {r['items']} | {r['num_fewshot']} | "
                 f"{r['accuracy']:.4f} | {r['centered']:.4f} | {r['accuracy_sum']:.4f} | "
                 f"{r['accuracy_per_char']:.4f} | {r['seconds']:.1f} |")
  return "\n".join(lines)


def write_results(path: str, results: Dict[str, Dict[str, Any]], meta: Dict[str, Any]) -> None:
  """`{"meta": ..., "results": ...}` as JSON at `path`, written whole or not at all."""
  out = pathlib.Path(path).expanduser()
  payload = json.dumps({"meta": meta, "results": results}, indent=1).encode()
  if out.exists() and not out.is_file():  # /dev/stdout, /dev/null, a pipe: written in place
    with open(out, "wb") as f:
      f.write(payload)
    return
  out.parent.mkdir(parents=True, exist_ok=True)
  _files.atomic_write_bytes(out, payload)

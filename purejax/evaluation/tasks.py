"""Multiple-choice, schema and language-modelling tasks from local files, scored by
log-likelihood in the formats of DCLM's CORE suite (which nanochat reports).

    task = tasks.load_task("arc_easy.jsonl", num_fewshot=5)
    result = tasks.run_task(task, params, config, tokenizer)   # {"accuracy": ..., ...}

A task file is JSON lines, one item each, of one of three kinds (the kind is
read from the first item's keys):

* multiple choice: `{"query": str, "choices": [str, ...], "gold": int}`; each
  choice is scored as the continuation of the query;
* schema: `{"context_options": [str, ...], "continuation": str, "gold": int}`;
  the one continuation is scored after each context;
* language modelling: `{"context": str, "continuation": str}`; right when
  every continuation token is the model's argmax.

Or a `.json` spec that names such a file and its settings:
`{"data": "items.jsonl", "num_fewshot": 5, "continuation_delimiter": " ",
"random_baseline": 25.0, "name": "arc_easy"}` (`data` relative to the spec).

Few-shot examples come before each item, separated by a blank line: other
items of the file, drawn by `random.Random(1234 + item index)` (CORE's rule),
each written with its right answer. An item's choice is the one of lowest
mean loss per continuation token (CORE's `accuracy`); `accuracy_sum` takes
the highest summed log-likelihood (lm-evaluation-harness's `acc`) and
`accuracy_per_char` the highest per character of the option, the delimiter left out (its
`acc_norm`). `centered` is `(accuracy - baseline) / (1 - baseline)`, the
baseline being the task's random accuracy (CORE's centred accuracy: 0 is
chance, 1 is perfect).
"""

import dataclasses
import json
import pathlib
import random  # a seeded instance per item, CORE's few-shot rule: no global state
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from purejax.evaluation import loglik

KINDS = ("multiple_choice", "schema", "language_modeling")
_KEYS = {"multiple_choice": ("query", "choices", "gold"),
         "schema": ("context_options", "continuation", "gold"),
         "language_modeling": ("context", "continuation")}
FEWSHOT_SEED = 1234


class TaskError(ValueError):
  """A task file or spec that cannot be read as a task."""


@dataclasses.dataclass(frozen=True)
class Task:
  """A task's items and how they are asked.

  Attributes:
    name: shown in the results (the file's stem unless the spec names it).
    kind: one of `KINDS`.
    items: the parsed items.
    num_fewshot: answered examples before each item.
    delimiter: between a query (or context) and its continuation.
    random_baseline: the accuracy of chance, in [0, 1).
  """
  name: str
  kind: str
  items: Tuple[Dict[str, Any], ...]
  num_fewshot: int = 0
  delimiter: str = " "
  random_baseline: float = 0.0


def _kind_of(item: Dict[str, Any], where: str) -> str:
  for kind in KINDS:
    if all(key in item for key in _KEYS[kind]):
      return kind
  raise TaskError(f"{where} is no task item: it needs the keys of one of "
                  + "; ".join(f"{k} ({', '.join(_KEYS[k])})" for k in KINDS) + ".")


def _check(item: Dict[str, Any], kind: str, where: str) -> None:
  options = item.get("choices") if kind == "multiple_choice" else item.get("context_options")
  if kind != "language_modeling":
    if (not isinstance(options, list) or len(options) < 2
        or not all(isinstance(o, str) for o in options)):
      raise TaskError(f"{where}: {_KEYS[kind][0 if kind == 'schema' else 1]} must be a list "
                      f"of at least two strings.")
    gold = item.get("gold")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(options):
      raise TaskError(f"{where}: gold must be the index of the right option, 0 to "
                      f"{len(options) - 1}; got {gold!r}.")
  texts = [item[k] for k in _KEYS[kind] if k in ("query", "continuation", "context")]
  if not all(isinstance(t, str) for t in texts):
    raise TaskError(f"{where}: {', '.join(_KEYS[kind])} must hold strings.")
  if kind != "multiple_choice" and not item["continuation"]:
    raise TaskError(f"{where}: the continuation is empty; there would be nothing to score.")


def _read_items(path: pathlib.Path) -> Tuple[str, Tuple[Dict[str, Any], ...]]:
  if not path.is_file():
    raise TaskError(f"task file {path} does not exist; pass a .jsonl of task items or a .json "
                    f"spec naming one.")
  items, kind = [], None
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{number}"
      try:
        item = json.loads(line)
      except json.JSONDecodeError as e:
        raise TaskError(f"{where} is not JSON ({e.msg}); write one item per line.") from None
      if not isinstance(item, dict):
        raise TaskError(f"{where} is not a JSON object; write one item per line.")
      kind = kind or _kind_of(item, where)
      if _kind_of(item, where) != kind:
        raise TaskError(f"{where} is a {_kind_of(item, where)} item in a {kind} file; keep "
                        f"one kind per file.")
      _check(item, kind, where)
      items.append(item)
  if not items:
    raise TaskError(f"task file {path} holds no items.")
  return kind, tuple(items)


def _chance(kind: str, items: Sequence[Dict[str, Any]]) -> float:
  if kind == "language_modeling":
    return 0.0
  key = "choices" if kind == "multiple_choice" else "context_options"
  return float(np.mean([1.0 / len(item[key]) for item in items]))


def check_names(tasks: Sequence[Task]) -> None:
  """Raises TaskError where two tasks share a name (their results would collide)."""
  names = [t.name for t in tasks]
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise TaskError(f"tasks {', '.join(twice)} are named twice; give each its own name "
                    f"(a spec's \"name\").")


def load_task(path: str, *, num_fewshot: Optional[int] = None) -> Task:
  """A task from a `.jsonl` of items or a `.json` spec (see the module docstring).

  Args:
    path: the file.
    num_fewshot: answered examples before each item; None: the spec's, else 0.

  Raises:
    TaskError: a missing file, a line that is not an item, mixed kinds, a
      bad spec, or more few-shot examples than the other items.
  """
  file = pathlib.Path(path).expanduser()
  spec: Dict[str, Any] = {}
  if file.suffix == ".json":
    try:
      spec = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
      raise TaskError(f"task spec {file} does not exist.") from None
    except json.JSONDecodeError as e:
      raise TaskError(f"task spec {file} is not JSON ({e.msg}).") from None
    known = {"data", "name", "num_fewshot", "continuation_delimiter", "random_baseline"}
    if not isinstance(spec, dict) or "data" not in spec or set(spec) - known:
      raise TaskError(f"task spec {file} must be an object with \"data\" (the items' .jsonl) "
                      f"and optionally {', '.join(sorted(known - {'data'}))}.")
    data = file.parent / spec["data"]
  else:
    data = file
  kind, items = _read_items(data)
  shots = num_fewshot if num_fewshot is not None else int(spec.get("num_fewshot", 0))
  if shots < 0 or shots > len(items) - 1:
    raise TaskError(f"{file}: {shots} few-shot examples, but an item has {len(items) - 1} "
                    f"others to draw them from; ask for 0 to {len(items) - 1}.")
  baseline = spec.get("random_baseline")
  baseline = _chance(kind, items) if baseline is None else float(baseline) / 100.0
  if not 0.0 <= baseline < 1.0:
    raise TaskError(f"{file}: random_baseline must be a percentage in [0, 100).")
  return Task(str(spec.get("name", data.stem)), kind, items, shots,
              str(spec.get("continuation_delimiter", " ")), baseline)


def _answered(task: Task, item: Dict[str, Any]) -> str:
  """A few-shot example: the item with its right answer."""
  if task.kind == "multiple_choice":
    return item["query"] + task.delimiter + item["choices"][item["gold"]]
  if task.kind == "schema":
    return item["context_options"][item["gold"]] + task.delimiter + item["continuation"]
  return item["context"] + task.delimiter + item["continuation"]


def prompts(task: Task, index: int) -> List[Tuple[str, str]]:
  """`(context, continuation)` texts of item `index`, one per option, few-shot included."""
  item = task.items[index]
  prefix = ""
  if task.num_fewshot:
    others = [i for i in range(len(task.items)) if i != index]
    shots = random.Random(FEWSHOT_SEED + index).sample(others, task.num_fewshot)
    prefix = "".join(_answered(task, task.items[i]) + "\n\n" for i in shots)
  if task.kind == "multiple_choice":
    return [(prefix + item["query"], task.delimiter + c) for c in item["choices"]]
  if task.kind == "schema":
    return [(prefix + c, task.delimiter + item["continuation"]) for c in item["context_options"]]
  return [(prefix + item["context"], task.delimiter + item["continuation"])]


def encode_pair(tokenizer, context: str, continuation: str) -> loglik.Request:
  """Token ids of a context and its continuation, as lm-evaluation-harness splits them:
  the context's trailing spaces move to the continuation, the pair is encoded whole
  and the continuation is what follows the context's own encoding."""
  stripped = context.rstrip(" ")
  continuation = context[len(stripped):] + continuation
  whole = [int(i) for i in tokenizer.encode(stripped + continuation)]
  head = [int(i) for i in tokenizer.encode(stripped)] if stripped else []
  if not head:
    head = [start_id(tokenizer)]
    whole = head + whole
  return loglik.Request(head, whole[len(head):])


def start_id(tokenizer) -> int:
  """The id an empty context stands for: the tokenizer's end-of-text (lm-eval's
  prefix token), else its BOS, else (a character tokenizer) the new line."""
  spec = tokenizer.spec() if hasattr(tokenizer, "spec") else None
  for name in ("eos_token", "bos_token"):
    text = getattr(spec, name, None)
    if text:
      ids = list(tokenizer.encode(text))
      if len(ids) == 1:
        return int(ids[0])
  special = dict(getattr(spec, "special_tokens", ()) or ())
  if "<|endoftext|>" in special:
    return int(special["<|endoftext|>"])
  try:  # a character tokenizer: a new line stands between its texts
    ids = list(tokenizer.encode("\n"))
  except (KeyError, ValueError):
    ids = []
  if len(ids) == 1:
    return int(ids[0])
  raise TaskError("an item has an empty context, and this tokenizer has no end-of-text or "
                  "BOS token to stand for it; give every item a context.")


def run_task(task: Task, params, config, tokenizer, *, batch_size: int = 8,
             limit: Optional[int] = None, forms=None,
             progress: Optional[Callable[[int, int], None]] = None) -> Dict[str, Any]:
  """Scores the task's items (the first `limit`); returns its metrics.

  Returns:
    `{"accuracy", "accuracy_sum", "accuracy_per_char", "centered",
    "random_baseline", "items", "num_fewshot", "kind"}`; for language
    modelling the three accuracies are the same (every token greedy).
  """
  count = len(task.items) if limit is None else min(limit, len(task.items))
  texts = [prompts(task, i) for i in range(count)]
  requests = [encode_pair(tokenizer, context, continuation)
              for options in texts for context, continuation in options]
  report = None if progress is None else (lambda done: progress(done, len(requests)))
  scored = loglik.score(params, config, requests, batch_size=batch_size, forms=forms,
                        progress=report)
  rules = {"accuracy": lambda s, text: s.logprob / s.tokens,
           "accuracy_sum": lambda s, text: s.logprob,
           # per character of the option itself, without the delimiter (lm-eval's acc_norm)
           "accuracy_per_char": lambda s, text: s.logprob / max(1, len(text) - len(task.delimiter))}
  hits = {name: 0 for name in rules}
  at = 0
  for i, options in enumerate(texts):
    mine = scored[at:at + len(options)]
    at += len(options)
    if task.kind == "language_modeling":
      for name in rules:
        hits[name] += int(mine[0].greedy)
      continue
    gold = task.items[i]["gold"]
    for name, rule in rules.items():
      values = [rule(s, cont) for s, (_, cont) in zip(mine, options)]
      hits[name] += int(int(np.argmax(values)) == gold)
  result = {name: hits[name] / count for name in rules}
  result["centered"] = (result["accuracy"] - task.random_baseline) / (1 - task.random_baseline)
  result.update(random_baseline=task.random_baseline, items=count,
                num_fewshot=task.num_fewshot, kind=task.kind)
  return result

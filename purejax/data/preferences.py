"""Preference pairs for DPO: a prompt, a chosen and a rejected answer, tokenized as rows.

    data = load_preferences("pairs.jsonl", tokenizer, fmt, block_size=256)
    data = data.with_reference(*(preference.pair_logps(params, rows, weights, config,
                                                       forms=forms, batch_size=8)[0]
                                 for rows, weights in (data.train, data.val)))
    data.feed(put)                       # batches.DevicePairs of both splits

A `.jsonl` file holds one pair per line in one of TRL's two explicit-prompt
formats:

* standard: `{"prompt": str, "chosen": str, "rejected": str}`, plain text: each
  answer is the text that follows the prompt, ended by the model's EOS token (added
  where the answer does not end with it);
* conversational: `{"prompt": [messages], "chosen": [messages], "rejected":
  [messages]}`, the answers holding the assistant's message: rendered through the
  model's chat template, the prompt ready for the assistant's turn.

Which tokens count: an answer's tokens are those after the longest prefix that the
prompt's tokens share with both `prompt + chosen` and `prompt + rejected` (a merge
across the boundary moves it back, never into the prompt), through the first stop
id in a conversational answer (where sampling stops, as conversations count
them). Each side is one row of `block_size + 1` ids, padded after its end as
conversations are; an answer that does not fit is cut to the row (counted in the
log line); a prompt that leaves no room for an answer is refused, naming its line.
"""

import dataclasses
import json
import math
import pathlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from purejax.data import batches
from purejax.data import chat
from purejax.data import conversations
from purejax.data import jsonl
from purejax.data.errors import TokenizerError

SIDES = ("chosen", "rejected")


class PreferenceError(ValueError):
  """A preference file that cannot be used; the message says what to change."""


@dataclasses.dataclass(frozen=True, eq=False)
class Preferences:
  """Tokenized preference pairs, two padded rows each (chosen, rejected).

  Attributes:
    tokenizer: the model's tokenizer.
    train: `(rows [n, 2, block_size + 1] int32, weights [n, 2, block_size] float32)`.
    val: the same, held out (the training pairs where the file has fewer than
      `conversations.MIN_FOR_VAL_SPLIT`).
    source: one line for the log.
    name: the file's name without its suffix.
    prompt_ids: the first held-out pair's prompt, what a run's closing sample continues.
    stop_ids: the ids that end an answer.
    reference: `([n_train, 2], [n_val, 2])`, the reference model's log-probability of
      each answer (`with_reference`); None before.
  """
  tokenizer: Any
  train: Tuple[np.ndarray, np.ndarray]
  val: Tuple[np.ndarray, np.ndarray]
  source: str
  name: str = ""
  prompt_ids: Tuple[int, ...] = ()
  stop_ids: Tuple[int, ...] = ()
  reference: Optional[Tuple[np.ndarray, np.ndarray]] = None

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.vocab_size

  def check_block_size(self, block_size: int) -> None:
    """Raises ValueError where the rows are not padded to the model's `block_size + 1`."""
    if self.train[0].shape[2] != block_size + 1:
      raise ValueError(f"the preference pairs are padded to {self.train[0].shape[2]} tokens, "
                       f"not the model's block_size + 1 = {block_size + 1}; load them with "
                       f"the model's block_size.")

  def on_device(self) -> bool:
    return True

  def sample_prompt(self) -> Tuple[Tuple[int, ...], Optional[Tuple[int, ...]]]:
    return self.prompt_ids, self.stop_ids or None

  def byte_lengths(self) -> None:
    """None: a preference run's loss is not a per-token loss (no bits per byte)."""
    return None

  def with_reference(self, train: np.ndarray, val: np.ndarray) -> "Preferences":
    """These pairs with the reference model's log-probability of each answer, `[n, 2]`
    per split (`preference.pair_logps` of the starting model, computed once: training
    then holds no reference model)."""
    for name, ref, (rows, _) in (("train", train, self.train), ("val", val, self.val)):
      if np.shape(ref) != rows.shape[:2]:
        raise ValueError(f"the {name} reference is {np.shape(ref)}, not one value per "
                         f"answer {rows.shape[:2]}.")
    return dataclasses.replace(self, reference=(np.asarray(train, np.float32),
                                                np.asarray(val, np.float32)))

  def pairs(self) -> Tuple[batches.DevicePairs, batches.DevicePairs]:
    """`(train, val)` as `batches.DevicePairs` on the host."""
    if self.reference is None:
      raise ValueError("the pairs have no reference log-probabilities yet; give them the "
                       "starting model's first (with_reference).")
    return tuple(batches.DevicePairs(rows, weights, ref)
                 for (rows, weights), ref in zip((self.train, self.val), self.reference))

  def feed(self, put: Callable, **unused) -> batches.Feed:
    """Both splits' pairs on every device (`batches.pairs_feed`)."""
    del unused
    return batches.pairs_feed(*self.pairs(), put)


def is_preferences_file(dataset: str) -> bool:
  """Whether `--dataset` names a `.jsonl` of preference pairs: its first record has a
  "chosen" field (a conversations file's has "messages")."""
  path = pathlib.Path(str(dataset)).expanduser()
  if not str(dataset).endswith(".jsonl") or not path.is_file():
    return False
  try:
    with path.open(encoding="utf-8") as f:
      for line in f:
        if line.strip():
          record = json.loads(line)
          return isinstance(record, dict) and "chosen" in record
  except (OSError, ValueError):
    return False
  return False


def _read_pairs(path: pathlib.Path) -> Tuple[List[Tuple[int, dict]], bool]:
  """The pairs of a `.jsonl` file with their line numbers, each checked, and whether
  they are conversational."""
  pairs, kind = [], None
  for number, record in jsonl.read_records(
      path, PreferenceError, 'one {"prompt": ..., "chosen": ..., "rejected": ...}'):
    if not isinstance(record, dict):
      raise PreferenceError(f"{path}:{number} is not a JSON object.")
    for field in ("prompt", *SIDES):
      if field not in record:
        implicit = " (a prompt inside each answer is not read: give it as its own field)" \
            if field == "prompt" else ""
        raise PreferenceError(f'{path}:{number} has no "{field}"{implicit}; each pair needs '
                              f'"prompt", "chosen" and "rejected".')
    conversational = chat.is_messages(record["prompt"])
    if not conversational and not isinstance(record["prompt"], str):
      raise PreferenceError(f'{path}:{number}: "prompt" must be a string (standard format) or '
                            f'a non-empty list of {{"role", "content"}} messages '
                            f"(conversational).")
    for side in SIDES:
      value = record[side]
      if conversational:
        if not chat.is_messages(value) or value[-1].get("role") != "assistant" or not any(
            m["content"].strip() for m in value):
          raise PreferenceError(
              f'{path}:{number}: "{side}" must be a non-empty list of messages ending with '
              f"the assistant's, as the conversational prompt is a list of messages.")
      elif not isinstance(value, str) or not value.strip():
        raise PreferenceError(f'{path}:{number}: "{side}" is {"empty" if value == "" else "not a string"}; '
                              f"each pair needs a non-empty chosen and rejected answer.")
    if kind is not None and kind != conversational:
      raise PreferenceError(f"{path}:{number} is in the "
                            f"{'conversational' if conversational else 'standard'} format "
                            f"but the lines before are not; use one format for the file.")
    kind = conversational
    pairs.append((number, record))
  if not pairs:
    raise PreferenceError(f"{path} holds no preference pairs.")
  return pairs, bool(kind)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def _encode(tokenizer, text: str) -> List[int]:
  return [int(i) for i in tokenizer.encode(text)]


def pair_tokens(tokenizer, fmt: Optional[chat.ChatFormat], record: dict, conversational: bool
                ) -> Tuple[int, List[List[int]], List[List[float]]]:
  """One pair's `(prompt length, [chosen ids, rejected ids], [their weights])`: each
  side's whole sequence, with weight 1.0 on the answer's tokens."""
  if conversational:
    prompt = chat.encode(tokenizer, fmt, record["prompt"], add_generation_prompt=True)
    sides = []
    for side in SIDES:
      ids, weights = conversations.assistant_tokens(tokenizer, fmt,
                                                    record["prompt"] + record[side])
      sides.append((ids, weights))
  else:
    eos = (fmt.eos_token or "") if fmt is not None else ""
    prompt = _encode(tokenizer, record["prompt"])
    sides = []
    for side in SIDES:
      answer = record[side] if not eos or record[side].endswith(eos) else record[side] + eos
      ids = _encode(tokenizer, record["prompt"] + answer)
      sides.append((ids, [1.0] * len(ids)))
  start = min(len(prompt), *(_common_prefix(prompt, ids) for ids, _ in sides))
  # Only the last answer counts: a conversational prompt's own assistant turns do not.
  return start, [ids for ids, _ in sides], [[0.0] * start + w[start:] for _, w in sides]


def load_preferences(path: str, tokenizer, fmt: Optional[chat.ChatFormat], block_size: int
                     ) -> Preferences:
  """Reads and tokenizes a `.jsonl` file of preference pairs.

  Args:
    fmt: the model's chat format: its template renders conversational pairs, its EOS
      ends standard ones (None: no EOS; conversational pairs are then refused).

  Raises:
    PreferenceError: a missing or malformed file, a pair with a missing or empty
      side, a prompt that leaves no room for an answer in `block_size`, or a pair the
      chat template refuses, each named by its line.
  """
  file = pathlib.Path(path).expanduser()
  pairs, conversational = _read_pairs(file)
  if conversational and (fmt is None or not fmt.template):
    raise PreferenceError(f"{file} holds conversational pairs, which need the model's chat "
                          f"template; start from an instruct model that has one.")
  encoded, cut = [], 0
  for number, record in pairs:
    try:
      start, ids, weights = pair_tokens(tokenizer, fmt, record, conversational)
    except TokenizerError as e:
      raise PreferenceError(f"{file}:{number}: {e}") from e
    if start >= block_size:
      raise PreferenceError(f"{file}:{number}: the prompt is {start} tokens, which leaves no "
                            f"room for an answer in the context of {block_size}; shorten it, "
                            f"drop the pair, or train with a longer block_size.")
    cut += sum(len(side) > block_size + 1 for side in ids)
    encoded.append((ids, weights))
  n_val = (math.ceil(conversations.VAL_FRACTION * len(encoded))
           if len(encoded) >= conversations.MIN_FOR_VAL_SPLIT else 0)
  train = _rows(encoded[:len(encoded) - n_val], block_size)
  val = _rows(encoded[len(encoded) - n_val:], block_size) if n_val else train
  fmt_name = "conversational" if conversational else "standard"
  source = (f"{file.name}: {len(encoded) - n_val} preference pairs ({fmt_name}), padded to "
            f"{block_size + 1} tokens{f', {cut} answers cut to fit' if cut else ''}; "
            f"{f'{n_val} held out' if n_val else 'evaluated on the training ones'}")
  first = pairs[len(pairs) - n_val][1] if n_val else pairs[0][1]
  prompt = (chat.encode(tokenizer, fmt, first["prompt"], add_generation_prompt=True)
            if conversational else _encode(tokenizer, first["prompt"]))
  stops = tuple(fmt.stop_ids) if fmt is not None else ()
  return Preferences(tokenizer, train, val, source, file.stem, tuple(prompt), stops)


def _rows(encoded, block_size: int) -> Tuple[np.ndarray, np.ndarray]:
  """Rows `[n, 2, block_size + 1]` and target weights `[n, 2, block_size]`."""
  rows = np.zeros((len(encoded), 2, block_size + 1), np.int32)
  weights = np.zeros((len(encoded), 2, block_size), np.float32)
  for r, (sides, side_weights) in enumerate(encoded):
    for s, (ids, w) in enumerate(zip(sides, side_weights)):
      ids, w = ids[:block_size + 1], w[:block_size + 1]
      rows[r, s, :len(ids)] = ids
      weights[r, s, :len(ids) - 1] = w[1:]  # the weight of target t is that of token t + 1
  return rows, weights

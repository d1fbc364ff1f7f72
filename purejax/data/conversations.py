"""Conversations for fine-tuning an instruct model: rendered, tokenized, one per row.

    fmt = chat.load_chat_format(model_folder, tokenizer)
    ids, weights = assistant_tokens(tokenizer, fmt, messages)   # list[int], list[float]
    data = load_conversations("chats.jsonl", tokenizer, fmt, block_size=128)
    data.train                                                  # batches.DeviceRows-ready arrays

A `.jsonl` file holds one conversation per line, `{"messages": [{"role":
..., "content": ...}, ...]}`, the format of Hugging Face chat datasets and
OpenAI's fine-tuning files. Each conversation is rendered with the model's
own chat template (`purejax.data.chat`) and tokenized as
`apply_chat_template` would.

Which tokens the loss counts: an assistant message's tokens are those the
model would generate for it, found by rendering prefixes of the
conversation: from the end of `encode(messages[:i], add_generation_prompt=True)`
(the prompt, ending in the assistant's header) to the end of
`encode(messages[:i + 1])`, cut after the first stop id (`fmt.stop_ids`,
e.g. `<|im_end|>`) in it, which is where sampling stops. Everything else (the
system and user turns, the headers, the template's text between turns) has
weight 0 and so gets no gradient. A template whose prefixes do not tokenize
as prefixes of the whole conversation is refused (the rule would be wrong).

Padding, not packing: each conversation is one row of `block_size + 1`
ids, padded after its end, and a step draws whole rows. Attention then stays
inside one conversation with the model's ordinary causal mask (the padding
comes after every real token, so no real token sees it, and its weight is
0), positions start at 0 as they do when the model is talked to, and every
attention form runs unchanged. Packing several conversations into a row
would waste fewer tokens but needs per-conversation (segment) masks in every
attention form and positions reset per segment. A conversation longer than
`block_size + 1` tokens is cut to its first `block_size + 1` (the count is
reported).
"""

import dataclasses
import math
import pathlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from purejax.data import batches
from purejax.data import chat
from purejax.data import jsonl
from purejax.data.errors import TokenizerError

VAL_FRACTION = 0.1
# Files with fewer conversations evaluate on the training ones (a held-out
# tenth of a handful is no measure).
MIN_FOR_VAL_SPLIT = 10


class ConversationError(ValueError):
  """A conversations file that cannot be used; the message says what to change."""


@dataclasses.dataclass(frozen=True, eq=False)
class Conversations:
  """Tokenized conversations, one padded row each.

  Attributes:
    tokenizer: the model's tokenizer.
    train: `(rows [n, block_size + 1] int32, weights [n, block_size] float32)`,
      the arrays of a `batches.DeviceRows`; a target's weight is 1 where it is
      an assistant token.
    val: the same for evaluation.
    source: one line for the log.
    name: the file's name without its suffix.
    prompt_ids: a conversation's messages before its first answer, through the
      chat template and ready for the assistant's turn: of the first held-out
      conversation (else of the first).
    stop_ids: the ids that end the assistant's turn.
  """
  tokenizer: Any
  train: Tuple[np.ndarray, np.ndarray]
  val: Tuple[np.ndarray, np.ndarray]
  source: str
  name: str = ""
  prompt_ids: Tuple[int, ...] = ()
  stop_ids: Tuple[int, ...] = ()

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.vocab_size

  def check_block_size(self, block_size: int) -> None:
    """Raises ValueError where the rows are not padded to the model's `block_size + 1`."""
    if self.train[0].shape[1] != block_size + 1:
      raise ValueError(f"the conversations are padded to {self.train[0].shape[1]} tokens, "
                       f"not the model's block_size + 1 = {block_size + 1}; load "
                       f"them with the model's block_size.")

  def on_device(self) -> bool:
    """Always: whole rows on every device, from which each step draws."""
    return True

  def sample_prompt(self) -> Tuple[Tuple[int, ...], Optional[Tuple[int, ...]]]:
    """What a run's closing sample continues: a user's turn, and the ids that end
    the answer."""
    return self.prompt_ids, self.stop_ids or None

  def byte_lengths(self) -> Optional[np.ndarray]:
    """None: the loss counts the assistant's tokens only, so bits per byte would need
    the weights too (not logged)."""
    return None

  def feed(self, put: Callable, **unused) -> batches.Feed:
    """Its batches for a training loop: the rows and weights of both splits on every
    device (`batches.rows_feed`); the windowing arguments of `Corpus.feed` do not apply."""
    del unused
    return batches.rows_feed(self.train, self.val, put)


def is_conversations_file(dataset: str) -> bool:
  """Whether `--dataset` names a conversations file (by its `.jsonl` suffix)."""
  return str(dataset).endswith(".jsonl")


def assistant_tokens(tokenizer, fmt: chat.ChatFormat, messages: Sequence[chat.Message]
                     ) -> Tuple[List[int], List[float]]:
  """A conversation's ids and, per id, 1.0 where it is an assistant token (else 0.0).

  Raises:
    chat.ChatTemplateError: a malformed conversation, one that begins with
      the assistant, or a template whose prefixes do not tokenize as
      prefixes of the whole (see the module docstring).
  """
  ids = chat.encode(tokenizer, fmt, messages)
  weights = [0.0] * len(ids)
  for i, message in enumerate(messages):
    if message.get("role") != "assistant":
      continue
    if i == 0:
      raise chat.ChatTemplateError("the conversation begins with an assistant message; "
                                   "begin it with a user (or system) message.")
    start = len(chat.encode(tokenizer, fmt, messages[:i], add_generation_prompt=True))
    through = chat.encode(tokenizer, fmt, messages[:i + 1])
    if through != ids[:len(through)] or start > len(through):
      raise chat.ChatTemplateError(
          f"the chat template of {fmt.source or 'this model'} does not render a "
          f"conversation's beginning as the beginning of the whole, so its assistant "
          f"tokens cannot be told apart; fine-tune on plain text instead.")
    end = len(through)
    stops = [j for j in range(start, end) if through[j] in fmt.stop_ids]
    if stops:  # the answer ends with its stop token, as sampling does
      end = stops[0] + 1
    weights[start:end] = [1.0] * (end - start)
  return ids, weights


def _read_lines(path: pathlib.Path) -> List[List[dict]]:
  """The conversations of a `.jsonl` file, each line checked."""
  conversations = []
  for number, record in jsonl.read_records(path, ConversationError,
                                           'one {"messages": [...]}'):
    messages = record.get("messages") if isinstance(record, dict) else None
    if not chat.is_messages(messages):
      raise ConversationError(
          f'{path}:{number} needs {{"messages": [{{"role": ..., "content": ...}}, ...]}}, '
          f"a non-empty list of messages with string roles and contents.")
    conversations.append(messages)
  if not conversations:
    raise ConversationError(f"{path} holds no conversations.")
  return conversations


def _rows(encoded, block_size: int) -> Tuple[np.ndarray, np.ndarray]:
  """Padded rows `[n, block_size + 1]` and target weights `[n, block_size]`."""
  rows = np.zeros((len(encoded), block_size + 1), np.int32)  # padding: id 0, weight 0
  weights = np.zeros((len(encoded), block_size), np.float32)
  for r, (ids, w) in enumerate(encoded):
    ids, w = ids[:block_size + 1], w[:block_size + 1]
    rows[r, :len(ids)] = ids
    weights[r, :len(ids) - 1] = w[1:]  # the weight of target t is that of token t + 1
  return rows, weights


def load_conversations(path: str, tokenizer, fmt: chat.ChatFormat, block_size: int
                       ) -> Conversations:
  """Reads, renders and tokenizes a `.jsonl` file of conversations.

  The last tenth (rounded up) of the conversations is held out for
  evaluation; a file of fewer than `MIN_FOR_VAL_SPLIT` evaluates on its
  training conversations.

  Raises:
    ConversationError: a missing or malformed file, a conversation the
      template refuses (named by its line), or no assistant token at all.
  """
  file = pathlib.Path(path).expanduser()
  conversations = _read_lines(file)
  encoded = []
  for number, messages in enumerate(conversations, 1):
    try:
      encoded.append(assistant_tokens(tokenizer, fmt, messages))
    except TokenizerError as e:
      raise ConversationError(f"{file}, conversation {number}: {e}") from e
  cut = sum(len(ids) > block_size + 1 for ids, _ in encoded)
  n_val = math.ceil(VAL_FRACTION * len(encoded)) if len(encoded) >= MIN_FOR_VAL_SPLIT else 0
  train = _rows(encoded[:len(encoded) - n_val], block_size)
  val = _rows(encoded[len(encoded) - n_val:], block_size) if n_val else train
  if not train[1].any():
    raise ConversationError(f"{file}: no assistant token falls within block_size="
                            f"{block_size}; add assistant messages or raise block_size.")
  counted = int(train[1].sum())
  source = (f"{file.name}: {len(encoded) - n_val} conversations ({counted} assistant tokens "
            f"in the loss), padded to {block_size + 1} tokens"
            f"{f', {cut} cut to fit' if cut else ''}; "
            f"{f'{n_val} held out' if n_val else 'evaluated on the training ones'}")
  first = conversations[len(conversations) - n_val] if n_val else conversations[0]
  answer = next((i for i, m in enumerate(first) if m.get("role") == "assistant"), len(first))
  prompt = chat.encode(tokenizer, fmt, first[:answer], add_generation_prompt=True)
  return Conversations(tokenizer, train, val, source, file.stem, tuple(prompt),
                       tuple(fmt.stop_ids))

"""Chat templates: a conversation rendered and encoded as an instruct model was trained on.

    fmt = chat.load_chat_format("path/to/model")   # tokenizer_config.json, chat_template.jinja
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    text = chat.render(fmt, messages, add_generation_prompt=True)   # str
    ids = chat.encode(tokenizer, fmt, messages, add_generation_prompt=True)  # list[int]

A model folder ships its template as Jinja source. It is rendered here with
`jinja2`, the library transformers renders it with, in the same sandboxed
environment (`trim_blocks`, `lstrip_blocks`, loop controls) and with the
same names in scope: `messages`, `add_generation_prompt`, `tools`,
`documents`, the tokenizer's named special tokens (`bos_token`,
`eos_token`, `pad_token`, ...), `raise_exception`, `strftime_now`, and a
`tojson` filter that does not escape HTML. The rendered text is then
encoded with special tokens recognised (`<|im_start|>` is one id) and
nothing added, which is what transformers' `apply_chat_template` does; so
the ids are transformers' ids (tested on a real model's folder).

BOS: a Hugging Face template writes `bos_token` itself where its model
wants one, and transformers adds nothing around it, so a folder's format
has `add_bos=False`. A format read from elsewhere (a GGUF file's metadata,
whose runtimes put BOS before the rendered text when the file says so)
sets `add_bos=True`; `encode` then adds BOS unless the text already begins
with it.
"""

import dataclasses
import datetime
import json
import pathlib
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from purejax.data.errors import TokenizerError

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"
# The named special tokens transformers passes to every template (its
# tokenizers' SPECIAL_TOKENS_ATTRIBUTES), each only when the tokenizer has it.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")

Message = Mapping[str, Any]


class ChatTemplateError(TokenizerError):
  """A model without a chat template, a template that does not render, or a bad message."""


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """How a model's conversations are written: its template and the tokens it names.

  Attributes:
    template: the Jinja source of the chat template.
    bos_token: the text of the beginning-of-sequence token, or None.
    eos_token: the text of the end-of-sequence token, or None.
    add_bos: whether `encode` puts BOS before the rendered text (when the text
      does not already begin with it); False for Hugging Face folders, whose
      templates write BOS themselves.
    special_tokens: every named special token the template may use, as
      `(name, text)` pairs (`("pad_token", "<|im_end|>")`, ...), BOS and EOS included.
    stop_ids: the ids that end an assistant's turn (`generation_config.json`'s
      `eos_token_id`, which may be several, else the tokenizer's EOS); empty
      when unknown.
    source: where the template was read from (for messages).
  """
  template: str
  bos_token: Optional[str] = None
  eos_token: Optional[str] = None
  add_bos: bool = False
  special_tokens: Tuple[Tuple[str, str], ...] = ()
  stop_ids: Tuple[int, ...] = ()
  source: str = ""

  def template_globals(self) -> Dict[str, str]:
    """The special tokens by name, as the template sees them."""
    names = dict(self.special_tokens)
    if self.bos_token is not None:
      names["bos_token"] = self.bos_token
    if self.eos_token is not None:
      names["eos_token"] = self.eos_token
    return names


def is_messages(value: Any) -> bool:
  """Whether `value` is a non-empty list of `{"role": str, "content": str}` messages."""
  return isinstance(value, list) and bool(value) and all(
      isinstance(m, dict) and isinstance(m.get("role"), str)
      and isinstance(m.get("content"), str) for m in value)


def _token_text(value: Any) -> Optional[str]:
  """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _read_json(path: pathlib.Path) -> Dict[str, Any]:
  try:
    value = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise ChatTemplateError(f"{path} does not read as JSON ({e}); download the model "
                            f"folder again.") from e
  if not isinstance(value, dict):
    raise ChatTemplateError(f"{path} holds no JSON object; download the model folder again.")
  return value


def _template_of(config: Dict[str, Any], folder: pathlib.Path) -> Tuple[Optional[str], str]:
  """The default template and the file it came from: chat_template.jinja, else the config's."""
  jinja_file = folder / TEMPLATE_FILE
  if jinja_file.is_file():
    return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
  template = config.get("chat_template")
  if isinstance(template, list):  # several named templates: transformers uses "default"
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  return (template if isinstance(template, str) else None), str(folder / TOKENIZER_CONFIG)


def stop_ids_of_folder(folder: str, eos_id: Optional[int] = None) -> Tuple[int, ...]:
  """The ids that end a model's answer: `generation_config.json`'s `eos_token_id`
  (an id or a list), else `eos_id` (the tokenizer's EOS), else none."""
  path = pathlib.Path(folder).expanduser() / GENERATION_CONFIG
  if path.is_file():
    value = _read_json(path).get("eos_token_id")
    ids = value if isinstance(value, list) else [value]
    ids = tuple(int(i) for i in ids if isinstance(i, int))
    if ids:
      return ids
  return () if eos_id is None else (int(eos_id),)


def load_chat_format(folder: str, tokenizer=None) -> ChatFormat:
  """The chat format of a Hugging Face model folder.

  The template is `chat_template.jinja` if the folder has one (transformers
  saves it there), else `tokenizer_config.json`'s `chat_template`; the
  special tokens are `tokenizer_config.json`'s; the stop ids
  `generation_config.json`'s `eos_token_id`, else EOS's id in `tokenizer`
  (anything with `encode`; a `tokenizer_json.JSONTokenizer`) when given.

  Raises:
    ChatTemplateError: the folder has no chat template (a base model), or
      its files do not read.
  """
  root = pathlib.Path(folder).expanduser()
  config_file = root / TOKENIZER_CONFIG
  config = _read_json(config_file) if config_file.is_file() else {}
  template, source = _template_of(config, root)
  if not template:
    raise ChatTemplateError(
        f"{root} has no chat template (neither {TEMPLATE_FILE} nor a chat_template in "
        f"{TOKENIZER_CONFIG}): a base model, not an instruct one; sample it as plain text, "
        f"or use a model folder that has a template.")
  named = tuple((name, text) for name in SPECIAL_TOKEN_NAMES
                if (text := _token_text(config.get(name))) is not None)
  found = dict(named)
  eos_id = None
  if tokenizer is not None and found.get("eos_token"):
    eos_ids = list(tokenizer.encode(found["eos_token"]))
    eos_id = eos_ids[0] if len(eos_ids) == 1 else None
  return ChatFormat(template=template, bos_token=found.get("bos_token"),
                    eos_token=found.get("eos_token"), add_bos=False, special_tokens=named,
                    stop_ids=stop_ids_of_folder(str(root), eos_id), source=source)


# Tokens that end a turn, by their text, as llama.cpp's vocabulary loader knows them.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def format_of_spec(spec, tokenizer=None) -> Optional[ChatFormat]:
  """The chat format a tokenizer spec records (`chat_template`, `bos_token`,
  `eos_token`, `add_bos`: a GGUF file's metadata), or None when it has none.
  The stop ids are EOS's id in `tokenizer`, when given, and those of the
  `END_OF_TURN_TOKENS` the template writes (Gemma's `<end_of_turn>`)."""
  template = getattr(spec, "chat_template", None)
  if not template:
    return None
  bos, eos = getattr(spec, "bos_token", None), getattr(spec, "eos_token", None)
  stops = []
  # A GGUF names one EOS; the token that ends a turn may be another, which llama.cpp
  # recognises by its text (Gemma's <end_of_turn>): taken when the template writes it.
  for text in (eos, *(t for t in END_OF_TURN_TOKENS if t in template and t != eos)):
    ids = [int(i) for i in tokenizer.encode(text)] if tokenizer is not None and text else []
    if len(ids) == 1 and ids[0] not in stops:
      stops.append(ids[0])
  named = tuple((name, text) for name, text in (("bos_token", bos), ("eos_token", eos)) if text)
  return ChatFormat(template=template, bos_token=bos, eos_token=eos,
                    add_bos=bool(getattr(spec, "add_bos", False)), special_tokens=named,
                    stop_ids=tuple(stops),
                    source=str(getattr(spec, "encoding_file", None) or spec.name))


# ----------------------------------------------------------------------------
# Rendering


def _environment():
  """The sandboxed Jinja environment transformers renders chat templates in."""
  try:
    import jinja2  # pylint: disable=import-outside-toplevel
    from jinja2 import ext, sandbox  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ChatTemplateError("chat templates need the jinja2 package: pip install "
                            "jinja2.") from None

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML (<, >, &), which no template wants.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env


_COMPILED: Dict[str, Any] = {}  # template source -> compiled template (templates are few)


def _compiled(fmt: ChatFormat):
  if fmt.template not in _COMPILED:
    import jinja2  # pylint: disable=import-outside-toplevel
    try:
      _COMPILED[fmt.template] = _environment().from_string(fmt.template)
    except jinja2.TemplateSyntaxError as e:
      raise ChatTemplateError(f"the chat template of {fmt.source or 'this model'} does not "
                              f"parse (line {e.lineno}: {e.message}); fix or replace "
                              f"the template.") from e
  return _COMPILED[fmt.template]


def _plain_messages(messages: Sequence[Message]) -> List[Dict[str, Any]]:
  """The messages as plain dicts, keys whose value is None dropped (as transformers does)."""
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
    raise ChatTemplateError(f"a conversation is a list of messages like "
                            f"{{'role': 'user', 'content': 'Hi'}}, got {type(messages).__name__}.")
  plain = []
  for message in messages:
    if not isinstance(message, Mapping) or "role" not in message:
      raise ChatTemplateError(f"a message is a dict with a 'role' and a 'content', like "
                              f"{{'role': 'user', 'content': 'Hi'}}; got {message!r:.80}.")
    plain.append({k: v for k, v in message.items() if v is not None})
  if not plain:
    raise ChatTemplateError("the conversation is empty; give at least one message.")
  return plain


def render(fmt: ChatFormat, messages: Sequence[Message], add_generation_prompt: bool = False,
           **template_kwargs: Any) -> str:
  """The conversation as the template writes it.

  Args:
    fmt: the model's chat format (`load_chat_format`).
    messages: dicts with a `role` ("system", "user", "assistant", ...) and a
      `content` string; keys set to None are left out, as transformers does.
    add_generation_prompt: end with the header of the assistant's next turn
      (for sampling the answer); False for a finished conversation (training).
    **template_kwargs: more names for the template (`tools=...`, or a
      template's own switch); they override the special tokens' names.

  Returns:
    The rendered text.

  Raises:
    ChatTemplateError: a malformed conversation, or the template refused it
      (`raise_exception`, e.g. roles that do not alternate).
  """
  import jinja2  # pylint: disable=import-outside-toplevel
  template = _compiled(fmt)
  names = {"tools": None, "documents": None, **fmt.template_globals(), **template_kwargs}
  try:
    return template.render(messages=_plain_messages(messages),
                           add_generation_prompt=add_generation_prompt, **names)
  except jinja2.TemplateError as e:
    raise ChatTemplateError(f"the chat template refused this conversation: {e}") from e


def encode(tokenizer, fmt: ChatFormat, messages: Sequence[Message],
           add_generation_prompt: bool = False, **template_kwargs: Any) -> List[int]:
  """The conversation's token ids, as `apply_chat_template(..., tokenize=True)` gives them.

  Args:
    tokenizer: the model's tokenizer (`tokenizer_json.JSONTokenizer`, or any
      tokenizer whose `encode` recognises special tokens in text and adds none).
    fmt, messages, add_generation_prompt, template_kwargs: as in `render`.

  Returns:
    The ids: BOS first when `fmt.add_bos` (once: not when the template wrote
    it), then the rendered text's ids.
  """
  ids = [int(i) for i in tokenizer.encode(render(fmt, messages, add_generation_prompt,
                                                 **template_kwargs))]
  if fmt.add_bos and fmt.bos_token is not None:
    bos = [int(i) for i in tokenizer.encode(fmt.bos_token)]
    if ids[:len(bos)] != bos:
      ids = bos + ids
  return ids

"""What an exported Hugging Face folder needs beside its weights to be talked to.

    extra = hf_talk.companion_files(tokenizer_file, config)
    extra.files            # {"tokenizer_config.json": {...}, "generation_config.json": {...}, ...}
    extra.config_values    # {"bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 8192}

A Llama-family model's `tokenizer.json` lives in the model's Hugging Face
folder, and so do the files that say how to talk to it: the chat template
(`tokenizer_config.json`'s `"chat_template"`, or `chat_template.jinja`), the
special tokens (`special_tokens_map.json`), when generation stops
(`generation_config.json`) and the token ids `config.json` records. A
purejax checkpoint keeps that tokenizer's path (its spec), so an export
finds them there, for a model converted directly and for a fine-tune alike.

The written `tokenizer_config.json` holds the chat template (transformers
reads it from there in every version). `config.json` gets the folder's
bos/eos/pad ids and, for a model of the folder's own shape (a fine-tune of
it), the folder's `max_position_embeddings`: a fine-tune's shorter
`block_size` is a training choice, not the model's context (rotary
positions carry to any length the original model was trained for).

A GGUF file's tokenizer has no folder: `companion_of_spec` makes the same
files from what the file's metadata held (template, special tokens, the
BOS rule), and `chat_fields` gives a folder's template and special tokens
to a GGUF export (`gguf_files`).
"""

import dataclasses
import json
import pathlib
from typing import Any, Dict, Optional

from purejax import gpt
from purejax.data.tokenizer_spec import TokenizerSpec

TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclasses.dataclass(frozen=True)
class Companion:
  """The files to write beside the weights, and values `config.json` takes.

  Attributes:
    files: `{file name: JSON object}` to write into the folder.
    config_values: `config.json` entries to set (token ids, the context).
  """
  files: Dict[str, Dict[str, Any]]
  config_values: Dict[str, Any]


def _read(path: pathlib.Path) -> Dict[str, Any]:
  """The JSON object in `path`, or {} when it is missing or unreadable (nothing to keep)."""
  try:
    value = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return {}
  return value if isinstance(value, dict) else {}


def _content(token: Any) -> Optional[str]:
  """A special token's text: a string, or older files' `{"content": ...}`."""
  return token.get("content") if isinstance(token, dict) else token


def _token_ids(tokenizer_config: Dict[str, Any], vocab: Dict[str, int]) -> Dict[str, int]:
  """`{"bos_token_id": ..., ...}` of the tokenizer's named special tokens."""
  ids = {}
  for key in TOKEN_KEYS:
    text = _content(tokenizer_config.get(key))
    if text is not None and text in vocab:
      ids[f"{key}_id"] = vocab[text]
  return ids


def _same_shape(source: Dict[str, Any], config: gpt.GPTConfig) -> bool:
  """Whether `source` (a config.json) describes a model of `config`'s shape."""
  return (source.get("hidden_size"), source.get("num_hidden_layers"),
          source.get("num_attention_heads"), source.get("vocab_size")) == (
              config.n_embd, config.n_layer, config.n_head, config.vocab_size)


def folder_tokenizer_config(tokenizer_file: str) -> Dict[str, Any]:
  """The `tokenizer_config.json` beside `tokenizer_file`, with the folder's chat template
  (from `chat_template.jinja` where the config has none); {} when there is none."""
  folder = pathlib.Path(tokenizer_file).parent
  tokenizer_config = _read(folder / "tokenizer_config.json")
  template = folder / "chat_template.jinja"
  if "chat_template" not in tokenizer_config and template.is_file():
    tokenizer_config["chat_template"] = template.read_text(encoding="utf-8")
  return tokenizer_config


def chat_fields(tokenizer_file: str) -> Dict[str, Any]:
  """`{"chat_template", "bos_token", "eos_token", "add_bos_token"}` the folder of
  `tokenizer_file` states (those it states), as a GGUF file's metadata holds them."""
  tokenizer_config = folder_tokenizer_config(tokenizer_file)
  fields = {key: _content(tokenizer_config.get(key)) for key in ("bos_token", "eos_token")}
  fields["chat_template"] = tokenizer_config.get("chat_template")
  fields["add_bos_token"] = tokenizer_config.get("add_bos_token")
  return {key: value for key, value in fields.items() if value is not None}


def companion_files(tokenizer_file: Optional[str], config: gpt.GPTConfig) -> Companion:
  """What to write beside a Llama-family export whose tokenizer is `tokenizer_file`.

  Args:
    tokenizer_file: the model's `tokenizer.json` (in its Hugging Face folder);
      None: no tokenizer, nothing to add.
    config: the exported model.

  Returns:
    `Companion`: `tokenizer_config.json` (with the chat template, if the
    folder has one), `special_tokens_map.json`, `generation_config.json`
    (the folder's, or one naming the bos/eos/pad ids), and the `config.json`
    values (those ids; the folder's `max_position_embeddings` when it is
    larger than `config.block_size` and the folder's model has `config`'s
    shape). Files the folder lacks and cannot be derived are left out.
  """
  if not tokenizer_file:
    return Companion({}, {})
  folder = pathlib.Path(tokenizer_file).parent
  source = _read(folder / "config.json")
  tokenizer_config = folder_tokenizer_config(tokenizer_file)
  vocab = _read(pathlib.Path(tokenizer_file)).get("model", {}).get("vocab", {})
  added = {token["content"]: token["id"] for token in
           _read(pathlib.Path(tokenizer_file)).get("added_tokens", [])}
  ids = _token_ids(tokenizer_config, {**(vocab if isinstance(vocab, dict) else {}), **added})
  # The model's own config.json wins over ids looked up from token names.
  ids.update({key: source[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
              if source.get(key) is not None})
  files = {}
  if tokenizer_config:
    files["tokenizer_config.json"] = tokenizer_config
    special = _read(folder / "special_tokens_map.json") or {
        key: tokenizer_config[key] for key in TOKEN_KEYS if key in tokenizer_config}
    if special:
      files["special_tokens_map.json"] = special
  generation = _read(folder / "generation_config.json") or {
      key: value for key, value in ids.items() if key != "unk_token_id"}
  if generation:
    files["generation_config.json"] = generation
  values = {key: value for key, value in ids.items() if key != "unk_token_id"}
  context = source.get("max_position_embeddings")
  if isinstance(context, int) and context > config.block_size and _same_shape(source, config):
    values["max_position_embeddings"] = context
  return Companion(files, values)


def companion_of_spec(spec: TokenizerSpec, vocab: Dict[str, int], config: gpt.GPTConfig,
                      context: Optional[int] = None) -> Companion:
  """What to write beside an export whose tokenizer has no folder (a GGUF file's).

  Args:
    spec: the model's tokenizer spec, with its chat template, BOS/EOS tokens
      and whether a prompt starts with BOS.
    vocab: `{token: id}` of that tokenizer, added tokens included.
    config: the exported model.
    context: the base model's context (`gguf_files.base_context`); stated as
      `max_position_embeddings` when larger than `config.block_size`.

  Returns:
    `Companion`: `tokenizer_config.json` (the template, the special tokens,
    `add_bos_token`, and `PreTrainedTokenizerFast` to read `tokenizer.json`
    as written), `special_tokens_map.json`, `generation_config.json` (the
    bos/eos ids, so `generate` stops at EOS) and the `config.json` values.
  """
  tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                      "add_bos_token": bool(spec.add_bos)}
  for key in ("bos_token", "eos_token"):
    if getattr(spec, key):
      tokenizer_config[key] = getattr(spec, key)
  if spec.chat_template:
    tokenizer_config["chat_template"] = spec.chat_template
  ids = {key: value for key, value in _token_ids(tokenizer_config, vocab).items()
         if key != "unk_token_id"}
  files = {"tokenizer_config.json": tokenizer_config}
  special = {key: tokenizer_config[key] for key in TOKEN_KEYS if key in tokenizer_config}
  if special:
    files["special_tokens_map.json"] = special
  if ids:
    files["generation_config.json"] = dict(ids)
  values = dict(ids)
  if isinstance(context, int) and context > config.block_size:
    values["max_position_embeddings"] = context
  return Companion(files, values)


"""Every value of a Hugging Face `config.json` checked before any arithmetic on it.

    values = hf_config.checked(raw, hf_config.LLAMA_FIELDS, "path/config.json")
    values["num_attention_heads"]      # a positive int; a missing required key raised

Each architecture's table says, per key, what its value must be (a positive
integer, a number, true or false, ...), and whether the key is required or
has a default. Defaults are only those Hugging Face documents for optional
keys (`rms_norm_eps`, `rope_theta`, `tie_word_embeddings`, ...); the sizes
that make a model (`hidden_size`, `num_hidden_layers`, ...) must be in the
file, as a file without them describes no particular model. A bad value is
one `ConversionError` line naming the file, the key, the value and what is
expected; JSON's `null` counts as absent for optional keys (Hugging Face
writes `"head_dim": null`).
"""

import math
from typing import Any, Callable, Dict, Mapping, NamedTuple

from purejax import nn
from purejax.weights.errors import ConversionError


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value))


# what a value must be -> its test
KINDS: Dict[str, Callable[[Any], bool]] = {
    "a positive integer": lambda v: _is_int(v) and v > 0,
    "a positive number": lambda v: _is_number(v) and v > 0,
    "a number": _is_number,
    "true or false": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "a JSON object (or null)": lambda v: isinstance(v, dict),
    "a list of strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}
_NO_DEFAULT = object()


class Field(NamedTuple):
  """What one key's value must be.

  Attributes:
    kind: a key of `KINDS`.
    required: the key must be present (and not null).
    default: the value of an absent optional key (Hugging Face's); None
      means "not set".
  """
  kind: str
  required: bool = False
  default: Any = None


def required(kind: str) -> Field:
  return Field(kind, required=True)


def optional(kind: str, default: Any = None) -> Field:
  return Field(kind, default=default)


SIZE = "a positive integer"
NUMBER = "a positive number"
BOOL = "true or false"
OBJECT = "a JSON object (or null)"

# LlamaConfig / MistralConfig / Qwen2Config: the keys purejax reads.
LLAMA_FIELDS = {
    "vocab_size": required(SIZE),
    "hidden_size": required(SIZE),
    "intermediate_size": required(SIZE),
    "num_hidden_layers": required(SIZE),
    "num_attention_heads": required(SIZE),
    "num_key_value_heads": optional(SIZE),  # absent: one per head
    "max_position_embeddings": required(SIZE),
    "head_dim": optional(SIZE),
    "sliding_window": optional(SIZE),
    "rms_norm_eps": optional(NUMBER, 1e-6),
    "rope_theta": optional(NUMBER),  # absent: rope_parameters', else 10000
    "rope_scaling": optional(OBJECT),
    "rope_parameters": optional(OBJECT),
    "partial_rotary_factor": optional(NUMBER, 1.0),
    "hidden_act": optional("a string", "silu"),
    "tie_word_embeddings": optional(BOOL, False),
    "attention_bias": optional(BOOL, False),
    "mlp_bias": optional(BOOL, False),
    "use_sliding_window": optional(BOOL, False),
    "max_window_layers": optional("a number"),
    "layer_types": optional("a list of strings"),
}

# Gemma3TextConfig (`model_type` "gemma3_text"): the keys purejax reads. Older
# files name the RoPE bases `rope_theta` and `rope_local_base_freq` and the
# layers' pattern `sliding_window_pattern`; newer ones `rope_parameters` and
# `layer_types`.
GEMMA3_FIELDS = {
    "vocab_size": required(SIZE),
    "hidden_size": required(SIZE),
    "intermediate_size": required(SIZE),
    "num_hidden_layers": required(SIZE),
    "num_attention_heads": required(SIZE),
    "num_key_value_heads": optional(SIZE),  # absent: one per head
    "head_dim": optional(SIZE, 256),
    "max_position_embeddings": required(SIZE),
    "rms_norm_eps": optional(NUMBER, 1e-6),
    "rope_theta": optional(NUMBER),
    "rope_local_base_freq": optional(NUMBER),
    "rope_scaling": optional(OBJECT),
    "rope_parameters": optional(OBJECT),
    "sliding_window": optional(SIZE, 4096),
    "sliding_window_pattern": optional(SIZE),
    "_sliding_window_pattern": optional(SIZE),
    "layer_types": optional("a list of strings"),
    "query_pre_attn_scalar": optional(NUMBER, 256),
    "final_logit_softcapping": optional(NUMBER),
    "attn_logit_softcapping": optional(NUMBER),
    "hidden_activation": optional("a string", "gelu_pytorch_tanh"),
    "tie_word_embeddings": optional(BOOL, True),
    "attention_bias": optional(BOOL, False),
    "use_bidirectional_attention": optional(BOOL, False),
}

# Inside `rope_scaling` (and `rope_parameters`).
ROPE_FIELDS = {
    "rope_type": optional("a string"),
    "type": optional("a string"),
    "factor": optional(NUMBER),
    "low_freq_factor": optional(NUMBER),
    "high_freq_factor": optional(NUMBER),
    "original_max_position_embeddings": optional(SIZE),
    "rope_theta": optional(NUMBER),
}

# GPT2Config: the keys purejax reads.
GPT2_FIELDS = {
    "vocab_size": required(SIZE),
    "n_embd": required(SIZE),
    "n_layer": required(SIZE),
    "n_head": required(SIZE),
    "n_positions": required(SIZE),
    "n_inner": optional(SIZE),  # absent: 4 * n_embd
    "layer_norm_epsilon": optional(NUMBER, 1e-5),
    "activation_function": optional("a string", "gelu_new"),
    "scale_attn_weights": optional(BOOL, True),
    "scale_attn_by_inverse_layer_idx": optional(BOOL, False),
    "add_cross_attention": optional(BOOL, False),
    "tie_word_embeddings": optional(BOOL, True),
}


def checked(hf_config: Mapping[str, Any], fields: Mapping[str, Field], source: str,
            prefix: str = "") -> Dict[str, Any]:
  """`{key: value}` for every key of `fields`: the file's value, checked, or the default.

  Args:
    hf_config: the parsed `config.json` (or a dict inside it).
    fields: the architecture's table (`LLAMA_FIELDS`, `GPT2_FIELDS`, ...).
    source: the file, for the error.
    prefix: `"rope_scaling."` for a dict inside the file.

  Raises:
    ConversionError: a required key missing, or a value of the wrong type
      or range.
  """
  out = {}
  for key, field in fields.items():
    value = hf_config.get(key)
    if value is None:
      if field.required:
        raise ConversionError(
            f"{source} has no {prefix}{key}; the model needs it ({field.kind}): use the "
            f"config.json that came with the weights.")
      out[key] = field.default
    elif not KINDS[field.kind](value):
      raise ConversionError(f"{source}: {prefix}{key}={value!r} must be {field.kind}; fix "
                            f"the file or use the config.json that came with the weights.")
    else:
      out[key] = value
  return out


def check_divides(source: str, part_key: str, part: int, whole_key: str, whole: int) -> None:
  """Raises unless `part` divides `whole` (heads into the width, key/value heads into heads)."""
  if whole % part:
    raise ConversionError(f"{source}: {part_key}={part} does not divide {whole_key}={whole}; "
                          f"it must (fix the file or use the one that came with the weights).")


def size_fields(config) -> Dict[str, Any]:
  """The sizes every Llama-family and Gemma `config.json` states, from a `GPTConfig`
  (what `checked` reads back from `LLAMA_FIELDS` or `GEMMA3_FIELDS`)."""
  return {
      "vocab_size": config.vocab_size,
      "hidden_size": config.n_embd,
      "intermediate_size": config.mlp_width,
      "num_hidden_layers": config.n_layer,
      "num_attention_heads": config.n_head,
      "num_key_value_heads": config.kv_heads,
      "head_dim": config.head_dim,
      "max_position_embeddings": config.block_size,
      "rms_norm_eps": config.norm_eps,
  }


def rope_scaling_or_refuse(source: str, scaling, unsupported: list):
  """The `nn.RopeScaling` of a `rope_scaling` dict (None for none), then raises one
  ConversionError naming every option in `unsupported` (a kind of scaling purejax
  lacks joins them) when there are any."""
  try:
    scaling = nn.RopeScaling.from_dict(scaling) if scaling else None
  except ValueError as e:
    unsupported.append(str(e).rstrip("."))
  if unsupported:
    raise ConversionError(f"{source}: purejax's GPT does not support "
                          f"{'; '.join(unsupported)}.")
  return scaling

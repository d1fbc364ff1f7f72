"""GPT-2-layout state dicts <-> purejax's GPT params, and GPT-2's config.json <-> `GPTConfig`.

    params = gpt2_weights.params_from_state(state, config, transposed=False, source=path)
    state = gpt2_weights.state_from_params(params, config, transposed=True)  # nanoGPT's
    config, vocab = gpt2_weights.config_from_hf(hf_config)  # a parsed config.json
    hf_config = gpt2_weights.hf_config_dict(config, vocab)

Hugging Face's GPT-2 and nanoGPT's checkpoints hold the same architecture as
`purejax.gpt` (GPT-2's), under the same layer names:
`transformer.h.{i}.attn.c_attn.weight` etc. They differ in how dense weights
are stored: Hugging Face's Conv1D keeps them `[in, out]` like purejax,
nanoGPT's `nn.Linear` keeps `[out, in]`. The mapping is spelled out in
`_TOP_WEIGHTS` and `_LAYER_WEIGHTS`; per-layer tensors are stacked on
purejax's leading `[n_layer]` axis. State dicts here are `{name: numpy
array}` with the names after `transformer.` (`strip_prefixes`); reading and
writing the files is `purejax.weights.huggingface`'s and `purejax.weights.nanogpt`'s job;
`ConversionError` is what all of them raise.

Vocabulary padding: imported GPT-2 vocabularies are padded with zero rows up
to a multiple of 64 (50257 -> 50304 ids, as nanoGPT does; the output matmul
runs faster). `config.vocab_size` is the padded table size; the number of
real ids travels in the tokenizer spec returned with the params as
`spec.vocab_size` (see `purejax.data.tokenizers`): samplers must mask logits of
ids >= it, and `state_from_params(..., vocab_rows=...)` drops the padding
again.
"""

import dataclasses
from typing import Any, Dict, Optional, Tuple

import numpy as np

from purejax import gpt
from purejax import host_memory
from purejax.data import tokenizers
from purejax.weights import hf_config as hf_config_lib
from purejax.weights import tensors
from purejax.weights.errors import ConversionError

Params = Dict[str, Any]

VOCAB_MULTIPLE = 64
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")
_LAYER_NORM_EPS = 1e-5


# ----------------------------------------------------------------------------
# The name table: checkpoint names (after "transformer.") -> purejax paths.
# `linear` marks dense weights, which nanoGPT stores transposed.

_TOP_WEIGHTS = (
    # (name, path, linear, is_bias)
    ("wte.weight", ("wte", "embedding"), False, False),
    ("wpe.weight", ("wpe", "embedding"), False, False),
    ("ln_f.weight", ("ln_f", "scale"), False, False),
    ("ln_f.bias", ("ln_f", "bias"), False, True),
)
_LAYER_WEIGHTS = (
    # (name after "h.{i}.", path under "blocks", linear, is_bias)
    ("ln_1.weight", ("ln_1", "scale"), False, False),
    ("ln_1.bias", ("ln_1", "bias"), False, True),
    ("attn.c_attn.weight", ("attn", "qkv", "w"), True, False),
    ("attn.c_attn.bias", ("attn", "qkv", "b"), False, True),
    ("attn.c_proj.weight", ("attn", "proj", "w"), True, False),
    ("attn.c_proj.bias", ("attn", "proj", "b"), False, True),
    ("ln_2.weight", ("ln_2", "scale"), False, False),
    ("ln_2.bias", ("ln_2", "bias"), False, True),
    ("mlp.c_fc.weight", ("mlp", "fc", "w"), True, False),
    ("mlp.c_fc.bias", ("mlp", "fc", "b"), False, True),
    ("mlp.c_proj.weight", ("mlp", "proj", "w"), True, False),
    ("mlp.c_proj.bias", ("mlp", "proj", "b"), False, True),
)


_LINEAR = frozenset(name for name, _, linear, _ in _LAYER_WEIGHTS if linear)


def _is_buffer(name: str) -> bool:
  """Causal-mask buffers some checkpoints carry (`h.0.attn.bias`, `...masked_bias`)."""
  return name.endswith(".attn.bias") or name.endswith(".attn.masked_bias")


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
  """`vocab_size` rounded up to a multiple of `multiple` (1: no padding)."""
  return -(-vocab_size // multiple) * multiple


def _get(tree: Params, path: Tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: Params, path: Tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _describe(config: gpt.GPTConfig) -> str:
  return (f"n_layer={config.n_layer}, n_head={config.n_head}, n_embd={config.n_embd}, "
          f"block_size={config.block_size}, vocab_size={config.vocab_size}")


def params_from_state(
    state: Dict[str, np.ndarray],
    config: gpt.GPTConfig,
    *,
    transposed: bool,
    source: str,
    vocab_rows: Optional[int] = None,
) -> Params:
  """purejax params from a GPT-2-layout state dict.

  Args:
    state: `{name: array}` with names as in `_TOP_WEIGHTS` / `_LAYER_WEIGHTS`
      (prefixes already stripped), plus optionally `lm_head.weight` and mask
      buffers.
    config: the target config.
    transposed: dense weights are `[out, in]` (nanoGPT) instead of `[in, out]`.
    source: the file, for error messages.
    vocab_rows: rows of the token embedding in `state` (default
      `config.vocab_size`); the rows up to `config.vocab_size` are zero padding.

  Returns:
    float32 params in `gpt.init_params`' layout, device arrays in C order.

  Raises:
    ConversionError: missing, unexpected or misshapen tensors, or an untied head.
  """
  expected = _expected_shapes(config)
  expected["wte.weight"] = (vocab_rows or config.vocab_size, config.n_embd)
  state = {name: value for name, value in state.items() if not _is_buffer(name)}
  head = state.pop("lm_head.weight", None)
  missing = sorted(set(expected) - set(state))
  extra = sorted(set(state) - set(expected))
  if extra and not config.bias and all(name.endswith(".bias") for name in extra):
    raise ConversionError(f"{source} has biases ({extra[0]}, ...) but the config says "
                          f"bias=False; set bias=True.")
  if missing or extra:
    raise ConversionError(
        f"{source} is not a GPT-2 layout for {_describe(config)} (bias={config.bias}): "
        f"missing {missing[:3]}, unexpected {extra[:3]}; only GPT-2-architecture "
        f"checkpoints convert.")
  arrays = tensors.float32_tensors(
      state, expected, source=source, needs=_describe(config), partner="the config",
      transpose=lambda name: transposed and name.split(".", 2)[-1] in _LINEAR)
  wte = arrays["wte.weight"]
  if head is not None:
    head = np.asarray(head, dtype=np.float32)
    if head.shape != wte.shape or not np.array_equal(head, wte):
      raise ConversionError(
          f"{source}: lm_head.weight differs from the token embedding wte.weight; "
          f"untied output heads are not supported (purejax's GPT ties the head to wte).")
  table = host_memory.empty((config.vocab_size, wte.shape[1]), np.float32)
  table[:wte.shape[0]], table[wte.shape[0]:] = wte, 0.0  # padding rows: zeros
  arrays["wte.weight"] = table
  del wte

  params: Params = {}
  for name, path, _, is_bias in _TOP_WEIGHTS:
    if config.bias or not is_bias:
      _set(params, path, host_memory.to_device(arrays.pop(name)))
  for name, path, _, is_bias in _LAYER_WEIGHTS:
    if config.bias or not is_bias:
      first = arrays[f"h.0.{name}"]
      stacked = host_memory.empty((config.n_layer, *first.shape), np.float32)
      for i in range(config.n_layer):
        stacked[i] = arrays.pop(f"h.{i}.{name}")
      _set(params, ("blocks",) + path, host_memory.to_device(stacked))
  gpt.check_params(params, config)
  return params


def _expected_shapes(config: gpt.GPTConfig) -> Dict[str, Tuple[int, ...]]:
  """`{checkpoint name: shape}` of every weight, in purejax's `[in, out]` layout."""
  c = config.n_embd
  top = {"wte.weight": (config.vocab_size, c), "wpe.weight": (config.block_size, c),
         "ln_f.weight": (c,), "ln_f.bias": (c,)}
  layer = {"ln_1.weight": (c,), "ln_1.bias": (c,), "attn.c_attn.weight": (c, 3 * c),
           "attn.c_attn.bias": (3 * c,), "attn.c_proj.weight": (c, c),
           "attn.c_proj.bias": (c,), "ln_2.weight": (c,), "ln_2.bias": (c,),
           "mlp.c_fc.weight": (c, 4 * c), "mlp.c_fc.bias": (4 * c,),
           "mlp.c_proj.weight": (4 * c, c), "mlp.c_proj.bias": (c,)}
  shapes = {name: shape for name, shape in top.items()
            if config.bias or not name.endswith(".bias")}
  for i in range(config.n_layer):
    shapes.update({f"h.{i}.{name}": shape for name, shape in layer.items()
                   if config.bias or not name.endswith(".bias")})
  return shapes


def state_from_params(
    params: Params,
    config: gpt.GPTConfig,
    *,
    transposed: bool,
    vocab_rows: Optional[int] = None,
    zero_biases: bool = False,
) -> Dict[str, np.ndarray]:
  """A GPT-2-layout state dict (names without prefix) from purejax params.

  Args:
    params: purejax GPT params (stacked blocks; jax or numpy arrays).
    config: their config.
    transposed: write dense weights `[out, in]` (nanoGPT) instead of `[in, out]`.
    vocab_rows: keep only the first rows of the token embedding (drops
      vocabulary padding); default all.
    zero_biases: for `bias=False` params, write zero biases (formats that
      always have biases compute the same function with them).

  Returns:
    `{name: float32 contiguous numpy array}`.
  """
  gpt.check_params(params, config)
  check_architecture(config)
  params = to_numpy(params)
  full = _expected_shapes(dataclasses.replace(config, bias=True))
  state = {}
  for name, path, _, is_bias in _TOP_WEIGHTS:
    if is_bias and not config.bias:
      if zero_biases:
        state[name] = np.zeros(full[name], np.float32)
      continue
    state[name] = _get(params, path)
  state["wte.weight"] = state["wte.weight"][:vocab_rows]
  for name, path, linear, is_bias in _LAYER_WEIGHTS:
    for i in range(config.n_layer):
      key = f"h.{i}.{name}"
      if is_bias and not config.bias:
        if zero_biases:
          state[key] = np.zeros(full[key], np.float32)
        continue
      value = _get(params, ("blocks",) + path)[i]
      state[key] = value.T if (transposed and linear) else value
  return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in state.items()}


def is_gpt2(config: gpt.GPTConfig) -> bool:
  """Whether `config` has GPT-2's architecture (what GPT-2's formats can hold)."""
  return (config.norm, config.position, config.mlp, config.mlp_width, config.kv_heads,
          config.tie_embeddings, config.qkv_bias, config.norm_eps) == (
              "layernorm", "learned", "gelu", 4 * config.n_embd, config.n_head, True, False,
              _LAYER_NORM_EPS) and not config.nanochat_options and not config.gemma_options


def check_architecture(config: gpt.GPTConfig) -> None:
  """Raises ConversionError unless `config` is GPT-2's architecture (`is_gpt2`)."""
  if not is_gpt2(config):
    raise ConversionError(
        f"this model is not GPT-2's architecture (norm={config.norm}, position="
        f"{config.position}, mlp={config.mlp}, n_kv_head={config.kv_heads}, tie_embeddings="
        f"{config.tie_embeddings}, other options {list(config.nanochat_options + config.gemma_options)}); GPT-2's formats (nanoGPT, GPT2LMHeadModel) cannot hold "
        f"it: write a Hugging Face folder (hf:DIR) of a Llama-family model instead.")


def to_numpy(params: Params) -> Params:
  """A params tree (of jax or numpy arrays) with float32 numpy arrays as its leaves."""
  if isinstance(params, dict):
    return {k: to_numpy(v) for k, v in params.items()}
  return np.asarray(params, dtype=np.float32)


def strip_prefixes(state: Dict[str, np.ndarray], prefixes: Tuple[str, ...]
                   ) -> Dict[str, np.ndarray]:
  """`state` with each of `prefixes`, in order, cut from the start of its names."""
  out = {}
  for name, value in state.items():
    for prefix in prefixes:
      if name.startswith(prefix):
        name = name[len(prefix):]
    out[name] = value
  return out


# ----------------------------------------------------------------------------
# Hugging Face's config.json


def config_from_hf(
    hf_config: Dict[str, Any], source: str = "config.json",
    pad_vocab_multiple: int = VOCAB_MULTIPLE,
) -> Tuple[gpt.GPTConfig, int]:
  """`(GPTConfig, real vocabulary size)` for a Hugging Face GPT-2 `config.json`.

  Raises:
    ConversionError: another architecture, a missing or bad value
      (`hf_config.GPT2_FIELDS`), or a GPT-2 option purejax's GPT does not have.
  """
  model_type = hf_config.get("model_type")
  if model_type != "gpt2":
    architectures = ", ".join(hf_config.get("architectures") or []) or "no architectures"
    raise ConversionError(
        f"{source} describes a {model_type!r} model ({architectures}); only GPT-2 "
        f"(model_type 'gpt2') and the Llama family (llama, mistral, qwen2, gemma3_text) convert to "
        f"purejax's GPT.")
  get = hf_config_lib.checked(hf_config, hf_config_lib.GPT2_FIELDS, source).get
  n_embd = get("n_embd")
  hf_config_lib.check_divides(source, "n_head", get("n_head"), "n_embd", n_embd)
  unsupported = []
  if get("activation_function") not in _GELU_TANH:
    unsupported.append(f"activation_function={get('activation_function')!r} "
                       f"(purejax uses tanh GELU: {' or '.join(_GELU_TANH)})")
  if abs(get("layer_norm_epsilon") - _LAYER_NORM_EPS) > 1e-12:
    unsupported.append(f"layer_norm_epsilon={get('layer_norm_epsilon')} "
                       f"(purejax uses {_LAYER_NORM_EPS})")
  if not get("scale_attn_weights"):
    unsupported.append("scale_attn_weights=false (purejax scales by 1/sqrt(head_dim))")
  if get("scale_attn_by_inverse_layer_idx"):
    unsupported.append("scale_attn_by_inverse_layer_idx=true")
  if get("n_inner") not in (None, 4 * n_embd):
    unsupported.append(f"n_inner={get('n_inner')} (purejax's MLP is 4 * n_embd wide)")
  if get("add_cross_attention"):
    unsupported.append("add_cross_attention=true")
  if not get("tie_word_embeddings"):
    unsupported.append("tie_word_embeddings=false (purejax ties the head to wte)")
  if unsupported:
    raise ConversionError(f"{source}: purejax's GPT does not support "
                          f"{'; '.join(unsupported)}.")
  vocab = get("vocab_size")
  try:
    config = gpt.GPTConfig(
        vocab_size=padded_vocab_size(vocab, pad_vocab_multiple),
        block_size=get("n_positions"), n_layer=get("n_layer"),
        n_head=get("n_head"), n_embd=n_embd, dropout=0.0, bias=True)
  except (ValueError, TypeError) as e:
    raise ConversionError(f"{source}: {e}") from e
  return config, vocab


def hf_config_dict(config: gpt.GPTConfig, vocab_size: int) -> Dict[str, Any]:
  """A Hugging Face `config.json` for a purejax GPT with `vocab_size` real ids."""
  out = {
      "architectures": ["GPT2LMHeadModel"],
      "model_type": "gpt2",
      "vocab_size": vocab_size,
      "n_positions": config.block_size,
      "n_ctx": config.block_size,
      "n_embd": config.n_embd,
      "n_layer": config.n_layer,
      "n_head": config.n_head,
      "n_inner": None,
      "activation_function": "gelu_new",
      "layer_norm_epsilon": _LAYER_NORM_EPS,
      "resid_pdrop": config.dropout,
      "embd_pdrop": config.dropout,
      "attn_pdrop": config.dropout,
      "scale_attn_weights": True,
      "tie_word_embeddings": True,
      "initializer_range": 0.02,
      "torch_dtype": "float32",
  }
  if vocab_size == tokenizers.GPT2_VOCAB_SIZE:
    out["bos_token_id"] = out["eos_token_id"] = tokenizers.GPT2_VOCAB_SIZE - 1
  return out

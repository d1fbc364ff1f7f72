r"""GPT weights in and out: Hugging Face GPT-2 folders and nanoGPT checkpoints.

    params, config, tok_spec = convert.from_huggingface("path/to/gpt2")  # or "gpt2"
    logits = gpt.forward(params, tokens, config)   # [..., config.vocab_size]
    convert.to_huggingface(params, config, "gpt2-hf", valid_vocab=tok_spec["vocab_size"])
    params, config, tok_spec = convert.from_nanogpt("out/ckpt.pt")
    convert.to_nanogpt(params, config, "ckpt.pt")

    python -m purejax.convert --from=hf:gpt2 --to=nanogpt:ckpt.pt
    python -m purejax.convert --from=purejax:out-gpt --to=hf:gpt2-finetuned

Both formats hold the same architecture as `purejax.gpt` (GPT-2's), under
the same layer names: `transformer.h.{i}.attn.c_attn.weight` etc. They
differ in how dense weights are stored: Hugging Face's Conv1D keeps them
`[in, out]` like purejax, nanoGPT's `nn.Linear` keeps `[out, in]`. The
mapping is spelled out in `_TOP_WEIGHTS` and `_LAYER_WEIGHTS`; per-layer
tensors are stacked on purejax's leading `[n_layer]` axis.

Vocabulary padding: imported GPT-2 vocabularies are padded with zero rows up
to a multiple of 64 (50257 -> 50304 ids, as nanoGPT does; the output matmul
runs faster). `config.vocab_size` is the padded table size; the number of
real ids travels in the returned tokenizer spec as `spec["vocab_size"]`
(see `purejax.tokenizers`): samplers must mask logits of ids >= it, and
`to_huggingface(..., valid_vocab=...)` drops the padding again.

Only our side is numpy: safetensors files are read with safetensors'
numpy API. nanoGPT's `.pt` files and Hugging Face's `pytorch_model.bin` need
torch, imported only for them.
"""

import dataclasses
import json
import os
import pathlib
import pickle
import shutil
import sys
import tempfile
from typing import Any, Dict, Optional, Tuple

from absl import app
from absl import flags
from absl import logging
import ml_dtypes  # pylint: disable=unused-import  # lets numpy (and safetensors) read bfloat16
import numpy as np
import safetensors
from safetensors import numpy as safetensors_numpy

from purejax import checkpoint
from purejax import gpt
from purejax import tokenizers

Params = Dict[str, Any]
TokenizerSpec = Dict[str, Any]

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
VOCAB_MULTIPLE = 64
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")
_LAYER_NORM_EPS = 1e-5


class ConversionError(ValueError):
  """Weights or a config that cannot be converted; the message says why and what to do."""


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
    float32 numpy params in `gpt.init_params`' layout.

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
  arrays = {}
  for name, want in expected.items():
    value = np.asarray(state[name], dtype=np.float32)
    if transposed and name.split(".", 2)[-1] in _LINEAR:
      value = value.T
    if value.shape != want:
      raise ConversionError(
          f"{source}: {name} has shape {tuple(value.shape)}, but {_describe(config)} "
          f"needs {want}; the weights and the config do not belong together.")
    arrays[name] = value
  wte = arrays["wte.weight"]
  if head is not None:
    head = np.asarray(head, dtype=np.float32)
    if head.shape != wte.shape or not np.array_equal(head, wte):
      raise ConversionError(
          f"{source}: lm_head.weight differs from the token embedding wte.weight; "
          f"untied output heads are not supported (purejax's GPT ties the head to wte).")
  padding = config.vocab_size - wte.shape[0]
  arrays["wte.weight"] = np.concatenate([wte, np.zeros((padding, wte.shape[1]), np.float32)])

  params: Params = {}
  for name, path, _, is_bias in _TOP_WEIGHTS:
    if config.bias or not is_bias:
      _set(params, path, arrays[name])
  for name, path, _, is_bias in _LAYER_WEIGHTS:
    if config.bias or not is_bias:
      layers = [arrays[f"h.{i}.{name}"] for i in range(config.n_layer)]
      _set(params, ("blocks",) + path, np.stack(layers))
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
  params = _to_numpy(params)
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


def _to_numpy(params: Params) -> Params:
  if isinstance(params, dict):
    return {k: _to_numpy(v) for k, v in params.items()}
  return np.asarray(params, dtype=np.float32)


# ----------------------------------------------------------------------------
# Hugging Face


def _hf_folder(path_or_name: str) -> pathlib.Path:
  """The local folder of `path_or_name`: a path, or a GPT-2 name in the HF cache."""
  path = pathlib.Path(path_or_name).expanduser()
  if path.is_dir():
    return path
  if path.is_file():
    raise ConversionError(f"{path_or_name} is a file; pass the folder holding config.json "
                          f"and model.safetensors.")
  short = path_or_name.rstrip("/").removeprefix("openai-community/")
  if short not in GPT2_NAMES:
    raise ConversionError(
        f"{path_or_name} is neither a folder nor one of {', '.join(GPT2_NAMES)}; pass the "
        f"folder holding config.json and model.safetensors.")
  fix = (f"download config.json and model.safetensors of openai-community/{short} "
         f"(e.g. `hf download openai-community/{short} config.json model.safetensors "
         f"--local-dir {short}`) and pass the folder's path.")
  try:
    import huggingface_hub  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConversionError(f"{short} is not a folder here and huggingface_hub is not "
                          f"installed to look in its cache; {fix}") from None
  for repo_id in (f"openai-community/{short}", short):
    try:
      folder = pathlib.Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True))
    except Exception:  # pylint: disable=broad-except  # not cached: try the next id
      continue
    if (folder / "config.json").is_file():
      return folder
  raise ConversionError(f"{short} is not in the Hugging Face cache, and purejax does not "
                        f"download; {fix}")


def _read_json(path: pathlib.Path) -> Dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except FileNotFoundError:
    raise ConversionError(f"{path} is missing; a Hugging Face model folder needs "
                          f"config.json beside its weights.") from None
  except (ValueError, OSError) as e:
    raise ConversionError(f"{path} is not readable JSON ({e}).") from e
  if not isinstance(value, dict):
    raise ConversionError(f"{path} does not hold a JSON object.")
  return value


def config_from_hf(
    hf_config: Dict[str, Any], source: str = "config.json",
    pad_vocab_multiple: int = VOCAB_MULTIPLE,
) -> Tuple[gpt.GPTConfig, int]:
  """`(GPTConfig, real vocabulary size)` for a Hugging Face GPT-2 `config.json`.

  Raises:
    ConversionError: another architecture, or a GPT-2 option purejax's GPT
      does not have.
  """
  model_type = hf_config.get("model_type")
  if model_type != "gpt2":
    architectures = ", ".join(hf_config.get("architectures") or []) or "no architectures"
    raise ConversionError(
        f"{source} describes a {model_type!r} model ({architectures}); only GPT-2 "
        f"checkpoints (model_type 'gpt2') convert to purejax's GPT.")
  get = lambda key, default: hf_config.get(key, default)  # GPT2Config's defaults
  n_embd = get("n_embd", 768)
  unsupported = []
  if get("activation_function", "gelu_new") not in _GELU_TANH:
    unsupported.append(f"activation_function={get('activation_function', None)!r} "
                       f"(purejax uses tanh GELU: {' or '.join(_GELU_TANH)})")
  if abs(get("layer_norm_epsilon", 1e-5) - _LAYER_NORM_EPS) > 1e-12:
    unsupported.append(f"layer_norm_epsilon={get('layer_norm_epsilon', None)} "
                       f"(purejax uses {_LAYER_NORM_EPS})")
  if not get("scale_attn_weights", True):
    unsupported.append("scale_attn_weights=false (purejax scales by 1/sqrt(head_dim))")
  if get("scale_attn_by_inverse_layer_idx", False):
    unsupported.append("scale_attn_by_inverse_layer_idx=true")
  if get("n_inner", None) not in (None, 4 * n_embd):
    unsupported.append(f"n_inner={get('n_inner', None)} (purejax's MLP is 4 * n_embd wide)")
  if get("add_cross_attention", False):
    unsupported.append("add_cross_attention=true")
  if not get("tie_word_embeddings", True):
    unsupported.append("tie_word_embeddings=false (purejax ties the head to wte)")
  if unsupported:
    raise ConversionError(f"{source}: purejax's GPT does not support "
                          f"{'; '.join(unsupported)}.")
  vocab = get("vocab_size", tokenizers.GPT2_VOCAB_SIZE)
  try:
    config = gpt.GPTConfig(
        vocab_size=padded_vocab_size(vocab, pad_vocab_multiple),
        block_size=get("n_positions", 1024), n_layer=get("n_layer", 12),
        n_head=get("n_head", 12), n_embd=n_embd, dropout=0.0, bias=True)
  except (ValueError, TypeError) as e:
    raise ConversionError(f"{source}: {e}") from e
  return config, vocab


def _read_safetensors(path: pathlib.Path) -> Dict[str, np.ndarray]:
  try:
    with safetensors.safe_open(str(path), framework="np") as f:
      return {name: f.get_tensor(name) for name in f.keys()}
  except FileNotFoundError:
    raise ConversionError(f"{path} is missing.") from None
  except Exception as e:  # pylint: disable=broad-except  # SafetensorError and dtype errors
    raise ConversionError(
        f"{path} is not a readable safetensors file ({str(e).splitlines()[0][:120]}); it "
        f"is truncated or damaged: download it again.") from e


def _import_torch(what: str):
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConversionError(f"{what} needs torch: pip install torch (or, for Hugging Face, "
                          f"use the folder's model.safetensors instead).") from None
  return torch


def _torch_load(path: pathlib.Path, allow_pickle: bool = False):
  """`torch.load` on the CPU, refusing arbitrary pickled code unless allowed."""
  torch = _import_torch(f"reading {path.name}")
  if not path.is_file():
    raise ConversionError(f"{path} is missing.")
  try:
    return torch.load(path, map_location="cpu", weights_only=True)
  except pickle.UnpicklingError as e:
    if not allow_pickle:
      raise ConversionError(
          f"{path} holds Python objects besides tensors, which torch's safe loader "
          f"refuses; if you trust the file, pass --trust_pickle.") from e
  except (RuntimeError, EOFError, OSError) as e:
    raise ConversionError(f"{path} is not a readable torch checkpoint "
                          f"({str(e).splitlines()[0][:120]}); it is truncated or "
                          f"damaged.") from e
  return torch.load(path, map_location="cpu", weights_only=False)


def _tensors_to_numpy(state: Dict[str, Any], source: pathlib.Path) -> Dict[str, np.ndarray]:
  out = {}
  for name, value in state.items():
    if not hasattr(value, "detach"):
      raise ConversionError(f"{source}: entry {name!r} is not a tensor; expected a "
                            f"state dict.")
    out[name] = value.detach().float().cpu().numpy()
  return out


def _read_hf_weights(folder: pathlib.Path) -> Dict[str, np.ndarray]:
  index = folder / "model.safetensors.index.json"
  if index.is_file():
    shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
    if not shards:
      raise ConversionError(f"{index} has no weight_map; download it again.")
    state = {}
    for shard in shards:
      state.update(_read_safetensors(folder / shard))
    return state
  if (folder / "model.safetensors").is_file():
    return _read_safetensors(folder / "model.safetensors")
  if (folder / "pytorch_model.bin").is_file():
    path = folder / "pytorch_model.bin"
    state = _torch_load(path)
    if not isinstance(state, dict):
      raise ConversionError(f"{path} does not hold a state dict.")
    return _tensors_to_numpy(state, path)
  raise ConversionError(f"{folder} has no model.safetensors (nor pytorch_model.bin); "
                        f"download the weights into it.")


def _strip(state: Dict[str, np.ndarray], prefixes: Tuple[str, ...]) -> Dict[str, np.ndarray]:
  out = {}
  for name, value in state.items():
    for prefix in prefixes:
      if name.startswith(prefix):
        name = name[len(prefix):]
    out[name] = value
  return out


def _tokenizer_spec_for_vocab(vocab: int) -> TokenizerSpec:
  """GPT-2's tokenizer for GPT-2's vocabulary size; otherwise only the id count."""
  if vocab == tokenizers.GPT2_VOCAB_SIZE:
    return tokenizers.gpt2_spec()
  return tokenizers.ids_spec(vocab)


def from_huggingface(
    path_or_name: str, *, pad_vocab_multiple: int = VOCAB_MULTIPLE,
) -> Tuple[Params, gpt.GPTConfig, TokenizerSpec]:
  """Imports a Hugging Face GPT-2 model (`GPT2LMHeadModel` / `GPT2Model`).

  Args:
    path_or_name: a folder with `config.json` and `model.safetensors` (or
      shards with `model.safetensors.index.json`, or `pytorch_model.bin`,
      which needs torch), or one of `GPT2_NAMES`, looked up in the Hugging
      Face cache only (never downloaded).
    pad_vocab_multiple: pad the vocabulary with zero rows up to a multiple
      of this (1: no padding).

  Returns:
    `(params, config, tokenizer_spec)`: float32 numpy params,
    `config.vocab_size` the padded table size, and the tokenizer's spec
    whose `"vocab_size"` is the number of real ids (GPT-2's tokenizer for
    a 50257-id vocabulary, else an "ids" spec).

  Raises:
    ConversionError: not found, another architecture, unsupported options,
      damaged files, or weights that do not fit the config.
  """
  folder = _hf_folder(path_or_name)
  config, vocab = config_from_hf(_read_json(folder / "config.json"),
                                 str(folder / "config.json"), pad_vocab_multiple)
  state = _strip(_read_hf_weights(folder), ("transformer.",))
  source = f"{folder} (weights)"
  wte = state.get("wte.weight")
  if wte is not None and wte.shape[0] != vocab:
    raise ConversionError(f"{source}: wte.weight has {wte.shape[0]} rows but config.json "
                          f"says vocab_size={vocab}; the weights and config.json do not "
                          f"belong together.")
  params = params_from_state(state, config, transposed=False, source=source,
                             vocab_rows=vocab)
  return params, config, _tokenizer_spec_for_vocab(vocab)


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


def _check_valid_vocab(valid_vocab: Optional[int], config: gpt.GPTConfig) -> int:
  if valid_vocab is None:
    return config.vocab_size
  if not 1 <= valid_vocab <= config.vocab_size:
    raise ConversionError(f"valid_vocab={valid_vocab} must be in [1, vocab_size="
                          f"{config.vocab_size}].")
  return int(valid_vocab)


def _check_target(kind: str, path: str, overwrite: bool) -> None:
  """Refuses to replace existing output unless `overwrite` (checked before any work)."""
  target = pathlib.Path(path).expanduser()
  if kind == "purejax":
    if checkpoint.list_checkpoints(str(target)):
      raise ConversionError(f"{target} already holds checkpoints; choose an empty folder.")
  elif kind == "hf":
    if target.exists() and not target.is_dir():
      raise ConversionError(f"{target} exists and is not a folder; choose another path.")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
      raise ConversionError(f"{target} exists and is not empty; pass --overwrite to "
                            f"replace it, or choose another folder.")
  elif target.exists() and not overwrite:
    raise ConversionError(f"{target} exists; pass --overwrite to replace it, or choose "
                          f"another file.")


def _fsync(path: pathlib.Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _publish_dir(tmp: pathlib.Path, out: pathlib.Path) -> None:
  """Renames the finished folder `tmp` to `out`.

  An old non-empty `out` is first moved aside into a hidden folder beside
  it and deleted only once the new one is in place; a crash between the two
  renames leaves it there, whole.
  """
  old = None
  if out.is_dir() and any(out.iterdir()):
    old = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.replace(out, old / out.name)
  elif out.is_dir():
    out.rmdir()
  os.replace(tmp, out)
  _fsync(out.parent)
  if old is not None:
    shutil.rmtree(old)


def to_huggingface(
    params: Params,
    config: gpt.GPTConfig,
    out_dir: str,
    valid_vocab: Optional[int] = None,
    *,
    overwrite: bool = False,
) -> pathlib.Path:
  """Writes a folder that `transformers.GPT2LMHeadModel.from_pretrained` loads.

  The folder holds `config.json` and `model.safetensors`. The head is tied,
  so only `transformer.wte.weight` is written (safetensors refuses shared
  tensors, and transformers re-ties `lm_head` on load, as its own
  `save_pretrained` expects). Params without biases get zero biases (GPT-2
  always has them; the function is the same).

  The folder is written under a temporary name beside `out_dir` and renamed
  into place when complete: a crash leaves no half-written `out_dir`.

  Args:
    params: purejax GPT params.
    config: their config.
    out_dir: the folder to create.
    valid_vocab: real vocabulary size; the padding rows past it are dropped.
    overwrite: replace an existing non-empty `out_dir`.

  Returns:
    The folder's path.

  Raises:
    ConversionError: bad `valid_vocab`, or `out_dir` exists and not `overwrite`.
  """
  _check_target("hf", out_dir, overwrite)
  vocab = _check_valid_vocab(valid_vocab, config)
  state = state_from_params(params, config, transposed=False, vocab_rows=vocab,
                            zero_biases=True)
  tensors = {f"transformer.{name}": value for name, value in state.items()}
  out = pathlib.Path(out_dir).expanduser().absolute()
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
  try:
    # transformers refuses safetensors files without a "format" in the metadata.
    safetensors_numpy.save_file(tensors, str(tmp / "model.safetensors"),
                                metadata={"format": "pt"})
    with open(tmp / "config.json", "w", encoding="utf-8") as f:
      json.dump(hf_config_dict(config, vocab), f, indent=2)
    for name in ("model.safetensors", "config.json"):
      _fsync(tmp / name)
    _publish_dir(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out


# ----------------------------------------------------------------------------
# nanoGPT

_NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")


class _PlainUnpickler(pickle.Unpickler):
  """Unpickles only plain containers, strings and numbers: no code runs."""

  def find_class(self, module, name):
    raise pickle.UnpicklingError(f"meta.pkl refers to {module}.{name}; only plain "
                                 f"dicts of strings and ints are read.")


def read_nanogpt_meta(path: str) -> tokenizers.CharTokenizer:
  """nanoGPT's `meta.pkl` (`{"vocab_size", "itos", "stoi"}`) as a `CharTokenizer`."""
  try:
    with open(path, "rb") as f:
      meta = _PlainUnpickler(f).load()
  except FileNotFoundError:
    raise ConversionError(f"{path} is missing.") from None
  except (pickle.UnpicklingError, EOFError, ValueError) as e:
    raise ConversionError(f"{path} is not a readable nanoGPT meta.pkl ({e}).") from e
  itos = meta.get("itos") if isinstance(meta, dict) else None
  if not isinstance(itos, dict) or sorted(itos) != list(range(len(itos))):
    raise ConversionError(f"{path} has no 'itos' table of ids 0..n-1; only nanoGPT's "
                          f"character vocabularies are read.")
  return tokenizers.CharTokenizer("".join(itos[i] for i in range(len(itos))))


def from_nanogpt(
    ckpt_path: str,
    *,
    meta_path: Optional[str] = None,
    allow_pickle: bool = False,
) -> Tuple[Params, gpt.GPTConfig, TokenizerSpec]:
  """Imports nanoGPT's `ckpt.pt` (needs torch).

  nanoGPT's MLP uses the exact (erf) GELU, purejax the tanh approximation
  GPT-2 was trained with; logits differ by ~1e-3, the approximation nanoGPT
  itself makes when it loads GPT-2's weights.

  Args:
    ckpt_path: the checkpoint (`{"model_args", "model", ...}`), as nanoGPT's
      train.py writes it; `torch.compile`'s `_orig_mod.` prefixes are fine.
    meta_path: nanoGPT's `meta.pkl` of a character model; default the
      `meta.pkl` beside the checkpoint, if any.
    allow_pickle: load files holding more than tensors and plain containers
      (runs pickled code: only for trusted files).

  Returns:
    `(params, config, tokenizer_spec)`. The spec is, in order: read from
    `meta_path`; the one `to_nanogpt` recorded; read from a `meta.pkl`
    beside the checkpoint. Failing all three, a vocabulary of
    50257 ids or more is taken to be GPT-2's, as nanoGPT's sample.py does
    (the rows past 50257 are nanoGPT's padding).

  Raises:
    ConversionError: missing or damaged file, not a nanoGPT checkpoint,
      unsupported model_args, or weights that do not fit.
  """
  path = pathlib.Path(ckpt_path).expanduser()
  ckpt = _torch_load(path, allow_pickle)
  if not isinstance(ckpt, dict) or "model_args" not in ckpt or "model" not in ckpt:
    raise ConversionError(f"{path} is not a nanoGPT checkpoint (a dict with 'model_args' "
                          f"and 'model').")
  args = dict(ckpt["model_args"])
  unknown = sorted(set(args) - set(_NANOGPT_ARGS))
  if unknown:
    raise ConversionError(f"{path}: model_args {unknown} are not nanoGPT's; purejax's GPT "
                          f"supports only {', '.join(_NANOGPT_ARGS)}.")
  try:
    config = gpt.GPTConfig(
        vocab_size=int(args["vocab_size"]), block_size=int(args["block_size"]),
        n_layer=int(args["n_layer"]), n_head=int(args["n_head"]),
        n_embd=int(args["n_embd"]), dropout=float(args.get("dropout", 0.0)),
        bias=bool(args.get("bias", True)))
  except KeyError as e:
    raise ConversionError(f"{path}: model_args lacks {e}.") from None
  except (ValueError, TypeError) as e:
    raise ConversionError(f"{path}: {e}") from e
  state = _strip(_tensors_to_numpy(ckpt["model"], path), ("_orig_mod.", "transformer."))
  params = params_from_state(state, config, transposed=True, source=str(path))

  meta = pathlib.Path(meta_path) if meta_path else path.parent / "meta.pkl"
  recorded = ckpt.get("tokenizer")
  if not meta_path and isinstance(recorded, dict) and "type" in recorded:
    spec = recorded  # written by to_nanogpt
  elif meta_path or meta.is_file():
    tokenizer = read_nanogpt_meta(str(meta))
    if tokenizer.vocab_size > config.vocab_size:
      raise ConversionError(f"{meta} has {tokenizer.vocab_size} characters but the model "
                            f"only {config.vocab_size} ids; pass the model's own meta.pkl.")
    spec = tokenizer.spec()
  elif config.vocab_size >= tokenizers.GPT2_VOCAB_SIZE:
    spec = tokenizers.gpt2_spec()
  else:
    spec = tokenizers.ids_spec(config.vocab_size)
  return params, config, spec


def to_nanogpt(
    params: Params,
    config: gpt.GPTConfig,
    path: str,
    *,
    tokenizer_spec: Optional[TokenizerSpec] = None,
    overwrite: bool = False,
) -> pathlib.Path:
  """Writes a `ckpt.pt` that nanoGPT's `sample.py` (`init_from='resume'`) loads (needs torch).

  The file holds `model_args` and the `model` state dict (`nn.Linear`
  weights `[out, in]`, `lm_head.weight` the same tensor as
  `transformer.wte.weight`), plus `iter_num` 0, an empty `config` and the
  tokenizer spec under `"tokenizer"` (nanoGPT ignores it). It has
  no optimizer state, so nanoGPT's train.py cannot resume from it. The
  vocabulary is kept as is, padding included (nanoGPT pads too). With a
  character tokenizer spec, nanoGPT's `meta.pkl` is written beside it.
  Written atomically (temp file, then rename).

  Args:
    params: purejax GPT params.
    config: their config.
    path: the checkpoint file to write.
    tokenizer_spec: the model's tokenizer spec; a character one also writes
      `meta.pkl`.
    overwrite: replace an existing file.

  Returns:
    The checkpoint's path.

  Raises:
    ConversionError: `path` exists and not `overwrite`.
  """
  torch = _import_torch("writing a nanoGPT checkpoint")
  _check_target("nanogpt", path, overwrite)
  state = state_from_params(params, config, transposed=True)
  # Copies: arrays that came from jax are read-only, which torch tensors cannot wrap.
  model = {f"transformer.{name}": torch.from_numpy(np.array(value))
           for name, value in state.items()}
  model["lm_head.weight"] = model["transformer.wte.weight"]  # tied: one storage
  ckpt = {
      "model": model,
      "model_args": {"n_layer": config.n_layer, "n_head": config.n_head,
                     "n_embd": config.n_embd, "block_size": config.block_size,
                     "bias": config.bias, "vocab_size": config.vocab_size,
                     "dropout": config.dropout},
      "iter_num": 0,
      "config": {},
  }
  if tokenizer_spec:
    # nanoGPT ignores keys it does not know; from_nanogpt reads it back, so
    # the real vocabulary size survives the trip.
    ckpt["tokenizer"] = tokenizer_spec
  out = pathlib.Path(path).expanduser()
  out.parent.mkdir(parents=True, exist_ok=True)
  checkpoint.atomic_write(out, lambda f: torch.save(ckpt, f))
  if tokenizer_spec and tokenizer_spec.get("type") == "char":
    chars = tokenizer_spec["chars"]
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)),
            "stoi": {c: i for i, c in enumerate(chars)}}
    checkpoint.atomic_write(out.parent / "meta.pkl", lambda f: pickle.dump(meta, f))
  return out


# ----------------------------------------------------------------------------
# purejax checkpoints


def from_purejax(out_dir: str, *, best: bool = False
                 ) -> Tuple[Params, gpt.GPTConfig, TokenizerSpec]:
  """The params, config and tokenizer spec of the newest GPT checkpoint in `out_dir`.

  With `best`, of the run's best checkpoint (`checkpoint.best_path`) instead.
  """
  import jax  # pylint: disable=g-import-not-at-top
  if best:
    path = checkpoint.best_path(out_dir)
    if not path.exists():
      raise ConversionError(f"{out_dir} holds no best checkpoint ({path.name}); train with "
                            f"--always_save_checkpoint=False to keep one.")
    arrays, manifest = checkpoint.read(path)
    meta = manifest["meta"]
  else:
    arrays, meta = checkpoint.latest_meta(out_dir)
  if meta.get("model") != "gpt":
    raise ConversionError(f"{out_dir} holds a {meta.get('model')!r} model, not a GPT; point "
                          f"at a GPT run.")
  try:
    config = gpt.GPTConfig(**meta["config"])
  except (TypeError, ValueError, KeyError) as e:
    raise ConversionError(f"{out_dir}: the checkpoint's config does not fit this purejax "
                          f"version ({e}).") from e
  template = {"params": jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))}
  params = checkpoint.extract(arrays, template, out_dir)["params"]
  if "tokenizer" in meta:
    spec = meta["tokenizer"]
  elif "vocab" in meta:
    spec = tokenizers.CharTokenizer(meta["vocab"]).spec()
  else:
    spec = tokenizers.ids_spec(config.vocab_size)
  return _to_numpy(params), config, spec


GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def from_pretrained(source: str, *, trust_pickle: bool = False
                    ) -> Tuple[Params, gpt.GPTConfig, TokenizerSpec]:
  """Params, config and tokenizer spec of a pretrained GPT, whatever its format.

  Args:
    source: `gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl` (Hugging Face's
      cache); `KIND:PATH` with KIND hf, nanogpt or purejax; or a path: a folder
      with `config.json` (Hugging Face), a folder of purejax checkpoints, or a
      nanoGPT `.pt` file.
    trust_pickle: load `.pt` files with arbitrary pickled objects.

  Raises:
    ConversionError: the source is none of these, or does not load.
  """
  kind, sep, path = source.partition(":")
  if not (sep and kind in _SOURCES):
    kind, path = None, source
    local = pathlib.Path(source).expanduser()
    if source in GPT2_NAMES or (local / "config.json").is_file():
      kind = "hf"
    elif local.is_dir() and checkpoint.list_checkpoints(str(local)):
      kind = "purejax"
    elif local.is_file() and local.suffix == ".pt":
      kind = "nanogpt"
    if kind is None:
      raise ConversionError(
          f"--init_from={source}: not {', '.join(GPT2_NAMES)}, nor a Hugging Face folder "
          f"(config.json), a purejax run directory (ckpt_*.npz) or a nanoGPT .pt file.")
  if kind == "hf":
    return from_huggingface(path)
  if kind == "nanogpt":
    return from_nanogpt(path, allow_pickle=trust_pickle)
  return from_purejax(path)


def to_purejax(params: Params, config: gpt.GPTConfig, out_dir: str,
               tokenizer_spec: TokenizerSpec) -> pathlib.Path:
  """Writes `params` as a step-0 purejax checkpoint (no optimizer state) in `out_dir`.

  The metadata holds the config, the tokenizer spec (`"tokenizer"`) and, for
  character tokenizers, `"vocab"` as `purejax.sample` reads it today.
  """
  meta = {"model": "gpt", "config": dataclasses.asdict(config), "tokenizer": tokenizer_spec}
  if tokenizer_spec.get("type") == "char":
    meta["vocab"] = tokenizer_spec["chars"]
  _check_target("purejax", out_dir, overwrite=False)
  return checkpoint.save(out_dir, 0, {"params": params}, meta)


# ----------------------------------------------------------------------------
# Command line


def _define_flags() -> Dict[str, Any]:
  """The CLI's flags, defined only when this module runs as a program.

  Imported as a library, it then adds no global flags that could clash with
  the host program's.
  """
  return {
      "from": flags.DEFINE_string(
          "from", None, "Source: hf:PATH_OR_NAME (a folder, or gpt2[-medium|-large|-xl] "
          "from the Hugging Face cache), nanogpt:CKPT.pt, or purejax:OUT_DIR."),
      "to": flags.DEFINE_string("to", None,
                                "Target: hf:DIR, nanogpt:FILE.pt, or purejax:OUT_DIR."),
      "meta": flags.DEFINE_string("meta", None, "nanoGPT meta.pkl of a character model "
                                  "(default: beside the checkpoint)."),
      "overwrite": flags.DEFINE_bool("overwrite", False,
                                     "Replace an existing hf:DIR or nanogpt:FILE."),
      "trust_pickle": flags.DEFINE_bool(
          "trust_pickle", False,
          "Load .pt files with arbitrary pickled objects (trusted files only)."),
  }


_FLAGS: Dict[str, Any] = {}
_SOURCES = ("hf", "nanogpt", "purejax")


def _split(value: Optional[str], flag: str) -> Tuple[str, str]:
  if not value:
    raise ConversionError(f"--{flag} is required: KIND:PATH with KIND one of "
                          f"{', '.join(_SOURCES)}.")
  kind, sep, path = value.partition(":")
  if not sep or kind not in _SOURCES or not path:
    raise ConversionError(f"--{flag}={value or ''} must be KIND:PATH with KIND one of "
                          f"{', '.join(_SOURCES)}.")
  return kind, path


def convert(source: str, target: str, *, meta: Optional[str] = None,
            overwrite: bool = False, trust_pickle: bool = False) -> str:
  """Converts `source` to `target` (both `KIND:PATH`); returns a one-line summary."""
  src_kind, src = _split(source, "from")
  dst_kind, dst = _split(target, "to")
  _check_target(dst_kind, dst, overwrite)  # before a load that may take minutes
  if src_kind == "hf":
    params, config, spec = from_huggingface(src)
  elif src_kind == "nanogpt":
    params, config, spec = from_nanogpt(src, meta_path=meta, allow_pickle=trust_pickle)
  else:
    params, config, spec = from_purejax(src)
  valid = int(spec.get("vocab_size", config.vocab_size))
  if dst_kind == "hf":
    written = to_huggingface(params, config, dst, valid_vocab=valid, overwrite=overwrite)
  elif dst_kind == "nanogpt":
    written = to_nanogpt(params, config, dst, tokenizer_spec=spec, overwrite=overwrite)
  else:
    written = to_purejax(params, config, dst, spec)
  return (f"wrote {dst_kind}:{written} ({config.n_layer} layers, n_embd={config.n_embd}, "
          f"{gpt.num_params(params) / 1e6:.2f}M params, {valid} ids of {config.vocab_size}, "
          f"tokenizer {spec.get('name')}).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # JAX logs backend probing at INFO under absl; errors must stay one line.
  logging.set_verbosity(logging.WARNING)
  try:
    values = {name: holder.value for name, holder in _FLAGS.items()}
    print(convert(values["from"], values["to"], meta=values["meta"],
                  overwrite=values["overwrite"], trust_pickle=values["trust_pickle"]))
  except (ValueError, OSError, checkpoint.CheckpointError) as e:
    sys.exit("error: " + " ".join(str(e).split()))


if __name__ == "__main__":
  _FLAGS.update(_define_flags())
  app.run(main)

"""Hugging Face GPT-2 folders in and out: `config.json` beside `model.safetensors`.

    params, config, tok_spec = huggingface.from_huggingface("path/to/gpt2")  # or "gpt2"
    logits = gpt.forward(params, tokens, config)   # [..., config.vocab_size]
    huggingface.to_huggingface(params, config, "gpt2-hf", valid_vocab=tok_spec["vocab_size"])

A name in `GPT2_NAMES` is looked up in the Hugging Face cache only: purejax
never downloads. Weights are read with safetensors' numpy API, sharded ones
too; a legacy `pytorch_model.bin` needs torch (`purejax.weights.torch_files`). The
folder written loads with `transformers.GPT2LMHeadModel.from_pretrained` and
appears whole or not at all. Tensor names, shapes and the config's fields
map onto purejax's as `purejax.weights.gpt2` says.
"""

import json
import os
import pathlib
import shutil
import tempfile
from typing import Any, Dict, Optional, Tuple

import ml_dtypes  # pylint: disable=unused-import  # lets numpy (and safetensors) read bfloat16
import numpy as np

from purejax import _files
from purejax import gpt
from purejax.weights import gpt2
from purejax.data import tokenizers
from purejax.weights import torch_files
from purejax.weights.errors import ConversionError

Params = Dict[str, Any]
TokenizerSpec = Dict[str, Any]

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


# ----------------------------------------------------------------------------
# Reading


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


def _import_safetensors():
  # Imported when used, so training needs it only for Hugging Face weights.
  try:
    import safetensors.numpy  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ConversionError("Hugging Face weights need the safetensors package: pip install "
                          "safetensors.") from None
  return safetensors


def _read_safetensors(path: pathlib.Path) -> Dict[str, np.ndarray]:
  safetensors = _import_safetensors()
  try:
    with safetensors.safe_open(str(path), framework="np") as f:
      return {name: f.get_tensor(name) for name in f.keys()}
  except FileNotFoundError:
    raise ConversionError(f"{path} is missing.") from None
  except Exception as e:  # pylint: disable=broad-except  # SafetensorError and dtype errors
    raise ConversionError(
        f"{path} is not a readable safetensors file ({str(e).splitlines()[0][:120]}); it "
        f"is truncated or damaged: download it again.") from e


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
    state = torch_files.load(path)
    if not isinstance(state, dict):
      raise ConversionError(f"{path} does not hold a state dict.")
    return torch_files.tensors_to_numpy(state, path)
  raise ConversionError(f"{folder} has no model.safetensors (nor pytorch_model.bin); "
                        f"download the weights into it.")


def _tokenizer_spec_for_vocab(vocab: int) -> TokenizerSpec:
  """GPT-2's tokenizer for GPT-2's vocabulary size; otherwise only the id count."""
  if vocab == tokenizers.GPT2_VOCAB_SIZE:
    return tokenizers.gpt2_spec()
  return tokenizers.ids_spec(vocab)


def from_huggingface(
    path_or_name: str, *, pad_vocab_multiple: int = gpt2.VOCAB_MULTIPLE,
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
  config, vocab = gpt2.config_from_hf(_read_json(folder / "config.json"),
                                              str(folder / "config.json"), pad_vocab_multiple)
  state = gpt2.strip_prefixes(_read_hf_weights(folder), ("transformer.",))
  source = f"{folder} (weights)"
  wte = state.get("wte.weight")
  if wte is not None and wte.shape[0] != vocab:
    raise ConversionError(f"{source}: wte.weight has {wte.shape[0]} rows but config.json "
                          f"says vocab_size={vocab}; the weights and config.json do not "
                          f"belong together.")
  params = gpt2.params_from_state(state, config, transposed=False, source=source,
                                          vocab_rows=vocab)
  return params, config, _tokenizer_spec_for_vocab(vocab)


# ----------------------------------------------------------------------------
# Writing


def _check_valid_vocab(valid_vocab: Optional[int], config: gpt.GPTConfig) -> int:
  if valid_vocab is None:
    return config.vocab_size
  if not 1 <= valid_vocab <= config.vocab_size:
    raise ConversionError(f"valid_vocab={valid_vocab} must be in [1, vocab_size="
                          f"{config.vocab_size}].")
  return int(valid_vocab)


def check_target(out_dir: str, overwrite: bool) -> None:
  """Refuses a file at `out_dir`, or a non-empty folder unless `overwrite` (before any work)."""
  target = pathlib.Path(out_dir).expanduser()
  if target.exists() and not target.is_dir():
    raise ConversionError(f"{target} exists and is not a folder; choose another path.")
  if target.is_dir() and any(target.iterdir()) and not overwrite:
    raise ConversionError(f"{target} exists and is not empty; pass --overwrite to "
                          f"replace it, or choose another folder.")


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
  _files.fsync(out.parent)
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
  check_target(out_dir, overwrite)
  vocab = _check_valid_vocab(valid_vocab, config)
  state = gpt2.state_from_params(params, config, transposed=False, vocab_rows=vocab,
                                         zero_biases=True)
  tensors = {f"transformer.{name}": value for name, value in state.items()}
  out = pathlib.Path(out_dir).expanduser().absolute()
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
  try:
    # transformers refuses safetensors files without a "format" in the metadata.
    _import_safetensors().numpy.save_file(tensors, str(tmp / "model.safetensors"),
                                metadata={"format": "pt"})
    with open(tmp / "config.json", "w", encoding="utf-8") as f:
      json.dump(gpt2.hf_config_dict(config, vocab), f, indent=2)
    for name in ("model.safetensors", "config.json"):
      _files.fsync(tmp / name)
    _publish_dir(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out

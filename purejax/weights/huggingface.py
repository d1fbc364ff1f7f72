"""Hugging Face model folders in and out: `config.json` beside `model.safetensors`.

    params, config, tok_spec = huggingface.from_huggingface("path/to/gpt2")  # or "gpt2"
    logits = gpt.forward(params, tokens, config)   # [..., config.vocab_size]
    huggingface.to_huggingface(params, config, "gpt2-hf", valid_vocab=tok_spec.vocab_size)

Two architectures convert: GPT-2 (`GPT2LMHeadModel`, mapped by
`purejax.weights.gpt2`) and the Llama family (`LlamaForCausalLM`,
`MistralForCausalLM`, `Qwen2ForCausalLM`, and Gemma 3's `Gemma3ForCausalLM`,
mapped by `purejax.weights.llama` and `purejax.weights.gemma`),
told apart by `model_type` in `config.json`. A name (`gpt2`, or a Hub id
such as `HuggingFaceTB/SmolLM-135M`) is looked up in the Hugging Face cache
only: purejax never downloads. Weights are read with safetensors' numpy API,
sharded ones too, in float32 or bfloat16; a legacy `pytorch_model.bin` needs
torch (`purejax.weights.torch_files`). A Llama-family folder's
`tokenizer.json` becomes the model's tokenizer. The folder written loads with
transformers' `from_pretrained` and appears whole or not at all.
"""

import json
import pathlib
import shutil
from typing import Any, Dict, Optional, Tuple

import ml_dtypes  # pylint: disable=unused-import  # lets numpy (and safetensors) read bfloat16
import numpy as np

from purejax import _files
from purejax import gpt
from purejax.data import tokenizer_json
from purejax.data import tokenizers
from purejax.data.tokenizer_spec import TokenizerSpec
from purejax.weights import gguf_files
from purejax.weights import gpt2
from purejax.weights import hf_talk
from purejax.weights import llama
from purejax.weights import torch_files
from purejax.weights.errors import ConversionError

Params = Dict[str, Any]

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


# ----------------------------------------------------------------------------
# Reading


def is_hub_name(name: str) -> bool:
  """Whether `name` reads as a Hub id (`gpt2`, `owner/model`) rather than a local path."""
  parts = name.split("/")
  return (name in GPT2_NAMES or len(parts) == 2 and all(parts)
          and not name.startswith((".", "~")) and not pathlib.Path(name).exists())


def _hf_folder(path_or_name: str) -> pathlib.Path:
  """The local folder of `path_or_name`: a path, or a Hub id in the HF cache."""
  path = pathlib.Path(path_or_name).expanduser()
  if path.is_dir():
    return path
  if path.is_file():
    raise ConversionError(f"{path_or_name} is a file; pass the folder holding config.json "
                          f"and model.safetensors.")
  short = path_or_name.rstrip("/").removeprefix("openai-community/")
  if not is_hub_name(short):
    raise ConversionError(
        f"{path_or_name} is neither a folder nor one of {', '.join(GPT2_NAMES)} or a Hub "
        f"id OWNER/MODEL; pass the folder holding config.json and model.safetensors.")
  repo = f"openai-community/{short}" if short in GPT2_NAMES else short
  fix = (f"download config.json and the weights of {repo} (e.g. `hf download {repo} "
         f"--local-dir {short.split('/')[-1]}`) and pass the folder's path.")
  try:
    import huggingface_hub  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConversionError(f"{short} is not a folder here and huggingface_hub is not "
                          f"installed to look in its cache; {fix}") from None
  for repo_id in dict.fromkeys((repo, short)):
    try:
      folder = pathlib.Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True))
    except Exception:  # pylint: disable=broad-except  # not cached: try the next id
      continue
    if (folder / "config.json").is_file():
      return folder
  raise ConversionError(f"{short} is no folder here and not in the Hugging Face cache, and "
                        f"purejax does not download; check the path, or {fix}")


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


import_safetensors = _import_safetensors  # (the PEFT writer's too)


def _read_safetensors(path: pathlib.Path) -> Dict[str, np.ndarray]:
  safetensors = _import_safetensors()
  try:
    with safetensors.safe_open(str(path), framework="np") as f:
      names = list(f.keys())
    state = {}
    for name in names:
      # The file is mapped while open, and every page a read touched stays resident
      # until it is closed: opened once per tensor, the file is never held whole
      # beside the arrays read from it.
      with safetensors.safe_open(str(path), framework="np") as f:
        state[name] = f.get_tensor(name)
    return state
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


def _from_llama_family(folder: pathlib.Path, hf_config: Dict[str, Any]
                       ) -> Tuple[Params, gpt.GPTConfig, TokenizerSpec]:
  config = llama.config_from_hf(hf_config, str(folder / "config.json"))
  params = llama.params_from_state(_read_hf_weights(folder), config,
                                   source=f"{folder} (weights)")
  spec = tokenizer_json.spec_of_folder(str(folder)) or tokenizers.ids_spec(config.vocab_size)
  return params, config, spec


def config_from_file(path: str) -> gpt.GPTConfig:
  """The model a Hugging Face `config.json` describes (no weights read): the Llama
  family, Gemma 3, or GPT-2 (its vocabulary padded as `from_huggingface` pads it).

  Raises:
    ConversionError: a missing or unreadable file, another architecture, options
      purejax does not have.
  """
  file = pathlib.Path(path).expanduser()
  if not file.is_file():
    raise ConversionError(f"{file} is missing; pass a model's config.json.")
  hf_config = _read_json(file)
  if hf_config.get("model_type") in (*llama.MODEL_TYPES, "gemma3"):
    return llama.config_from_hf(hf_config, str(file))
  return gpt2.config_from_hf(hf_config, str(file), gpt2.VOCAB_MULTIPLE)[0]


def from_huggingface(
    path_or_name: str, *, pad_vocab_multiple: int = gpt2.VOCAB_MULTIPLE,
) -> Tuple[Params, gpt.GPTConfig, TokenizerSpec]:
  """Imports a Hugging Face GPT-2 (`GPT2LMHeadModel`) or Llama-family model.

  Args:
    path_or_name: a folder with `config.json` and `model.safetensors` (or
      shards with `model.safetensors.index.json`, or `pytorch_model.bin`,
      which needs torch), or a Hub id (`gpt2`, `OWNER/MODEL`), looked up in
      the Hugging Face cache only (never downloaded).
    pad_vocab_multiple: GPT-2 only: pad the vocabulary with zero rows up to
      a multiple of this (1: no padding).

  Returns:
    `(params, config, tokenizer_spec)`: float32 params (device arrays in the
    layout the model reads),
    `config.vocab_size` the (padded) table size, and the tokenizer's spec
    whose `"vocab_size"` is the number of real ids: GPT-2's tokenizer for a
    50257-id GPT-2, the folder's `tokenizer.json` for the Llama family,
    else an "ids" spec.

  Raises:
    ConversionError: not found, another architecture, unsupported options,
      damaged files, or weights that do not fit the config.
  """
  folder = _hf_folder(path_or_name)
  hf_config = _read_json(folder / "config.json")
  if hf_config.get("model_type") in (*llama.MODEL_TYPES, "gemma3"):
    return _from_llama_family(folder, hf_config)
  config, vocab = gpt2.config_from_hf(hf_config, str(folder / "config.json"),
                                      pad_vocab_multiple)
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
    raise ConversionError(f"{target} exists and is not empty; pass `overwrite` to "
                          f"replace it, or choose another folder.")




def _shards(tensors: Dict[str, np.ndarray], max_shard_bytes: int):
  """`tensors` cut, in order, into dicts of at most `max_shard_bytes` (one tensor at least)."""
  shards, size = [{}], 0
  for name, value in tensors.items():
    if shards[-1] and size + value.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = value
    size += value.nbytes
  return shards


def _write_weights(tensors: Dict[str, np.ndarray], folder: pathlib.Path,
                   max_shard_bytes: int) -> None:
  """`model.safetensors`, or shards and `model.safetensors.index.json` as transformers writes."""
  safetensors = _import_safetensors()
  shards = _shards(tensors, max_shard_bytes)
  # transformers refuses safetensors files without a "format" in the metadata.
  if len(shards) == 1:
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"),
                                metadata={"format": "pt"})
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    safetensors.numpy.save_file(shard, str(folder / name), metadata={"format": "pt"})
    weight_map.update({tensor: name for tensor in shard})
  index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
           "weight_map": weight_map}
  (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def tokenizer_files(tokenizer_spec: Optional[TokenizerSpec], config: gpt.GPTConfig
                    ) -> Tuple[Optional[str], Optional[str], hf_talk.Companion]:
  """What a folder needs to talk to the model: `(a tokenizer.json to copy, or the text
  of one rebuilt from a GGUF file's tokenizer, the companion files and config values)`.

  The model's own `tokenizer.json` is found by its hash (a moved one is left
  out); a GGUF file's tokenizer is rebuilt and written as a tokenizer.json,
  with its chat template and special tokens (`hf_talk.companion_of_spec`).
  """
  if tokenizer_spec and tokenizer_spec.kind == "tokenizer.json":
    try:
      tokenizer_file = tokenizer_json.from_spec(tokenizer_spec).encoding_file
    except tokenizers.TokenizerError:
      tokenizer_file = None
    return tokenizer_file, None, hf_talk.companion_files(tokenizer_file, config)
  if tokenizer_spec and tokenizer_spec.kind == "gguf":
    try:
      rebuilt = tokenizers.from_spec(tokenizer_spec).tokenizer
      return None, rebuilt.to_str(), hf_talk.companion_of_spec(
          tokenizer_spec, rebuilt.get_vocab(), config,
          gguf_files.base_context(tokenizer_spec, config))
    except tokenizers.TokenizerError:
      pass
  return None, None, hf_talk.companion_files(None, config)


def to_huggingface(
    params: Params,
    config: gpt.GPTConfig,
    out_dir: str,
    valid_vocab: Optional[int] = None,
    *,
    overwrite: bool = False,
    dtype: str = "float32",
    max_shard_bytes: int = 5 << 30,
    tokenizer_spec: Optional[TokenizerSpec] = None,
) -> pathlib.Path:
  """Writes a folder that transformers' `from_pretrained` loads.

  GPT-2's architecture becomes a `GPT2LMHeadModel`: the head is tied, so
  only `transformer.wte.weight` is written (safetensors refuses shared
  tensors, and transformers re-ties `lm_head` on load, as its own
  `save_pretrained` expects), and params without biases get zero biases
  (GPT-2 always has them; the function is the same). The Llama family
  becomes a `LlamaForCausalLM`, or a `Qwen2ForCausalLM` with qkv-only biases
  (`purejax.weights.llama`), with the model's `tokenizer.json` beside it
  (a GGUF file's tokenizer is written as one), and what its folder, or its
  GGUF file, says about talking to it (`purejax.weights.hf_talk`: the chat
  template in `tokenizer_config.json`, `special_tokens_map.json`,
  `generation_config.json`, the bos/eos ids and the model's own context
  `max_position_embeddings` in `config.json`).

  The folder is written under a temporary name beside `out_dir` and renamed
  into place when complete: a crash leaves no half-written `out_dir`.

  Args:
    params: purejax GPT params.
    config: their config.
    out_dir: the folder to create.
    valid_vocab: GPT-2: real vocabulary size; the padding rows past it are
      dropped. The Llama family keeps every row.
    overwrite: replace an existing non-empty `out_dir`.
    dtype: of the written weights, "float32" or "bfloat16".
    max_shard_bytes: larger weights are split into shards of at most this
      size, with `model.safetensors.index.json`.
    tokenizer_spec: the model's tokenizer; a `tokenizer.json` one is copied
      into the folder (when the file recorded in the spec is still there).

  Returns:
    The folder's path.

  Raises:
    ConversionError: bad `valid_vocab` or `dtype`, an architecture Hugging
      Face has no class for, or `out_dir` exists and not `overwrite`.
  """
  check_target(out_dir, overwrite)
  if dtype not in _DTYPES:
    raise ConversionError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}.")
  if gpt2.is_gpt2(config):
    vocab = _check_valid_vocab(valid_vocab, config)
    state = gpt2.state_from_params(params, config, transposed=False, vocab_rows=vocab,
                                   zero_biases=True)
    tensors = {f"transformer.{name}": value.astype(_DTYPES[dtype])
               for name, value in state.items()}
    hf_config = dict(gpt2.hf_config_dict(config, vocab), torch_dtype=dtype)
  else:
    hf_config = llama.hf_config_dict(config, dtype)
    tensors = llama.state_from_params(gpt2.to_numpy(params), config, _DTYPES[dtype])
  tokenizer_file, tokenizer_text, extra = tokenizer_files(tokenizer_spec, config)
  hf_config.update(extra.config_values)
  out = pathlib.Path(out_dir).expanduser().absolute()
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = _files.make_temp(out, directory=True)
  try:
    _write_weights(tensors, tmp, max_shard_bytes)
    with open(tmp / "config.json", "w", encoding="utf-8") as f:
      json.dump(hf_config, f, indent=2)
    if tokenizer_file:
      shutil.copyfile(tokenizer_file, tmp / tokenizer_json.FILE_NAME)
    for name, value in extra.files.items():
      (tmp / name).write_text(json.dumps(value, indent=2, ensure_ascii=False), encoding="utf-8")
    if tokenizer_text:
      (tmp / tokenizer_json.FILE_NAME).write_text(tokenizer_text, encoding="utf-8")
    for path in tmp.iterdir():
      _files.fsync(path)
    _files.publish_dir(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out

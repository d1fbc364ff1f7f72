"""GPT weights in and out, whatever the format: Hugging Face, nanoGPT, purejax checkpoints.

    params, config, tok_spec = pretrained.from_pretrained("gpt2")  # a name, a path, KIND:PATH
    logits = gpt.forward(params, tokens, config)   # [..., config.vocab_size]
    pretrained.to_purejax(params, config, "out-gpt", tok_spec)   # a step-0 checkpoint
    params, config, tok_spec = pretrained.from_purejax("out-gpt")
    pretrained.convert("hf:gpt2", "nanogpt:ckpt.pt")             # what `python -m purejax.convert` runs

Each outside format has its module: `purejax.weights.huggingface` (a folder with
`config.json` and `model.safetensors`) and `purejax.weights.nanogpt` (`ckpt.pt`,
`meta.pkl`); `purejax.weights.gpt2` maps their tensors onto purejax's params.

`config.vocab_size` may count padding rows (see `purejax.weights.gpt2`); the
tokenizer spec returned with the params says how many ids are real
(`spec.vocab_size`).
"""

import dataclasses
import pathlib
from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np

from purejax import checkpoint
from purejax import gpt
from purejax import host_memory
from purejax import lora
from purejax.data import tokenizers
from purejax.data.tokenizer_spec import TokenizerSpec
from purejax.ops import quant
from purejax.weights import gguf_files
from purejax.weights import huggingface
from purejax.weights import nanogpt
from purejax.weights import peft
from purejax.weights.errors import ConversionError

Params = Dict[str, Any]

# ----------------------------------------------------------------------------
# purejax checkpoints


def from_purejax(out_dir: str, *, best: bool = False, merge_adapters: bool = True
                 ) -> Tuple[Params, gpt.GPTConfig, TokenizerSpec]:
  """The params, config and tokenizer spec of the newest GPT checkpoint in `out_dir`.

  A LoRA fine-tune's adapters are merged into its base (`lora.merge`, float32), so
  sampling and every export format get the fine-tuned weights. With
  `merge_adapters=False` they stay beside the base as the run trained them
  (`lora.low_rank`: each adapted weight a `LowRankWeight`), the base held as the run
  held it (QLoRA: quantized): the same model in the base's memory, which the model
  and the engine run as they are.

  With `best`, of the run's best checkpoint (`checkpoint.best_path`) instead.
  """
  if merge_adapters:
    return _read_purejax(out_dir, best)[:3]
  params, config, spec, meta = _read_purejax(out_dir, best, merged=False)
  if meta.get("lora"):
    alpha = lora.LoraConfig(meta["lora"]["rank"], meta["lora"]["alpha"]).scale_alpha
    params = lora.low_rank(params["base"], params["adapters"], alpha)
  return jax.tree.map(host_memory.to_device, params), config, spec


def _held_base(template: Params, arrays) -> Params:
  """A LoRA run's base template as its checkpoint holds it: a matrix saved quantized
  (`--quantize`: `w.codes`, `w.scale`, `w.offset` arrays) as a `quant.QuantizedWeight`
  (its code width from its rows; an embedding table is the transposed form), one saved in
  bfloat16 as bfloat16."""

  def one(path, leaf):
    name = "['params']['base']" + jax.tree_util.keystr(path)
    if name + ".codes" in arrays:
      parts = [jax.ShapeDtypeStruct(arrays[f"{name}.{f}"].shape, arrays[f"{name}.{f}"].dtype)
               for f in ("codes", "scale", "offset")]
      table = name.endswith("['embedding']")  # blocks along a row: the transposed form
      rows, stored = leaf.shape[-1 if table else -2], parts[0].shape[-2]
      bits = {rows: 8, rows // 2: 4, rows * 5 // 8: 5}[stored]
      return quant.QuantizedWeight(*parts, bits, table)
    if name in arrays and arrays[name].dtype != leaf.dtype:
      return jax.ShapeDtypeStruct(leaf.shape, arrays[name].dtype)
    return leaf

  return jax.tree_util.tree_map_with_path(one, template)


def _read_purejax(out_dir: str, best: bool = False, merged: bool = True):
  """`from_purejax`'s values and the checkpoint's whole metadata; with `merged=False`,
  a LoRA run's params are `{"base": ..., "adapters": ...}` (`lora.trainable`)."""
  if best:
    path = checkpoint.best_path(out_dir)
    if not path.exists():
      raise ConversionError(f"{out_dir} holds no best checkpoint ({path.name}); train with "
                            f"`always_save_checkpoint=False` to keep one.")
    arrays, manifest = checkpoint.read(path)
    meta = manifest["meta"]
  else:
    arrays, meta = checkpoint.latest_meta(out_dir)
  if meta.get("model") != "gpt":
    raise ConversionError(f"{out_dir} holds a {meta.get('model')!r} model, not a GPT; point "
                          f"at a GPT run.")
  try:
    config = gpt.GPTConfig.from_dict(meta["config"])
  except (TypeError, ValueError, KeyError) as e:
    raise ConversionError(f"{out_dir}: the checkpoint's config does not fit this purejax "
                          f"version ({e}).") from e
  template = {"params": jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))}
  adapted = meta.get("lora")
  if adapted:  # a LoRA fine-tune: base and adapters, merged here for every use
    adapters = jax.eval_shape(lambda p: lora.init(p, adapted["rank"], tuple(adapted["targets"]),
                                                  jax.random.PRNGKey(0)), template["params"])
    template = {"params": lora.trainable(_held_base(template["params"], arrays), adapters)}
  params = checkpoint.extract(arrays, template, out_dir)["params"]
  if "tokenizer" in meta:
    spec = TokenizerSpec.from_dict(meta["tokenizer"])
  elif "vocab" in meta:
    spec = tokenizers.CharTokenizer(meta["vocab"]).spec()
  else:
    spec = tokenizers.ids_spec(config.vocab_size)
  if adapted and not merged:
    return params, config, spec, meta
  if adapted:
    alpha = lora.LoraConfig(adapted["rank"], adapted["alpha"]).scale_alpha
    params = lora.merge(params["base"], params["adapters"], alpha)
    # A base held quantized or in bfloat16 (`--quantize`): every weight float32 again.
    params = jax.tree.map(lambda w: np.asarray(quant.dense(w), np.float32), params,
                          is_leaf=lambda w: isinstance(w, quant.QuantizedWeight))
  # float32 device arrays, as every loader gives them (no copy per call of the model).
  params = jax.tree.map(lambda a: host_memory.to_device(np.asarray(a, np.float32)), params)
  return params, config, spec, meta


def from_pretrained(source: str, *, trust_pickle: bool = False, keep_quantized: bool = False
                    ) -> Tuple[Params, gpt.GPTConfig, TokenizerSpec]:
  """Params, config and tokenizer spec of a pretrained GPT, whatever its format.

  Args:
    source: `gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl` or a Hub id
      `OWNER/MODEL` of a Llama-family model (Hugging Face's cache); `KIND:PATH`
      with KIND hf, gguf, nanogpt or purejax; or a path: a folder with
      `config.json` (Hugging Face: GPT-2, Llama, Mistral, Qwen2), a `.gguf`
      file (llama.cpp's: llama, mistral, qwen2, gemma3; dequantized to float32
      unless `keep_quantized`), a folder of purejax checkpoints, or a nanoGPT
      `.pt` file.
    trust_pickle: load `.pt` files with arbitrary pickled objects.
    keep_quantized: a GGUF file's quantized blocks kept as they are
      (`gguf_files.from_gguf`); refused for any other source.

  Raises:
    ConversionError: the source is none of these, or does not load.
  """
  kind, sep, path = source.partition(":")
  if not (sep and kind in _SOURCES):
    kind, path = None, source
    local = pathlib.Path(source).expanduser()
    if (local / "config.json").is_file() or huggingface.is_hub_name(source):
      kind = "hf"
    elif local.is_dir() and checkpoint.list_checkpoints(str(local)):
      kind = "purejax"
    elif local.is_file() and local.suffix == ".pt":
      kind = "nanogpt"
    elif local.suffix == ".gguf" or gguf_files.is_gguf(source):
      kind = "gguf"
    if kind is None and not local.exists():
      raise ConversionError(
          f"`source={source}` is missing: no such file or folder. Check the path (a Hugging "
          f"Face folder, a .gguf file, a purejax run directory or a nanoGPT .pt file), or "
          f"name {', '.join(huggingface.GPT2_NAMES)} or a Hub id OWNER/MODEL.")
    if kind is None:
      raise ConversionError(
          f"`source={source}`: not {', '.join(huggingface.GPT2_NAMES)}, nor a Hub id "
          f"OWNER/MODEL, a Hugging Face folder (config.json), a .gguf file, a purejax run "
          f"directory (ckpt_*.npz) or a nanoGPT .pt file.")
  if keep_quantized and kind != "gguf":
    named = {"hf": "Hugging Face", "nanogpt": "nanoGPT", "purejax": "purejax run's"}[kind]
    raise ConversionError(f"`{source}` is a {named} model, not a .gguf file: only a GGUF file "
                          f"has quantized blocks to keep; quantize it after loading instead "
                          f"(`quant.quantize_matrices`: int8, q8_0 or q4_1).")
  if kind == "hf":
    return huggingface.from_huggingface(path)
  if kind == "gguf":
    return gguf_files.from_gguf(path, keep_quantized=keep_quantized)
  if kind == "nanogpt":
    return nanogpt.from_nanogpt(path, allow_pickle=trust_pickle)
  return from_purejax(path)


def to_purejax(params: Params, config: gpt.GPTConfig, out_dir: str,
               tokenizer_spec: TokenizerSpec) -> pathlib.Path:
  """Writes `params` as a step-0 purejax checkpoint (no optimizer state) in `out_dir`.

  The metadata holds the config, the tokenizer spec (`"tokenizer"`) and, for
  character tokenizers, `"vocab"` as `purejax.sample` reads it today.
  """
  meta = {"model": "gpt", "config": dataclasses.asdict(config),
          "tokenizer": tokenizer_spec.to_dict()}
  if tokenizer_spec.kind == "char":
    meta["vocab"] = tokenizer_spec.chars
  _check_target("purejax", out_dir, overwrite=False)
  return checkpoint.save(out_dir, 0, {"params": params}, meta)


# ----------------------------------------------------------------------------
# Command line


def _check_target(kind: str, path: str, overwrite: bool) -> None:
  """Refuses to replace existing output unless `overwrite` (checked before any work)."""
  target = pathlib.Path(path).expanduser()
  if kind == "purejax":
    if checkpoint.list_checkpoints(str(target)):
      raise ConversionError(f"{target} already holds checkpoints; choose an empty folder.")
  elif kind in ("hf", "peft"):
    huggingface.check_target(path, overwrite)
  elif kind == "gguf":
    gguf_files.check_target(path, overwrite)
  else:
    nanogpt.check_target(path, overwrite)


_SOURCES = ("hf", "gguf", "nanogpt", "purejax")
_TARGETS = _SOURCES + ("peft",)  # peft: a LoRA run's adapters alone


def parse_location(value: Optional[str], what: str, *, target: bool = False
                   ) -> Tuple[str, str]:
  """`(kind, path)` of a `KIND:PATH` location; `what` names it in the error; a
  `target` may also be `peft:`."""
  kinds = _TARGETS if target else _SOURCES
  if not value:
    raise ConversionError(f"{what} is required: KIND:PATH with KIND one of "
                          f"{', '.join(kinds)}.")
  kind, sep, path = value.partition(":")
  if not sep or kind not in kinds or not path:
    raise ConversionError(f"{what}={value or ''} must be KIND:PATH with KIND one of "
                          f"{', '.join(kinds)}.")
  return kind, path


def _to_peft(src_kind: str, src: str, dst: str, overwrite: bool) -> str:
  """A LoRA run's adapters as a PEFT folder; the summary line."""
  if src_kind != "purejax":
    raise ConversionError(f"peft: targets take a purejax LoRA run's adapters; the source "
                          f"is {src_kind}:{src}.")
  tree, config, spec, meta = _read_purejax(src, merged=False)
  if not meta.get("lora"):
    raise ConversionError(f"{src} is not a LoRA fine-tune (it has no adapters); export "
                          f"it whole with hf:DIR.")
  settings = lora.LoraConfig(meta["lora"]["rank"], meta["lora"]["alpha"],
                             tuple(meta["lora"]["targets"]))
  written = peft.to_peft(tree["adapters"], settings, config, dst,
                         base_model=meta.get("init_from"), overwrite=overwrite,
                         tokenizer_spec=spec)
  return (f"wrote peft:{written} (LoRA rank {settings.rank}, alpha {settings.scale_alpha:g}, "
          f"{lora.num_params(tree['adapters']) / 1e6:.3f}M adapter params; base "
          f"{meta.get('init_from')}).")


def convert(source: str, target: str, *, meta: Optional[str] = None,
            overwrite: bool = False, trust_pickle: bool = False,
            dtype: str = "float32", gguf_type: str = "f16") -> str:
  """Converts `source` to `target` (both `KIND:PATH`); returns a one-line summary.

  `dtype` ("float32" or "bfloat16") is that of a Hugging Face target's
  weights; `gguf_type` ("f32", "f16", "bf16" or "q8_0") that of a GGUF target's.
  """
  src_kind, src = parse_location(source, "source")
  dst_kind, dst = parse_location(target, "target", target=True)
  _check_target(dst_kind, dst, overwrite)  # before a load that may take minutes
  if dst_kind == "peft":
    return _to_peft(src_kind, src, dst, overwrite)
  dataset = None  # the training data's name, which nanoGPT's sample.py looks for
  if src_kind == "hf":
    params, config, spec = huggingface.from_huggingface(src)
  elif src_kind == "gguf":
    params, config, spec = gguf_files.from_gguf(src)
  elif src_kind == "nanogpt":
    params, config, spec = nanogpt.from_nanogpt(src, meta_path=meta, allow_pickle=trust_pickle)
  else:
    params, config, spec, saved = _read_purejax(src)
    dataset = saved.get("dataset")
  valid = spec.vocab_size
  if dst_kind == "hf":
    written = huggingface.to_huggingface(params, config, dst, valid_vocab=valid,
                                         overwrite=overwrite, tokenizer_spec=spec,
                                         dtype=dtype)
  elif dst_kind == "gguf":
    written = gguf_files.to_gguf(params, config, dst, spec, gguf_type=gguf_type,
                                 overwrite=overwrite)
  elif dst_kind == "nanogpt":
    written = nanogpt.to_nanogpt(params, config, dst, tokenizer_spec=spec, dataset=dataset,
                                 overwrite=overwrite)
  else:
    written = to_purejax(params, config, dst, spec)
  return (f"wrote {dst_kind}:{written} ({config.n_layer} layers, n_embd={config.n_embd}, "
          f"{gpt.num_params(params) / 1e6:.2f}M params, {valid} ids of {config.vocab_size}, "
          f"tokenizer {spec.name}).")

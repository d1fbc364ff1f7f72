"""What `purejax.sample` and `purejax.chat` share: the model a flag names, where it ends.

    params, config, tokenizer = models.load_model("out-gpt", init_from="path/to/model")
    params, config = models.adjust(params, config, block_size=1024, dtype="bfloat16")
    stops = models.stop_ids(tokenizer)                  # the model's end-of-text ids
    fmt = models.chat_format("path/to/model", tokenizer)  # its chat template
"""

import dataclasses
import pathlib
import sys
from typing import Optional, Tuple

from absl import flags
import jax
import jax.numpy as jnp

from purejax import checkpoint
from purejax import gpt
from purejax import weights
from purejax.data import chat
from purejax.data import tokenizers
from purejax.ops import quant
from purejax.ops.matmul import LowRankWeight

GPT2_END = "<|endoftext|>"
KEEP_GGUF = "gguf"  # --quantize's value that keeps a GGUF file's blocks as they are
KEEP_HELD = "held"  # --quantize's value that keeps a LoRA run's base as the run held it


def load_model(out_dir: str, init_from=None, *, best: bool = False, tokenizer_file=None,
               quantize: Optional[str] = None):
  """`(params, config, tokenizer)` of `init_from` if given, else of the run in `out_dir`;
  `quantize="gguf"` keeps a GGUF file's quantized blocks, `quantize="held"` a LoRA run's
  base as the run held it, its adapters beside it (each refused for other models)."""
  if quantize == KEEP_GGUF and not init_from:
    raise weights.ConversionError(
        f"--quantize={KEEP_GGUF} keeps a GGUF file's own blocks, and a run's checkpoints are "
        f"float; pass the .gguf file as --init_from, or --quantize=int8, q8_0 or q4_1.")
  if quantize == KEEP_HELD:
    params, config, spec = _held_run(init_from or out_dir, best)
  elif init_from:
    params, config, spec = weights.from_pretrained(init_from,
                                                   keep_quantized=quantize == KEEP_GGUF)
  elif best:
    params, config, spec = weights.from_purejax(out_dir, best=True)
  elif checkpoint.list_checkpoints(out_dir):
    params, config, spec = weights.from_purejax(out_dir)
  else:
    raise checkpoint.CheckpointError(
        f"no checkpoint in {out_dir}; train first with `python -m purejax.train "
        f"--out_dir={out_dir}`, or pass --init_from=gpt2.")
  tokenizer = tokenizers.from_spec(spec, encoding_file=tokenizer_file)
  return jax.tree.map(jnp.asarray, params), config, tokenizer


def _held_run(source: str, best: bool):
  """`--quantize=held`: a LoRA run's model with its adapters beside its base, held as the
  run held it (`weights.from_purejax(merge_adapters=False)`)."""
  if not checkpoint.list_checkpoints(source) and not (best and checkpoint.best_path(
      source).exists()):
    raise weights.ConversionError(
        f"--quantize={KEEP_HELD} keeps a LoRA run's base as the run held it, and {source} "
        f"is not a purejax run folder; pass the run's folder, or another --quantize.")
  params, config, spec = weights.from_purejax(source, best=best, merge_adapters=False)
  is_low_rank = lambda x: isinstance(x, LowRankWeight)
  if not any(map(is_low_rank, jax.tree.leaves(params, is_leaf=is_low_rank))):
    raise weights.ConversionError(
        f"--quantize={KEEP_HELD} keeps a LoRA run's base as the run held it, and {source} "
        f"is not a LoRA run; drop --quantize, or choose int8, q8_0 or q4_1.")
  return params, config, spec


def adjust(params, config: gpt.GPTConfig, block_size: Optional[int] = None,
           dtype: Optional[str] = None, quantize: Optional[str] = None
           ) -> Tuple[dict, gpt.GPTConfig]:
  """The model with a shorter context (`block_size`, for a smaller cache), another
  matmul dtype (`dtype`: "float32" or "bfloat16") and its dense layers' matrices kept
  quantized (`quantize`: one of `quant.FORMATS`); None (or "gguf", which `load_model`
  applies) keeps the model's."""
  if block_size is not None:
    if block_size < 1:
      raise ValueError(f"`block_size={block_size}` must be positive.")
    block_size = min(block_size, config.block_size)
    if "wpe" in params:  # learned positions: only the first block_size rows are used
      params = {**params, "wpe": {"embedding": params["wpe"]["embedding"][:block_size]}}
    config = dataclasses.replace(config, block_size=block_size)
  if dtype is not None:
    config = dataclasses.replace(config, compute_dtype=dtype)
  if quantize in quant.FORMATS:
    params, left = quant.quantize_matrices(params, quantize)
    if left:
      print(f"kept in float32 (not a multiple of {quant.BLOCK} rows for {quantize}): "
            f"{', '.join(left)}", file=sys.stderr)
  return params, config


def hold_base(params, held: Optional[str]):
  """A LoRA run's frozen base held as `held` says (`quant.hold_matrices`; None or "gguf",
  which `load_model` applies: as it is); the matrices it cannot hold so are named on
  stderr."""
  if held in (None, KEEP_GGUF):
    return params
  params, left = quant.hold_matrices(params, held)
  if left:
    print(f"base matrices kept in float32 (not a multiple of {quant.BLOCK} rows for "
          f"{held}): {', '.join(left)}", file=sys.stderr)
  return params


def define_quantize_flag(args) -> None:
  """`--quantize`, which every command that runs a model shares."""
  flags.DEFINE_enum("quantize", None, [*quant.FORMATS, KEEP_GGUF, KEEP_HELD], "Keep the "
                    "dense layers' matrices quantized in memory, dequantized inside each "
                    "product: int8 (a scale per column), q8_0 or q4_1 (GGUF's blocks of 32 "
                    "rows); embeddings and norms stay float. gguf: keep a .gguf file's own "
                    "blocks (Q8_0, Q4_1, Q5_0, Q4_K, Q6_K; its token embedding too) as they "
                    "are. held: a LoRA run's base as the run held it (QLoRA: quantized), its "
                    "adapters beside it, unmerged: the model as trained, in the base's memory.",
                    flag_values=args)


def _folder_of(tokenizer) -> Optional[pathlib.Path]:
  """The model folder a tokenizer.json tokenizer was read from, if any."""
  spec = tokenizer.spec() if hasattr(tokenizer, "spec") else None
  if spec is None or spec.kind != "tokenizer.json" or not spec.encoding_file:
    return None
  return pathlib.Path(spec.encoding_file).parent


def _single_id(tokenizer, text: Optional[str]) -> Optional[int]:
  if not text:
    return None
  ids = [int(i) for i in tokenizer.encode(text)]
  return ids[0] if len(ids) == 1 else None


def stop_ids(tokenizer, fmt: Optional[chat.ChatFormat] = None) -> Tuple[int, ...]:
  """The ids a model's text ends at: a chat format's, a model folder's
  (`generation_config.json`, else its EOS), GPT-2's `<|endoftext|>`; () if none."""
  if fmt is not None and fmt.stop_ids:
    return fmt.stop_ids
  folder = _folder_of(tokenizer)
  if folder is not None:
    try:
      return chat.load_chat_format(str(folder), tokenizer).stop_ids
    except chat.ChatTemplateError:  # a base model: its EOS, from the files it has
      return chat.stop_ids_of_folder(str(folder))
  special = dict(getattr(getattr(tokenizer, "spec", lambda: None)(), "special_tokens", ()) or ())
  return (special[GPT2_END],) if GPT2_END in special else ()


def chat_format(init_from: Optional[str], tokenizer) -> chat.ChatFormat:
  """The chat template of the model `init_from` names, of the folder its tokenizer
  came from (a purejax run fine-tuned from a Hugging Face folder), or the one
  its tokenizer spec records (a GGUF file's).

  Raises:
    chat.ChatTemplateError: the model has no template.
  """
  folder = None
  if init_from and pathlib.Path(init_from).expanduser().is_dir():
    local = pathlib.Path(init_from).expanduser()
    if (local / chat.TOKENIZER_CONFIG).is_file() or (local / chat.TEMPLATE_FILE).is_file():
      folder = local
  folder = folder or _folder_of(tokenizer)
  recorded = chat.format_of_spec(tokenizer.spec(), tokenizer) if folder is None else None
  if recorded is not None:  # a GGUF file's template, from its metadata
    return recorded
  if folder is None:
    raise chat.ChatTemplateError(
        f"{init_from or 'this model'} has no chat template (neither a model folder's "
        f"tokenizer.json nor a GGUF file's); use an instruct model's folder or GGUF file.")
  return chat.load_chat_format(str(folder), tokenizer)

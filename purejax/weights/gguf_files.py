"""GGUF files (llama.cpp's format) in and out, for the Llama family and Gemma 3.

    params, config, tok_spec = gguf_files.from_gguf("model.gguf")   # any quantization below
    gguf_files.to_gguf(params, config, "out.gguf", tok_spec, gguf_type="q8_0")

Reading and writing go through llama.cpp's own Python package, `gguf`: its
reader, and its `quants` functions to dequantize (`READ_TYPES`) and to
quantize (`WRITE_TYPES`). A file's architecture (`general.architecture`:
llama, mistral, qwen2, gemma3) and hyperparameters become a Hugging Face
`config.json`'s values, checked by `purejax.weights.llama` (and, for
gemma3, `purejax.weights.gemma`) like any other, and its tensors are
renamed to Hugging Face's names:

    token_embd.weight                   model.embed_tokens.weight
    output_norm.weight                  model.norm.weight
    output.weight                       lm_head.weight (absent: a tied head)
    blk.{i}.attn_norm.weight            model.layers.{i}.input_layernorm.weight
    blk.{i}.attn_{q,k,v}.*              ...self_attn.{q,k,v}_proj.*
    blk.{i}.attn_output.weight          ...self_attn.o_proj.weight
    blk.{i}.ffn_norm.weight             ...post_attention_layernorm.weight (not gemma3)
    blk.{i}.ffn_{gate,up,down}.*        ...mlp.{gate,up,down}_proj.weight
  gemma3's four norms per block and QK-norm scales:
    blk.{i}.post_attention_norm.weight  ...post_attention_layernorm.weight
    blk.{i}.ffn_norm.weight             ...pre_feedforward_layernorm.weight
    blk.{i}.post_ffw_norm.weight        ...post_feedforward_layernorm.weight
    blk.{i}.attn_{q,k}_norm.weight      ...self_attn.{q,k}_norm.weight

llama.cpp's converter reorders the rows of a llama's query and key
projections within each head (from the rotate-half pairing Hugging Face's
RoPE uses to the interleaved pairs of llama.cpp's); `_permute` and
`_unpermute` convert between the two. Qwen2 and Gemma 3 use the rotate-half
pairing in llama.cpp too, so their rows are stored as they are.

Gemma 3 follows llama.cpp's gemma3 conventions (its convert_hf_to_gguf.py
and llama-model.cpp; transformers' GGUF loader reads them too): every
`*norm.weight` is stored as `1 + w` (Gemma's RMSNorm multiplies by
`1 + w`), and what the file does not state llama.cpp fixes, and so does
purejax on reading: every 6th layer is global (layer `i` when
`(i + 1) % 6 == 0`; a `gemma3.attention.sliding_window_pattern` key, which
newer llama.cpp reads, is honoured: a period, or one flag per layer, true
where it slides), the sliding layers' RoPE base is 10000 (or
`gemma3.rope.freq_base_swa`), the attention scale is `head_dim ** -0.5`
(`(n_embd / n_head) ** -0.5` for the 62-layer 27B), there is no soft-cap
(a `final_logit_softcapping` key is ignored, as llama.cpp's graph ignores
it with sliding layers), the head is tied unless `output.weight` is there,
and RoPE scaling (linear only) is the global layers'. A file without a
sliding window is refused (llama.cpp versions disagree on what it means);
a model outside these conventions is refused on export (`to_gguf`), one
error naming the option. transformers' GGUF loader reads neither the RoPE
scaling nor the 27B's scale from a gemma3 file; llama.cpp does.

The tokenizer, with its chat template, is the file's metadata
(`purejax.data.gguf_tokenizer`).
"""

import dataclasses
import logging
import os
import pathlib
import re
from typing import Any, Dict, Tuple

import numpy as np

from purejax import _files
from purejax import host_memory
from purejax import gpt
from purejax.data import gguf_reader
from purejax.data import gguf_tokenizer
from purejax.data import tokenizers
from purejax.data.tokenizer_spec import TokenizerSpec
from purejax.ops import quant
from purejax.weights import gemma
from purejax.weights import gpt2
from purejax.weights import hf_talk
from purejax.weights import llama
from purejax.weights.errors import ConversionError

Params = Dict[str, Any]

ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3")
# Architectures whose query/key rows llama.cpp's converter permutes.
_PERMUTED = ("llama", "mistral")
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
              "Q4_K", "Q5_K", "Q6_K")
WRITE_TYPES = ("f32", "f16", "bf16", "q8_0")

_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
# Gemma 3's four norms per block and QK-norm scales (llama.cpp's gemma3 names).
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm",
                       "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_HF_NAMES = {**{hf: g for g, hf in _GLOBAL_NAMES.items()}}

# gemma3: what llama.cpp fixes rather than stores (llama-model.cpp, LLM_ARCH_GEMMA3).
GEMMA3_GLOBAL_EVERY = 6          # layer i is global iff (i + 1) % 6 == 0
GEMMA3_LOCAL_THETA = 10_000.0    # the sliding layers' RoPE base
_GEMMA3_27B_LAYERS = 62          # the 27B's attention scale is n_embd / n_head, not head_dim


def _layer_names(arch: str) -> Dict[str, str]:
  return _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES


def _hf_name(name: str, arch: str = "llama") -> str:
  """Hugging Face's name of the GGUF tensor `name` (unknown names are kept)."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  names = _layer_names(arch)
  found = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
  if found and found.group(2) in names:
    i, part, leaf = found.groups()
    return f"model.layers.{i}.{names[part]}.{leaf}"
  return name


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
  """`_hf_name`'s inverse."""
  if hf_name in _HF_NAMES:
    return _HF_NAMES[hf_name]
  found = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
  parts = {hf: g for g, hf in _layer_names(arch).items()}
  i, part, leaf = found.groups()
  return f"blk.{i}.{parts[part]}.{leaf}"


def _is_gemma_norm(gguf_name: str) -> bool:
  """Whether llama.cpp stores this gemma3 tensor as `1 + w` (every `*norm.weight`)."""
  return gguf_name.endswith("norm.weight")


def _gemma3_attn_scalar(n_layer: int, n_embd: int, n_head: int, head_dim: int) -> int:
  """The `query_pre_attn_scalar` llama.cpp gives a gemma3 file: `head_dim`, or for the
  62-layer 27B `n_embd // n_head` (llama-model.cpp's `f_attention_scale`)."""
  return n_embd // n_head if n_layer == _GEMMA3_27B_LAYERS else head_dim


def _gemma3_layer_types(n_layer: int, pattern=None) -> list:
  """Gemma's `layer_types` of a gemma3 file: every 6th layer global, or as
  `gemma3.attention.sliding_window_pattern` says (llama.cpp's `set_swa_pattern`: a
  period n, layer i sliding iff i % n < n - 1, 0 all sliding; or one bool per layer,
  true where it slides)."""
  if pattern is None:
    pattern = GEMMA3_GLOBAL_EVERY
  if isinstance(pattern, list):
    sliding = [bool(x) for x in pattern]
  else:
    n = int(pattern)
    sliding = [n == 0 or i % n < n - 1 for i in range(n_layer)]
  return ["sliding_attention" if s else "full_attention" for s in sliding]


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
  """Hugging Face's query/key rows (`[heads * head_dim, ...]`) in llama.cpp's order."""
  half = rows.shape[0] // heads // 2
  return rows.reshape(heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
  """`_permute`'s inverse: llama.cpp's query/key rows in Hugging Face's order."""
  half = rows.shape[0] // heads // 2
  return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


# ----------------------------------------------------------------------------
# Reading


def _hf_config(meta: Dict[str, Any], names: set, source: str) -> Dict[str, Any]:
  """The `config.json` values a GGUF's metadata states (`llama.config_from_hf` checks them)."""
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ConversionError(f"{source} holds a {arch!r} model; purejax reads GGUF files of "
                          f"the Llama family and Gemma 3 ({', '.join(ARCHITECTURES)}).")
  a = lambda key: meta.get(f"{arch}.{key}")
  heads, width = a("attention.head_count"), a("embedding_length")
  if isinstance(heads, list) or isinstance(a("attention.head_count_kv"), list):
    raise ConversionError(f"{source}: per-layer head counts are not a purejax GPT.")
  if arch == "gemma3":
    return _gemma3_hf_config(meta, names, source)
  scaling = a("rope.scaling.type")
  if scaling not in (None, "none") or "rope_freqs.weight" in names:
    raise ConversionError(f"{source}: RoPE scaling ({scaling or 'rope_freqs.weight'}) is "
                          f"not read from GGUF files; convert the model from its Hugging "
                          f"Face folder instead.")
  rope_dims = a("rope.dimension_count")
  if rope_dims is not None and heads and width and rope_dims != width // heads:
    raise ConversionError(f"{source}: {arch}.rope.dimension_count={rope_dims} rotates part of "
                          f"each head ({width // heads}); purejax rotates whole heads.")
  tokens = meta.get("tokenizer.ggml.tokens")
  vocab = a("vocab_size") or (len(tokens) if tokens else None)
  bias = "blk.0.attn_output.bias" in names
  return {"model_type": arch, "vocab_size": vocab, "hidden_size": width,
          "intermediate_size": a("feed_forward_length"), "num_hidden_layers": a("block_count"),
          "num_attention_heads": heads, "num_key_value_heads": a("attention.head_count_kv"),
          "max_position_embeddings": a("context_length"),
          "rms_norm_eps": a("attention.layer_norm_rms_epsilon"),
          "rope_theta": a("rope.freq_base"), "tie_word_embeddings": "output.weight" not in names,
          "attention_bias": bias, "mlp_bias": bias}


def _gemma3_hf_config(meta: Dict[str, Any], names: set, source: str) -> Dict[str, Any]:
  """A gemma3 file's `config.json` (`gemma3_text`), with what llama.cpp fixes rather than
  stores: layer kinds, the sliding layers' RoPE base, the attention scale, no soft-caps."""
  a = lambda key: meta.get(f"gemma3.{key}")
  heads, width, n_layer = a("attention.head_count"), a("embedding_length"), a("block_count")
  head_dim = a("attention.key_length") or (width // heads if width and heads else None)
  if a("attention.value_length") not in (None, head_dim):
    raise ConversionError(f"{source}: gemma3.attention.value_length="
                          f"{a('attention.value_length')} differs from key_length={head_dim}; "
                          f"purejax's heads have one width.")
  rope_dims = a("rope.dimension_count")
  if rope_dims is not None and head_dim and rope_dims != head_dim:
    raise ConversionError(f"{source}: gemma3.rope.dimension_count={rope_dims} rotates part of "
                          f"each head ({head_dim}); purejax rotates whole heads.")
  scaling = a("rope.scaling.type")
  if scaling not in (None, "none", "linear") or "rope_freqs.weight" in names:
    raise ConversionError(f"{source}: RoPE scaling ({scaling or 'rope_freqs.weight'}) is not "
                          f"Gemma 3's (linear); purejax does not read it.")
  # llama.cpp's defaults where a key is absent: base 10000 (its converter always writes it).
  full = {"rope_type": "default", "rope_theta": a("rope.freq_base") or 10_000.0}
  if scaling == "linear":
    full.update(rope_type="linear", factor=a("rope.scaling.factor"))
  local = {"rope_type": "default", "rope_theta": a("rope.freq_base_swa") or GEMMA3_LOCAL_THETA}
  window = a("attention.sliding_window")
  if not window:
    raise ConversionError(f"{source}: gemma3.attention.sliding_window is "
                          f"{'0' if window == 0 else 'missing'}; llama.cpp versions differ on "
                          f"what such a gemma3 file computes, so purejax reads only files with "
                          f"a sliding window.")
  pattern = a("attention.sliding_window_pattern")
  if isinstance(pattern, list) and len(pattern) != n_layer:
    raise ConversionError(f"{source}: gemma3.attention.sliding_window_pattern lists "
                          f"{len(pattern)} layers, block_count is {n_layer}.")
  if a("final_logit_softcapping"):
    # llama.cpp's gemma3 graph soft-caps only a file without sliding layers (none here).
    logging.getLogger(__name__).warning(
        "%s: gemma3.final_logit_softcapping=%s is ignored, as llama.cpp ignores it in a model "
        "with sliding layers.", source, a("final_logit_softcapping"))
  tokens = meta.get("tokenizer.ggml.tokens")
  return {"model_type": "gemma3_text",
          "vocab_size": a("vocab_size") or (len(tokens) if tokens else None),
          "hidden_size": width, "intermediate_size": a("feed_forward_length"),
          "num_hidden_layers": n_layer, "num_attention_heads": heads,
          "num_key_value_heads": a("attention.head_count_kv"), "head_dim": head_dim,
          "max_position_embeddings": a("context_length"),
          "rms_norm_eps": a("attention.layer_norm_rms_epsilon"),
          "rope_parameters": {"full_attention": full, "sliding_attention": local},
          "sliding_window": window,
          "layer_types": (_gemma3_layer_types(n_layer, pattern)
                          if isinstance(n_layer, int) else None),
          "query_pre_attn_scalar": (_gemma3_attn_scalar(n_layer, width, heads, head_dim)
                                    if n_layer and width and heads and head_dim else None),
          "final_logit_softcapping": None, "attn_logit_softcapping": None,
          "hidden_activation": "gelu_pytorch_tanh",
          "tie_word_embeddings": "output.weight" not in names, "attention_bias": False}


_CHUNK_BYTES = 16 << 20  # a tensor is decoded this many bytes of float32 rows at a time


def _row_chunks(tensor):
  """`(start, stop)` ranges of a tensor's rows (its slowest axis), each about
  `_CHUNK_BYTES` as float32, so a large tensor (a token embedding) is decoded into its
  place without being held twice."""
  dims = tensor.dims
  if len(dims) == 1:
    return [(0, dims[0])]
  row = int(np.prod(dims[1:], dtype=np.int64))
  # A row's float32 values: the most any decoding of it makes (blocks are smaller).
  step = max(1, _CHUNK_BYTES // max(1, 4 * row))
  return [(start, min(dims[0], start + step)) for start in range(0, dims[0], step)]


def _dequantize(tensor, source: str) -> np.ndarray:
  """A GGUF tensor as float32, in its logical shape (`[out, in]` for a matrix), in an
  array from `host_memory.empty`."""
  import gguf  # pylint: disable=import-outside-toplevel
  kind = tensor.tensor_type.name
  if kind not in READ_TYPES:
    raise ConversionError(f"{source}: tensor {tensor.name} is {kind}, a type purejax does not "
                          f"read ({', '.join(READ_TYPES)}); use a file of one of those.")
  shape = tensor.dims  # [out, in] for a matrix
  out = host_memory.empty(shape, np.float32)
  for start, stop in _row_chunks(tensor):
    raw = tensor.rows(start, stop)
    if kind != "F32":
      raw = gguf.quants.dequantize(raw, tensor.tensor_type)
    out[start:stop] = np.asarray(raw).reshape(stop - start, *shape[1:])
  return out


def _kept(tensor, source: str):
  """A GGUF matrix's blocks kept quantized, as a `quant.QuantizedWeight` in Hugging
  Face's `[out, in]` orientation (`.T` of the `[in, out]` weight the model reads), its
  arrays from `host_memory.empty` where it is decoded in several pieces."""
  out, rows = tensor.dims
  chunks = _row_chunks(tensor)
  arrays = None
  try:
    for start, stop in chunks:
      piece = quant.from_gguf_blocks(tensor.rows(start, stop), tensor.tensor_type.name,
                                     (stop - start, rows))
      if len(chunks) == 1:  # one piece: it is the weight
        return piece.T
      fields = ("codes", "scale", "offset") if piece.has_offset else ("codes", "scale")
      if arrays is None:  # (an absent offset stays the piece's empty placeholder)
        arrays = {"offset": piece.offset, **{f: host_memory.empty(
            (*getattr(piece, f).shape[:-1], out), getattr(piece, f).dtype) for f in fields}}
      for f in fields:
        arrays[f][..., start:stop] = getattr(piece, f)
  except quant.QuantizeError as e:
    raise ConversionError(f"{source}: tensor {tensor.name}: {e}") from None
  return quant.QuantizedWeight(arrays["codes"], arrays["scale"], arrays["offset"],
                               piece.bits).T


def _unpermute_kept(w: "quant.QuantizedWeight", heads: int) -> "quant.QuantizedWeight":
  """`_unpermute` of a kept `[out, in]` weight's rows: its stored arrays' columns."""
  return dataclasses.replace(w, **{f: np.ascontiguousarray(_unpermute(
      np.asarray(getattr(w, f)).T, heads).T) for f in ("codes", "scale")},
      offset=(np.ascontiguousarray(_unpermute(np.asarray(w.offset).T, heads).T)
              if w.has_offset else w.offset))


def _read_state(path: str, header, config: gpt.GPTConfig, keep_quantized: bool,
                widened: Dict[str, list], source: str) -> Dict[str, Any]:
  """`{Hugging Face name: tensor}` of the file: float32 arrays, or kept blocks
  (`_kept`); the types not kept, by name, into `widened`."""
  arch = header.meta["general.architecture"]
  state = {}
  for tensor in gguf_reader.tensors(path, header):
    name, kind = tensor.name, tensor.tensor_type.name
    keep = keep_quantized and kind in quant.GGUF_KEPT and len(tensor.shape) == 2
    if keep_quantized and not keep and kind not in ("F32", "F16", "BF16"):
      widened.setdefault(kind, []).append(name)
    try:
      value = _kept(tensor, source) if keep else _dequantize(tensor, source)
    except tokenizers.TokenizerError as e:  # a truncated file
      raise ConversionError(str(e)) from None
    if config.position == "rope" and arch in _PERMUTED:
      unpermute = _unpermute_kept if keep else _unpermute
      if re.fullmatch(r"blk\.\d+\.attn_q\.(weight|bias)", name):
        value = unpermute(value, config.n_head)
      elif re.fullmatch(r"blk\.\d+\.attn_k\.(weight|bias)", name):
        value = unpermute(value, config.kv_heads)
    if arch == "gemma3" and _is_gemma_norm(name):
      value = value - np.float32(1.0)  # stored as 1 + w, as transformers' loader reads it
    state[_hf_name(name, arch)] = value
  return state


def from_gguf(path: str, *, keep_quantized: bool = False
              ) -> Tuple[Params, gpt.GPTConfig, TokenizerSpec]:
  """Imports a Llama-family or Gemma 3 GGUF file (`ARCHITECTURES`).

  Args:
    path: the `.gguf` file (one file; split `-00001-of-0000N` files are not read).
    keep_quantized: keep the matrices (and the token embedding) whose type is in
      `quant.GGUF_KEPT` as they are, `quant.QuantizedWeight`s on the device: a
      layer's weight whose layers mix kept types shares the widest container
      (`quant.common`, lossless); other types are dequantized to float32 and
      named in one warning. False: every tensor dequantized to float32.

  Returns:
    `(params, config, tokenizer_spec)`: params as device arrays in the layout
    the model reads (float32, or with `keep_quantized` the kept blocks), their config,
    and the file's tokenizer (kind "gguf", with its chat template, BOS/EOS
    tokens and whether to prepend BOS), or an "ids" spec if it has none.

  Raises:
    ConversionError: not a GGUF file, another architecture, a tensor type
      outside `READ_TYPES`, options purejax does not have, or tensors that
      do not fit the metadata.
  """
  source = str(pathlib.Path(path).expanduser())
  try:
    header = gguf_tokenizer.read_header(path)
  except tokenizers.TokenizerError as e:
    raise ConversionError(str(e)) from None
  meta = header.meta
  config = llama.config_from_hf(_hf_config(meta, set(header.tensor_names), source), source)
  # The tokenizer's record first: its transient (a 262144-token vocabulary's) is then
  # not on top of the weights.
  if meta.get("tokenizer.ggml.tokens"):
    try:
      spec = gguf_tokenizer.spec_of_fields(gguf_tokenizer.fields_of(meta), source)
    except tokenizers.TokenizerError as e:
      raise ConversionError(str(e)) from None
  else:
    spec = tokenizers.ids_spec(config.vocab_size)
  widened = {}
  # The state is passed on without a name here, so each tensor's host array goes once
  # it is placed on the device (`llama.params_from_state`).
  params = llama.params_from_state(_read_state(path, header, config, keep_quantized,
                                               widened, source), config, source=source)
  if widened:
    logging.getLogger(__name__).warning(
        "%s: %s kept as float32: %s are not kept quantized (only %s).", source,
        ", ".join(f"{len(v)} {k} tensor{'s' * (len(v) > 1)}" for k, v in widened.items()),
        "/".join(widened), ", ".join(quant.GGUF_KEPT))
  host_memory.release_freed()  # the tensors read, decoded and dropped
  return params, config, spec


def is_gguf(path: str) -> bool:
  """Whether `path` is a file that starts as a GGUF file does (`GGUF` magic)."""
  p = pathlib.Path(path).expanduser()
  if not p.is_file():
    return False
  with open(p, "rb") as f:
    return f.read(4) == b"GGUF"


# ----------------------------------------------------------------------------
# Writing


def check_target(path: str, overwrite: bool) -> None:
  """Refuses a folder at `path`, or an existing file unless `overwrite` (before any work)."""
  target = pathlib.Path(path).expanduser()
  if target.is_dir():
    raise ConversionError(f"{target} is a folder; name the .gguf file to write.")
  if target.exists() and not overwrite:
    raise ConversionError(f"{target} exists; pass `overwrite` to replace it, or choose "
                          f"another path.")


def _tokenizer_fields(spec: TokenizerSpec, vocab_size: int) -> Dict[str, Any]:
  """The GGUF tokenizer metadata of `spec`, its vocabulary padded to `vocab_size` ids."""
  if spec.kind == "gguf":
    try:
      fields = gguf_tokenizer.read_fields(str(spec.encoding_file))
    except tokenizers.TokenizerError as e:
      raise ConversionError(f"the model's tokenizer: {e}") from None
    if gguf_tokenizer.fingerprint(fields) != spec.fingerprint:
      raise ConversionError(f"{spec.encoding_file} holds another tokenizer than the model "
                            f"was made with; its GGUF cannot be written with it.")
  elif spec.kind == "tokenizer.json":
    fields = _fields_of_tokenizer_json(spec)
  else:
    raise ConversionError(f"a GGUF file needs the model's tokenizer, and this model records "
                          f"a {spec.kind!r} one; GGUF holds tokenizer.json and GGUF "
                          f"tokenizers (the Llama family's).")
  for key, value in (("chat_template", spec.chat_template), ("add_bos_token", spec.add_bos)):
    fields.setdefault(key, value)
  tokens = list(fields["tokens"])
  if len(tokens) > vocab_size:
    raise ConversionError(f"the tokenizer has {len(tokens)} tokens but the model only "
                          f"{vocab_size} embedding rows; they do not belong together.")
  types = list(fields.get("token_type") or [1] * len(tokens))
  pad = vocab_size - len(tokens)  # llama.cpp wants one token per row, as its converter pads
  fields["tokens"] = tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
  fields["token_type"] = types + [5] * pad  # 5: UNUSED
  if fields.get("scores"):
    fields["scores"] = list(fields["scores"]) + [-1000.0] * pad
  return fields


def _fields_of_tokenizer_json(spec: TokenizerSpec) -> Dict[str, Any]:
  """GGUF tokenizer metadata of a byte-level BPE `tokenizer.json` (Llama 3, SmolLM, Qwen2)."""
  import json  # pylint: disable=import-outside-toplevel
  from purejax.data import tokenizer_json  # pylint: disable=import-outside-toplevel
  try:
    file = tokenizer_json.from_spec(spec).encoding_file
  except tokenizers.TokenizerError as e:
    raise ConversionError(f"the model's tokenizer: {e}") from None
  data = json.loads(pathlib.Path(file).read_text(encoding="utf-8"))
  model, pre = data.get("model") or {}, json.dumps(data.get("pre_tokenizer"))
  if model.get("type") != "BPE" or "ByteLevel" not in pre:
    raise ConversionError(f"{file} is not a byte-level BPE tokenizer; GGUF export writes "
                          f"those (and GGUF files' own tokenizers) only.")
  vocab = dict(model["vocab"])
  for added in data.get("added_tokens") or []:
    vocab[added["content"]] = added["id"]
  tokens = [None] * (max(vocab.values()) + 1)
  for token, i in vocab.items():
    tokens[i] = token
  special = {a["content"] for a in data.get("added_tokens") or [] if a.get("special")}
  added = {a["content"] for a in data.get("added_tokens") or []}
  types = [3 if t in special else 4 if t in added else 1 for t in tokens]
  tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
  names = {split: name for name, split in gguf_tokenizer.SPLITS.items()}
  found = re.search(r'"Regex": "((?:[^"\\]|\\.)*)"', pre)
  pre_name = names.get(json.loads(f'"{found.group(1)}"')) if found else None
  ids = {t: i for i, t in enumerate(tokens)}
  # The folder's chat template and special tokens, where the spec does not carry them.
  chat = hf_talk.chat_fields(str(file))
  bos, eos = spec.bos_token or chat.get("bos_token"), spec.eos_token or chat.get("eos_token")
  fields = {"model": "gpt2", "pre": pre_name or "gpt-2", "tokens": tokens, "token_type": types,
            "merges": merges, "bos_token_id": ids.get(bos), "eos_token_id": ids.get(eos)}
  if not spec.chat_template and chat.get("chat_template"):
    fields["chat_template"] = chat["chat_template"]
  if "add_bos_token" in chat:
    fields["add_bos_token"] = bool(chat["add_bos_token"])
  return fields


def _add_tokenizer(writer, fields: Dict[str, Any]) -> None:
  writer.add_tokenizer_model(fields["model"])
  if fields.get("pre"):
    writer.add_tokenizer_pre(fields["pre"])
  writer.add_token_list(fields["tokens"])
  writer.add_token_types(fields["token_type"])
  if fields.get("scores"):
    writer.add_token_scores(fields["scores"])
  if fields.get("merges"):
    writer.add_token_merges(fields["merges"])
  for key, add in (("bos_token_id", writer.add_bos_token_id),
                   ("eos_token_id", writer.add_eos_token_id),
                   ("unknown_token_id", writer.add_unk_token_id),
                   ("padding_token_id", writer.add_pad_token_id)):
    if isinstance(fields.get(key), int):
      add(fields[key])
  writer.add_add_bos_token(bool(fields.get("add_bos_token")))
  if "add_space_prefix" in fields:  # Gemma's SentencePiece vocabularies say false
    writer.add_add_space_prefix(bool(fields["add_space_prefix"]))
  if "add_eos_token" in fields:
    writer.add_add_eos_token(bool(fields["add_eos_token"]))
  if fields.get("chat_template"):
    writer.add_chat_template(fields["chat_template"])


def _encode(value: np.ndarray, gguf_type: str):
  """`(data, raw_dtype)` for `GGUFWriter.add_tensor`: 1-D tensors stay float32 (as llama.cpp
  keeps norms); q8_0 needs rows of a multiple of 32 values, else the tensor is f16."""
  import gguf  # pylint: disable=import-outside-toplevel
  q = gguf.GGMLQuantizationType
  if value.ndim == 1 or gguf_type == "f32":
    return value.astype(np.float32), None
  if gguf_type == "q8_0" and value.shape[-1] % 32 == 0:
    return gguf.quants.quantize(value, q.Q8_0), q.Q8_0
  if gguf_type == "bf16":
    return gguf.quants.quantize(value, q.BF16), q.BF16
  return value.astype(np.float16), None


def base_context(spec: TokenizerSpec, config: gpt.GPTConfig) -> int:
  """The context the file states: the base model's, for a fine-tune of it, else `block_size`.

  A fine-tune's shorter `block_size` is a training choice, not the model's
  context (rotary positions carry to any length the base was trained for);
  the base is where the tokenizer came from, a GGUF file or a Hugging Face
  folder (`hf_talk`), when that model has `config`'s shape.
  """
  context = None
  if spec.kind == "gguf" and spec.encoding_file and pathlib.Path(spec.encoding_file).is_file():
    try:
      header = gguf_tokenizer.read_header(str(spec.encoding_file))
      source = _hf_config(header.meta, set(header.tensor_names), str(spec.encoding_file))
    except (tokenizers.TokenizerError, ConversionError):
      source = {}
    same_shape = (source.get("hidden_size"), source.get("num_hidden_layers"),
                  source.get("num_attention_heads"), source.get("vocab_size")) == (
                      config.n_embd, config.n_layer, config.n_head, config.vocab_size)
    context = source.get("max_position_embeddings") if same_shape else None
  elif spec.kind == "tokenizer.json" and spec.encoding_file:
    context = hf_talk.companion_files(str(spec.encoding_file), config).config_values.get(
        "max_position_embeddings")
  return context if isinstance(context, int) and context > config.block_size \
      else config.block_size


def _check_gemma3(config: gpt.GPTConfig) -> None:
  """Refuses a Gemma 3 model that llama.cpp's gemma3 conventions cannot hold (what the
  file does not state, llama.cpp fixes: see the module's docstring)."""
  fix = "export to hf: instead"
  every = GEMMA3_GLOBAL_EVERY
  want = tuple(int((i + 1) % every != 0) for i in range(config.n_layer))
  if config.window is None or config.layer_kinds != want:
    letters = "".join("S" if k else "L" for k in config.layer_kinds)
    raise ConversionError(
        f"window={config.window}, window_pattern={config.window_pattern!r} (layers "
        f"{letters}): llama.cpp's gemma3 makes every {every}th layer global and the others "
        f"slide (window_pattern='SSSSSL' with a window); {fix}.")
  if config.kind_rope(1) != (GEMMA3_LOCAL_THETA, None):
    raise ConversionError(
        f"rope_local_theta={config.rope_local_theta}: llama.cpp's gemma3 fixes the sliding "
        f"layers' RoPE base at {GEMMA3_LOCAL_THETA:g}, unscaled; {fix}.")
  scalar = _gemma3_attn_scalar(config.n_layer, config.n_embd, config.n_head, config.head_dim)
  if (config.attn_scalar or config.head_dim) != scalar:
    which = "n_embd / n_head, at 62 layers" if config.n_layer == _GEMMA3_27B_LAYERS else "head_dim"
    raise ConversionError(
        f"attn_scalar={config.attn_scalar}: llama.cpp's gemma3 scales attention by "
        f"{scalar} ** -0.5 ({which}); {fix}.")
  for name in ("logit_softcap", "attn_softcap"):
    if getattr(config, name) is not None:
      raise ConversionError(f"{name}={getattr(config, name)}: llama.cpp's gemma3 applies no "
                            f"soft-cap to a model with sliding layers; {fix}.")
  if config.rope_scaling is not None and config.rope_scaling.rope_type != "linear":
    raise ConversionError(f"rope_scaling.rope_type={config.rope_scaling.rope_type!r}: "
                          f"llama.cpp's gemma3 holds linear RoPE scaling only; {fix}.")


def to_gguf(params: Params, config: gpt.GPTConfig, path: str, tokenizer_spec: TokenizerSpec,
            *, gguf_type: str = "f16", overwrite: bool = False) -> pathlib.Path:
  """Writes a Llama-family or Gemma 3 model as a GGUF file that llama.cpp and transformers load.

  The architecture is `gemma3` for a Gemma 3 model (`gemma.is_family`: its
  norms stored as `1 + w`; a model outside llama.cpp's gemma3 conventions is
  refused), `qwen2` for qkv-only biases, else `llama` (whose query/key rows
  are permuted as llama.cpp's converter does). The file is written under a
  temporary name beside `path` and renamed when complete.

  Args:
    params: purejax GPT params of a Llama-family or Gemma 3 config (LoRA merged).
    config: their config.
    path: the `.gguf` file to write.
    tokenizer_spec: the model's tokenizer: a GGUF file's, or a byte-level
      BPE `tokenizer.json` (a SentencePiece one, as Gemma's, is refused);
      its chat template and BOS/EOS go in the file.
    gguf_type: "f32", "f16", "bf16" or "q8_0" (matrices; 1-D tensors stay float32).
    overwrite: replace an existing file.

  Returns:
    The file's path.

  Raises:
    ConversionError: another architecture, RoPE scaling (but Gemma 3's
      linear), a Gemma 3 option llama.cpp's gemma3 cannot hold (named), a
      tokenizer GGUF cannot hold, a bad `gguf_type`, or `path` exists and
      not `overwrite`.
  """
  check_target(path, overwrite)
  if gguf_type not in WRITE_TYPES:
    raise ConversionError(f"gguf_type={gguf_type!r} is not one of {', '.join(WRITE_TYPES)}.")
  is_gemma3 = gemma.is_family(config)
  if is_gemma3:
    _check_gemma3(config)
  elif config.rope_scaling is not None:
    raise ConversionError("RoPE scaling is not written to GGUF files; export to hf: instead.")
  state = llama.state_from_params(gpt2.to_numpy(params), config)  # refuses other architectures
  fields = _tokenizer_fields(tokenizer_spec, config.vocab_size)
  gguf = gguf_reader.import_gguf()
  arch = ("gemma3" if is_gemma3 else
          "qwen2" if config.qkv_bias and not config.bias else "llama")
  out = pathlib.Path(path).expanduser().absolute()
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = _files.make_temp(out)
  try:
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_context_length(base_context(tokenizer_spec, config))
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.mlp_width)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)  # gemma3: the global layers' base
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if is_gemma3:  # what llama.cpp's converter states for Gemma 3; the rest it fixes
      writer.add_key_length(config.head_dim)
      writer.add_value_length(config.head_dim)
      writer.add_sliding_window(config.window)
      if config.rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling.factor)
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    writer.add_file_type(file_types[gguf_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, fields)
    for hf_name, value in state.items():
      name = _gguf_name(hf_name, arch)
      if arch in _PERMUTED and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", name):
        value = _permute(value, config.n_head if ".attn_q." in name else config.kv_heads)
      if arch == "gemma3" and _is_gemma_norm(name):
        value = value + np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w
      data, raw = _encode(np.ascontiguousarray(value), gguf_type)
      writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  return out

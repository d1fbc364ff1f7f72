"""Hugging Face Llama-family state dicts and config.json <-> purejax's GPT params and `GPTConfig`.

    config = llama.config_from_hf(hf_config, source="config.json")
    params = llama.params_from_state(state, config, source=path)
    state = llama.state_from_params(params, config)     # Hugging Face's names, [out, in]
    hf_config = llama.hf_config_dict(config)             # LlamaForCausalLM or Qwen2ForCausalLM

`LlamaForCausalLM`, `MistralForCausalLM` and `Qwen2ForCausalLM` are purejax's
GPT with the Llama options (`gpt.ARCHITECTURES`): RMSNorm, rotary positions,
SwiGLU, grouped-query attention, a tied or untied head, and for Qwen2 biases
on the query/key/value projections. Their tensors map onto purejax's params
as follows (Hugging Face's `nn.Linear` weights are `[out, in]`, purejax's
`[in, out]`):

    model.embed_tokens.weight                  wte.embedding
    model.layers.{i}.input_layernorm.weight    blocks.ln_1.scale[i]
    ...self_attn.{q,k,v}_proj.{weight,bias}    blocks.attn.qkv.{w,b}[i]  (q, k, v side by side)
    ...self_attn.o_proj.weight                 blocks.attn.proj.w[i]
    ...post_attention_layernorm.weight         blocks.ln_2.scale[i]
    ...mlp.{gate,up}_proj.weight               blocks.mlp.fc.w[i]        (gate, up side by side)
    ...mlp.down_proj.weight                    blocks.mlp.proj.w[i]
    model.norm.weight                          ln_f.scale
    lm_head.weight                             lm_head.w  (untied heads only)

Mistral's and Qwen2's sliding windows are `GPTConfig.window` (Qwen2's on the
layers from `max_window_layers` on). `Gemma3ForCausalLM` maps the same way,
with its config in `purejax.weights.gemma` and four norms per block. The
vocabulary is not padded (these vocabularies already are multiples of 64,
or close).
"""

from typing import Any, Dict, Optional, Tuple

import numpy as np

from purejax import gpt
from purejax.gpt import config as gpt_config
from purejax import host_memory
from purejax.ops import quant
from purejax.weights import gemma
from purejax.weights import hf_config as hf_config_lib
from purejax.weights import tensors
from purejax.weights.errors import ConversionError

Params = Dict[str, Any]

# model_type in config.json -> the class that reads it in transformers.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", gemma.MODEL_TYPE: gemma.CLASS}


# ----------------------------------------------------------------------------
# config.json


def config_from_hf(hf_config: Dict[str, Any], source: str = "config.json") -> gpt.GPTConfig:
  """The `GPTConfig` of a Llama, Mistral, Qwen2 or Gemma 3 `config.json`.

  Raises:
    ConversionError: another architecture, a missing or bad value
      (`hf_config.LLAMA_FIELDS`), or an option purejax does not have
      (named, as its config.json field).
  """
  model_type = hf_config.get("model_type")
  if model_type in (gemma.MODEL_TYPE, "gemma3"):
    return gemma.config_from_hf(hf_config, source)
  if model_type not in MODEL_TYPES:
    raise ConversionError(f"{source} describes a {model_type!r} model; the Llama family "
                          f"converts from model_type {', '.join(MODEL_TYPES)}.")
  get = hf_config_lib.checked(hf_config, hf_config_lib.LLAMA_FIELDS, source).get
  hidden, heads = get("hidden_size"), get("num_attention_heads")
  kv_heads = get("num_key_value_heads") or heads
  hf_config_lib.check_divides(source, "num_attention_heads", heads, "hidden_size", hidden)
  hf_config_lib.check_divides(source, "num_key_value_heads", kv_heads,
                              "num_attention_heads", heads)
  # Newer config.json files keep theta and scaling in one "rope_parameters" dict.
  rope = hf_config_lib.checked(get("rope_parameters") or {}, hf_config_lib.ROPE_FIELDS,
                               source, "rope_parameters.")
  theta = get("rope_theta") or rope["rope_theta"] or 10000.0
  scaling = get("rope_scaling")
  if scaling is not None:
    hf_config_lib.checked(scaling, hf_config_lib.ROPE_FIELDS, source, "rope_scaling.")
  scaling = scaling or {k: v for k, v in (get("rope_parameters") or {}).items()
                        if k != "rope_theta"} or None
  unsupported = []
  if get("hidden_act") != "silu":
    unsupported.append(f"hidden_act={get('hidden_act')!r} (purejax's SwiGLU uses silu)")
  if get("head_dim") not in (None, hidden // heads):
    unsupported.append(f"head_dim={get('head_dim')} (purejax's is hidden_size / "
                       f"num_attention_heads = {hidden // heads})")
  if get("partial_rotary_factor") != 1.0:
    unsupported.append(f"partial_rotary_factor={get('partial_rotary_factor')}")
  bias = get("attention_bias")
  if bias != get("mlp_bias"):
    unsupported.append(f"attention_bias={bias} with mlp_bias={get('mlp_bias')} "
                       f"(purejax's bias option covers both)")
  scaling = hf_config_lib.rope_scaling_or_refuse(source, scaling, unsupported)
  window, pattern = _window(get, model_type, source)
  try:
    return gpt.GPTConfig(
        vocab_size=get("vocab_size"), block_size=get("max_position_embeddings"),
        n_layer=get("num_hidden_layers"), n_head=heads, n_embd=hidden, dropout=0.0,
        bias=bias, qkv_bias=model_type == "qwen2", norm="rmsnorm",
        norm_eps=float(get("rms_norm_eps")), position="rope", rope_theta=float(theta),
        rope_scaling=scaling, mlp="swiglu", mlp_hidden=get("intermediate_size"),
        n_kv_head=kv_heads, tie_embeddings=get("tie_word_embeddings"),
        window=window, window_pattern=pattern)
  except (ValueError, TypeError) as e:
    raise ConversionError(f"{source}: {e}") from e


def _window(get, model_type: str, source: str):
  """`(window, window_pattern)`: Mistral's window on every layer; Qwen2's, with
  `use_sliding_window`, on the layers `layer_types` names (or those from
  `max_window_layers` on)."""
  window = get("sliding_window")
  if model_type == "mistral" and window is not None:
    return window, None
  if model_type != "qwen2" or not get("use_sliding_window") or window is None:
    return None, None
  n_layer = get("num_hidden_layers")
  types = get("layer_types")
  if types is not None and len(types) == n_layer:
    pattern = "".join(gpt_config.SLIDING if t == "sliding_attention" else gpt_config.FULL
                      for t in types)
  else:
    full = int(get("max_window_layers") if get("max_window_layers") is not None else n_layer)
    pattern = "".join(gpt_config.FULL if i < full else gpt_config.SLIDING
                      for i in range(n_layer))
  if gpt_config.SLIDING not in pattern:
    return None, None
  return window, pattern


def is_family(config: gpt.GPTConfig) -> bool:
  """Whether `config` is a Llama-family model (what `hf_config_dict` can describe).

  Gemma 3 counts (`gemma.is_family`); a window only as Mistral's (every
  layer) or Qwen2's (the last layers).
  """
  if gemma.is_family(config):
    return True
  return ((config.norm, config.position, config.mlp) == ("rmsnorm", "rope", "swiglu")
          and not config.nanochat_options and not set(config.gemma_options) - {"window"}
          and _window_model_type(config) is not False)


def _window_model_type(config: gpt.GPTConfig):
  """The model type that holds `config`'s window: None (no window), "mistral",
  "qwen2", or False (none does)."""
  kinds = config.layer_kinds
  if config.window is None or 1 not in kinds:
    return None
  qwen2 = config.qkv_bias and not config.bias
  if qwen2:
    full = kinds.index(1)
    return "qwen2" if all(kinds[full:]) else False
  if all(kinds) and not config.bias:
    return "mistral"
  return False


def hf_config_dict(config: gpt.GPTConfig, dtype: str = "float32") -> Dict[str, Any]:
  """A `config.json` for `config`: Qwen2's with qkv-only biases, else Llama's.

  Raises:
    ConversionError: `config` is not a Llama-family model (`is_family`).
  """
  if gemma.is_family(config):
    return gemma.hf_config_dict(config, dtype)
  if not is_family(config):
    raise ConversionError(
        f"this model (norm={config.norm}, position={config.position}, mlp={config.mlp}, "
        f"other options {list(config.nanochat_options + config.gemma_options)}) is neither "
        f"GPT-2's architecture, the Llama family's (rmsnorm, rope, swiglu, no other options; a "
        f"window on every layer as Mistral, or on the last layers as Qwen2) nor Gemma 3's; "
        f"Hugging Face has no class for it.")
  qwen2 = config.qkv_bias and not config.bias
  model_type = "qwen2" if qwen2 else (_window_model_type(config) or "llama")
  out = {
      "architectures": [MODEL_TYPES[model_type]],
      "model_type": model_type,
      **hf_config_lib.size_fields(config),
      "rope_theta": config.rope_theta,
      "rope_scaling": (None if config.rope_scaling is None else
                       {**vars(config.rope_scaling)}),
      "hidden_act": "silu",
      "tie_word_embeddings": config.tie_embeddings,
      "attention_dropout": config.dropout,
      "initializer_range": 0.02,
      "torch_dtype": dtype,
  }
  if qwen2:
    kinds = config.layer_kinds
    out.update(use_sliding_window=config.window is not None, sliding_window=config.window,
               max_window_layers=kinds.index(1) if config.window else config.n_layer,
               layer_types=["sliding_attention" if k else "full_attention" for k in kinds])
  elif model_type == "mistral":
    out.update(sliding_window=config.window)
  else:
    out.update(attention_bias=config.bias, mlp_bias=config.bias)
  return out


# ----------------------------------------------------------------------------
# Tensors


def _norm_names(config: gpt.GPTConfig) -> Dict[str, Tuple[str, ...]]:
  """`{name after "model.layers.{i}.": path of its scale in a block's params}` of the norms."""
  if config.sandwich_norm:  # Gemma: the post-attention norm is on the attention's output
    names = {"input_layernorm.weight": ("ln_1",),
             "post_attention_layernorm.weight": ("ln_attn_out",),
             "pre_feedforward_layernorm.weight": ("ln_2",),
             "post_feedforward_layernorm.weight": ("ln_mlp_out",)}
  else:
    names = {"input_layernorm.weight": ("ln_1",),
             "post_attention_layernorm.weight": ("ln_2",)}
  if config.qk_norm_scale:
    names.update({"self_attn.q_norm.weight": ("attn", "q_norm"),
                  "self_attn.k_norm.weight": ("attn", "k_norm")})
  return names


def _layer_names(config: gpt.GPTConfig) -> Dict[str, Tuple[int, ...]]:
  """`{name after "model.layers.{i}.": [out, in] shape}` of one layer."""
  c, d, f = config.n_embd, config.head_dim, config.mlp_width
  h, kv = config.n_head, config.kv_heads
  names = {name: (d,) if path[0] == "attn" else (c,)
           for name, path in _norm_names(config).items()}
  names.update({
      "self_attn.q_proj.weight": (h * d, c), "self_attn.k_proj.weight": (kv * d, c),
      "self_attn.v_proj.weight": (kv * d, c), "self_attn.o_proj.weight": (c, h * d),
      "mlp.gate_proj.weight": (f, c), "mlp.up_proj.weight": (f, c),
      "mlp.down_proj.weight": (c, f),
  })
  if config.bias or config.qkv_bias:
    names.update({"self_attn.q_proj.bias": (h * d,), "self_attn.k_proj.bias": (kv * d,),
                  "self_attn.v_proj.bias": (kv * d,)})
  if config.bias:
    names.update({"self_attn.o_proj.bias": (c,), "mlp.gate_proj.bias": (f,),
                  "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (c,)})
  return names


def _expected(config: gpt.GPTConfig) -> Dict[str, Tuple[int, ...]]:
  shapes = {"model.embed_tokens.weight": (config.vocab_size, config.n_embd),
            "model.norm.weight": (config.n_embd,)}
  if not config.tie_embeddings:
    shapes["lm_head.weight"] = (config.vocab_size, config.n_embd)
  for i in range(config.n_layer):
    shapes.update({f"model.layers.{i}.{name}": shape
                   for name, shape in _layer_names(config).items()})
  return shapes


_RELEASE_BYTES = 16 << 20  # layers' host pieces let go between handing memory back


def params_from_state(state: Dict[str, np.ndarray], config: gpt.GPTConfig, *,
                      source: str) -> Params:
  """float32 params in `gpt.init_params`' layout from a Hugging Face state dict, as
  device arrays in the layout the model reads (C order: no copy per call).

  Placed leaf by leaf: a layer's host array is let go once written into its stacked
  leaf (unless the caller holds `state`), so a loader that passes its dict without
  keeping it holds the host copy and the device copy of one leaf at a time, not of
  the whole model (on CPU the stacked host buffer is the device array:
  `host_memory.to_device`).

  Args:
    state: `{name: array}` with Hugging Face's names (any float dtype); a matrix may be
      a `quant.QuantizedWeight` in Hugging Face's `[out, in]` orientation (a GGUF file's
      blocks): a layer's matrices all kept so stay quantized
      (`quant.stack_side_by_side`), else they are dequantized.
    config: from `config_from_hf`.
    source: the files, for error messages.

  Raises:
    ConversionError: missing, unexpected or misshapen tensors.
  """
  # Older checkpoints store RoPE's frequencies; they follow from the config.
  state = {name: value for name, value in state.items()
           if not name.endswith("rotary_emb.inv_freq")}
  expected = _expected(config)
  if config.tie_embeddings:
    state.pop("lm_head.weight", None)  # some tied checkpoints store the shared table twice
  missing = sorted(set(expected) - set(state))
  extra = sorted(set(state) - set(expected))
  if missing or extra:
    raise ConversionError(
        f"{source} does not hold the tensors config.json describes (n_layer="
        f"{config.n_layer}, bias={config.bias}, tie_word_embeddings={config.tie_embeddings})"
        f": missing {missing[:3]}, unexpected {extra[:3]}.")
  arrays = tensors.float32_tensors(state, expected, source=source, needs="config.json",
                                   partner="config.json", convert=False)
  del state  # each tensor's host array is let go once it is placed (a caller's dict aside)

  def layers(*names):
    """`names`' layers side by side as one `[n_layer, ...]` leaf in purejax's `[in, out]`
    layout, on the device; each layer's host array let go once written."""
    values = [[arrays.pop(f"model.layers.{i}.{name}") for i in range(config.n_layer)]
              for name in names]
    if all(isinstance(v, quant.QuantizedWeight) for vs in values for v in vs):
      # A GGUF file's blocks, `[out, in]` views of `[in, out]` weights.
      joined = quant.stack_side_by_side([[v.T for v in vs] for vs in values])
      del values
      host_memory.release_freed()  # the layers' pieces, before the next leaf's
      return quant.to_device(joined)
    widths = [vs[0].shape[0] for vs in values]  # out (a matrix's), or the vector's length
    lead = values[0][0].shape[1:]  # (in,) for a matrix, () for a vector
    out = host_memory.empty((config.n_layer, *lead, sum(widths)), np.float32)
    starts, freed = np.cumsum([0] + widths), 0
    # Layer by layer (a layer's slice of `out` is its own pages), each piece let go once
    # written, and the heap's freed pieces handed back as the buffer fills.
    for i in range(config.n_layer):
      for vs, at, width in zip(values, starts, widths):
        out[i, ..., at:at + width] = np.asarray(quant.dense(vs[i]), np.float32).T
        freed += getattr(vs[i], "nbytes", 0)
        vs[i] = None
      if freed > _RELEASE_BYTES:
        host_memory.release_freed()
        freed = 0
    host_memory.release_freed()
    return host_memory.to_device(out)

  def dense(*names, bias=True):
    out = {"w": layers(*(f"{n}.weight" for n in names))}
    if bias:
      out["b"] = layers(*(f"{n}.bias" for n in names))
    return out

  attn = "self_attn."
  blocks = {
      "attn": {"qkv": dense(attn + "q_proj", attn + "k_proj", attn + "v_proj",
                            bias=config.bias or config.qkv_bias),
               "proj": dense(attn + "o_proj", bias=config.bias)},
      "mlp": {"fc": dense("mlp.gate_proj", "mlp.up_proj", bias=config.bias),
              "proj": dense("mlp.down_proj", bias=config.bias)},
  }
  for name, path in _norm_names(config).items():
    node = blocks
    for part in path[:-1]:
      node = node[part]
    node[path[-1]] = {"scale": layers(name)}

  def whole(value):
    if isinstance(value, quant.QuantizedWeight):
      return quant.to_device(value)
    if value.dtype == np.float32:  # (a buffer the loader made is adopted as it is)
      return host_memory.to_device(value)
    out = host_memory.empty(value.shape, np.float32)
    out[...] = value  # a bfloat16 checkpoint's tensor, widened once into its buffer
    return host_memory.to_device(out)

  params = {
      "wte": {"embedding": whole(arrays.pop("model.embed_tokens.weight"))},
      "blocks": blocks,
      "ln_f": {"scale": whole(arrays.pop("model.norm.weight"))},
  }
  if not config.tie_embeddings:
    head = arrays.pop("lm_head.weight")
    params["lm_head"] = {"w": whole(head.T)}
  gpt.check_params(params, config)
  return params


def fused_projections(config: gpt.GPTConfig):
  """`((sublayer, dense), Hugging Face projections side by side in it, where they split)`
  for each dense layer of a block (q, k, v in `attn.qkv`; gate, up in `mlp.fc`)."""
  h, kv, d, f = config.n_head, config.kv_heads, config.head_dim, config.mlp_width
  return ((("attn", "qkv"), ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           (h * d, (h + kv) * d)),
          (("attn", "proj"), ("self_attn.o_proj",), ()),
          (("mlp", "fc"), ("mlp.gate_proj", "mlp.up_proj"), (f,)),
          (("mlp", "proj"), ("mlp.down_proj",), ()))


def state_from_params(params: Params, config: gpt.GPTConfig,
                      dtype: Optional[Any] = np.float32) -> Dict[str, np.ndarray]:
  """Hugging Face's state dict (`[out, in]` weights) of Llama-family params, in `dtype`."""
  gpt.check_params(params, config)
  hf_config_dict(config)  # refuses configs outside the family
  blocks = params["blocks"]
  fused = fused_projections(config)
  state = {"model.embed_tokens.weight": params["wte"]["embedding"],
           "model.norm.weight": params["ln_f"]["scale"]}
  if not config.tie_embeddings:
    state["lm_head.weight"] = np.asarray(params["lm_head"]["w"]).T
  for i in range(config.n_layer):
    prefix = f"model.layers.{i}."
    for name, path in _norm_names(config).items():
      node = blocks
      for part in path:
        node = node[part]
      state[prefix + name] = node["scale"][i]
    for (sublayer, dense), names, cuts in fused:
      layer = blocks[sublayer][dense]
      for leaf, suffix in (("w", "weight"), ("b", "bias")):
        if leaf in layer:
          pieces = np.split(np.asarray(layer[leaf][i]), cuts, axis=-1)
          for name, piece in zip(names, pieces):
            state[f"{prefix}{name}.{suffix}"] = piece.T if leaf == "w" else piece
  return {name: np.ascontiguousarray(np.asarray(value, np.float32).astype(dtype))
          for name, value in state.items()}

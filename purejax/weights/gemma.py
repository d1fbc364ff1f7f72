"""Gemma 3's `config.json` (`Gemma3ForCausalLM`) <-> purejax's `GPTConfig`.

    config = gemma.config_from_hf(hf_config, source="config.json")
    hf_config = gemma.hf_config_dict(config)

Gemma 3's text model is purejax's GPT with the options of
`gpt.ARCHITECTURES["gemma3"]`; its tensors map onto the params as the Llama
family's do (`purejax.weights.llama`), with four norms per block and
QK-norm scales:

    ...input_layernorm.weight                  blocks.ln_1.scale[i]
    ...post_attention_layernorm.weight         blocks.ln_attn_out.scale[i]
    ...pre_feedforward_layernorm.weight        blocks.ln_2.scale[i]
    ...post_feedforward_layernorm.weight       blocks.ln_mlp_out.scale[i]
    ...self_attn.{q,k}_norm.weight             blocks.attn.{q,k}_norm.scale[i]

Norm weights are stored as Gemma stores them: the `w` of `x * (1 + w)`.

`attn_logit_softcapping` is read as transformers' `Gemma3ForCausalLM` reads
it: not at all (its attention never applies it; Gemma 3's own configs set it
to null). A model with `GPTConfig.attn_softcap` (Gemma 2's) therefore has no
Gemma 3 export.
"""

import logging
from typing import Any, Dict

from purejax import gpt
from purejax.gpt import config as gpt_config
from purejax.weights import hf_config as hf_config_lib
from purejax.weights.errors import ConversionError

MODEL_TYPE = "gemma3_text"
CLASS = "Gemma3ForCausalLM"
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _window_pattern(get, n_layer: int, source: str) -> str:
  """One `window_pattern` letter per layer, from `layer_types` or the older `sliding_window_pattern`."""
  types = get("layer_types")
  if types is not None:
    if len(types) != n_layer or set(types) - {_SLIDING, _FULL}:
      raise ConversionError(f"{source}: layer_types must list {n_layer} entries of "
                            f"{_SLIDING!r} or {_FULL!r}; got {types!r}.")
    return "".join(gpt_config.SLIDING if t == _SLIDING else gpt_config.FULL for t in types)
  every = get("sliding_window_pattern") or get("_sliding_window_pattern") or 6
  return "".join(gpt_config.FULL if (i + 1) % every == 0 else gpt_config.SLIDING
                 for i in range(n_layer))


def _rope(get, source: str):
  """`(global theta, local theta, global scaling dict or None)` from either spelling."""
  parameters = get("rope_parameters") or {}
  if parameters and not {_SLIDING, _FULL} <= set(parameters):
    parameters = {_FULL: parameters}  # one dict for every layer
  full = hf_config_lib.checked(parameters.get(_FULL) or {}, hf_config_lib.ROPE_FIELDS,
                               source, f"rope_parameters.{_FULL}.")
  local = hf_config_lib.checked(parameters.get(_SLIDING) or {}, hf_config_lib.ROPE_FIELDS,
                                source, f"rope_parameters.{_SLIDING}.")
  theta = full["rope_theta"] or get("rope_theta") or 1_000_000.0
  local_theta = local["rope_theta"] or get("rope_local_base_freq") or 10_000.0
  scaling = get("rope_scaling")
  if scaling is not None:
    hf_config_lib.checked(scaling, hf_config_lib.ROPE_FIELDS, source, "rope_scaling.")
  else:
    scaling = {k: v for k, v in (parameters.get(_FULL) or {}).items() if k != "rope_theta"}
  local_type = (parameters.get(_SLIDING) or {}).get("rope_type", "default")
  return theta, local_theta, scaling or None, local_type


def config_from_hf(hf_config: Dict[str, Any], source: str = "config.json") -> gpt.GPTConfig:
  """The `GPTConfig` of a Gemma 3 text `config.json` (`model_type` "gemma3_text").

  Raises:
    ConversionError: a missing or bad value (`hf_config.GEMMA3_FIELDS`), or an
      option purejax does not have (named, as its config.json field).
  """
  if hf_config.get("model_type") == "gemma3":
    raise ConversionError(f"{source} describes Gemma 3's image-and-text model "
                          f"(Gemma3ForConditionalGeneration); purejax reads the text-only "
                          f"models (model_type 'gemma3_text': Gemma 3 270M and 1B).")
  if hf_config.get("model_type") != MODEL_TYPE:
    raise ConversionError(f"{source} describes a {hf_config.get('model_type')!r} model, "
                          f"not Gemma 3's text model ({MODEL_TYPE!r}).")
  get = hf_config_lib.checked(hf_config, hf_config_lib.GEMMA3_FIELDS, source).get
  heads, n_layer = get("num_attention_heads"), get("num_hidden_layers")
  kv_heads = get("num_key_value_heads") or heads
  hf_config_lib.check_divides(source, "num_key_value_heads", kv_heads,
                              "num_attention_heads", heads)
  theta, local_theta, scaling, local_type = _rope(get, source)
  if get("attn_logit_softcapping") is not None:
    logging.getLogger(__name__).warning(
        "%s: attn_logit_softcapping=%s is ignored, as Gemma3ForCausalLM ignores it.", source,
        get("attn_logit_softcapping"))
  unsupported = []
  if get("hidden_activation") != "gelu_pytorch_tanh":
    unsupported.append(f"hidden_activation={get('hidden_activation')!r} (purejax's GeGLU "
                       f"uses gelu_pytorch_tanh)")
  if get("attention_bias"):
    unsupported.append("attention_bias=true")
  if get("use_bidirectional_attention"):
    unsupported.append("use_bidirectional_attention=true (an embedding model, not causal)")
  if local_type != "default":
    unsupported.append(f"rope_parameters.{_SLIDING}.rope_type={local_type!r}")
  scaling = hf_config_lib.rope_scaling_or_refuse(source, scaling, unsupported)
  options = dict(gpt.ARCHITECTURES["gemma3"])
  options.update(
      vocab_size=get("vocab_size"), block_size=get("max_position_embeddings"),
      n_layer=n_layer, n_head=heads, n_embd=get("hidden_size"), dropout=0.0,
      head_size=get("head_dim"), n_kv_head=kv_heads, mlp_hidden=get("intermediate_size"),
      norm_eps=float(get("rms_norm_eps")), rope_theta=float(theta),
      rope_local_theta=float(local_theta), rope_scaling=scaling,
      window=get("sliding_window"), window_pattern=_window_pattern(get, n_layer, source),
      attn_scalar=float(get("query_pre_attn_scalar")),
      logit_softcap=get("final_logit_softcapping"),
      tie_embeddings=get("tie_word_embeddings"))
  try:
    return gpt.GPTConfig(**options)
  except (ValueError, TypeError) as e:
    raise ConversionError(f"{source}: {e}") from e


def is_family(config: gpt.GPTConfig) -> bool:
  """Whether `config` is a Gemma 3 text model (what `hf_config_dict` can describe)."""
  gemma = gpt.ARCHITECTURES["gemma3"]
  same = all(getattr(config, name) == gemma[name] for name in (
      "norm", "norm_offset", "sandwich_norm", "position", "qk_norm", "qk_norm_scale", "mlp",
      "bias", "embed_scale"))
  nanochat_only = set(config.nanochat_options) - {"qk_norm", "logit_softcap"}
  return same and not nanochat_only and not config.qkv_bias


def _int_if_whole(value: float):
  """transformers types `query_pre_attn_scalar` as an int (published configs hold 256)."""
  return int(value) if float(value).is_integer() else value


def hf_config_dict(config: gpt.GPTConfig, dtype: str = "float32") -> Dict[str, Any]:
  """A Gemma 3 `config.json` for `config` (transformers' current spelling)."""
  if not is_family(config):
    raise ConversionError("this model is not Gemma 3's architecture (gpt.ARCHITECTURES"
                          "['gemma3']); Gemma3ForCausalLM cannot hold it.")
  if config.attn_softcap is not None:
    raise ConversionError(f"attn_softcap={config.attn_softcap}: Gemma3ForCausalLM does not "
                          f"apply an attention soft-cap, so it cannot hold this model.")
  kinds = config.layer_kinds
  full_theta, full_scaling = config.kind_rope(0)
  local_theta, _ = config.kind_rope(1)
  full = {"rope_type": "default", "rope_theta": full_theta}
  if full_scaling is not None:
    full = {**vars(full_scaling), "rope_theta": full_theta}
  return {
      "architectures": [CLASS],
      "model_type": MODEL_TYPE,
      **hf_config_lib.size_fields(config),
      "rope_parameters": {_FULL: full,
                          _SLIDING: {"rope_type": "default", "rope_theta": local_theta}},
      # With no window, every layer is global; Gemma's config still wants a size.
      "sliding_window": config.window or config.block_size,
      "layer_types": [_SLIDING if kind else _FULL for kind in kinds],
      "query_pre_attn_scalar": _int_if_whole(config.attn_scalar or config.head_dim),
      "final_logit_softcapping": config.logit_softcap,
      "attn_logit_softcapping": None,
      "hidden_activation": "gelu_pytorch_tanh",
      "tie_word_embeddings": config.tie_embeddings,
      "attention_bias": False,
      "attention_dropout": config.dropout,
      "initializer_range": 0.02,
      "torch_dtype": dtype,
  }

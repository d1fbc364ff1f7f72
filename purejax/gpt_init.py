"""The GPT's params: their initialisation and count (`gpt.init_params`, `gpt.num_params`).

    params = gpt.init_params(config, jax.random.PRNGKey(0))

`gpt` re-exports these functions, so `gpt.init_params` is the name to use;
the model's math is in `purejax/gpt.py`, its config in `gpt_config.py`.
"""

import functools
import math
from typing import Any, Dict

import chex
import jax
import jax.numpy as jnp

from purejax import gpt_config
from purejax import nn
from purejax import rng
from purejax.gpt_config import GPTConfig

Params = Dict[str, Any]

_DTYPES = gpt_config.DTYPES

def init_norm(config: GPTConfig) -> Params:
  """Params of one of the model's norms (`config.norm`); with `norm_scale=False` it has none."""
  dtype = _DTYPES[config.param_dtype]
  if config.norm == "rmsnorm":
    return nn.init_rms_norm(config.n_embd, dtype=dtype)
  return nn.init_layer_norm(config.n_embd, bias=config.bias, dtype=dtype)


def init_block(config: GPTConfig, key: chex.PRNGKey) -> Params:
  """Params of one transformer block (unstacked).

  GPT-2 initialisation: weights N(0, 0.02^2), except the two projections that
  write into the residual stream, scaled by 1/sqrt(2 * n_layer) so the
  residual variance does not grow with depth (with `zero_init_proj`, zero).
  With `norm_scale=False` there are no `ln_1`, `ln_2`. The key comes last, as
  in every init function (`init_block(key, config)` works for one release,
  deprecated).
  """
  config, key = rng.key_last("init_block", (config, key))
  c, dtype = config.n_embd, _DTYPES[config.param_dtype]
  keys = rng.split_named(key, ("qkv", "attn_proj", "fc", "mlp_proj"))
  resid_scale = 0.0 if config.zero_init_proj else 0.02 / math.sqrt(2 * config.n_layer)
  dense = functools.partial(nn.init_dense, bias=config.bias, dtype=dtype)
  qkv_width = (config.n_head + 2 * config.kv_heads) * config.head_dim
  fc_width = config.mlp_width * (2 if config.mlp == "swiglu" else 1)  # swiglu: gate, up
  params = {
      "ln_1": init_norm(config),
      "attn": {
          "qkv": nn.init_dense(c, qkv_width, keys["qkv"], scale=0.02, dtype=dtype,
                               bias=config.bias or config.qkv_bias),
          "proj": dense(c, c, keys["attn_proj"], scale=resid_scale),
      },
      "ln_2": init_norm(config),
      "mlp": {
          "fc": dense(c, fc_width, keys["fc"], scale=0.02),
          "proj": dense(config.mlp_width, c, keys["mlp_proj"], scale=resid_scale),
      },
  }
  if not config.norm_scale:
    del params["ln_1"], params["ln_2"]
  return params


def init_params(config: GPTConfig, key: chex.PRNGKey) -> Params:
  """All model params; block params are stacked on a leading `[n_layer]` axis.

  Returns:
    `{"wte": {"embedding": [vocab, embd]}, "wpe": {"embedding": [block, embd]},
      "blocks": <init_block tree, each leaf with a leading [n_layer] axis>,
      "ln_f": {...}}`. The output head reuses `wte` (tied embeddings); with
    `tie_embeddings=False` it is `"lm_head": {"w": [embd, vocab]}`. With
    `position="rope"` there is no `"wpe"`. With `norm_scale=False` there is
    no `"ln_f"`; with `embed_norm` (and `norm_scale`) the embedding's norm is
    `"ln_e"`; with `value_embeds`, `"value_embeds"` holds `"embedding"`
    `[n_value_embeds, vocab, kv_heads * head_dim]`, N(0, 0.02^2), and
    `"gate"` `[n_value_embeds, 12, kv_heads]`, zero (each gate starts at 1.5).
  """
  keys = rng.split_named(key, ("wte", "wpe", "blocks"))
  dtype = _DTYPES[config.param_dtype]
  block_keys = rng.layer_keys(keys["blocks"], config.n_layer)
  params = {
      "wte": nn.init_embedding(config.vocab_size, config.n_embd, keys["wte"], dtype=dtype),
      "wpe": nn.init_embedding(config.block_size, config.n_embd, keys["wpe"], dtype=dtype),
      "blocks": jax.vmap(lambda k: init_block(config, k))(block_keys),
      "ln_f": init_norm(config),
  }
  if config.position != "learned":
    del params["wpe"]
  if not config.tie_embeddings:
    params["lm_head"] = nn.init_dense(config.n_embd, config.vocab_size,
                                      jax.random.fold_in(keys["wte"], 1), bias=False,
                                      dtype=dtype)
  if not config.norm_scale:
    del params["ln_f"]
  elif config.embed_norm:
    params["ln_e"] = init_norm(config)
  if config.value_embeds:
    n, kv = config.n_value_embeds, config.kv_heads
    table = nn.init_embedding(n * config.vocab_size, kv * config.head_dim,
                              jax.random.fold_in(keys["wte"], 2), dtype=dtype)["embedding"]
    params["value_embeds"] = {
        "embedding": table.reshape(n, config.vocab_size, kv * config.head_dim),
        "gate": jnp.zeros((n, gpt_config.VALUE_GATE_CHANNELS, kv), dtype)}
  return params


def num_params(params: Params, *, non_embedding: bool = True) -> int:
  """Parameter count; like nanoGPT, leaves out position embeddings by default."""
  total = sum(x.size for x in jax.tree.leaves(params))
  if non_embedding and "wpe" in params:
    total -= params["wpe"]["embedding"].size
  return total

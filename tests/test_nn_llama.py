"""nn's Llama-family layers equal Hugging Face's own modules on random inputs.

RMSNorm, RoPE (plain, "linear" and "llama3" scaling, any theta) and SwiGLU are
checked against `transformers`' Llama implementation (a test/bench extra),
and against the maths where no reference is needed.
"""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.data import need
from purejax import nn



def random(shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_rms_norm_matches_transformers():
  torch = need("torch")
  llama = need("transformers.models.llama.modeling_llama")
  x, scale = random((2, 5, 16)), random((16,), seed=1)
  reference = llama.LlamaRMSNorm(16, eps=1e-5)
  with torch.no_grad():
    reference.weight.copy_(torch.from_numpy(scale))
    want = reference(torch.from_numpy(x)).numpy()
  got = nn.rms_norm({"scale": jnp.asarray(scale)}, jnp.asarray(x), eps=1e-5)
  chex.assert_trees_all_close(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_rms_norm_is_unit_rms_without_a_mean_shift():
  x = jnp.asarray(random((3, 8))) + 5.0
  y = nn.rms_norm(nn.init_rms_norm(8), x, eps=0.0)
  chex.assert_trees_all_close(jnp.sqrt(jnp.mean(y ** 2, axis=-1)), jnp.ones(3), rtol=1e-5)
  assert float(jnp.mean(y)) > 0.5  # the mean was scaled, not removed
  assert nn.rms_norm(nn.init_rms_norm(8), x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("theta, scaling", [
    (10000.0, None),
    (500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    (1000.0, {"type": "linear", "factor": 4.0}),
])
def test_rope_matches_transformers(theta, scaling):
  torch = need("torch")
  transformers = need("transformers")
  llama = need("transformers.models.llama.modeling_llama")
  heads, head_dim, kv_heads, t = 4, 16, 2, 12
  config = transformers.LlamaConfig(
      hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
      max_position_embeddings=64, rope_theta=theta, rope_scaling=scaling)
  q, k = random((2, t, heads, head_dim)), random((2, t, kv_heads, head_dim), seed=1)
  positions = np.array([[3, 4, 5, 9, 10, 11, 20, 21, 22, 40, 50, 63]] * 2)
  rotary = llama.LlamaRotaryEmbedding(config)
  with torch.no_grad():
    cos, sin = rotary(torch.from_numpy(q), torch.from_numpy(positions))
    want_q, want_k = llama.apply_rotary_pos_emb(
        torch.from_numpy(q).transpose(1, 2), torch.from_numpy(k).transpose(1, 2), cos, sin)
  frequencies = nn.rope_frequencies(head_dim, theta,
                                    scaling and nn.RopeScaling.from_dict(scaling))
  got_q = nn.rope(jnp.asarray(q), jnp.asarray(positions), frequencies)
  got_k = nn.rope(jnp.asarray(k), jnp.asarray(positions[0]), frequencies)  # [time] positions
  chex.assert_trees_all_close(np.asarray(got_q), want_q.transpose(1, 2).numpy(),
                              rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(np.asarray(got_k), want_k.transpose(1, 2).numpy(),
                              rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
  frequencies = nn.rope_frequencies(8)
  q, k = jnp.asarray(random((1, 1, 1, 8))), jnp.asarray(random((1, 1, 1, 8), seed=1))
  def score(i, j):
    return jnp.sum(nn.rope(q, jnp.array([i]), frequencies) *
                   nn.rope(k, jnp.array([j]), frequencies))
  chex.assert_trees_all_close(score(7, 3), score(104, 100), rtol=1e-4)
  assert abs(float(score(7, 3)) - float(score(7, 6))) > 1e-3


def test_rope_scaling_errors_name_the_field():
  with pytest.raises(ValueError, match=r"rope_scaling.rope_type='yarn' is not supported"):
    nn.RopeScaling.from_dict({"rope_type": "yarn", "factor": 4.0})
  with pytest.raises(ValueError, match=r"needs rope_scaling.low_freq_factor"):
    nn.RopeScaling.from_dict({"rope_type": "llama3", "factor": 8.0})
  assert nn.RopeScaling.from_dict({"rope_type": "default"}) is None
  with pytest.raises(ValueError, match="even head dimension"):
    nn.rope_frequencies(7)


def test_swiglu_mlp_matches_transformers():
  torch = need("torch")
  transformers = need("transformers")
  llama = need("transformers.models.llama.modeling_llama")
  config = transformers.LlamaConfig(hidden_size=8, intermediate_size=12, num_attention_heads=2,
                                    num_key_value_heads=2)
  reference = llama.LlamaMLP(config)
  x = random((2, 3, 8))
  with torch.no_grad():
    want = reference(torch.from_numpy(x)).numpy()
  weights = {name: getattr(reference, name).weight.detach().numpy().T
             for name in ("gate_proj", "up_proj", "down_proj")}
  fc = {"w": jnp.concatenate([weights["gate_proj"], weights["up_proj"]], axis=1)}  # [8, 24]
  got = nn.dense({"w": weights["down_proj"]}, nn.swiglu(nn.dense(fc, jnp.asarray(x))))
  chex.assert_trees_all_close(np.asarray(got), want, rtol=1e-5, atol=1e-6)

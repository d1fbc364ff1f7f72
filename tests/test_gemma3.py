"""Gemma 3's text model against transformers' `Gemma3ForCausalLM`, on tiny random models.

Each model is built offline from a config (local and global layers, a window
shorter than the sequences, grouped-query heads, a head size independent of
the width, `query_pre_attn_scalar`, RoPE bases per layer kind), its weights
and norms moved off their init, and saved with `save_pretrained`. purejax
imports the folder and must compute the same function in float32: logits
within 1e-5 relative in every attention form, scanned or not; the same
greedy tokens as `generate` through the KV cache (whose local layers are
rings of the window); an export that transformers reloads with equal logits
and that purejax reads back exactly. transformers and torch are test extras.
"""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.data import need
from helpers.models import greedy_continuations
from purejax import decode
from purejax import gpt
from purejax import kv_cache
from purejax.ops import kernels
from purejax.weights import huggingface
from purejax.weights.errors import ConversionError

VOCAB = 96
WINDOW = 5
LAYERS = ["sliding_attention", "sliding_attention", "full_attention"]
# name -> Gemma3TextConfig fields; the first is the fast tier's.
MODELS = {
    "softcap_gqa": dict(num_key_value_heads=2, final_logit_softcapping=30.0),
    "no_softcap_mqa_scaled": dict(num_key_value_heads=1, final_logit_softcapping=None,
                                  rope_parameters={
                                      "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                         "rope_theta": 50000.0},
                                      "sliding_attention": {"rope_type": "default",
                                                            "rope_theta": 500.0}}),
}
pytestmark = pytest.mark.slow  # transformers' models: the full suite's
CASES = list(MODELS)


def build(name: str, folder):
  """A random tiny Gemma 3 of case `name`, saved in `folder`; returns the torch model."""
  torch = need("torch")
  transformers = need("transformers")
  config = transformers.Gemma3TextConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
      num_attention_heads=4, head_dim=32, sliding_window=WINDOW, layer_types=LAYERS,
      max_position_embeddings=64, query_pre_attn_scalar=24, **MODELS[name])
  torch.manual_seed(0)
  model = transformers.Gemma3ForCausalLM(config)
  with torch.no_grad():
    for p in model.parameters():  # norms start at 0 (a scale of 1): move them too
      p.add_(0.05 * torch.randn_like(p))
  model.eval()
  model.save_pretrained(folder)
  return model


@pytest.fixture(scope="module", params=CASES)
def hf_model(request, tmp_path_factory):
  folder = tmp_path_factory.mktemp(request.param)
  model = build(request.param, folder)
  params, config, _ = huggingface.from_huggingface(str(folder))
  return model, folder, params, config


def hf_logits(model, ids):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(ids))).logits.numpy()


def ids(batch=2, length=20, seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, length))


def assert_relative_close(got, want, tolerance=1e-5):
  error = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
  assert error < tolerance, error


def test_the_config_is_gemma3s(hf_model):
  model, _, params, config = hf_model
  assert config.layer_kinds == (1, 1, 0) and config.window == WINDOW
  assert config.head_dim == 32 != config.n_embd // config.n_head
  assert config.attn_scale == 24 ** -0.5
  assert config.kv_heads == model.config.num_key_value_heads
  assert config.logit_softcap == model.config.final_logit_softcapping
  assert "lm_head" not in params
  assert set(params["blocks"]) == {"ln_1", "attn", "ln_attn_out", "ln_2", "mlp", "ln_mlp_out"}
  assert params["blocks"]["attn"]["q_norm"]["scale"].shape == (3, 32)


@pytest.mark.parametrize("form", ["plain", "blocked", "xla"])
@pytest.mark.parametrize("scan", [True, False])
def test_logits_equal_transformers_beyond_the_window(hf_model, form, scan):
  model, _, params, config = hf_model
  tokens = ids()  # 20 positions, a window of 5
  forms = kernels.select("cpu", attention=form, attn_block=8, scan_layers=scan)
  got = gpt.forward(params, jnp.asarray(tokens), config, forms=forms)
  assert_relative_close(got, hf_logits(model, tokens))


def test_greedy_kv_cache_tokens_equal_generate(hf_model):
  import torch  # pylint: disable=g-import-not-at-top
  model, _, params, config = hf_model
  prompt = ids(batch=2, length=7, seed=3)  # longer than the window, and 12 tokens more
  ours = greedy_continuations(params, prompt, config, 12)
  with torch.no_grad():
    theirs = model.generate(torch.from_numpy(prompt), do_sample=False, max_new_tokens=12,
                            min_new_tokens=12, pad_token_id=0)
  np.testing.assert_array_equal(np.asarray(ours), theirs.numpy())


def test_export_reloads_in_transformers_with_equal_logits(hf_model, tmp_path):
  transformers = need("transformers")
  model, _, params, config = hf_model
  out = huggingface.to_huggingface(params, config, str(tmp_path / "export"))
  written = json.loads((out / "config.json").read_text())
  assert written["model_type"] == "gemma3_text" and written["layer_types"] == LAYERS
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = ids(seed=7)
  np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(model, tokens),
                             atol=1e-6, rtol=1e-6)
  again, config_again, _ = huggingface.from_huggingface(str(out))
  assert config_again == config
  chex.assert_trees_all_equal(again, params)


def test_older_config_spellings_read_the_same(hf_model, tmp_path):
  """`rope_theta`, `rope_local_base_freq` and `sliding_window_pattern`, as Gemma 3's
  published config.json files (written by transformers 4.5x) spell them."""
  _, folder, _, config = hf_model
  hf = json.loads((folder / "config.json").read_text())
  for key in ("rope_parameters", "layer_types"):
    hf.pop(key)
  hf.update(rope_theta=config.rope_theta, rope_local_base_freq=config.rope_local_theta,
            sliding_window_pattern=3, rope_scaling=config.rope_scaling and {
                "rope_type": config.rope_scaling.rope_type,
                "factor": config.rope_scaling.factor})
  (tmp_path / "config.json").write_text(json.dumps(hf))
  (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
  _, older, _ = huggingface.from_huggingface(str(tmp_path))
  assert older == config


def test_unsupported_options_are_one_line_errors_naming_the_field(tmp_path):
  build("softcap_gqa", tmp_path)
  path = tmp_path / "config.json"
  original = json.loads(path.read_text())
  for changes, message in [
      ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
      ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
      ({"model_type": "gemma3"}, "image-and-text model"),
      ({"layer_types": ["full_attention"]}, "layer_types must list 3 entries"),
      ({"sliding_window": 0}, "sliding_window=0 must be a positive integer"),
  ]:
    path.write_text(json.dumps({**original, **changes}))
    with pytest.raises(ConversionError) as e:
      huggingface.from_huggingface(str(tmp_path))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_attention_softcap_has_no_gemma3_export(hf_model, tmp_path):
  """transformers' Gemma 3 ignores `attn_logit_softcapping`; a model with one is not Gemma 3."""
  _, _, params, config = hf_model
  import dataclasses  # pylint: disable=g-import-not-at-top
  capped = dataclasses.replace(config, attn_softcap=50.0)
  with pytest.raises(ConversionError, match="attention soft-cap"):
    huggingface.to_huggingface(params, capped, str(tmp_path / "export"))


def test_local_layers_cache_only_their_window(hf_model):
  _, _, params, config = hf_model
  cache = kv_cache.init_kv_cache(config, batch=2, length=40)
  assert [k.shape[1] for k in cache.k] == [WINDOW, WINDOW, 40]
  # Jitted, as `generate` runs them: eagerly each layer's ops dispatch (and compile) one by one.
  feed = jax.jit(decode.forward_with_cache, static_argnames=("config",))
  forward = jax.jit(gpt.forward, static_argnames=("config",))
  prompt = jnp.asarray(ids(batch=2, length=9))
  logits, cache = feed(params, prompt, cache, 0, config=config)
  full = forward(params, prompt, config=config)[:, -1]
  np.testing.assert_allclose(logits, full, atol=1e-5, rtol=1e-5)
  step = jnp.asarray(ids(batch=2, length=1, seed=5))
  logits, cache = feed(params, step, cache, 9, config=config)
  whole = forward(params, jnp.concatenate([prompt, step], axis=1), config=config)[:, -1]
  np.testing.assert_allclose(logits, whole, atol=1e-5, rtol=1e-5)
  assert [k.shape[1] for k in cache.k] == [WINDOW, WINDOW, 40]

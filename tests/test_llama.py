"""The Llama family (Llama, Mistral, Qwen2) against transformers, on tiny random models.

Each model is built offline from a config, its weights moved off their init,
and saved with `save_pretrained`; purejax imports the folder and must compute
the same function: logits within 1e-4 in float32, the same greedy tokens as
`generate` through the KV cache, and an export that transformers reloads
with equal logits. The cases cover grouped-query attention with fewer
key/value heads than heads, multi-query attention, tied and untied heads,
Qwen2's query/key/value biases, Llama 3's RoPE scaling, and Mistral's and
Qwen2's sliding windows, shorter than the sequences. transformers and torch are test/bench extras.
"""

import dataclasses
import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.data import need
from helpers.gpu import CUDNN_BACKWARD, CUDNN_FORWARD, custom_calls, square_faces, train_step_hlo
from helpers.models import greedy_continuations
from purejax import decode
from purejax import gpt
from purejax.weights import huggingface
from purejax.weights import llama
from purejax.weights import nanogpt
from purejax.weights import pretrained
from purejax.weights.errors import ConversionError

VOCAB = 97
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8}

# name -> (transformers class, config fields); the first two are the fast tier's.
MODELS = {
    "llama_gqa_untied": ("Llama", dict(num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=False, rope_scaling=LLAMA3_SCALING,
                                       rope_theta=5000.0)),
    "qwen2_qkv_bias": ("Qwen2", dict(num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "llama_mqa_tied": ("Llama", dict(num_attention_heads=4, num_key_value_heads=1,
                                     tie_word_embeddings=True)),
    "mistral_window": ("Mistral", dict(num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=False, sliding_window=6)),
    "qwen2_window": ("Qwen2", dict(num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=True, use_sliding_window=True,
                                   sliding_window=6, max_window_layers=1)),
}
FAST = ("llama_gqa_untied", "qwen2_qkv_bias")
CASES = [pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in MODELS]


def build(name: str, folder, **overrides):
  """A random tiny model of family `name`, saved in `folder`; returns the torch model."""
  torch = need("torch")
  transformers = need("transformers")
  family, fields = MODELS[name]
  config = getattr(transformers, f"{family}Config")(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      max_position_embeddings=32, **{**fields, **overrides})
  torch.manual_seed(0)
  model = getattr(transformers, f"{family}ForCausalLM")(config)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  model.eval()
  model.save_pretrained(folder)
  return model


@pytest.fixture(scope="module", params=CASES)
def hf_model(request, tmp_path_factory):
  folder = tmp_path_factory.mktemp(request.param)
  return request.param, build(request.param, folder), folder


def hf_logits(model, ids):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(ids))).logits.numpy()


def ids(batch=2, length=14, seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, length))


def test_logits_equal_transformers(hf_model):
  name, model, folder = hf_model
  params, config, spec = huggingface.from_huggingface(str(folder))
  assert (config.norm, config.position, config.mlp) == ("rmsnorm", "rope", "swiglu")
  assert config.kv_heads == model.config.num_key_value_heads < config.n_head
  assert config.tie_embeddings == ("lm_head" not in params)
  assert config.qkv_bias == name.startswith("qwen2") == ("b" in params["blocks"]["attn"]["qkv"])
  assert config.layer_kinds == {"mistral_window": (1, 1), "qwen2_window": (0, 1)}.get(
      name, (0, 0))
  assert config.window == (6 if name.endswith("window") else None)
  assert spec.to_dict() == {"type": "ids", "name": "ids", "vocab_size": VOCAB}  # no tokenizer.json
  tokens = ids()
  got = np.asarray(gpt.forward(params, jnp.asarray(tokens), config))
  np.testing.assert_allclose(got, hf_logits(model, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
def test_greedy_kv_cache_tokens_equal_generate(hf_model):
  import torch  # pylint: disable=g-import-not-at-top
  _, model, folder = hf_model
  params, config, _ = huggingface.from_huggingface(str(folder))
  prompt = ids(batch=2, length=5, seed=3)
  ours = greedy_continuations(params, prompt, config, 10)
  with torch.no_grad():
    theirs = model.generate(torch.from_numpy(prompt), do_sample=False, max_new_tokens=10,
                            min_new_tokens=10, pad_token_id=0)
  np.testing.assert_array_equal(np.asarray(ours), theirs.numpy())


def test_export_reloads_in_transformers_with_equal_logits(hf_model, tmp_path):
  transformers = need("transformers")
  name, model, folder = hf_model
  params, config, spec = huggingface.from_huggingface(str(folder))
  out = huggingface.to_huggingface(params, config, str(tmp_path / "export"),
                                   tokenizer_spec=spec)
  written = json.loads((out / "config.json").read_text())
  assert written["model_type"] == name.split("_")[0]
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = ids(seed=7)
  np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(model, tokens),
                             atol=1e-6, rtol=1e-6)
  again, config_again, _ = huggingface.from_huggingface(str(out))
  assert config_again == config
  chex.assert_trees_all_equal(again, params)


def test_bf16_and_sharded_folders_import(tmp_path):
  torch = need("torch")
  model = build("llama_gqa_untied", tmp_path / "fp32")
  model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
  assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
  params, config, _ = huggingface.from_huggingface(str(tmp_path / "bf16"))
  reference, _, _ = huggingface.from_huggingface(str(tmp_path / "fp32"))
  rounded = jax.tree.map(lambda p: np.asarray(p, jnp.bfloat16).astype(np.float32), reference)
  chex.assert_trees_all_equal(params, rounded)  # bf16 values, read exactly, held as float32
  # Device arrays in the model's [in, out] layout, not a transpose's strides.
  assert all(isinstance(leaf, jax.Array) and leaf.dtype == jnp.float32
             for leaf in jax.tree.leaves(params))
  out = huggingface.to_huggingface(params, config, str(tmp_path / "out"), dtype="bfloat16",
                                   max_shard_bytes=20_000)
  assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
  chex.assert_trees_all_equal(huggingface.from_huggingface(str(out))[0], params)


def test_a_hub_id_is_read_from_the_cache_only(tmp_path, monkeypatch):
  hub = need("huggingface_hub")
  cache = tmp_path / "hub"
  snapshot = cache / "models--tiny--llama" / "snapshots" / ("0" * 40)
  build("llama_mqa_tied", snapshot)
  (cache / "models--tiny--llama" / "refs").mkdir()
  (cache / "models--tiny--llama" / "refs" / "main").write_text("0" * 40)
  monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  params, config, _ = pretrained.from_pretrained("tiny/llama")
  assert config.kv_heads == 1 and params["wte"]["embedding"].shape == (VOCAB, 32)
  with pytest.raises(ConversionError, match="not in the Hugging Face cache, and purejax "
                     "does not download"):
    pretrained.from_pretrained("tiny/absent")


def test_top_p_keeps_what_transformers_top_p_warper_keeps():
  torch = need("torch")
  transformers = need("transformers")
  vocab = 50
  logits = np.random.default_rng(0).normal(size=(6, vocab)).astype(np.float32) * 3
  for top_p in (0.1, 0.5, 0.9, 0.99):
    warper = transformers.TopPLogitsWarper(top_p)
    theirs = np.isfinite(warper(None, torch.from_numpy(logits)).numpy())  # [rows, vocab]
    # Token j survives the filter iff noise that favours only j draws j.
    ours = np.zeros_like(theirs)
    for row in range(len(logits)):
      noise = jnp.eye(vocab) * 1e6
      drawn = decode.sample_logits(None, jnp.tile(jnp.asarray(logits[row]), (vocab, 1)),
                                   temperature=1.0, top_p=top_p, gumbel=noise)
      ours[row] = np.asarray(drawn) == np.arange(vocab)
    np.testing.assert_array_equal(ours, theirs, err_msg=f"top_p={top_p}")


def test_unsupported_options_are_one_line_errors_naming_the_field(tmp_path):
  build("llama_gqa_untied", tmp_path)
  path = tmp_path / "config.json"
  original = json.loads(path.read_text())
  for changes, message in [
      ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
       "rope_scaling.rope_type='yarn' is not supported"),
      ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
      ({"head_dim": 16}, "head_dim=16"),
      ({"attention_bias": True}, "attention_bias=True with mlp_bias=False"),
      ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide "
                                   "num_attention_heads=4"),
      ({"num_hidden_layers": 3}, "missing ['model.layers.2."),
  ]:
    path.write_text(json.dumps({**original, **changes}))
    with pytest.raises(ConversionError) as e:
      huggingface.from_huggingface(str(tmp_path))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_gpt2_formats_refuse_the_family(tmp_path):
  config = gpt.GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=16,
                         **gpt.ARCHITECTURES["llama"])
  params = jax.eval_shape(lambda k: gpt.init_params(config, k), jax.random.PRNGKey(0))  # shapes suffice
  with pytest.raises(ConversionError, match="not GPT-2's architecture"):
    nanogpt.to_nanogpt(params, config, str(tmp_path / "ckpt.pt"))
  assert llama.is_family(config)
  odd = gpt.GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=16,
                      norm="rmsnorm")
  with pytest.raises(ConversionError, match="Hugging Face has no class for it"):
    huggingface.to_huggingface(jax.eval_shape(lambda k: gpt.init_params(odd, k), jax.random.PRNGKey(0)),
                               odd, str(tmp_path / "odd"))


def tiny_family_config(**changes) -> gpt.GPTConfig:
  return gpt.GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32,
                       **{**gpt.ARCHITECTURES["llama"], "n_kv_head": 2, **changes})


def test_grouped_heads_in_every_attention_form_equal_repeated_heads():
  from purejax.ops import attention, kernels  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(2, 12, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, 12, 2, 8)), jnp.float32) for _ in range(2))
  want = attention.causal_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2),
                                    form="plain")
  for form in kernels.ATTENTION_FORMS:
    got = jax.jit(lambda q, k, v, form=form: attention.causal_attention(
        q, k, v, form=form, block=5))(q, k, v)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5, custom_message=form)
  with pytest.raises(ValueError, match="3 key/value heads do not divide 4 query heads"):
    attention.causal_attention(q, q[:, :, :3], q[:, :, :3])


@pytest.mark.parametrize("form", [pytest.param("plain", marks=pytest.mark.slow), "blocked"])
def test_the_family_is_causal_in_training_and_its_loss_starts_at_log_vocab(form):
  # The Llama block learns the recipe much faster than GPT-2's (bench.arch_compare),
  # so check it cannot see the future: the loss path, with the CPU's forms.
  from purejax.ops import kernels  # pylint: disable=g-import-not-at-top
  config = tiny_family_config()
  forms = kernels.select("cpu", attention=form, attn_block=4)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, config.vocab_size)
  loss_of = jax.jit(lambda p, x: gpt.loss(p, x[:, :-1], x[:, 1:], config, forms=forms))
  assert abs(float(loss_of(params, tokens)) - np.log(config.vocab_size)) < 0.2
  for t in (3, 8):
    changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 1) % config.vocab_size)
    a = gpt.forward(params, tokens, config, forms=forms)
    b = gpt.forward(params, changed, config, forms=forms)
    chex.assert_trees_all_close(a[:, :t + 1], b[:, :t + 1], atol=1e-6)
    assert not np.allclose(a[:, t + 1:], b[:, t + 1:], atol=1e-4)


def test_a_family_config_survives_a_checkpoints_json():
  config = tiny_family_config(rope_scaling=LLAMA3_SCALING, tie_embeddings=False,
                              qkv_bias=True, mlp_hidden=40)
  saved = json.loads(json.dumps(dataclasses.asdict(config)))
  assert gpt.GPTConfig(**saved) == config and hash(gpt.GPTConfig(**saved)) == hash(config)
  assert isinstance(gpt.GPTConfig(**saved).rope_scaling, type(config.rope_scaling))
  with pytest.raises(ValueError, match="rope_scaling.rope_type='dynamic' is not supported"):
    tiny_family_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
  with pytest.raises(ValueError, match="GPTConfig.norm='batchnorm' is not one of"):
    tiny_family_config(norm="batchnorm")


def test_family_params_shapes_and_training_gradients():
  config = tiny_family_config(tie_embeddings=False)
  assert config.mlp_width == 88  # 8/3 * 32 rounded up to a multiple of 8
  params = jax.jit(gpt.init_params, static_argnums=0)(config, jax.random.PRNGKey(0))
  assert "wpe" not in params and params["lm_head"]["w"].shape == (32, VOCAB)
  assert params["blocks"]["attn"]["qkv"]["w"].shape == (2, 32, (4 + 2 * 2) * 8)
  assert params["blocks"]["mlp"]["fc"]["w"].shape == (2, 32, 2 * 88)
  assert set(params["blocks"]["ln_1"]) == {"scale"}  # RMSNorm: no bias
  tokens = jnp.asarray(ids(length=16))
  grads = jax.jit(jax.grad(gpt.loss), static_argnums=3)(params, tokens[:, :-1], tokens[:, 1:],
                                                         config)
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
  bf16 = dataclasses.replace(config, compute_dtype="bfloat16")
  forward = jax.jit(gpt.forward, static_argnums=2)
  chex.assert_trees_all_close(forward(params, tokens, bf16), forward(params, tokens, config),
                              atol=0.05)


def test_lora_adapts_the_family_blocks():
  from purejax import lora  # pylint: disable=g-import-not-at-top
  config = tiny_family_config(tie_embeddings=False)
  params = jax.jit(gpt.init_params, static_argnums=0)(config, jax.random.PRNGKey(0))
  adapters = lora.init(params, rank=2, targets=lora.ATTENTION_AND_MLP, key=jax.random.PRNGKey(1))
  assert set(adapters) == {"blocks.attn.qkv.w", "blocks.attn.proj.w", "blocks.mlp.fc.w",
                           "blocks.mlp.proj.w"}  # not the head, embeddings or norms
  tokens = jnp.asarray(ids(length=16))
  loss = jax.jit(lambda a: gpt.loss(lora.merge(params, a, alpha=4.0), tokens[:, :-1],
                                    tokens[:, 1:], config))
  grads = jax.grad(loss)(adapters)
  assert float(jnp.abs(grads["blocks.mlp.fc.w"]["b"]).max()) > 0


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
def test_gpu_program_runs_grouped_heads_through_cudnn(cudnn_version):
  """SmolLM-135M's shape (9 heads, 3 key/value heads) lowered for CUDA: cuDNN reads the groups."""
  del cudnn_version
  from purejax.ops import kernels  # pylint: disable=g-import-not-at-top
  config = gpt.GPTConfig(vocab_size=49152, block_size=1024, n_layer=30, n_head=9, n_embd=576,
                         n_kv_head=3, mlp_hidden=1536, compute_dtype="bfloat16",
                         **gpt.ARCHITECTURES["llama"])
  hlo = train_step_hlo(kernels.select("gpu"), config=config, batch=4)
  calls = custom_calls(hlo)
  # The GPU unrolls the layers: each one's attention forward and backward, once.
  assert calls[CUDNN_FORWARD] == calls[CUDNN_BACKWARD] == config.n_layer
  assert square_faces(hlo, config.block_size) == 0  # no [.., T, T] scores
  # cuDNN's operands: 9 query heads, 3 key/value heads (never repeated to 9).
  grouped = "(tensor<4x1024x9x64xbf16>, tensor<4x1024x3x64xbf16>, tensor<4x1024x3x64xbf16>)"
  assert any(CUDNN_FORWARD + "(" in line and grouped in line
             for line in hlo.splitlines())


@pytest.mark.parametrize("compute_dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("time", [1, 3])
def test_a_grouped_cache_reads_as_the_repeated_one(compute_dtype, time):
  from purejax.ops import attention  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(2, 6, time, 8)), jnp.float32)  # 6 heads
  k, v = (jnp.asarray(rng.normal(size=(2, 2, 10, 8)), jnp.float32) for _ in range(2))
  attend = jax.jit(functools.partial(attention.attend_with_cache, compute_dtype=compute_dtype))
  starts = jnp.asarray([4, 2])  # each row at its own position
  got = attend(q, k, v, starts)
  want = attend(q, jnp.repeat(k, 3, axis=1), jnp.repeat(v, 3, axis=1), starts)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)

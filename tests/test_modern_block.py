"""Today's pretraining block (nanochat's GPT) as options of the one GPT.

Each option is a `GPTConfig` field whose default is GPT-2's behaviour:
QK-norm, a ReLU^2 MLP, soft-capped logits, zero-initialised residual
projections, parameter-free RMSNorm (also after the embedding), value
embeddings, with the untied head the Llama family already had. Each piece is
checked against a plain numpy form of it (and, where `transformers` has the
same piece, against that), the whole nanochat block against a numpy forward
written from nanochat's description, and `--arch=nanochat --depth=N` trains.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.data import need
from purejax import decode
from purejax import gpt
from purejax import kv_cache
from purejax import nn
from purejax.cli import train as train_cli
from purejax.ops import kernels

NANOCHAT = gpt.ARCHITECTURES["nanochat"]


def random(shape, seed=0, scale=1.0):
  return (scale * np.random.default_rng(seed).normal(size=shape)).astype(np.float32)


init = jax.jit(gpt.init_params, static_argnums=0)
forward = jax.jit(gpt.forward, static_argnums=2)
loss_of = jax.jit(gpt.loss, static_argnums=3)


def randomised(params, scale=0.3):
  """Every leaf redrawn at random, so zero-initialised pieces (projections, gates) act too."""
  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten([jnp.asarray(random(leaf.shape, seed=i, scale=scale))
                            for i, leaf in enumerate(leaves)])


# ----------------------------------------------------------------------------
# A plain numpy nanochat forward (float64), from its description in
# karpathy/nanochat's nanochat/gpt.py: embedding -> norm; per block
# x += proj(attn(norm(x))) with RoPE then QK-norm and, on every other layer
# from the last, v += 3 sigmoid(norm(x)[:12] @ gate) * value_embedding;
# x += proj(relu(fc(norm(x)))^2); norm -> untied head -> 15 tanh(logits / 15).


def np_norm(x, eps):
  return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps)


def np_rope(x, theta):
  """Half-split rotary positions (Hugging Face's pairing) over `[b, t, h, d]`."""
  t, d = x.shape[1], x.shape[-1]
  angles = np.arange(t)[:, None] / theta ** (np.arange(0, d, 2) / d)[None]  # [t, d/2]
  cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
  first, second = x[..., :d // 2], x[..., d // 2:]
  return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def np_nanochat_logits(params, tokens, config):
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  eps, (b, t) = config.norm_eps, tokens.shape
  h, kv, d = config.n_head, config.kv_heads, config.head_dim
  x = np_norm(p["wte"]["embedding"][tokens], eps)
  for i in range(config.n_layer):
    layer = jax.tree.map(lambda a, i=i: a[i], p["blocks"])
    a = np_norm(x, eps)
    qkv = a @ layer["attn"]["qkv"]["w"]
    q = qkv[..., :h * d].reshape(b, t, h, d)
    k = qkv[..., h * d:(h + kv) * d].reshape(b, t, kv, d)
    v = qkv[..., (h + kv) * d:].reshape(b, t, kv, d)
    q = np_norm(np_rope(q, config.rope_theta), eps)
    k = np_norm(np_rope(k, config.rope_theta), eps)
    if i % 2 == (config.n_layer - 1) % 2:  # nanochat's has_ve
      rows = p["value_embeds"]["embedding"][i // 2][tokens].reshape(b, t, kv, d)
      gate = 3.0 / (1.0 + np.exp(-(a[..., :12] @ p["value_embeds"]["gate"][i // 2])))
      v = v + gate[..., None] * rows
    k, v = np.repeat(k, h // kv, axis=2), np.repeat(v, h // kv, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    y = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, h * d)
    x = x + y @ layer["attn"]["proj"]["w"]
    hidden = np.maximum(np_norm(x, eps) @ layer["mlp"]["fc"]["w"], 0) ** 2
    x = x + hidden @ layer["mlp"]["proj"]["w"]
  logits = np_norm(x, eps) @ p["lm_head"]["w"]
  return config.logit_softcap * np.tanh(logits / config.logit_softcap)


def np_cross_entropy(logits, targets):
  logits = logits - logits.max(-1, keepdims=True)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return -np.mean(np.take_along_axis(log_probs, targets[..., None], axis=-1))


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
def test_the_nanochat_block_equals_a_plain_numpy_forward():
  # Three layers (value embeddings on 0 and 2), two key/value heads for four queries.
  config = gpt.GPTConfig(vocab_size=40, block_size=12, n_layer=3, n_head=4, n_embd=32,
                         n_kv_head=2, **NANOCHAT)
  params = randomised(init(config, jax.random.PRNGKey(0)))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 40, (2, 12)), jnp.int32)
  want = np_nanochat_logits(params, np.asarray(tokens), config)
  for scan in (True, False):  # the layer scan indexes value tables by a traced layer
    forms = dataclasses.replace(kernels.select("cpu"), scan_layers=scan)
    got = jax.jit(lambda p, t, f=forms: gpt.forward(p, t, config, forms=f))(params, tokens)
    chex.assert_trees_all_close(np.asarray(got), want, rtol=2e-4, atol=2e-4)
  # The loss, in chunks of rows, is the capped logits' cross-entropy.
  targets = jnp.roll(tokens, -1, axis=1)
  forms = dataclasses.replace(kernels.select("cpu"), loss_chunk_rows=8, loss_chunk_min_logits=1)
  loss = jax.jit(lambda p: gpt.loss(p, tokens, targets, config, forms=forms))(params)
  chex.assert_trees_all_close(float(loss), np_cross_entropy(want, np.asarray(targets)),
                              rtol=1e-4)
  # Decoding through the KV cache, one token after a prompt, reads the same logits.
  step = jax.jit(decode.forward_with_cache, static_argnums=(3, 4))
  _, cache = step(params, tokens[:, :11], kv_cache.init_kv_cache(config, 2), 0, config)
  last, _ = step(params, tokens[:, 11:], cache, 11, config)
  chex.assert_trees_all_close(np.asarray(last), want[:, -1], rtol=2e-4, atol=2e-4)


def test_the_nanochat_params_are_nanochats():
  config = gpt.GPTConfig(vocab_size=40, block_size=8, n_layer=4, n_head=2, n_embd=32,
                         **NANOCHAT)
  params = init(config, jax.random.PRNGKey(0))
  # No norm has params, no dense layer a bias; the head is its own matrix.
  assert set(params) == {"wte", "blocks", "lm_head", "value_embeds"}
  assert set(params["blocks"]) == {"attn", "mlp"}
  assert all(path[-1].key == "w" for path, _ in
             jax.tree_util.tree_flatten_with_path(params["blocks"])[0])
  # Blocks start as the identity: both residual projections are zero.
  assert not np.any(params["blocks"]["attn"]["proj"]["w"])
  assert not np.any(params["blocks"]["mlp"]["proj"]["w"])
  # Value embeddings on layers 1 and 3 of 4 (nanochat: i % 2 == (n_layer - 1) % 2).
  assert [config.has_value_embed(i) for i in range(4)] == [False, True, False, True]
  assert params["value_embeds"]["embedding"].shape == (2, 40, 32)
  assert params["value_embeds"]["gate"].shape == (2, 12, 2)
  five = dataclasses.replace(config, n_layer=5)
  assert [five.has_value_embed(i) for i in range(5)] == [True, False, True, False, True]
  assert five.n_value_embeds == 3


# ----------------------------------------------------------------------------
# Each option alone, on the GPT-2 or Llama block


def test_options_default_to_the_gpt2_block():
  config = gpt.GPTConfig()
  assert (config.norm_scale, config.embed_norm, config.qk_norm, config.logit_softcap,
          config.zero_init_proj, config.value_embeds) == (True, False, False, None, False,
                                                          False)
  params = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  assert set(params) == {"wte", "wpe", "blocks", "ln_f"}


def test_qk_norm_is_unit_rms_heads_and_commutes_with_rope():
  config = gpt.GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16,
                         position="rope", qk_norm=True, norm_eps=1e-6)
  params = {"qkv": {"w": jnp.asarray(random((16, 48)))}}
  x = jnp.asarray(random((2, 8, 16), seed=1))
  consts = gpt.shared_consts(config)  # the one RoPE table every layer shares
  q, k, v = gpt.qkv_heads(params, x, consts, gpt.Context(config, kernels.Forms()))
  plain = np.asarray(x) @ np.asarray(params["qkv"]["w"])
  heads = plain.reshape(2, 8, 3, 2, 8)
  # Normalising before the rotation equals after it: a rotation keeps a head's norm.
  for got, want in ((q, heads[:, :, 0]), (k, heads[:, :, 1])):
    chex.assert_trees_all_close(np.asarray(got), np_rope(np_norm(want, 1e-6), 1e4),
                                rtol=1e-4, atol=1e-5)
  chex.assert_trees_all_close(np.asarray(v), heads[:, :, 2], rtol=1e-5, atol=1e-5)


def test_rms_normalize_equals_transformers_qk_norm():
  torch = need("torch")
  qwen3 = need("transformers.models.qwen3.modeling_qwen3")
  x = random((2, 5, 3, 16))
  want = qwen3.Qwen3RMSNorm(16, eps=1e-6)(torch.from_numpy(x)).detach().numpy()
  chex.assert_trees_all_close(np.asarray(nn.rms_normalize(jnp.asarray(x), eps=1e-6)), want,
                              rtol=1e-5, atol=1e-6)


def test_relu_squared_mlp_equals_numpy_and_transformers():
  torch = need("torch")
  activations = need("transformers.activations")
  x = random((3, 10))
  want = activations.ACT2FN["relu2"](torch.from_numpy(x)).numpy()
  chex.assert_trees_all_close(np.asarray(nn.relu_squared(jnp.asarray(x))), want)
  config = gpt.GPTConfig(vocab_size=16, n_layer=1, n_head=2, n_embd=16, mlp="relu2",
                         bias=False)
  assert config.mlp_width == 64
  params = {"fc": {"w": jnp.asarray(random((16, 64), 1))},
            "proj": {"w": jnp.asarray(random((64, 16), 2))}}
  h = random((4, 16), 3)
  got = gpt.mlp(params, jnp.asarray(h), config, kernels.Forms())
  want = np.maximum(h @ np.asarray(params["fc"]["w"]), 0) ** 2 @ np.asarray(params["proj"]["w"])
  chex.assert_trees_all_close(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_logit_softcap_bounds_the_logits_and_the_loss_reads_them():
  base = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
  capped = dataclasses.replace(base, logit_softcap=2.0)
  params = randomised(init(base, jax.random.PRNGKey(0)), scale=1.0)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (2, 8)), jnp.int32)
  plain = np.asarray(forward(params, tokens, base), np.float64)
  assert np.abs(plain).max() > 2.0  # the cap has something to do
  want = 2.0 * np.tanh(plain / 2.0)
  got = np.asarray(forward(params, tokens, capped))
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
  assert np.abs(got).max() <= 2.0  # float32's tanh reaches 1 only when saturated
  chex.assert_trees_all_close(float(loss_of(params, tokens, tokens, capped)),
                              np_cross_entropy(want, np.asarray(tokens)), rtol=1e-5)


def test_zero_initialised_projections_make_each_block_the_identity():
  config = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16,
                         zero_init_proj=True)
  params = init(config, jax.random.PRNGKey(0))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (2, 8)), jnp.int32)
  x = np.asarray(params["wte"]["embedding"])[tokens] + np.asarray(params["wpe"]["embedding"])
  x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)  # ln_f at init
  want = x @ np.asarray(params["wte"]["embedding"]).T
  chex.assert_trees_all_close(np.asarray(forward(params, tokens, config)), want,
                              rtol=1e-4, atol=1e-5)
  # Gradients still reach the projections (through the residual stream).
  grads = jax.jit(jax.grad(gpt.loss), static_argnums=3)(params, tokens, tokens, config)
  assert np.abs(np.asarray(grads["blocks"]["mlp"]["proj"]["w"])).max() > 0


def test_embed_norm_with_a_scale_has_its_own_params():
  config = gpt.GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16,
                         norm="rmsnorm", embed_norm=True)
  params = init(config, jax.random.PRNGKey(0))
  params["ln_e"]["scale"] = jnp.full((16,), 3.0)
  params["wte"]["embedding"] = jnp.asarray(random((16, 16)))  # well above norm_eps
  tokens = jnp.arange(4)[None]
  x = gpt.input_states(params, tokens, config)
  chex.assert_trees_all_close(jnp.sqrt(jnp.mean(x ** 2, -1)), jnp.full((1, 4), 3.0), rtol=1e-4)


@pytest.mark.parametrize("changes, message", [
    (dict(norm_scale=False), "norm_scale=False is a parameter-free RMSNorm"),
    (dict(logit_softcap=0.0), "logit_softcap must be None or positive"),
    (dict(value_embeds=True, n_embd=8, n_head=2), "value_embeds' gates read 12 channels"),
    (dict(mlp="relu3"), r"mlp='relu3' is not one of \['gelu', 'swiglu', 'relu2', 'geglu'\]"),
])
def test_bad_options_are_one_line_errors(changes, message):
  with pytest.raises(ValueError, match=message):
    gpt.GPTConfig(**changes)


# ----------------------------------------------------------------------------
# nanochat's depth rule and the preset from the command line


def test_the_depth_rule_is_nanochats():
  assert gpt.depth_shape(12) == dict(n_layer=12, n_embd=768, n_head=6)
  assert gpt.depth_shape(20) == dict(n_layer=20, n_embd=1280, n_head=10)
  assert gpt.depth_shape(26) == dict(n_layer=26, n_embd=1664, n_head=13)
  assert gpt.depth_shape(1) == dict(n_layer=1, n_embd=128, n_head=1)  # one whole head
  assert gpt.depth_lr_scale(768) == 1.0
  assert gpt.depth_lr_scale(3072) == 0.5
  with pytest.raises(ValueError, match="depth must be a positive integer"):
    gpt.depth_shape(0)


def test_depth_sets_the_shape_and_scales_the_rates():
  args = train_cli.command.parse(["train", "--arch=nanochat", "--depth=2",
                                  "--learning_rate=0.01", "--min_lr=0.001"],
                                 lambda a: train_cli.train_flags.define_flags(a, "gpt"))
  config = train_cli.gpt_config(args, vocab_size=40)
  assert (config.n_layer, config.n_embd, config.n_head) == (2, 128, 1)
  assert config.value_embeds and config.logit_softcap == 15.0
  optimizer = train_cli.optimizer_config(args)
  scale = (128 / 768) ** -0.5
  assert optimizer.learning_rate == pytest.approx(0.01 * scale)
  assert optimizer.min_lr == pytest.approx(0.001 * scale)


@pytest.mark.parametrize("flags, pattern, window", [
    (["--window_pattern=S"], "SSL", 33),            # tiled, the last layer global
    (["--window_pattern=SL", "--window=8"], "SLL", 8),
])
def test_nanochats_window_pattern_tiles_over_the_layers(flags, pattern, window):
  args = train_cli.command.parse(["train", "--arch=nanochat", "--depth=3", "--block_size=64",
                                  *flags],
                                 lambda a: train_cli.train_flags.define_flags(a, "gpt"))
  config = train_cli.gpt_config(args, vocab_size=40)
  assert (config.window_pattern, config.window) == (pattern, window)


@pytest.mark.parametrize("flags, message", [
    (["--n_layer=3"], "--depth sets the model's shape; drop --n_layer or drop --depth."),
    (["--sweep=learning_rate=1e-3,3e-3"], "--sweep gives learning_rate as it is, but --depth "
     "scales the rate flags by the width;"),
])
def test_depth_with_a_shape_flag_or_a_rate_sweep_is_a_one_line_error(capsys, tmp_path, flags,
                                                                      message):
  code = train_cli.run(["train", "--depth=2", *flags, f"--out_dir={tmp_path}"])
  assert code == train_cli.EXIT_ERROR
  assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: " + message)


@pytest.mark.slow
def test_the_nanochat_preset_trains(tmp_path, text_file, capsys):
  code = train_cli.run([
      "train", "--arch=nanochat", "--depth=1", f"--dataset={text_file}",
      f"--out_dir={tmp_path}", "--block_size=16", "--batch_size=8", "--max_iters=20",
      "--warmup_iters=0", "--learning_rate=3e-3", "--eval_interval=20", "--eval_iters=2",
      "--log_interval=1", "--steps_per_call=10", "--sample_tokens=0"])
  assert code == 0
  losses = [float(line.split("| loss ")[1].split()[0])
            for line in capsys.readouterr().out.splitlines() if "| loss " in line]
  assert len(losses) == 20 and losses[-1] < losses[0] - 0.5, losses


def test_weight_formats_refuse_what_they_cannot_hold():
  from purejax.weights import gpt2 as gpt2_format  # pylint: disable=import-outside-toplevel
  from purejax.weights import llama as llama_format  # pylint: disable=import-outside-toplevel
  nanochat = gpt.GPTConfig(**NANOCHAT)
  assert nanochat.nanochat_options == ("norm_scale", "embed_norm", "qk_norm", "logit_softcap",
                                       "value_embeds", "mlp")
  llama_qk = gpt.GPTConfig(**gpt.ARCHITECTURES["llama"], qk_norm=True)
  for config in (nanochat, llama_qk):
    with pytest.raises(ValueError, match="Hugging Face has no class for it"):
      llama_format.hf_config_dict(config)
  with pytest.raises(ValueError, match=r"other options \['logit_softcap'\]"):
    gpt2_format.check_architecture(gpt.GPTConfig(logit_softcap=30.0))
  llama_format.hf_config_dict(gpt.GPTConfig(**gpt.ARCHITECTURES["llama"]))  # still exports

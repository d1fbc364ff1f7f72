"""gpt: shapes, causality, param checks, dropout keys, remat and gradients."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax import test_util as jtu

from helpers.models import TINY, random_tokens, sharpened_params
from purejax import gpt
from purejax import nn
from purejax.ops import kernels

class GPTTest(chex.TestCase, parameterized.TestCase):

  def test_param_shapes_are_stacked_per_layer(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    chex.assert_shape(params["wte"]["embedding"], (11, 16))
    chex.assert_shape(params["wpe"]["embedding"], (8, 16))
    chex.assert_shape(params["blocks"]["attn"]["qkv"]["w"], (2, 16, 48))
    chex.assert_shape(params["blocks"]["mlp"]["fc"]["b"], (2, 64))
    chex.assert_shape(params["blocks"]["ln_1"]["scale"], (2, 16))
    assert "lm_head" not in params  # the head is tied to wte

  def test_gpt2_initialisation(self):
    config = gpt.GPTConfig(n_layer=8, n_embd=128, n_head=4)
    params = gpt.init_params(config, jax.random.PRNGKey(0))
    std = lambda x: float(jnp.std(x))
    assert abs(std(params["blocks"]["attn"]["qkv"]["w"]) - 0.02) < 1e-3
    resid = 0.02 / np.sqrt(2 * 8)
    assert abs(std(params["blocks"]["attn"]["proj"]["w"]) - resid) < 2e-4
    assert abs(std(params["blocks"]["mlp"]["proj"]["w"]) - resid) < 2e-4
    chex.assert_trees_all_equal(params["blocks"]["attn"]["qkv"]["b"],
                                jnp.zeros((8, 3 * 128)))
    # Layers get different keys.
    w = params["blocks"]["attn"]["qkv"]["w"]
    assert not np.allclose(w[0], w[1])

  def test_no_bias_config_has_no_biases(self):
    params = gpt.init_params(dataclasses.replace(TINY, bias=False), jax.random.PRNGKey(0))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert not [p for p in paths if "'b'" in p or "'bias'" in p]

  @chex.variants(with_jit=True, without_jit=True)
  def test_forward_shape_and_dtype(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    tokens = random_tokens(jax.random.PRNGKey(1), (3, 8))
    logits = self.variant(lambda p, t: gpt.forward(p, t, TINY))(params, tokens)
    chex.assert_shape(logits, (3, 8, 11))
    assert logits.dtype == jnp.float32

  def test_forward_rejects_long_or_float_input(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="exceeds block_size 8"):
      gpt.forward(params, jnp.zeros((1, 9), jnp.int32), TINY)
    with pytest.raises(AssertionError):
      gpt.forward(params, jnp.zeros((1, 4)), TINY)

  @parameterized.named_parameters(
      ("more_layers", dict(n_layer=3), r"\['blocks'\].*\(2, .*needs \(3, "),
      ("wider", dict(n_embd=32), "needs"),
      ("other_vocab", dict(vocab_size=12), r"\['wte'\]"),
      ("no_biases", dict(bias=False), "unexpected"),
  )
  def test_params_of_another_config_are_a_clear_error(self, changes, message):
    # Without the check, 2 stacked layers would run silently under n_layer=3.
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    other = dataclasses.replace(TINY, **changes)
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=message):
      gpt.forward(params, tokens, other)
    with pytest.raises(ValueError, match=message):
      jax.jit(lambda p: gpt.loss(p, tokens, tokens, other))(params)
    gpt.check_params(params, TINY)  # the matching config passes

  def test_causality(self):
    params = sharpened_params(TINY)
    tokens = random_tokens(jax.random.PRNGKey(1), (2, 8))
    forward = jax.jit(gpt.forward, static_argnums=2)
    for t in range(7):
      changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 1) % TINY.vocab_size)
      a = forward(params, tokens, TINY)
      b = forward(params, changed, TINY)
      chex.assert_trees_all_close(a[:, :t + 1], b[:, :t + 1], atol=1e-5)
      assert not np.allclose(a[:, t + 1:], b[:, t + 1:], atol=1e-3)

  def test_loss_at_init_is_log_vocab(self):
    config = gpt.GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
    params = gpt.init_params(config, jax.random.PRNGKey(0))
    tokens = random_tokens(jax.random.PRNGKey(1), (8, 17), vocab=65)
    value = gpt.loss(params, tokens[:, :-1], tokens[:, 1:], config)
    assert abs(float(value) - np.log(65)) < 0.1

  def test_scan_forward_equals_unrolled_loop(self):
    params = sharpened_params(TINY)
    tokens = random_tokens(jax.random.PRNGKey(1), (2, 8))
    x = params["wte"]["embedding"][tokens] + params["wpe"]["embedding"][:8]
    ctx = gpt.Context(TINY, kernels.Forms())  # the pass: no dropout, positions from 0
    for i in range(TINY.n_layer):
      layer = jax.tree.map(lambda p, i=i: p[i], params["blocks"])
      x, _ = gpt.block(x, layer, {}, ctx)  # GPT-2's layers differ only in their params
    x = nn.layer_norm(params["ln_f"], x)
    unrolled = x @ params["wte"]["embedding"].T
    chex.assert_trees_all_close(gpt.forward(params, tokens, TINY), unrolled,
                                rtol=1e-5, atol=1e-5)

  @parameterized.parameters("full", "dots", "full_compute_dtype")  # float32: nothing rounds
  @pytest.mark.slow
  def test_remat_gives_the_same_loss_and_gradients(self, policy):
    params = sharpened_params(TINY)
    tokens = random_tokens(jax.random.PRNGKey(1), (2, 9))
    grad = lambda remat: jax.jit(jax.value_and_grad(functools.partial(
        gpt.loss, forms=kernels.select("cpu", remat=remat))), static_argnums=3)(
            params, tokens[:, :-1], tokens[:, 1:], TINY)
    chex.assert_trees_all_close(grad("none"), grad(policy), rtol=1e-5, atol=1e-6)

  @parameterized.parameters((1, 8), (3, 8), (3, 7), (5, 8))
  @pytest.mark.budget(25)
  @pytest.mark.slow
  def test_attention_in_query_blocks_is_exact(self, attn_block, time):
    # Blocks of queries skip most of the masked keys; the loss, its gradients
    # and causality must not change.
    params = sharpened_params(TINY)
    tokens = random_tokens(jax.random.PRNGKey(1), (2, time + 1))
    grad = lambda forms: jax.jit(jax.value_and_grad(functools.partial(gpt.loss, forms=forms)),
                                 static_argnums=3)(params, tokens[:, :-1], tokens[:, 1:], TINY)
    blocked = kernels.select("cpu", attention="blocked", attn_block=attn_block)
    chex.assert_trees_all_close(grad(kernels.Forms()), grad(blocked), rtol=1e-5, atol=1e-6)
    changed = tokens.at[:, 4:].set((tokens[:, 4:] + 1) % TINY.vocab_size)
    forward = jax.jit(functools.partial(gpt.forward, config=TINY, forms=blocked))
    chex.assert_trees_all_close(forward(params, tokens[:, :-1])[:, :4],
                                forward(params, changed[:, :-1])[:, :4], atol=1e-6)

  @pytest.mark.slow
  def test_dropout_keys(self):
    config = dataclasses.replace(TINY, dropout=0.3)
    params = gpt.init_params(config, jax.random.PRNGKey(0))
    tokens = random_tokens(jax.random.PRNGKey(1), (2, 8))
    run = lambda key, det: gpt.forward(params, tokens, config, key=key, deterministic=det)
    k1, k2 = jax.random.PRNGKey(5), jax.random.PRNGKey(6)
    chex.assert_trees_all_equal(run(k1, False), run(k1, False))
    assert not np.allclose(run(k1, False), run(k2, False))
    # deterministic=True ignores the key and equals the dropout-free model.
    chex.assert_trees_all_equal(run(k1, True), run(k2, True))
    chex.assert_trees_all_close(run(k1, True), gpt.forward(params, tokens, TINY), atol=1e-6)
    with pytest.raises(ValueError, match="key"):
      run(None, False)

  @pytest.mark.slow
  def test_an_array_dropout_rate_is_the_configs_rate(self, rate=0.2):
    # A sweep passes each run's rate as a traced scalar; it replaces
    # config.dropout and drops as that config would with the same key.
    config = dataclasses.replace(TINY, dropout=rate)
    params = gpt.init_params(config, jax.random.PRNGKey(0))
    tokens = random_tokens(jax.random.PRNGKey(1), (2, 8))
    key = jax.random.PRNGKey(5)
    traced = jax.jit(lambda r: gpt.loss(params, tokens, tokens, TINY, key=key,
                                        deterministic=False, dropout=r))
    chex.assert_trees_all_close(
        traced(jnp.float32(rate)),
        jax.jit(lambda: gpt.loss(params, tokens, tokens, config, key=key,
                                 deterministic=False))(),
        rtol=1e-6, atol=1e-6)
    assert not np.isclose(traced(jnp.float32(0.5)), traced(jnp.float32(rate)))
    # a rate of 0 draws masks that keep everything: the model without dropout
    chex.assert_trees_all_close(traced(jnp.float32(0.0)),
                                gpt.loss(params, tokens, tokens, TINY), rtol=1e-6)

  @pytest.mark.slow
  def test_gradients_match_finite_differences(self):
    config = gpt.GPTConfig(vocab_size=7, block_size=5, n_layer=2, n_head=2, n_embd=8)
    params = sharpened_params(config)
    tokens = random_tokens(jax.random.PRNGKey(1), (2, 6), vocab=7)
    f = jax.jit(lambda p: gpt.loss(p, tokens[:, :-1], tokens[:, 1:], config))
    jtu.check_grads(f, (params,), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)

  @parameterized.parameters("bfloat16", "float32")
  def test_compute_dtype_keeps_float32_params(self, dtype):
    config = dataclasses.replace(TINY, compute_dtype=dtype)
    params = gpt.init_params(config, jax.random.PRNGKey(0))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    tokens = random_tokens(jax.random.PRNGKey(1), (2, 8))
    logits = gpt.forward(params, tokens, config)
    assert logits.dtype == jnp.float32
    chex.assert_trees_all_close(logits, gpt.forward(params, tokens, TINY), atol=5e-2)

  def test_saved_configs_with_execution_options_still_load(self):
    # Configs saved when they also held how the model ran.
    saved = {**dataclasses.asdict(TINY), "remat": "full", "attn_block": 32,
             "attention": "fused", "scan_layers": False}
    assert gpt.GPTConfig.from_dict(saved) == TINY
    with pytest.raises(TypeError, match="n_experts"):  # an unknown field is no such option
      gpt.GPTConfig.from_dict({**saved, "n_experts": 2})

  @parameterized.parameters(
      (dict(n_embd=30, n_head=4), "not divisible by n_head"),
      (dict(dropout=1.0), r"\[0, 1\)"),
      (dict(dropout=-0.1), r"\[0, 1\)"),
      (dict(block_size=0), "block_size must be a positive"),
      (dict(compute_dtype="int8"), "compute_dtype"),
  )
  def test_bad_config_is_a_clear_error(self, changes, message):
    with pytest.raises(ValueError, match=message):
      dataclasses.replace(TINY, **changes)

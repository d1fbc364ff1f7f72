"""gpt: shapes, causality, caching, dropout keys, gradients and training steps."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized
from jax import test_util as jtu

from purejax import gpt
from purejax import optim

TINY = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)


def random_tokens(key, shape, vocab=TINY.vocab_size):
  return jax.random.randint(key, shape, 0, vocab)


def sharpened_params(config, seed=0):
  """Random params scaled up, so logits have clear winners (no argmax ties)."""
  params = gpt.init_params(config, jax.random.PRNGKey(seed))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  return jax.tree.unflatten(
      tree, [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


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
    gpt.check_params(gpt.unstack_layers(params), TINY)  # so do per-layer params

  def test_causality(self):
    params = sharpened_params(TINY)
    tokens = random_tokens(jax.random.PRNGKey(1), (2, 8))
    for t in range(7):
      changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 1) % TINY.vocab_size)
      a = gpt.forward(params, tokens, TINY)
      b = gpt.forward(params, changed, TINY)
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
    for i in range(TINY.n_layer):
      layer = jax.tree.map(lambda p, i=i: p[i], params["blocks"])
      x, _ = gpt.block(layer, x, TINY, key=None, deterministic=True)
    x = gpt.nn.layer_norm(params["ln_f"], x)
    unrolled = x @ params["wte"]["embedding"].T
    chex.assert_trees_all_close(gpt.forward(params, tokens, TINY), unrolled,
                                rtol=1e-5, atol=1e-5)

  @parameterized.parameters("full", "dots")
  def test_remat_gives_the_same_loss_and_gradients(self, policy):
    params = sharpened_params(TINY)
    tokens = random_tokens(jax.random.PRNGKey(1), (2, 9))
    grad = lambda cfg: jax.value_and_grad(gpt.loss)(params, tokens[:, :-1],
                                                    tokens[:, 1:], cfg)
    chex.assert_trees_all_close(grad(dataclasses.replace(TINY, remat="none")),
                                grad(dataclasses.replace(TINY, remat=policy)),
                                rtol=1e-5, atol=1e-6)

  @parameterized.parameters((1, 8), (3, 8), (3, 7), (5, 8))
  def test_attention_in_query_blocks_is_exact(self, attn_block, time):
    # Blocks of queries skip most of the masked keys; the loss, its gradients
    # and causality must not change.
    params = sharpened_params(TINY)
    tokens = random_tokens(jax.random.PRNGKey(1), (2, time + 1))
    grad = lambda cfg: jax.value_and_grad(gpt.loss)(params, tokens[:, :-1],
                                                    tokens[:, 1:], cfg)
    blocked = dataclasses.replace(TINY, attn_block=attn_block)
    chex.assert_trees_all_close(grad(TINY), grad(blocked), rtol=1e-5, atol=1e-6)
    changed = tokens.at[:, 4:].set((tokens[:, 4:] + 1) % TINY.vocab_size)
    chex.assert_trees_all_close(gpt.forward(params, tokens[:, :-1], blocked)[:, :4],
                                gpt.forward(params, changed[:, :-1], blocked)[:, :4],
                                atol=1e-6)

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

  def test_gradients_match_finite_differences(self):
    config = gpt.GPTConfig(vocab_size=7, block_size=5, n_layer=2, n_head=2, n_embd=8)
    params = sharpened_params(config)
    tokens = random_tokens(jax.random.PRNGKey(1), (2, 6), vocab=7)
    f = lambda p: gpt.loss(p, tokens[:, :-1], tokens[:, 1:], config)
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

  @parameterized.parameters(
      (dict(n_embd=30, n_head=4), "not divisible by n_head"),
      (dict(dropout=1.0), r"\[0, 1\)"),
      (dict(dropout=-0.1), r"\[0, 1\)"),
      (dict(block_size=0), "block_size must be a positive"),
      (dict(compute_dtype="int8"), "compute_dtype"),
      (dict(remat="yes"), "remat"),
      (dict(attn_block=0), "attn_block must be a positive"),
  )
  def test_bad_config_is_a_clear_error(self, changes, message):
    with pytest.raises(ValueError, match=message):
      dataclasses.replace(TINY, **changes)


def greedy_recompute(params, prompt, config, max_new_tokens):
  """Greedy decoding by full recomputation, with `generate`'s context windows.

  The context of each prediction is the last `cache_len` tokens, where
  `cache_len` follows generate's rule: it starts at min(prompt, block_size),
  grows by one per token, and drops to block_size // 2 when it would
  exceed block_size.
  """
  tokens = list(np.asarray(prompt))
  cache_len = min(len(tokens), config.block_size)
  for i in range(max_new_tokens):
    if i > 0:
      cache_len = config.block_size // 2 if cache_len == config.block_size else cache_len + 1
    context = jnp.asarray(tokens[len(tokens) - cache_len:])[None]
    tokens.append(int(jnp.argmax(gpt.forward(params, context, config)[0, -1])))
  return np.array(tokens)


class GenerateTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("within_block", 3, 5),
      ("slides_past_block", 3, 20),
      ("prompt_longer_than_block", 12, 6),
  )
  def test_kv_cache_greedy_equals_full_recompute(self, prompt_len, new_tokens):
    params = sharpened_params(TINY)
    prompt = random_tokens(jax.random.PRNGKey(2), (prompt_len,))
    cached = gpt.generate(params, prompt, TINY, jax.random.PRNGKey(0),
                          max_new_tokens=new_tokens, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(cached),
                                  greedy_recompute(params, prompt, TINY, new_tokens))

  def test_within_block_equals_nanogpt_crop_semantics(self):
    # Inside block_size, the context is simply every token so far.
    params = sharpened_params(TINY)
    prompt = random_tokens(jax.random.PRNGKey(3), (2,))
    out = np.asarray(gpt.generate(params, prompt, TINY, jax.random.PRNGKey(0),
                                  max_new_tokens=6, temperature=0.0))
    for n in range(2, 8):
      logits = gpt.forward(params, jnp.asarray(out[:n])[None], TINY)
      assert out[n] == int(jnp.argmax(logits[0, -1]))

  def test_batched_sampling_shapes_and_determinism(self):
    params = sharpened_params(TINY)
    prompts = random_tokens(jax.random.PRNGKey(3), (4, 3))
    a = gpt.generate(params, prompts, TINY, jax.random.PRNGKey(7), max_new_tokens=10)
    b = gpt.generate(params, prompts, TINY, jax.random.PRNGKey(7), max_new_tokens=10)
    c = gpt.generate(params, prompts, TINY, jax.random.PRNGKey(8), max_new_tokens=10)
    chex.assert_shape(a, (4, 13))
    chex.assert_trees_all_equal(a, b)
    chex.assert_trees_all_equal(a[:, :3], prompts)
    assert not np.array_equal(a, c)
    assert int(a.max()) < TINY.vocab_size and int(a.min()) >= 0

  def test_top_k_one_is_greedy(self):
    params = sharpened_params(TINY)
    prompt = random_tokens(jax.random.PRNGKey(4), (3,))
    greedy = gpt.generate(params, prompt, TINY, jax.random.PRNGKey(0), 8, temperature=0.0)
    top1 = gpt.generate(params, prompt, TINY, jax.random.PRNGKey(9), 8, temperature=1.0,
                        top_k=1)
    chex.assert_trees_all_equal(greedy, top1)

  def test_sample_logits_filters(self):
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    draw = lambda **kw: np.array([int(gpt.sample_logits(k, logits, 1.0, **kw)[0])
                                  for k in keys[:200]])
    assert set(draw(top_k=2)) == {0, 1}
    assert set(draw(top_p=0.7)) == {0, 1}      # 0.5 + 0.3 reaches 0.7
    assert set(draw(top_p=0.5)) == {0}         # the first token alone has 0.5
    assert set(draw()) == {0, 1, 2, 3}
    assert int(gpt.sample_logits(keys[0], logits, 0.0)[0]) == 0

  def test_generate_rejects_bad_top_k_and_mismatched_params(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    prompt = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="top_k=0"):
      gpt.generate(params, prompt, TINY, jax.random.PRNGKey(0), 3, top_k=0)
    with pytest.raises(ValueError, match="layers"):
      gpt.generate(params, prompt, dataclasses.replace(TINY, n_layer=1),
                   jax.random.PRNGKey(0), 3)

  def test_forward_with_cache_token_by_token_equals_forward(self):
    params = sharpened_params(TINY)
    tokens = random_tokens(jax.random.PRNGKey(5), (2, TINY.block_size))
    full = gpt.forward(params, tokens, TINY)  # [2, block, vocab]
    cache = gpt.init_kv_cache(TINY, batch=2)
    chex.assert_shape(cache.k, [(2 * TINY.n_head, TINY.block_size, TINY.head_dim)] * 2)
    step = jax.jit(gpt.forward_with_cache, static_argnames="config")
    for t in range(TINY.block_size):
      logits, cache = step(params, tokens[:, t:t + 1], cache, t, config=TINY)
      chex.assert_trees_all_close(logits, full[:, t], atol=1e-5)

  def test_forward_with_cache_rejects_a_cache_of_another_batch(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"init_kv_cache\(config, batch\)"):
      gpt.forward_with_cache(params, jnp.zeros((2, 1), jnp.int32),
                             gpt.init_kv_cache(TINY, batch=3), 0, TINY)

  def test_generate_rejects_empty_prompt(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="non-empty prompt"):
      gpt.generate(params, jnp.zeros((1, 0), jnp.int32), TINY, jax.random.PRNGKey(0), 3)


class TrainStepsTest(parameterized.TestCase):

  def test_sample_batch_targets_are_shifted_inputs(self):
    data = jnp.arange(100, dtype=jnp.int32)
    x, y = gpt.sample_batch(jax.random.PRNGKey(0), data, 8, 5)
    chex.assert_shape((x, y), (5, 8))
    chex.assert_trees_all_equal(y, x + 1)
    chex.assert_trees_all_equal(x[:, 1:], x[:, :-1] + 1)  # contiguous windows

  def test_chunking_does_not_change_the_run(self):
    # 6 steps as one call or as 2 + 4 calls: same params, bit for bit.
    config = dataclasses.replace(TINY, dropout=0.1)
    data = random_tokens(jax.random.PRNGKey(0), (500,))
    opt = optim.make_optimizer(optim.OptimizerConfig(
        learning_rate=1e-2, warmup_iters=2, decay_iters=6, weight_decay=0.1, grad_clip=1.0))
    key = jax.random.PRNGKey(3)

    def run(chunks):
      params = gpt.init_params(config, jax.random.PRNGKey(0))
      state, step = opt.init(params), 0
      for n in chunks:
        params, state, _ = gpt.train_steps(params, state, data, key, step, config=config,
                                           optimizer=opt, batch_size=4, num_steps=n)
        step += n
      return params

    chex.assert_trees_all_equal(run([6]), run([2, 4]))

  def test_training_lowers_the_loss(self):
    # A repeating pattern is learnable: the loss must fall well below ln(vocab).
    data = jnp.tile(jnp.arange(TINY.vocab_size, dtype=jnp.int32), 50)
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    opt = optax.adam(1e-2)
    state = opt.init(params)
    params, state, losses = gpt.train_steps(params, state, data, jax.random.PRNGKey(1), 0,
                                            config=TINY, optimizer=opt, batch_size=8,
                                            num_steps=60)
    assert float(losses[0]) > 2.0
    assert float(losses[-1]) < 0.5
    val = gpt.evaluate(params, data, jax.random.PRNGKey(2), config=TINY, batch_size=8,
                       num_batches=4)
    assert float(val) < 0.5

  def test_weight_decay_only_on_matrices(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    mask = optim.decay_mask(params)
    assert mask["blocks"]["attn"]["qkv"]["w"] and mask["wte"]["embedding"]
    # Stacked per-layer biases and norms are [n_layer, dim] yet must not decay.
    assert params["blocks"]["attn"]["qkv"]["b"].ndim == 2
    assert not mask["blocks"]["attn"]["qkv"]["b"] and not mask["blocks"]["ln_1"]["scale"]
    assert not mask["ln_f"]["scale"]

"""Decoding (`engine.generate`, `decode`): KV-cache sampling equals full recomputation, past
the context too; sampling filters and checks; the model run through its cache."""

import dataclasses

import chex
import jax
from jax import monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from purejax import decode
from purejax import engine
from purejax import gpt
from purejax import kv_cache
from purejax.ops import kernels
from helpers.models import TINY, random_tokens, sharpened_params


def greedy_recompute(params, prompt, config, max_new_tokens):
  """Greedy decoding by full recomputation, with `generate(slide=True)`'s context windows.

  The context of each prediction is the last `cache_len` tokens, where
  `cache_len` follows the sliding rule: it starts at min(prompt, block_size),
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
  return np.array(tokens[len(prompt):])


def new_tokens(params, prompts, config, key, max_new_tokens, **options):
  """`engine.generate`'s tokens: `[prompts, max_new_tokens]` (one sample each, run to the end)."""
  rows = engine.generate(params, prompts, config, key, max_new_tokens, **options)
  assert all(len(c.tokens) == max_new_tokens and not c.stopped for (c,) in rows)
  return np.asarray([c.tokens for (c,) in rows])


class GenerateTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("within_block", 3, 5),
      ("slides_past_block", 3, 20),
      ("prompt_longer_than_block", 12, 6),
  )
  @pytest.mark.slow
  def test_kv_cache_greedy_equals_full_recompute(self, prompt_len, max_new_tokens):
    params = sharpened_params(TINY)
    prompt = random_tokens(jax.random.PRNGKey(2), (prompt_len,))
    cached = new_tokens(params, [prompt], TINY, jax.random.PRNGKey(0), max_new_tokens,
                        slide=True, rows=1, prefill_rows=1)
    np.testing.assert_array_equal(cached[0], greedy_recompute(params, prompt, TINY,
                                                              max_new_tokens))

  @pytest.mark.slow
  def test_within_block_equals_nanogpt_crop_semantics(self):
    # Inside block_size, the context is simply every token so far.
    params = sharpened_params(TINY)
    prompt = random_tokens(jax.random.PRNGKey(3), (2,))
    out = np.concatenate([prompt, new_tokens(params, [prompt], TINY, jax.random.PRNGKey(0),
                                             6)[0]])
    for n in range(2, 8):
      logits = gpt.forward(params, jnp.asarray(out[:n])[None], TINY)
      assert out[n] == int(jnp.argmax(logits[0, -1]))

  @pytest.mark.slow
  def test_batched_sampling_shapes_and_determinism(self):
    params = sharpened_params(TINY)
    prompts = random_tokens(jax.random.PRNGKey(3), (4, 3))
    sample = lambda key: new_tokens(params, prompts, TINY, key, 10, temperature=1.0,
                                    slide=True)
    a, b, c = sample(jax.random.PRNGKey(7)), sample(jax.random.PRNGKey(7)), sample(
        jax.random.PRNGKey(8))
    chex.assert_shape(a, (4, 10))
    chex.assert_trees_all_equal(a, b)
    assert not np.array_equal(a, c)
    assert int(a.max()) < TINY.vocab_size and int(a.min()) >= 0

  @pytest.mark.slow
  def test_top_k_one_is_greedy(self):
    params = sharpened_params(TINY)
    prompt = random_tokens(jax.random.PRNGKey(4), (1, 3))
    greedy = new_tokens(params, prompt, TINY, jax.random.PRNGKey(0), 8, slide=True)
    top1 = new_tokens(params, prompt, TINY, jax.random.PRNGKey(9), 8, temperature=1.0,
                      top_k=1, slide=True)
    chex.assert_trees_all_equal(greedy, top1)

  def test_sample_logits_filters(self):
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    draw = lambda **kw: np.array([int(decode.sample_logits(k, logits, 1.0, **kw)[0])
                                  for k in keys[:200]])
    assert set(draw(top_k=2)) == {0, 1}
    assert set(draw(top_p=0.7)) == {0, 1}      # 0.5 + 0.3 reaches 0.7
    assert set(draw(top_p=0.5)) == {0}         # the first token alone has 0.5
    assert set(draw()) == {0, 1, 2, 3}
    assert int(decode.sample_logits(keys[0], logits, 0.0)[0]) == 0

  def test_sample_logits_outside_jit_compiles_once_per_setting_kind(self):
    # A Python loop of draws (as a user writes one) reuses the first call's programs.
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    compiles = []

    def listen(name, secs, **kw):
      if name == "/jax/core/compile/backend_compile_duration":
        compiles.append(name)

    monitoring.register_event_duration_secs_listener(listen)
    self.addCleanup(monitoring.unregister_event_duration_listener, listen)
    for kw in (dict(top_k=2), dict(top_p=0.7), dict(top_k=3, top_p=0.9)):
      decode.sample_logits(jax.random.PRNGKey(0), logits, 1.0, **kw)
      compiles.clear()
      for i in range(1, 4):
        decode.sample_logits(jax.random.PRNGKey(i), logits, 0.8, **kw)
      self.assertEqual(compiles, [], f"{kw}: an eager draw compiled again")

  def test_generate_rejects_bad_top_k_and_mismatched_params(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    prompt = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="top_k >= 0"):
      engine.generate(params, prompt, TINY, jax.random.PRNGKey(0), 3, top_k=-1)
    with pytest.raises(ValueError, match="top_k=-1"):
      decode.sample_logits(jax.random.PRNGKey(0), jnp.zeros((1, 4)), 1.0, top_k=-1)
    with pytest.raises(ValueError, match="n_layer=1"):
      engine.generate(params, prompt, dataclasses.replace(TINY, n_layer=1),
                      jax.random.PRNGKey(0), 3)

  def test_forward_with_cache_token_by_token_equals_forward(self):
    params = sharpened_params(TINY)
    tokens = random_tokens(jax.random.PRNGKey(5), (2, TINY.block_size))
    full = gpt.forward(params, tokens, TINY)  # [2, block, vocab]
    cache = kv_cache.init_kv_cache(TINY, batch=2)
    chex.assert_shape(cache.k, [(2 * TINY.n_head, TINY.block_size, TINY.head_dim)] * 2)
    step = jax.jit(decode.forward_with_cache, static_argnames="config")
    # Sliced on the host: a device slice at each position would compile one program each.
    tokens, full = np.asarray(tokens), np.asarray(full)
    for t in range(TINY.block_size):
      logits, cache = step(params, tokens[:, t:t + 1], cache, t, config=TINY)
      chex.assert_trees_all_close(logits, full[:, t], atol=1e-5)

  @pytest.mark.slow  # a long one; the full suite runs it
  def test_forward_with_cache_runs_the_gpu_forms(self):
    # The GPU's forms read the cache with bfloat16 products. (With "cudnn",
    # which cannot run on a CPU, the prompt's program is checked in
    # test_gpu_lowering.py.)
    config = dataclasses.replace(TINY, compute_dtype="bfloat16")
    params = sharpened_params(config)
    tokens = random_tokens(jax.random.PRNGKey(5), (2, config.block_size))
    forms = kernels.select("gpu", attention="xla")
    full = gpt.forward(params, tokens, config, forms=forms)
    logits, cache = decode.forward_with_cache(params, tokens[:, :5],
                                              kv_cache.init_kv_cache(config, 2), 0, config,
                                              forms=forms)
    chex.assert_trees_all_close(logits, full[:, 4], atol=5e-2)
    logits, _ = decode.forward_with_cache(params, tokens[:, 5:6], cache, jnp.int32(5),
                                          config, forms=forms)
    chex.assert_trees_all_close(logits, full[:, 5], atol=5e-2)

  @pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
  def test_bf16_layers_hold_their_dense_weights_in_bf16_and_decode_the_same(self):
    # The products cast the dense weights to the compute dtype anyway, so the
    # decode loops hold them cast (half the bytes); nothing else is rounded.
    config = dataclasses.replace(TINY, compute_dtype="bfloat16")
    params = sharpened_params(config)
    layers = kv_cache.layers_of(params, config)
    float32_layers = kv_cache.layers_of(params, dataclasses.replace(config, compute_dtype="float32"))
    for path, leaf in jax.tree_util.tree_leaves_with_path(layers[0]):
      assert leaf.dtype == (jnp.bfloat16 if path[-1].key == "w" else jnp.float32), path
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(float32_layers))
    tokens = random_tokens(jax.random.PRNGKey(5), (2, 6))
    forms = kernels.select("gpu", attention="xla")
    rest = kv_cache.prepare(params, config).rest  # embeddings, final norm, head
    feed = lambda layers: kv_cache.forward(
        kv_cache.Model(layers, rest), tokens, kv_cache.init_kv_cache(config, 2),
        jnp.zeros(2, jnp.int32), jnp.full(2, 6, jnp.int32), config, forms)
    chex.assert_trees_all_equal(jax.jit(feed)(layers), jax.jit(feed)(float32_layers))
    chex.assert_trees_all_equal_dtypes(kv_cache.prepare(params, config).layers, layers)

  def test_forward_with_cache_rejects_a_cache_of_another_batch(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"init_kv_cache\(config, batch\)"):
      decode.forward_with_cache(params, jnp.zeros((2, 1), jnp.int32),
                             kv_cache.init_kv_cache(TINY, batch=3), 0, TINY)

  def test_generate_rejects_empty_prompt(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="each of at least one token"):
      engine.generate(params, jnp.zeros((1, 0), jnp.int32), TINY, jax.random.PRNGKey(0), 3)


def test_sample_text_continues_the_prompt_as_text():
  from purejax.data import tokenizers
  tok = tokenizers.CharTokenizer.from_text("abcdefgh \n")
  config = gpt.GPTConfig(vocab_size=16, block_size=16, n_layer=1, n_head=2, n_embd=8)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  text = engine.sample_text(params, tok, config, jax.random.PRNGKey(1), 12, prompt="abc")
  assert text.startswith("abc") and len(text) == 3 + 12
  assert set(text) <= set("abcdefgh \n")  # padded ids (10..15) are never sampled
  again = engine.sample_text(params, tok, config, jax.random.PRNGKey(1), 12, prompt="abc")
  assert again == text  # the key decides the sample

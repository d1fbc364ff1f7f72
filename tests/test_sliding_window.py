"""Sliding-window attention: every form computes the same function, and costs fall with the window.

`GPTConfig.window` and `window_pattern` make some layers attend only to the
last `window` positions. Each attention form must equal the plain form
(values and gradients) with windows, soft-caps and a custom scale; the
plain form must equal the masked softmax written out in numpy; layers of
different kinds stay one scan whose program does not grow with depth; the
blocked form skips the key blocks outside the window; and a sliding layer's
KV cache is a ring of the window.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import decode
from purejax import engine
from purejax import gpt
from purejax import kv_cache
from purejax.ops import attention
from purejax.ops import kernels


def qkv(key, t=24, heads=4, kv_heads=2, d=8, batch=2):
  kq, kk, kv = jax.random.split(key, 3)
  return (jax.random.normal(kq, (batch, t, heads, d)),
          jax.random.normal(kk, (batch, t, kv_heads, d)),
          jax.random.normal(kv, (batch, t, kv_heads, d)))


def numpy_attention(q, k, v, window, softcap, scale):
  """The masked softmax, written out: query t sees keys t - window + 1 .. t."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, h, d = q.shape
  k, v = (np.repeat(a, h // a.shape[2], axis=2) for a in (k, v))
  scores = np.einsum("bthd,bshd->bhts", q, k) * scale
  if softcap:
    scores = softcap * np.tanh(scores / softcap)
  query, key = np.arange(t)[:, None], np.arange(t)[None, :]
  visible = (key <= query) & (key > query - (window or t + 1))
  scores = np.where(visible, scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("bhts,bshd->bthd", weights, v)


@pytest.mark.parametrize("window,softcap,scale", [(5, None, None), (1, None, None),
                                                  (8, 20.0, 0.3), (None, 5.0, None)])
def test_the_plain_form_is_the_masked_softmax(window, softcap, scale):
  q, k, v = qkv(jax.random.PRNGKey(0))
  got = attention.causal_attention(q, k, v, form="plain", window=window, softcap=softcap,
                                   scale=scale)
  want = numpy_attention(q, k, v, window, softcap, scale or 8 ** -0.5)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("form,block", [("blocked", 8),
                                        pytest.param("blocked", 5, marks=pytest.mark.slow),
                                        ("xla", 64), ("cudnn", 64)])
@pytest.mark.parametrize("window,softcap,kv_heads", [
    (5, None, 2), pytest.param(8, 20.0, 4, marks=pytest.mark.slow),
    pytest.param(30, None, 1, marks=pytest.mark.slow)])
def test_every_form_equals_the_plain_form_values_and_gradients(form, block, window, softcap,
                                                               kv_heads):
  q, k, v = qkv(jax.random.PRNGKey(1), kv_heads=kv_heads)

  def loss(form, q, k, v):
    y = attention.causal_attention(q, k, v, form=form, block=block, window=window,
                                   softcap=softcap, scale=0.25)
    return jnp.sum(jnp.sin(y))  # weights every output differently

  value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3)), static_argnums=0)
  want = value_and_grad("plain", q, k, v)
  got = value_and_grad(form, q, k, v)  # cuDNN runs "xla" on CPU
  chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_bad_window_is_a_clear_error():
  q, k, v = qkv(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="window must be a positive integer"):
    attention.causal_attention(q, k, v, window=0)
  with pytest.raises(ValueError, match="needs window=N"):
    gpt.GPTConfig(window_pattern="SL")
  with pytest.raises(ValueError, match="letters 'S'"):
    gpt.GPTConfig(window=4, window_pattern="SG")


def test_the_blocked_forms_work_falls_with_the_window():
  """At T=1024, a 128 window in blocks of 128 (the form widens its blocks of 64 to the
  window) multiplies at most 256 keys a query, against 544 on average without it in
  blocks of 64: XLA's own count of the forward and backward FLOPs falls below half of
  the full causal form's (times: bench/sliding_window.py)."""
  q, k, v = qkv(jax.random.PRNGKey(0), t=1024, heads=2, kv_heads=2, d=32, batch=1)

  def flops(window):
    loss = lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v, form="blocked",
                                                              block=64, window=window))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    analysis = compiled.cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]

  assert flops(128) < 0.5 * flops(None)


def small(**changes):
  """A tiny Gemma 3: two sliding layers of window 5, then a global one."""
  return gpt.GPTConfig(**{**gpt.ARCHITECTURES["gemma3"], **dict(
      vocab_size=61, block_size=32, n_layer=3, n_head=4, n_embd=32, n_kv_head=2, dropout=0.0,
      window=5, window_pattern="SSL"), **changes})


def perturbed(params, key):
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


@pytest.mark.slow
def test_layers_of_different_kinds_scan_as_they_run_unrolled():
  config = small()
  assert config.layer_kinds == (1, 1, 0) and config.mixed_layers
  params = perturbed(gpt.init_params(config, jax.random.PRNGKey(0)), jax.random.PRNGKey(1))
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 20), 0, config.vocab_size)

  def loss(params, scan):
    forms = kernels.select("cpu", scan_layers=scan, attn_block=8)
    return gpt.loss(params, tokens[:, :-1], tokens[:, 1:], config, forms=forms)

  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  scanned = value_and_grad(params, True)
  unrolled = value_and_grad(params, False)
  chex.assert_trees_all_close(scanned, unrolled, atol=1e-5, rtol=1e-5)
  # Each kind is its own function: a global layer in the sliding layers' place differs.
  same = small(window_pattern="SLL")
  assert not np.allclose(scanned[0], jax.jit(
      lambda p: gpt.loss(p, tokens[:, :-1], tokens[:, 1:], same,
                         forms=kernels.select("cpu", attn_block=8)))(params))


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
def test_a_deeper_mixed_model_compiles_the_same_program():
  """One block in the scanned program, whatever the depth: 12 layers' optimised HLO is
  the size of 2 layers' (their compile times, bench/sliding_window.py, follow)."""
  def program_lines(n_layer, pattern):
    config = small(n_layer=n_layer, window_pattern=pattern)
    assert config.mixed_layers
    params = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    step = jax.jit(jax.grad(lambda p, x: gpt.loss(
        p, x, x, config, forms=kernels.select("cpu", scan_layers=True))))
    return len(step.lower(params, tokens).compile().as_text().splitlines())

  assert program_lines(12, "SSSSSL") <= 1.02 * program_lines(2, "SL")


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["S", "SSL"])
def test_a_sliding_layers_cache_is_a_ring_of_the_window(pattern):
  config = small(window_pattern=pattern)
  params = perturbed(gpt.init_params(config, jax.random.PRNGKey(0)), jax.random.PRNGKey(1))
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 24), 0, config.vocab_size)
  cache = kv_cache.init_kv_cache(config, batch=2, length=24)
  assert [k.shape for k in cache.k] == [
      (2 * config.kv_heads, 5 if kind else 24, config.head_dim) for kind in config.layer_kinds]
  full = jax.jit(gpt.forward, static_argnames="config")(params, tokens, config=config)
  # A prompt of 7 (beyond the window) at the static position 0, then one token at a
  # time at a traced position: each step's logits are the full forward's.
  prompt = jax.jit(decode.forward_with_cache, static_argnames=("config", "pos"))
  step = jax.jit(decode.forward_with_cache, static_argnames="config")
  logits, cache = prompt(params, tokens[:, :7], cache, pos=0, config=config)
  np.testing.assert_allclose(logits, full[:, 6], atol=2e-5, rtol=2e-5)
  for pos in range(7, 24):
    logits, cache = step(params, tokens[:, pos:pos + 1], cache, pos, config=config)
    np.testing.assert_allclose(logits, full[:, pos], atol=2e-5, rtol=2e-5)
  # Several tokens at a traced position read the ring and themselves.
  cache = kv_cache.init_kv_cache(config, batch=2, length=24)
  _, cache = prompt(params, tokens[:, :9], cache, pos=0, config=config)
  logits, cache = step(params, tokens[:, 9:16], cache, 9, config=config)
  np.testing.assert_allclose(logits, full[:, 15], atol=2e-5, rtol=2e-5)
  assert kv_cache.cache_length(cache, config) == (32 if pattern == "S" else 24)


@pytest.mark.slow
def test_a_conversation_through_rings_equals_feeding_it_afresh():
  """A row that keeps a conversation (`EngineConfig(reuse_prefix=True)`) feeds only what
  changed. A sliding layer's ring holds the window and one prefill call's tokens more,
  so a conversation rewound by more than that is fed again from its start."""
  config = small()
  params = perturbed(gpt.init_params(config, jax.random.PRNGKey(0)), jax.random.PRNGKey(1))
  eng = engine.Engine(params, config, engine.EngineConfig(
      rows=1, prefill_rows=1, prefill_chunk=4, top_logprobs=5, reuse_prefix=True),
                      forms=kernels.select("cpu"))
  assert [k.shape[1] for k in eng.rows.cache.k] == [5 + 4, 5 + 4, 32]
  ids = [int(i) for i in jax.random.randint(jax.random.PRNGKey(3), (26,), 0, 61)]
  forward = jax.jit(gpt.forward, static_argnames="config")
  cached = ()

  def first_token(prompt):
    """Feeds `prompt` and draws one token: how many were fed; the token's top 5 against
    the model fed the whole prompt afresh."""
    nonlocal cached
    events = []
    eng.submit(engine.Request(prompt, 1, top_logprobs=5), events.append)
    while eng.step():
      pass
    done = events[-1]
    logp = np.asarray(jax.nn.log_softmax(forward(params, jnp.asarray([prompt]),
                                                 config=config)[0, -1]))
    (top,) = done.completion.top_logprobs
    assert [i for i, _ in top] == list(np.argsort(-logp)[:5])
    np.testing.assert_allclose([v for _, v in top], np.sort(logp)[::-1][:5], atol=1e-4)
    cached = tuple(prompt) + done.completion.tokens
    return done.prompt_fed

  for upto in (9, 17, 26):  # each turn feeds what the cache does not hold
    held = decode.common_prefix(cached, ids[:upto])
    assert first_token(ids[:upto]) == upto - held
  rewound = ids[:20] + [7, 8, 9]  # 7 of the 27 cached tokens replaced: more than the room
  assert first_token(rewound) == len(rewound)
  assert first_token(rewound[:22] + [5]) == 1  # 2 replaced: the ring still holds its window


def greedy_alone(params, config, prompt, n):
  """`prompt`'s `n` greedy tokens, the model run over the whole sequence for each."""
  forward = jax.jit(gpt.forward, static_argnames="config")
  tokens = list(prompt)
  for _ in range(n):
    padded = jnp.asarray([tokens + [0] * (config.block_size - len(tokens))])  # one program
    tokens.append(int(jnp.argmax(forward(params, padded, config=config)[0, len(tokens) - 1])))
  return tuple(tokens[len(prompt):])


@pytest.mark.slow
def test_a_batch_decodes_through_rings_as_each_prompt_alone():
  # Rings of the window and one prefill call (4 tokens): the longer prompt is fed in two
  # chunks, and both rows wrap their rings as they decode.
  config = small()
  params = perturbed(gpt.init_params(config, jax.random.PRNGKey(0)), jax.random.PRNGKey(1))
  prompts = [[3, 4, 5, 6, 7, 8, 9, 10], [11, 12]]
  batch = engine.generate(params, prompts, config, jax.random.PRNGKey(0), max_new_tokens=9,
                          prefill_rows=1, prefill_chunk=4)
  for prompt, (completion,) in zip(prompts, batch):
    assert completion.tokens == greedy_alone(params, config, prompt, 9)


@pytest.mark.slow
def test_nanochats_window_pattern_is_an_option():
  config = gpt.GPTConfig(vocab_size=61, block_size=32, n_layer=6, n_head=2, n_embd=32,
                         **{**gpt.ARCHITECTURES["nanochat"], "window": 17,
                            "window_pattern": "SSSL"})
  assert config.layer_kinds == (1, 1, 1, 0, 1, 1)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  tokens = jnp.zeros((1, 32), jnp.int32)
  assert np.isfinite(gpt.loss(params, tokens, tokens, config)).all()


def test_formats_without_windows_refuse_a_windowed_model(tmp_path):
  """GPT-2's formats and Llama's config hold no window: a model with one is refused
  rather than exported without it (Mistral's class holds a window on every layer)."""
  from purejax.weights import gpt2 as gpt2_weights  # pylint: disable=g-import-not-at-top
  from purejax.weights import llama  # pylint: disable=g-import-not-at-top
  from purejax.weights.errors import ConversionError  # pylint: disable=g-import-not-at-top
  windowed = gpt.GPTConfig(window=8)
  with pytest.raises(ConversionError, match="window"):
    gpt2_weights.check_architecture(windowed)
  mixed = gpt.GPTConfig(**{**gpt.ARCHITECTURES["llama"], "window": 8, "window_pattern": "SL"})
  with pytest.raises(ConversionError, match="window"):
    llama.hf_config_dict(mixed)
  every = dataclasses.replace(mixed, window_pattern=None)
  assert llama.hf_config_dict(every)["model_type"] == "mistral"

"""Continuous batching (`engine.generate_many`): more prompts than rows, each row refilled as
its completion ends; every completion is its prompt's decoded alone, whatever rows it ran
beside, and sampled ones do not depend on the number of rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import decode
from purejax import engine
from purejax import gpt

LLAMA_LIKE = gpt.GPTConfig(vocab_size=61, block_size=48, n_layer=2, n_head=4, n_kv_head=2,
                           n_embd=32, dropout=0.0, **gpt.ARCHITECTURES["llama"])
GPT2_LIKE = gpt.GPTConfig(vocab_size=61, block_size=48, n_layer=2, n_head=2, n_embd=32,
                          dropout=0.0, bias=False)
# Gemma 3's shape: two sliding layers of window 5 (rings), then a global one.
GEMMA_LIKE = gpt.GPTConfig(**{**gpt.ARCHITECTURES["gemma3"], **dict(
    vocab_size=61, block_size=48, n_layer=3, n_head=4, n_embd=32, n_kv_head=2, dropout=0.0,
    window=5, window_pattern="SSL")})
# Six prompts for two or three rows: rows are refilled. One prompt is longer than a
# window and fills the context with 12 new tokens: it is fed in a chunk of 32, then
# one cut to end at the cache's end (`engine.prefill`).
PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [33, 12, 40, 8],
           [(7 * i) % 61 for i in range(36)], [4, 4]]


def alone(params, config, prompt, n):
  out = decode.generate(params, jnp.asarray([prompt]), config, jax.random.PRNGKey(0),
                        max_new_tokens=n, temperature=0.0)
  return tuple(int(t) for t in np.asarray(out)[0, len(prompt):])


def perturbed(params, key):  # Gemma's zero-initialised norm scales, made to matter
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("config", [  # each over 2 s of compiles: the full suite runs them
    pytest.param(LLAMA_LIKE, marks=pytest.mark.slow),
    pytest.param(GPT2_LIKE, marks=pytest.mark.slow),
    pytest.param(GEMMA_LIKE, marks=pytest.mark.slow)], ids=["rope", "positions", "rings"])
def test_each_completion_is_its_prompt_decoded_alone_and_ends_at_its_stop(config):
  params = perturbed(gpt.init_params(config, jax.random.PRNGKey(1)), jax.random.PRNGKey(2))
  want = [alone(params, config, prompt, 12) for prompt in PROMPTS]
  free = engine.generate_many(params, PROMPTS, config, jax.random.PRNGKey(0), 12, rows=2)
  assert [row.tokens for (row,) in free] == want
  assert not any(row.stopped for (row,) in free)
  # Each prompt stops at its own id, at different steps: rows end and refill out of step.
  stops = [[w[2 + i % 4]] for i, w in enumerate(want)]
  stopped = engine.generate_many(params, PROMPTS, config, jax.random.PRNGKey(0), 12, rows=3,
                                 stop_ids=stops)
  for w, (stop,), (row,) in zip(want, stops, stopped):
    assert row == decode.Completion(w[:w.index(stop) + 1], True)


@pytest.mark.slow
def test_sampled_completions_do_not_depend_on_the_rows_and_samples_differ():
  params = gpt.init_params(LLAMA_LIKE, jax.random.PRNGKey(1))
  run = lambda rows: engine.generate_many(params, PROMPTS[:3], LLAMA_LIKE,
                                          jax.random.PRNGKey(3), 10, rows=rows,
                                          temperature=1.0, num_samples=3)
  two, five = run(2), run(5)
  assert two == five
  assert all(len({c.tokens for c in samples}) > 1 for samples in two)  # drawn, not copied


@pytest.mark.slow
def test_stop_strings_end_a_completion_as_in_one_batch():
  params = gpt.init_params(LLAMA_LIKE, jax.random.PRNGKey(1))
  texts = [f"<{i}>" for i in range(LLAMA_LIKE.vocab_size)]
  free = decode.generate_batch(params, PROMPTS[:2], LLAMA_LIKE, jax.random.PRNGKey(0), 12)
  row = free[0][0].tokens
  table = decode.stop_strings(texts, [f"{row[3]}><{row[4]}", "never"])  # spans two tokens
  want = decode.generate_batch(params, PROMPTS[:2], LLAMA_LIKE, jax.random.PRNGKey(0), 12,
                               stop_strings=table)
  got = engine.generate_many(params, PROMPTS[:2], LLAMA_LIKE, jax.random.PRNGKey(0), 12,
                             rows=1, stop_strings=table)
  assert got == want and got[0][0].stopped and not got[1][0].stopped


def test_progress_counts_prompts_as_their_last_sample_ends():
  params = gpt.init_params(LLAMA_LIKE, jax.random.PRNGKey(1))
  seen = []
  engine.generate_many(params, PROMPTS[:4], LLAMA_LIKE, jax.random.PRNGKey(0), 4, rows=3,
                       num_samples=2, progress=lambda done, total: seen.append((done, total)))
  assert seen == [(n, 4) for n in range(1, 5)]


def test_bad_requests_are_clear_errors():
  params = gpt.init_params(GPT2_LIKE, jax.random.PRNGKey(1))
  key = jax.random.PRNGKey(0)
  with pytest.raises(ValueError, match="exceed block_size=48"):
    engine.generate_many(params, [[1] * 40], GPT2_LIKE, key, 10)
  with pytest.raises(ValueError, match="at least one token"):
    engine.generate_many(params, [[1], []], GPT2_LIKE, key, 4)
  with pytest.raises(ValueError, match="rows, num_samples and max_new_tokens >= 1"):
    engine.generate_many(params, [[1]], GPT2_LIKE, key, 4, rows=0)
  with pytest.raises(ValueError, match="2 lists for 3 prompts"):
    engine.generate_many(params, [[1], [2], [3]], GPT2_LIKE, key, 4, stop_ids=[[1], [2]])

"""Many prompts of different lengths in one program (`decode.generate_batch`): each row
decodes as its prompt alone, samples share one prefill, rows stop at their own ids."""

import dataclasses

import jax
import numpy as np
import pytest

from purejax import decode
from purejax import gpt
from purejax.ops import kernels

GPT2_LIKE = gpt.GPTConfig(vocab_size=61, block_size=48, n_layer=2, n_head=2, n_embd=32,
                          dropout=0.0, bias=False)
LLAMA_LIKE = gpt.GPTConfig(vocab_size=61, block_size=48, n_layer=2, n_head=4, n_kv_head=2,
                           n_embd=32, dropout=0.0, **gpt.ARCHITECTURES["llama"])
PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [33, 12, 40, 8]]


def alone(params, config, prompt, n):
  out = decode.generate(params, np.asarray(prompt), config, jax.random.PRNGKey(0),
                        max_new_tokens=n, temperature=0.0)
  return tuple(int(t) for t in np.asarray(out)[len(prompt):])


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
@pytest.mark.parametrize("config", [GPT2_LIKE, LLAMA_LIKE], ids=["positions", "rope"])
def test_each_row_decodes_greedily_as_its_prompt_alone(config):
  params = gpt.init_params(config, jax.random.PRNGKey(1))
  batch = decode.generate_batch(params, PROMPTS, config, jax.random.PRNGKey(0), 12)
  for prompt, (row,) in zip(PROMPTS, batch):
    assert row.tokens == alone(params, config, prompt, 12) and not row.stopped


@pytest.mark.slow
def test_samples_of_a_prompt_share_its_prefill_and_differ():
  params = gpt.init_params(LLAMA_LIKE, jax.random.PRNGKey(1))
  sampled = decode.generate_batch(params, PROMPTS[:2], LLAMA_LIKE, jax.random.PRNGKey(3), 10,
                                  temperature=1.0, num_samples=4)
  assert [len(s) for s in sampled] == [4, 4]
  assert len({c.tokens for c in sampled[0]}) > 1  # four draws, not one copied
  greedy = decode.generate_batch(params, PROMPTS[:2], LLAMA_LIKE, jax.random.PRNGKey(3), 10,
                                 num_samples=3)
  for prompt, rows in zip(PROMPTS[:2], greedy):
    assert {c.tokens for c in rows} == {alone(params, LLAMA_LIKE, prompt, 10)}


@pytest.mark.slow
def test_each_row_stops_at_its_own_ids():
  params = gpt.init_params(GPT2_LIKE, jax.random.PRNGKey(1))
  free = decode.generate_batch(params, PROMPTS[:2], GPT2_LIKE, jax.random.PRNGKey(0), 12)
  stop_a, stop_b = free[0][0].tokens[3], free[1][0].tokens[5]
  stopped = decode.generate_batch(params, PROMPTS[:2], GPT2_LIKE, jax.random.PRNGKey(0), 12,
                                  stop_ids=[[stop_a], [stop_b]])
  (a,), (b,) = stopped
  cut = lambda tokens, stop: tokens[:tokens.index(stop) + 1]
  assert a.tokens == cut(free[0][0].tokens, stop_a) and a.stopped
  assert b.tokens == cut(free[1][0].tokens, stop_b) and b.stopped


def test_a_batch_that_does_not_fit_the_context_is_refused():
  params = gpt.init_params(GPT2_LIKE, jax.random.PRNGKey(1))
  with pytest.raises(ValueError, match="exceed block_size=48"):
    decode.generate_batch(params, [[1] * 40], GPT2_LIKE, jax.random.PRNGKey(0), 10)
  with pytest.raises(ValueError, match="at least one token"):
    decode.generate_batch(params, [[1], []], GPT2_LIKE, jax.random.PRNGKey(0), 4)


def test_greedy_decoding_draws_no_noise_and_picks_the_same_tokens():
  """A Python temperature <= 0 is known before tracing: the program draws no Gumbel
  noise (for a greedy HumanEval batch it held 805 MB), and picks the tokens a
  traced temperature of 0 picks."""
  params = gpt.init_params(LLAMA_LIKE, jax.random.PRNGKey(1))
  prompt = np.asarray([[5, 9, 2], [7, 1, 1]])
  forms = kernels.select("cpu")

  def program(temperature, greedy):
    traced = decode.jitted_generate.trace(params, prompt, LLAMA_LIKE, jax.random.PRNGKey(0), 8,
                                          temperature, stop_ids=(3,), forms=forms,
                                          greedy=greedy)
    return str(traced.jaxpr)

  assert "random_bits" not in program(0.0, True)
  assert "random_bits" in program(0.0, False)  # a traced temperature may sample
  greedy = decode.generate(params, prompt, LLAMA_LIKE, jax.random.PRNGKey(0), 8, 0.0)
  traced = jax.jit(lambda t: decode.generate(params, prompt, LLAMA_LIKE, jax.random.PRNGKey(0),
                                             8, t, forms=forms))(0.0)
  np.testing.assert_array_equal(greedy, traced)


def test_rows_end_at_their_first_stop_string_with_the_tokens_before_it():
  # Id i reads "<i>"; a string spanning two tokens' text ends its row at the
  # token that completes it, the tokens before it as in the free run.
  params = gpt.init_params(LLAMA_LIKE, jax.random.PRNGKey(1))
  texts = [f"<{i}>" for i in range(LLAMA_LIKE.vocab_size)]
  free = decode.generate_batch(params, PROMPTS[:2], LLAMA_LIKE, jax.random.PRNGKey(0), 12)
  row = free[0][0].tokens
  string = f"{row[3]}><{row[4]}"  # the end of token 3's text and the start of token 4's
  table = decode.stop_strings(texts, [string, "never"])
  stopped = decode.generate_batch(params, PROMPTS[:2], LLAMA_LIKE, jax.random.PRNGKey(0), 12,
                                  stop_strings=table)
  ends = next(j for j in range(len(row)) if string in "".join(texts[t] for t in row[:j + 1]))
  assert stopped[0][0] == decode.Completion(row[:ends + 1], True)
  assert stopped[1][0] == free[1][0] and not stopped[1][0].stopped  # holds neither string


def test_stop_strings_must_be_non_empty():
  with pytest.raises(ValueError, match="non-empty"):
    decode.stop_strings(["a", "b"], ["a", ""])

"""The generation engine (`engine.generate`, `engine.Engine`): prompts decoded side by side in
a fixed set of rows, each row refilled as its completion ends. Every greedy completion is its
prompt's decoded alone, whatever rows it ran beside; sampled ones follow the noise rule
(`decode.completion_key`, `decode.token_noise`) and so do not depend on the rows; a
prompt's samples share its prefill; rows end at their own stop ids and strings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import decode
from purejax import cache_rows
from purejax import engine
from purejax import gpt
from purejax import kv_cache
from purejax.ops import kernels

LLAMA_LIKE = gpt.GPTConfig(vocab_size=61, block_size=48, n_layer=2, n_head=4, n_kv_head=2,
                           n_embd=32, dropout=0.0, **gpt.ARCHITECTURES["llama"])
GPT2_LIKE = gpt.GPTConfig(vocab_size=61, block_size=48, n_layer=2, n_head=2, n_embd=32,
                          dropout=0.0, bias=False)
# Gemma 3's shape: two sliding layers of window 5 (rings), then a global one.
GEMMA_LIKE = gpt.GPTConfig(**{**gpt.ARCHITECTURES["gemma3"], **dict(
    vocab_size=61, block_size=48, n_layer=3, n_head=4, n_embd=32, n_kv_head=2, dropout=0.0,
    window=5, window_pattern="SSL")})
# Six prompts for two or three rows: rows are refilled. One prompt is longer than a
# window and fills the context with 12 new tokens.
PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [33, 12, 40, 8],
           [(7 * i) % 61 for i in range(36)], [4, 4]]

_forward = jax.jit(gpt.forward, static_argnames="config")


def last_logits(params, config, ids):
  """The model's next-token logits after `ids`, over the whole sequence (`gpt.forward`;
  padded to the context, so one program serves every length: a causal model's logits
  do not see what follows)."""
  padded = jnp.asarray([list(ids) + [0] * (config.block_size - len(ids))])
  return _forward(params, padded, config=config)[0, len(ids) - 1]


def alone(params, config, prompt, n):
  """`prompt`'s `n` greedy tokens by full recomputation."""
  tokens = list(prompt)
  for _ in range(n):
    tokens.append(int(jnp.argmax(last_logits(params, config, tokens))))
  return tuple(tokens[len(prompt):])


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
  run = lambda **kw: engine.generate(params, PROMPTS, config, jax.random.PRNGKey(0), 12, **kw)
  for rows in (2, 6):  # rows refilled; every prompt in one batch
    free = run(rows=rows)
    assert [row.tokens for (row,) in free] == want, rows
    assert not any(row.stopped for (row,) in free)
  # Each prompt stops at its own id, at different steps: rows end and refill out of step.
  stops = [[w[2 + i % 4]] for i, w in enumerate(want)]
  for w, (stop,), (row,) in zip(want, stops, run(rows=3, stop_ids=stops)):
    assert row == decode.Completion(w[:w.index(stop) + 1], True)
  # One list for every prompt: each ends where it meets one (or runs to its end).
  stop, never = want[0][2], config.vocab_size + 5
  for w, (row,) in zip(want, run(rows=3, stop_ids=[stop, never])):
    cut = w[:w.index(stop) + 1] if stop in w else w
    assert row == decode.Completion(cut, stop in w)


@pytest.mark.slow
def test_sampled_completions_follow_the_noise_rule_whatever_the_rows():
  # Completion j = prompt * num_samples + sample draws token i with
  # decode.token_noise(decode.completion_key(key, j), i): recomputed here by hand
  # from the whole sequence's logits, with each token's log-probability.
  params = gpt.init_params(LLAMA_LIKE, jax.random.PRNGKey(1))
  key, prompts = jax.random.PRNGKey(3), PROMPTS[:3]
  run = lambda rows: engine.generate(params, prompts, LLAMA_LIKE, key, 10, rows=rows,
                                     temperature=1.0, top_k=20, num_samples=3, logprobs=True,
                                     top_logprobs=2)
  two, five = run(2), run(5)
  assert two == five
  assert all(len({c.tokens for c in samples}) > 1 for samples in two)  # drawn, not copied
  for p, (prompt, samples) in enumerate(zip(prompts, two)):
    for s, completion in enumerate(samples):
      completion_key = decode.completion_key(key, p * 3 + s)
      for i, token in enumerate(completion.tokens):
        logits = last_logits(params, LLAMA_LIKE, prompt + list(completion.tokens[:i]))
        noise = decode.token_noise(completion_key, i, LLAMA_LIKE.vocab_size)
        drawn = decode.sample_logits(None, logits[None], 1.0, 20, gumbel=noise[None])
        assert int(drawn[0]) == token, (p, s, i)
        logp = np.asarray(jax.nn.log_softmax(logits))
        np.testing.assert_allclose(completion.logprobs[i], logp[token], rtol=1e-4, atol=1e-4)
        (first, _), (second, _) = completion.top_logprobs[i]
        assert [first, second] == list(np.argsort(-logp)[:2])


@pytest.mark.slow
def test_samples_of_a_prompt_share_its_prefill():
  # A request of three completions feeds its prompt once, into one row, and copies that
  # row to the others: greedy, all three are the prompt's decoded alone; sampled, each
  # is engine.generate's completion of the same key.
  params = gpt.init_params(LLAMA_LIKE, jax.random.PRNGKey(1))
  prompt, key = PROMPTS[2], jax.random.PRNGKey(3)
  eng = engine.Engine(params, LLAMA_LIKE, engine.EngineConfig(rows=3, length=24))

  def complete(**settings):
    ended = {}

    def on_event(event):
      if event.completion is not None:
        ended[event.sample] = event.completion

    eng.submit(engine.Request(prompt, 10, **settings), on_event)
    while eng.step():
      pass
    return [ended[s] for s in range(3)]

  keys = [decode.completion_key(key, s) for s in range(3)]
  greedy = complete(keys=keys)
  assert eng.counters["prompt_tokens"] == len(prompt)
  assert {c.tokens for c in greedy} == {alone(params, LLAMA_LIKE, prompt, 10)}
  sampled = complete(keys=keys, temperature=1.0)
  assert eng.counters["prompt_tokens"] == 2 * len(prompt)
  (want,) = engine.generate(params, [prompt], LLAMA_LIKE, key, 10, temperature=1.0,
                            num_samples=3)
  assert sampled == want and len({c.tokens for c in sampled}) > 1


@pytest.mark.slow
def test_rows_end_at_their_first_stop_string_with_the_tokens_before_it():
  # Id i reads "<i>"; a string spanning two tokens' text ends its row at the token
  # that completes it, the tokens before it as in the free run, in one row or two.
  params = gpt.init_params(LLAMA_LIKE, jax.random.PRNGKey(1))
  texts = [f"<{i}>" for i in range(LLAMA_LIKE.vocab_size)]
  run = lambda **kw: engine.generate(params, PROMPTS[:2], LLAMA_LIKE, jax.random.PRNGKey(0),
                                     12, **kw)
  free = run()
  row = free[0][0].tokens
  string = f"{row[3]}><{row[4]}"  # the end of token 3's text and the start of token 4's
  stopped = run(stop_strings=[string, "never"], token_texts=texts)
  ends = next(j for j in range(len(row)) if string in "".join(texts[t] for t in row[:j + 1]))
  assert stopped[0][0] == decode.Completion(row[:ends + 1], True)
  assert stopped[1][0] == free[1][0] and not stopped[1][0].stopped  # holds neither string
  assert run(stop_strings=[string, "never"], token_texts=texts, rows=1) == stopped


@pytest.mark.slow
def test_stopping_works_across_cache_slides():
  # With `slide`, a completion goes on past the context from its last half; a stop id
  # still ends it where it first appears.
  params = perturbed(gpt.init_params(GPT2_LIKE, jax.random.PRNGKey(1)), jax.random.PRNGKey(2))
  prompt = [(5 * i) % 61 for i in range(46)]  # slides after two tokens
  run = lambda **kw: engine.generate(params, [prompt], GPT2_LIKE, jax.random.PRNGKey(0), 40,
                                     slide=True, **kw)[0][0]
  plain = run().tokens
  assert len(plain) == 40
  stop = plain[25]
  first = plain.index(stop)
  assert first > 2  # after the first slide
  assert run(stop_ids=[stop, GPT2_LIKE.vocab_size + 1]) == decode.Completion(
      plain[:first + 1], True)


def test_a_batchs_cache_is_as_long_as_its_prompts_and_new_tokens_need(monkeypatch):
  # The longest prompt in whole prefill chunks, then the new tokens: a short call reads
  # a short cache; never past the model's context.
  assert engine.cache_length([5, 3], 7, 4, GPT2_LIKE) == 8 + 7
  assert engine.cache_length([5], 7, 64, GPT2_LIKE) == 48
  lengths = []

  class Seen(Exception):
    pass

  def engine_of(params, config, settings, **kw):
    lengths.append(settings.length)
    raise Seen

  monkeypatch.setattr(engine, "Engine", engine_of)
  with pytest.raises(Seen):
    engine.generate({}, [[1] * 5, [2] * 3], GPT2_LIKE, jax.random.PRNGKey(0), 7,
                    prefill_chunk=4)
  with pytest.raises(Seen):
    engine.generate({}, [[1] * 5], GPT2_LIKE, jax.random.PRNGKey(0), 7, slide=True)
  assert lengths == [15, 48]  # sliding: the whole context
  with pytest.raises(ValueError, match="a KV cache of 60 positions"):
    kv_cache.init_kv_cache(GPT2_LIKE, 1, 60)


def test_greedy_rows_draw_no_noise():
  # The decoding program draws Gumbel noise only when a running row samples (for a
  # greedy HumanEval batch, 256 tokens x 16 rows x 49152 ids, it held 805 MB): every
  # draw sits inside a `cond`, on the CPU (ahead of the loop) and the GPU (in it).
  params = gpt.init_params(LLAMA_LIKE, jax.random.PRNGKey(1))
  settings = engine.EngineConfig(rows=2, length=16)
  eng = engine.Engine(params, LLAMA_LIKE, settings)

  def draws(jaxpr, in_cond=False):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "random_bits":
        yield in_cond
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            yield from draws(sub, in_cond or eqn.primitive.name == "cond")

  for platform in ("cpu", "gpu"):
    traced = cache_rows.decode_chunk.trace(
        eng.model, eng.rows, engine_settings(settings.rows), None, 4, False,
        config=LLAMA_LIKE, forms=kernels.select(platform), steps=4, top=0, valid_vocab=None)
    found = list(draws(traced.jaxpr.jaxpr))
    assert found and all(found), (platform, found)


def engine_settings(rows):
  """`cache_rows.Settings` of `rows` greedy rows, every one active."""
  return cache_rows.Settings(
      keys=jnp.zeros((rows, 2), jnp.uint32), temperature=jnp.zeros(rows),
      top_k=jnp.zeros(rows, jnp.int32), top_p=jnp.ones(rows), limit=jnp.full(rows, 8),
      stop_ids=jnp.full((rows, 1), -1), strings=jnp.full((rows, 1, 1), -1),
      active=jnp.ones(rows, bool), logprobs=jnp.zeros(rows, bool), top=jnp.zeros(rows, bool))


def test_progress_counts_prompts_as_their_last_sample_ends():
  params = gpt.init_params(LLAMA_LIKE, jax.random.PRNGKey(1))
  seen = []
  engine.generate(params, PROMPTS[:4], LLAMA_LIKE, jax.random.PRNGKey(0), 4, rows=3,
                  num_samples=2, progress=lambda done, total: seen.append((done, total)))
  assert seen == [(n, 4) for n in range(1, 5)]


def test_bad_requests_are_clear_errors():
  params = gpt.init_params(GPT2_LIKE, jax.random.PRNGKey(1))
  key = jax.random.PRNGKey(0)
  with pytest.raises(ValueError, match="exceed block_size=48"):
    engine.generate(params, [[1] * 40], GPT2_LIKE, key, 10)
  with pytest.raises(ValueError, match="at least one token"):
    engine.generate(params, [[1], []], GPT2_LIKE, key, 4)
  with pytest.raises(ValueError, match="rows, num_samples and max_new_tokens >= 1"):
    engine.generate(params, [[1]], GPT2_LIKE, key, 4, rows=0)
  with pytest.raises(ValueError, match="2 lists for 3 prompts"):
    engine.generate(params, [[1], [2], [3]], GPT2_LIKE, key, 4, stop_ids=[[1], [2]])
  with pytest.raises(ValueError, match="need token_texts"):
    engine.generate(params, [[1]], GPT2_LIKE, key, 4, stop_strings=["a"])
  with pytest.raises(ValueError, match="non-empty"):
    engine.generate(params, [[1]], GPT2_LIKE, key, 4, stop_strings=["a", ""],
                    token_texts=["a", "b"])
  with pytest.raises(ValueError, match="top_k >= 0"):
    engine.generate(params, [[1]], GPT2_LIKE, key, 4, top_k=-1)

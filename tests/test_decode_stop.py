"""decode: stop ids end each row on its own, the cache is as long as a call needs, and a
conversation kept in a cache across turns decodes as if fed afresh (tiny random models)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import decode
from purejax import gpt
from purejax import kv_cache
from helpers.models import CPU_FORMS, TINY, random_tokens, sharpened_params

CONFIG = dataclasses.replace(TINY, block_size=32)


@pytest.fixture(scope="module")
def params():
  return sharpened_params(CONFIG)


@pytest.mark.slow
def test_each_row_stops_at_its_own_stop_id_and_says_where(params):
  prompts = random_tokens(jax.random.PRNGKey(4), (3, 4))
  key = jax.random.PRNGKey(0)
  plain = np.asarray(decode.generate(params, prompts, CONFIG, key, 12, temperature=0.0))
  new = plain[:, 4:]
  stop = int(new[0, 2])  # row 0 stops at its third token; the others where they meet it
  out = decode.generate(params, prompts, CONFIG, key, 12, temperature=0.0, stop_ids=[stop])
  for row in range(3):
    hits = np.flatnonzero(new[row] == stop)
    length = hits[0] + 1 if hits.size else 12
    assert int(out.lengths[row]) == length
    assert bool(out.stopped[row]) == bool(hits.size)
    np.testing.assert_array_equal(out.tokens[row, :4 + length], plain[row, :4 + length])
    if hits.size:  # after its stop token a row repeats it
      assert (np.asarray(out.tokens[row, 4 + length:]) == stop).all()
  never = decode.generate(params, prompts, CONFIG, key, 12, temperature=0.0,
                          stop_ids=[CONFIG.vocab_size + 5])
  np.testing.assert_array_equal(never.tokens, plain)
  assert (np.asarray(never.lengths) == 12).all() and not np.asarray(never.stopped).any()


@pytest.mark.slow
def test_stopping_works_across_cache_slides_and_unbatched(params):
  prompt = random_tokens(jax.random.PRNGKey(5), (30,))  # slides after two tokens
  plain = np.asarray(decode.generate(params, prompt, CONFIG, jax.random.PRNGKey(0), 40,
                                     temperature=0.0))
  stop = int(plain[30 + 25])
  first = int(np.flatnonzero(plain[30:] == stop)[0])
  out = decode.generate(params, prompt, CONFIG, jax.random.PRNGKey(0), 40, temperature=0.0,
                        stop_ids=(stop, CONFIG.vocab_size + 1))
  assert out.tokens.shape == (70,) and int(out.lengths) == first + 1 and bool(out.stopped)
  np.testing.assert_array_equal(out.tokens[:31 + first], plain[:31 + first])
  with pytest.raises(ValueError, match="`stop_ids` is empty"):
    decode.generate(params, prompt, CONFIG, jax.random.PRNGKey(0), 4, stop_ids=[])


def test_the_cache_is_sized_to_the_call(params):
  prompt = jnp.zeros((1, 5), jnp.int32)

  def cache_shapes(new_tokens):
    hlo = decode.jitted_generate.lower(params, prompt, CONFIG, jax.random.PRNGKey(0),
                                       new_tokens, forms=CPU_FORMS).as_text()
    heads = CONFIG.kv_heads
    return {n for n in (5 + new_tokens, CONFIG.block_size)
            if f"tensor<{heads}x{n}x{CONFIG.head_dim}xf32>" in hlo}

  assert cache_shapes(7) == {12}  # prompt + new tokens, not block_size
  assert cache_shapes(60) == {32}  # capped by the model's context
  with pytest.raises(ValueError, match="a KV cache of 40 positions"):
    kv_cache.init_kv_cache(CONFIG, 1, 40)


def feed_afresh(params, ids):
  return np.asarray(gpt.forward(params, jnp.asarray(ids)[None], CONFIG)[0, -1])


@pytest.mark.slow
def test_a_conversation_feeds_each_turn_once_and_equals_feeding_it_afresh(params):
  layers, rest = decode.model_part(params, CONFIG)
  conversation = decode.Conversation(kv_cache.init_kv_cache(CONFIG, 1, 4))
  history = [int(i) for i in random_tokens(jax.random.PRNGKey(6), (6,))]
  for turn in range(3):
    logits, conversation = decode.extend(layers, rest, conversation, history, CONFIG,
                                         forms=CPU_FORMS, pad_to=4)
    np.testing.assert_allclose(np.asarray(logits[0]), feed_afresh(params, history),
                               rtol=1e-5, atol=1e-5)
    steps = list(decode.stream(layers, rest, conversation, logits, jax.random.PRNGKey(0),
                               4, temperature=0.0, config=CONFIG, forms=CPU_FORMS))
    answer = [s.token for s in steps]
    expected = np.asarray(decode.generate(params, jnp.asarray(history), CONFIG,
                                          jax.random.PRNGKey(0), 4, temperature=0.0))
    assert history + answer == list(expected), turn
    conversation = steps[-1].conversation
    assert conversation.ids == tuple(history + answer)
    history = history + answer + [turn + 1, 2]  # the next turn's own tokens
  assert kv_cache.cache_length(conversation.cache) == 32  # grew 4 -> 8 -> 16 -> 32


@pytest.mark.slow
def test_an_edited_history_is_fed_from_where_it_differs(params):
  layers, rest = decode.model_part(params, CONFIG)
  conversation = decode.Conversation(kv_cache.init_kv_cache(CONFIG, 1, 16))
  ids = [1, 2, 3, 4, 5, 6]
  _, conversation = decode.extend(layers, rest, conversation, ids, CONFIG, forms=CPU_FORMS)
  edited = [1, 2, 9, 4]
  logits, conversation = decode.extend(layers, rest, conversation, edited, CONFIG,
                                       forms=CPU_FORMS)
  np.testing.assert_allclose(np.asarray(logits[0]), feed_afresh(params, edited), rtol=1e-5,
                             atol=1e-5)
  same, conversation = decode.extend(layers, rest, conversation, edited, CONFIG,
                                     forms=CPU_FORMS)  # nothing new: the last id again
  np.testing.assert_allclose(same, logits, rtol=1e-6)
  with pytest.raises(ValueError, match="more than the model's context"):
    decode.extend(layers, rest, conversation, list(range(1, 11)) * 4, CONFIG,
                  forms=CPU_FORMS)


def test_streaming_stops_at_a_stop_id_and_yields_it(params):
  layers, rest = decode.model_part(params, CONFIG)

  def answer(**kw):  # each stream consumes its conversation's cache, so each starts anew
    conversation = decode.Conversation(kv_cache.init_kv_cache(CONFIG, 1, 16))
    logits, conversation = decode.extend(layers, rest, conversation, [3, 1, 4], CONFIG,
                                         forms=CPU_FORMS)
    return [s.token for s in decode.stream(layers, rest, conversation, logits,
                                           jax.random.PRNGKey(1), 6, temperature=0.0,
                                           config=CONFIG, forms=CPU_FORMS, **kw)]

  free = answer()
  stopped = answer(stop_ids=[free[1]])
  assert stopped == free[:free.index(free[1]) + 1]

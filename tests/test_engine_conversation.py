"""A conversation kept in an engine row's cache (`EngineConfig(reuse_prefix=True)`, as
`purejax.chat` runs it): each turn feeds only what the row's cache does not hold yet and
decodes as if the whole conversation were fed afresh; events stream the tokens as they
are decoded, through the stop id that ends the answer (tiny random models)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import engine
from purejax import gpt
from helpers.models import CPU_FORMS, TINY, random_tokens, sharpened_params

CONFIG = dataclasses.replace(TINY, block_size=32)


@pytest.fixture(scope="module")
def params():
  return sharpened_params(CONFIG)


def conversation(params):
  """One row whose cache keeps what it was fed, in chunks of 4 tokens."""
  return engine.Engine(params, CONFIG, engine.EngineConfig(
      rows=1, prefill_rows=1, prefill_chunk=4, chunk_steps=2, top_logprobs=3,
      reuse_prefix=True), forms=CPU_FORMS)


def turn(eng, ids, max_new_tokens, **settings):
  """One request through `eng`: its events, the last one holding the completion."""
  events = []
  eng.submit(engine.Request(ids, max_new_tokens, **settings), events.append)
  while eng.step():
    pass
  assert events[-1].completion is not None
  return events


def afresh(params, ids):
  """`[vocab]` next-token log-probabilities after `ids`, the model over all of them."""
  logits = gpt.forward(params, jnp.asarray(ids)[None], CONFIG)[0, -1]
  return np.asarray(jax.nn.log_softmax(logits))


def assert_read_afresh(params, ids, completion):
  """Each token of `completion` is greedy after `ids` and what it follows, with the
  log-probabilities of the model fed everything afresh."""
  for i, token in enumerate(completion.tokens):
    logp = afresh(params, list(ids) + list(completion.tokens[:i]))
    assert token == int(np.argmax(logp)), i
    np.testing.assert_allclose(completion.logprobs[i], logp[token], rtol=1e-5, atol=1e-5)
    top = [t for t, _ in completion.top_logprobs[i]]
    assert top == list(np.argsort(-logp)[:3]), i


@pytest.mark.slow
def test_a_conversation_feeds_each_turn_once_and_equals_feeding_it_afresh(params):
  eng = conversation(params)
  history = [int(i) for i in random_tokens(jax.random.PRNGKey(6), (6,))]
  fed = []
  for t in range(3):
    *_, done = turn(eng, history, 4, logprobs=True, top_logprobs=3)
    assert_read_afresh(params, history, done.completion)
    fed.append(done.prompt_fed)
    history = history + list(done.completion.tokens) + [t + 1, 2]  # the next turn's own
  # The first turn whole; then each turn's own two tokens and the answer's last one
  # (drawn, and never fed while the answer was decoded).
  assert fed == [6, 3, 3]


@pytest.mark.slow
def test_an_edited_history_is_fed_from_where_it_differs(params):
  eng = conversation(params)
  turn(eng, [1, 2, 3, 4, 5, 6], 1)
  edited = [1, 2, 9, 4]
  *_, done = turn(eng, edited, 2, logprobs=True, top_logprobs=3)
  assert done.prompt_fed == 2  # from the 9 on
  assert_read_afresh(params, edited, done.completion)
  *_, again = turn(eng, edited, 2, logprobs=True, top_logprobs=3)
  assert again.prompt_fed == 1  # nothing new: the last id again, for its logits
  assert again.completion == done.completion
  with pytest.raises(ValueError, match="exceed the context of 32 tokens"):
    eng.submit(engine.Request(list(range(1, 11)) * 4, 1), lambda event: None)


def test_streaming_stops_at_a_stop_id_and_yields_it(params):
  eng = conversation(params)

  def answer(**settings):
    events = turn(eng, [3, 1, 4], 6, **settings)
    streamed = [t for e in events for t in e.tokens]
    assert tuple(streamed) == events[-1].completion.tokens
    return events

  *streamed, free = answer()
  assert free.finish_reason == "length" and len(free.completion.tokens) == 6
  # As they are decoded: the first with the prompt's feeding, then two a call.
  assert [len(e.tokens) for e in streamed if e.tokens] == [1, 2, 2, 1]
  tokens = list(free.completion.tokens)
  *_, stopped = answer(stop_ids=[tokens[1]])
  assert list(stopped.completion.tokens) == tokens[:tokens.index(tokens[1]) + 1]
  assert stopped.finish_reason == "stop" and stopped.completion.stopped

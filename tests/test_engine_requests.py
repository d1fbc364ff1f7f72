"""`engine.Engine` serving requests as they come: a request joins the rows between decoding
chunks, waiting prompts are fed together, a cancelled request frees its row within a chunk,
and a request's tokens and log-probabilities are the same bits whatever runs beside it
(tiny random models)."""

import jax
import pytest

from purejax import decode
from purejax import engine
from purejax import gpt

CONFIG = gpt.GPTConfig(vocab_size=61, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                       n_embd=32, dropout=0.0, **gpt.ARCHITECTURES["llama"])
SETTINGS = engine.EngineConfig(rows=3, prefill_rows=4, prefill_chunk=8, chunk_steps=2,
                               top_logprobs=2)


@pytest.fixture(scope="module")
def params():
  leaves, tree = jax.tree.flatten(gpt.init_params(CONFIG, jax.random.PRNGKey(1)))
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


def request(prompt, n=12, temperature=0.0, seed=0, **kw):
  return engine.Request(prompt, n, [jax.random.PRNGKey(seed)], temperature,
                        logprobs=True, top_logprobs=2, **kw)


class Recorder:
  """Every event of each request, in the order the engine gave them."""

  def __init__(self):
    self.events = []

  def __call__(self, name):
    return lambda event: self.events.append((name, event))

  def completion(self, name):
    (done,) = [e.completion for n, e in self.events if n == name and e.completion is not None]
    return done

  def index(self, name, first_tokens=False):
    """Where the request's first token event (or its completion) is in the order."""
    for i, (n, e) in enumerate(self.events):
      if n == name and (e.tokens if first_tokens else e.completion is not None):
        return i
    return None


def alone(params, req, settings=SETTINGS):
  """`req` through an engine of these shapes with nothing else in it."""
  eng = engine.Engine(params, CONFIG, settings)
  log = Recorder()
  eng.submit(req, log("alone"))
  while eng.step():
    pass
  return log.completion("alone")


def test_a_request_arriving_mid_decoding_joins_before_the_others_end(params):
  eng = engine.Engine(params, CONFIG, SETTINGS)
  log = Recorder()
  first = request([3, 1, 4, 1, 5], n=30)
  late = request([2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], n=6, temperature=0.9, seed=5)
  eng.submit(first, log("first"))
  for _ in range(4):  # a prefill and some decoding chunks
    eng.step()
  assert log.index("first", first_tokens=True) is not None
  eng.submit(late, log("late"))
  while eng.step():
    pass
  # The late request ran beside the first and ended long before it.
  assert log.index("late") < log.index("first")
  assert log.index("late", first_tokens=True) < log.index("first")
  # Each is the bits it is alone: tokens, log-probabilities and the most likely tokens.
  assert log.completion("first") == alone(params, first)
  assert log.completion("late") == alone(params, late)
  assert len(log.completion("first").tokens) == 30


def test_waiting_prompts_are_fed_together_each_as_alone(params):
  eng = engine.Engine(params, CONFIG, SETTINGS)
  log = Recorder()
  prompts = {"a": [5, 9, 2], "b": [7] * 13, "c": [1, 2, 3, 4, 5, 6, 7, 8]}
  for name, prompt in prompts.items():
    eng.submit(request(prompt), log(name))
  while eng.step():
    pass
  # 3 + 13 + 8 tokens are 4 chunks of 8: one call of 4 chunk rows fed all three prompts.
  assert eng.counters["prefill_calls"] == 1
  assert eng.counters["prompt_tokens"] == 24
  for name, prompt in prompts.items():
    assert log.completion(name) == alone(params, request(prompt))


def test_a_cancelled_request_frees_its_row_within_a_chunk(params):
  settings = engine.EngineConfig(rows=1, prefill_rows=1, prefill_chunk=8, chunk_steps=2)
  eng = engine.Engine(params, CONFIG, settings)
  log = Recorder()
  long_id = eng.submit(engine.Request([4, 4, 4], 50), log("long"))
  for _ in range(3):
    eng.step()
  emitted = sum(len(e.tokens) for _, e in log.events)
  eng.submit(engine.Request([9, 9], 9), log("next"))  # waits: the one row is taken
  assert eng.load() == {"waiting": 1, "rows_in_use": 1}
  eng.cancel(long_id)
  eng.step()  # the cancellation is read, the row is given to the next request
  cancelled = log.completion("long")
  assert not cancelled.stopped and len(cancelled.tokens) <= emitted + settings.chunk_steps
  assert [e.finish_reason for n, e in log.events if n == "long" and e.finish_reason] == [
      "cancelled"]
  assert eng.load() == {"waiting": 0, "rows_in_use": 1}
  while eng.step():
    pass
  assert len(log.completion("next").tokens) == 9
  assert eng.load() == {"waiting": 0, "rows_in_use": 0}


def test_events_carry_text_that_joins_to_the_completions(params):
  texts = [chr(ord("a") + i % 26) * (1 + i % 3) for i in range(CONFIG.vocab_size)]
  eng = engine.Engine(params, CONFIG, SETTINGS, token_texts=texts,
                      decode_text=lambda ids: "".join(texts[i] for i in ids))
  log = Recorder()
  eng.submit(request([1, 2, 3], n=10, stop_ids=[60]), log("plain"))
  while eng.step():
    pass
  done = log.completion("plain")
  shown = "".join(e.text for _, e in log.events)
  assert shown == "".join(texts[t] for t in done.tokens if t != 60)
  # A stop string the text holds ends the completion there, and is not shown.
  stop = shown[2:5]
  log = Recorder()
  eng.submit(request([1, 2, 3], n=10, stop_ids=[60], stop_strings=[stop]), log("cut"))
  while eng.step():
    pass
  assert "".join(e.text for _, e in log.events) == shown[:shown.index(stop)]
  assert log.completion("cut").stopped


def test_samples_of_a_request_use_its_keys_in_turn(params):
  keys = [decode.completion_key(jax.random.PRNGKey(3), j) for j in range(2)]
  eng = engine.Engine(params, CONFIG, SETTINGS)
  log = Recorder()
  eng.submit(engine.Request([6, 6, 6], 8, keys, temperature=1.0), log("pair"))
  while eng.step():
    pass
  got = sorted((e.sample, e.completion.tokens) for _, e in log.events if e.completion)
  want = [(j, alone(params, engine.Request([6, 6, 6], 8, [k], temperature=1.0)).tokens)
          for j, k in enumerate(keys)]
  assert got == want and got[0][1] != got[1][1]


def test_requests_the_engine_cannot_run_are_refused_before_they_queue(params):
  eng = engine.Engine(params, CONFIG, SETTINGS)
  for bad, message in [(engine.Request([], 4), "prompt is empty"),
                       (engine.Request([1], 0), "max_new_tokens must be >= 1"),
                       (engine.Request([1] * 60, 10), "exceed the context of 64"),
                       (engine.Request([99], 4), "outside the model's 61"),
                       (engine.Request([1], 4, [None] * 4), "give 1 to 3"),
                       (engine.Request([1], 4, top_p=0.0), "top_p in"),
                       (engine.Request([1], 4, stop_strings=["x"]), "token texts")]:
    with pytest.raises(ValueError, match=message):
      eng.submit(bad, lambda event: None)
  assert eng.load() == {"waiting": 0, "rows_in_use": 0}


def test_a_prompts_tail_is_fed_in_the_short_chunks_each_as_alone(params):
  settings = engine.EngineConfig(rows=3, prefill_rows=2, prefill_chunk=8,
                                 short_prefill_chunks=(4,), chunk_steps=2)
  # Whole calls (2 rows of 8) first, then the rest in the smallest chunk that holds it.
  assert [settings.chunk_at(n, 0) for n in (1, 8, 9, 16, 20)] == [4, 4, 8, 8, 8]
  assert [settings.chunk_at(20, fed) for fed in (8, 16, 17)] == [8, 4, 4]
  eng = engine.Engine(params, CONFIG, settings)
  log = Recorder()
  # 2 chunks of 4; 2 chunks of 8; 2 chunks of 8 and 1 of 4.
  prompts = {"short": [5, 9, 2, 7, 7], "long": [3] * 13, "longer": [6] * 20}
  for name, prompt in prompts.items():
    eng.submit(engine.Request(prompt, 6, logprobs=True), log(name))
  while eng.step():
    pass
  assert eng.counters["prefill_calls"] == 4  # a call of chunks of one size each
  for name, prompt in prompts.items():
    one = engine.Engine(params, CONFIG, settings)
    alone_log = Recorder()
    one.submit(engine.Request(prompt, 6, logprobs=True), alone_log("alone"))
    while one.step():
      pass
    assert log.completion(name) == alone_log.completion("alone")


def test_prompts_are_fed_before_decoding_and_at_most_prefill_calls_a_round_beside_it(params):
  # One prompt a call (chunks of 8 in one call row), so calls count prompts.
  settings = engine.EngineConfig(rows=6, prefill_rows=1, prefill_chunk=8, prefill_calls=2,
                                 chunk_steps=2)
  eng = engine.Engine(params, CONFIG, settings)
  log = Recorder()
  for name in "abc":
    eng.submit(request([3, 1, 4], n=20), log(name))
  eng.step()
  # Nothing was decoding: all three prompts were fed before the first decoding chunk, so
  # every row's first chunk is full.
  assert eng.counters["prefill_calls"] == 3
  assert eng.counters["decode_calls"] == 1
  assert eng.counters["tokens"] == 3 + 3 * 2
  for name in "def":
    eng.submit(request([2, 7, 1], n=4), log(name))
  eng.step()
  # Rows decode now: at most `prefill_calls` calls in this round, the third prompt next.
  assert eng.counters["prefill_calls"] == 5
  eng.step()
  assert eng.counters["prefill_calls"] == 6
  while eng.step():
    pass
  for name in "abc":
    assert log.completion(name) == alone(params, request([3, 1, 4], n=20), settings)

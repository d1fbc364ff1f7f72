"""`purejax.serving`: OpenAI's API over the engine, checked with a tiny random model in-process.

Each test talks to one application (Starlette's test client; the engine runs in
its own thread, as under `python -m purejax.serve`): the shapes of responses and
stream chunks, what streaming equals, and every way a request is refused, each
with OpenAI's error body naming the field. The real model, real clients (the
`openai` package, a browser) and signals are in tests/test_serve_live.py.
"""

import json

import jax
import pytest

from helpers.data import SHAKESPEARE, train_tokenizer_json
from purejax import engine
from purejax import gpt
from purejax.data import chat
from purejax.data import tokenizer_json
from purejax.data import tokenizers
from purejax.serving import app as app_lib
from purejax.serving import protocol

starlette_testclient = pytest.importorskip("starlette.testclient")

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")
HELLO = [{"role": "user", "content": "Good morrow, what news?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tiny")
  train_tokenizer_json(folder, SHAKESPEARE[:20000])
  tokenizer = tokenizer_json.load(str(folder))
  config = gpt.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=96, n_layer=2, n_head=2,
                         n_kv_head=1, n_embd=32, dropout=0.0, **gpt.ARCHITECTURES["llama"])
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  fmt = chat.ChatFormat(TEMPLATE, bos_token="<s>", eos_token="</s>", stop_ids=(1,))
  texts = tokenizers.token_texts(tokenizer)
  eng = engine.Engine(params, config, engine.EngineConfig(
      rows=4, prefill_rows=2, prefill_chunk=16, chunk_steps=4, stop_strings=4,
      stop_string_bytes=32, top_logprobs=5), valid_vocab=tokenizer.vocab_size,
      token_texts=texts, decode_text=tokenizer.decode)
  return app_lib.Served(eng, tokenizer, fmt, (1,), "tiny", texts)


def client_of(served, **config):
  return starlette_testclient.TestClient(app_lib.create_app(
      served, app_lib.ServerConfig(limits=protocol.Limits(
          max_tokens=40, max_n=3, max_messages=4, max_body_bytes=4096, max_top_logprobs=5),
                                   **config)))


@pytest.fixture(scope="module")
def client(served):
  with client_of(served) as c:
    for _ in range(600):  # the engine's programs compile in its thread
      if c.get("/health").status_code == 200:
        break
      __import__("time").sleep(0.1)
    yield c


def post(client, path, body, **kw):
  return client.post(path, content=json.dumps(body), headers={"Content-Type":
                                                               "application/json"}, **kw)


def events(response):
  """A streamed response's chunks, and whether it ended with `[DONE]`."""
  chunks, done = [], False
  for line in response.iter_lines():
    if line.startswith("data: "):
      if line == "data: [DONE]":
        done = True
      else:
        chunks.append(json.loads(line[6:]))
  return chunks, done


def test_health_models_and_the_page(client):
  assert client.get("/health").json()["status"] == "ok"
  models = client.get("/v1/models").json()
  assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
  page = client.get("/")
  assert page.status_code == 200 and "text/html" in page.headers["content-type"]
  # It must work offline: no script, style or font from another host.
  assert "<textarea" in page.text and "src=\"http" not in page.text and "//cdn" not in page.text


def test_a_chat_answer_is_shaped_as_openais_and_counts_its_tokens(client, served):
  body = post(client, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 12,
                                               "temperature": 0}).json()
  assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
  assert body["model"] == "tiny" and isinstance(body["created"], int)
  (choice,) = body["choices"]
  assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
  assert choice["finish_reason"] in ("stop", "length")
  prompt = chat.encode(served.tokenizer, served.chat_format, HELLO, add_generation_prompt=True)
  usage = body["usage"]
  assert usage["prompt_tokens"] == len(prompt)
  assert 1 <= usage["completion_tokens"] <= 12
  assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
  # Greedy: the same request gives the same answer.
  again = post(client, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 12,
                                                "temperature": 0}).json()
  assert again["choices"][0]["message"] == choice["message"]


def test_a_streams_deltas_join_to_the_whole_answer_and_end_with_usage(client):
  request = {"messages": HELLO, "max_tokens": 20, "temperature": 0}
  whole = post(client, "/v1/chat/completions", request).json()
  with client.stream("POST", "/v1/chat/completions", json={
      **request, "stream": True, "stream_options": {"include_usage": True}}) as response:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks, done = events(response)
  assert done
  assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"]
             for c in chunks)
  assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
  text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
  assert text == whole["choices"][0]["message"]["content"]
  finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
  assert finishes[-1] == whole["choices"][0]["finish_reason"] and not any(finishes[:-1])
  *_, last = chunks
  assert last["choices"] == [] and last["usage"] == whole["usage"]
  assert all(c["usage"] is None for c in chunks[:-1])


def test_completions_take_text_or_ids_and_n_seeded_samples(client, served):
  ids = [int(i) for i in served.tokenizer.encode("ROMEO:")]
  by_text = post(client, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 8,
                                             "temperature": 0}).json()
  by_ids = post(client, "/v1/completions", {"prompt": ids, "max_tokens": 8,
                                            "temperature": 0}).json()
  assert by_text["object"] == "text_completion"
  assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]
  assert by_text["usage"]["prompt_tokens"] == len(ids)
  sampled = {"prompt": "ROMEO:", "max_tokens": 10, "temperature": 1.0, "n": 3, "seed": 7}
  first = post(client, "/v1/completions", sampled).json()
  second = post(client, "/v1/completions", sampled).json()
  texts = [c["text"] for c in first["choices"]]
  assert [c["index"] for c in first["choices"]] == [0, 1, 2]
  assert texts == [c["text"] for c in second["choices"]]  # a seed is a seed
  assert len(set(texts)) > 1  # three draws, not one copied
  assert first["usage"]["prompt_tokens"] == 3 * len(ids)


def test_a_stop_string_cuts_the_text_before_it_in_both_forms(client):
  request = {"prompt": "JULIET:", "max_tokens": 24, "temperature": 0}
  text = post(client, "/v1/completions", request).json()["choices"][0]["text"]
  assert len(text) > 6
  stop = text[3:6]  # a string the greedy answer holds
  cut = post(client, "/v1/completions", {**request, "stop": [stop, "never seen"]}).json()
  assert cut["choices"][0]["text"] == text[:text.index(stop)]
  assert cut["choices"][0]["finish_reason"] == "stop"
  with client.stream("POST", "/v1/completions", json={**request, "stop": stop,
                                                      "stream": True}) as response:
    chunks, _ = events(response)
  assert "".join(c["choices"][0]["text"] for c in chunks) == text[:text.index(stop)]


def test_logprobs_in_both_apis(client):
  chat_body = post(client, "/v1/chat/completions", {
      "messages": HELLO, "max_tokens": 6, "temperature": 0, "logprobs": True,
      "top_logprobs": 3}).json()
  content = chat_body["choices"][0]["logprobs"]["content"]
  assert content and all(len(c["top_logprobs"]) == 3 for c in content)
  for c in content:  # greedy: the chosen token is the most likely one
    assert c["logprob"] <= 0 and c["logprob"] == pytest.approx(c["top_logprobs"][0]["logprob"])
    assert c["bytes"] == list(c["token"].encode("utf-8"))
  completion = post(client, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 5,
                                                "temperature": 0, "logprobs": 2}).json()
  logprobs = completion["choices"][0]["logprobs"]
  assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 5
  assert "".join(logprobs["tokens"]) == completion["choices"][0]["text"]
  assert all(len(top) == 2 for top in logprobs["top_logprobs"])


@pytest.mark.parametrize("body,status,param", [
    ({"messages": HELLO, "max_tokens": "12"}, 400, "max_tokens"),
    ({"messages": HELLO, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": HELLO, "max_tokens": 41}, 400, "max_tokens"),
    ({"messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    ({"messages": HELLO, "temperature": 2.5}, 400, "temperature"),
    ({"messages": HELLO, "top_p": 0}, 400, "top_p"),
    ({"messages": HELLO, "top_k": 5000}, 400, "top_k"),
    ({"messages": HELLO, "n": True}, 400, "n"),
    ({"messages": HELLO, "n": 4}, 400, "n"),
    ({"messages": HELLO, "stop": 3}, 400, "stop"),
    ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"messages": HELLO, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": HELLO, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": HELLO, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"messages": HELLO, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": HELLO * 5}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "word " * 200}]}, 400, "messages"),
    ({"messages": HELLO, "model": "gpt-4"}, 404, "model"),
    ([1, 2, 3], 400, None),
])
def test_bad_chat_requests_get_openais_error_naming_the_field(client, body, status, param):
  response = post(client, "/v1/chat/completions", body)
  assert response.status_code == status, response.text
  error = response.json()["error"]
  assert error["param"] == param and error["message"] and error["type"]


def test_harmless_values_of_unsupported_fields_and_unknown_fields_are_accepted(client):
  response = post(client, "/v1/chat/completions", {
      "messages": HELLO, "max_tokens": 2, "presence_penalty": 0, "tools": [],
      "response_format": {"type": "text"}, "user": "someone", "x_unknown": {"a": 1}})
  assert response.status_code == 200, response.text


def test_a_body_that_is_not_json_or_too_large_is_refused(client):
  bad = client.post("/v1/chat/completions", content=b"{not json",
                    headers={"Content-Type": "application/json"})
  assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
  deep = client.post("/v1/chat/completions", content=b"[" * 2000 + b"]" * 2000,
                     headers={"Content-Type": "application/json"})
  assert deep.status_code == 400 and deep.json()["error"]["message"]
  big = client.post("/v1/chat/completions", content=b"x" * 5000,
                    headers={"Content-Type": "application/json"})
  assert big.status_code == 413 and big.json()["error"]["message"]
  prompt = post(client, "/v1/completions", {"prompt": [10 ** 6]})
  assert prompt.status_code == 400 and prompt.json()["error"]["param"] == "prompt"
  assert client.get("/v1/nothing").status_code == 404
  assert client.get("/v1/chat/completions").status_code == 405


def test_an_api_key_guards_the_api_but_not_health(served):
  with client_of(served, api_key="sesame") as guarded:
    assert guarded.get("/health").status_code in (200, 503)  # open, ready or compiling
    refused = post(guarded, "/v1/chat/completions", {"messages": HELLO})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert guarded.get("/v1/models", headers={"Authorization": "Bearer nope"}
                       ).status_code == 401
    assert guarded.get("/metrics").status_code == 401
    ok = guarded.get("/v1/models", headers={"Authorization": "Bearer sesame"})
    assert ok.status_code == 200


def test_a_full_queue_answers_429_with_retry_after(served):
  with client_of(served, max_queue=0, retry_after=3) as full:
    for _ in range(600):
      if full.get("/health").status_code == 200:
        break
      __import__("time").sleep(0.1)
    response = post(full, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2})
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert response.json()["error"]["type"] == "rate_limit_error"


def test_metrics_count_requests_tokens_and_latency(client):
  post(client, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0})
  text = client.get("/metrics").text
  for name in ("purejax_queue_depth", "purejax_rows_in_use", "purejax_generated_tokens_total",
               "purejax_time_to_first_token_seconds_count",
               "purejax_inter_token_latency_seconds_count", 'purejax_requests_total{status="200"}'):
    assert name in text, name
  generated = [line for line in text.splitlines()
               if line.startswith("purejax_generated_tokens_total")]
  assert float(generated[0].split()[-1]) >= 4

"""The ASGI application: OpenAI's chat and completions API over one generation engine.

    served = app.Served(engine, tokenizer, chat_format, stop_ids, "SmolLM2-135M-Instruct")
    asgi = app.create_app(served, app.ServerConfig(api_key="..."))
    uvicorn.run(asgi, host="127.0.0.1", port=8000)

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
`GET /health` (200 once the engine's programs are compiled), `GET /metrics`
(Prometheus), and the chat page at `/`. The engine runs in a thread of its
own (`Engine.run`); each HTTP request submits its prompts to it and reads
its events from an `asyncio.Queue` the engine's thread feeds. A client that
goes away has its request cancelled, which frees its rows within one
decoding chunk.

Errors are OpenAI's JSON (`protocol.APIError`), never a traceback: a bad
field is a 400 naming it, a full queue a 429 with `Retry-After`, a missing
or wrong API key a 401. Each request logs one line: its id, status, prompt
and completion tokens, time to first token and tokens per second.
"""

import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import json
import logging
import pathlib
import secrets
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import prometheus_client
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from purejax import decode
from purejax import engine as engine_lib
from purejax.data import chat
from purejax.data import tokenizers
from purejax.serving import protocol

LOG = logging.getLogger("purejax.serve")
PAGE = pathlib.Path(__file__).parent / "static" / "chat.html"


@dataclasses.dataclass
class Served:
  """What the server serves.

  Attributes:
    engine: the model's engine (`engine.Engine`, with `decode_text` and `token_texts`).
    tokenizer: the model's tokenizer (`encode`, `decode`, `vocab_size`).
    chat_format: its chat template (None: the chat API answers 400).
    stop_ids: the ids that end a turn (and a completion).
    model_name: the name clients ask for (`GET /v1/models`).
    token_texts: each id's text (`tokenizers.token_texts`), for log-probabilities.
  """
  engine: engine_lib.Engine
  tokenizer: Any
  chat_format: Optional[chat.ChatFormat]
  stop_ids: Tuple[int, ...]
  model_name: str
  token_texts: Sequence[str]


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """How the server guards itself.

  Attributes:
    limits: what one request may ask for (`protocol.Limits`).
    api_key: with a key, `/v1/*` and `/metrics` need `Authorization: Bearer KEY`.
    max_queue: requests waiting for a row at most; more answer 429.
    retry_after: seconds a 429 tells the client to wait.
  """
  limits: protocol.Limits = protocol.Limits()
  api_key: Optional[str] = None
  max_queue: int = 64
  retry_after: int = 1


class _Metrics:
  """The server's Prometheus metrics, in a registry of its own."""

  def __init__(self, served: Served):
    self.registry = prometheus_client.CollectorRegistry()
    make = lambda cls, name, doc, **kw: cls(name, doc, registry=self.registry, **kw)
    self.queue = make(prometheus_client.Gauge, "purejax_queue_depth",
                      "Requests waiting for a cache row.")
    self.queue.set_function(lambda: served.engine.load()["waiting"])
    self.rows = make(prometheus_client.Gauge, "purejax_rows_in_use",
                     "Cache rows prefilling or decoding.")
    self.rows.set_function(lambda: served.engine.load()["rows_in_use"])
    self.generated = make(prometheus_client.Counter, "purejax_generated_tokens",
                          "Tokens generated.")
    self.prompt = make(prometheus_client.Counter, "purejax_prompt_tokens",
                       "Prompt tokens of requests served.")
    self.requests = make(prometheus_client.Counter, "purejax_requests",
                         "Requests answered, by HTTP status.", labelnames=("status",))
    buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
    self.ttft = make(prometheus_client.Histogram, "purejax_time_to_first_token_seconds",
                     "Time from a request's arrival to its first token.", buckets=buckets)
    self.itl = make(prometheus_client.Histogram, "purejax_inter_token_latency_seconds",
                    "Time between a completion's tokens.", buckets=buckets)


class _Run:
  """One HTTP request's completions in the engine, read as their events arrive."""

  def __init__(self, loop: asyncio.AbstractEventLoop, count: int):
    self.loop, self.queue = loop, asyncio.Queue()
    self.ids: List[int] = []
    self.left = count  # completions not yet finished

  def on_event(self, event: engine_lib.Event, slot: int) -> None:  # the engine's thread
    self.loop.call_soon_threadsafe(self.queue.put_nowait, (slot, event))


class _Server:
  """The routes' state: the model, the engine's thread, counters and metrics."""

  def __init__(self, served: Served, config: ServerConfig):
    self.served, self.config = served, config
    self.metrics = _Metrics(served)
    self.numbers = itertools.count()
    self.ready = threading.Event()
    self.failed: Optional[str] = None
    self.draining = False
    self.stop = threading.Event()
    self.thread: Optional[threading.Thread] = None
    self.created = int(time.time())
    self.runs: Dict[int, Tuple[_Run, List[int]]] = {}
    self._texts = served.token_texts

  # -- the engine's thread ------------------------------------------------------

  def start(self) -> None:
    self.thread = threading.Thread(target=self._drive, name="purejax-engine", daemon=True)
    self.thread.start()

  def _drive(self) -> None:
    try:
      self.served.engine.warm_up()
      self.ready.set()
      LOG.info("ready: %s (%d rows of %d positions)", self.served.model_name,
               self.served.engine.settings.rows, self.served.engine.length)
      self.served.engine.run(self.stop)
    except Exception as e:  # pylint: disable=broad-except
      self.failed = f"{type(e).__name__}: {e}"
      LOG.error("the engine stopped: %s", self.failed)
      for run, _ in list(self.runs.values()):
        for slot in range(run.left):
          run.loop.call_soon_threadsafe(run.queue.put_nowait, (slot, None))

  def shutdown(self, seconds: float = 10.0) -> None:
    """Stops admitting, cancels what is in flight, and stops the engine's thread."""
    self.draining = True
    for run, _ in list(self.runs.values()):
      for request_id in run.ids:
        self.served.engine.cancel(request_id)
    self.stop.set()
    if self.thread is not None:
      self.thread.join(seconds)

  # -- helpers ------------------------------------------------------------------

  def text_of(self, token: int) -> str:
    return self._texts[token] if 0 <= token < len(self._texts) else ""

  def check_open(self, request: HTTPRequest) -> None:
    if self.config.api_key is not None:
      given = request.headers.get("authorization", "")
      if not hmac.compare_digest(given.encode(), f"Bearer {self.config.api_key}".encode()):
        raise protocol.APIError(401, "a valid API key is needed: send 'Authorization: "
                                     "Bearer KEY'.", kind="authentication_error",
                                code="invalid_api_key")
    if self.failed is not None:
      raise protocol.APIError(503, f"the engine stopped: {self.failed}", kind="server_error")
    if self.draining:
      raise protocol.APIError(503, "the server is shutting down.", kind="server_error")
    if not self.ready.is_set():
      raise protocol.APIError(503, "the model is still loading; retry once GET /health "
                                   "answers 200.", kind="server_error",
                              headers={"Retry-After": "5"})

  async def read_json(self, request: HTTPRequest) -> Any:
    limit = self.config.limits.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
      raise protocol.APIError(413, f"the request body is {int(length)} bytes; at most "
                                   f"{limit}.")
    body = bytearray()
    async for part in request.stream():
      body += part
      if len(body) > limit:
        raise protocol.APIError(413, f"the request body is over {limit} bytes.")
    try:
      return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
      raise protocol.APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
      raise protocol.APIError(400, "the request body is nested too deeply.") from None

  def check_model(self, model: Optional[str]) -> None:
    if model is not None and model != self.served.model_name:
      raise protocol.APIError(404, f"the model {model!r} is not served here; this server "
                                   f"serves {self.served.model_name!r} (GET /v1/models).",
                              param="model", code="model_not_found")

  def engine_requests(self, prompts: List[List[int]], sampling: protocol.Sampling,
                      param: str) -> List[engine_lib.Request]:
    """The engine's requests for `prompts`, with their token budget checked."""
    context = self.served.engine.length
    out = []
    seed = (sampling.seed if sampling.seed is not None else secrets.randbits(64)) % (1 << 64)
    # `jax.random.PRNGKey(seed)` of all 64 bits (JAX without x64 would drop the high 32).
    key = np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
    for p, ids in enumerate(prompts):
      room = context - len(ids)
      if room < 1:
        raise protocol.APIError(400, f"the prompt is {len(ids)} tokens; the model's context "
                                     f"of {context} leaves no room for an answer.", param=param,
                                code="context_length_exceeded")
      wanted = sampling.max_tokens
      if wanted is not None and wanted > room:
        raise protocol.APIError(
            400, f"the prompt ({len(ids)} tokens) and max_tokens={wanted} exceed the model's "
                 f"context of {context} tokens; lower max_tokens or shorten the prompt.",
            param="max_tokens", code="context_length_exceeded")
      limit = min(room, wanted or self.config.limits.max_tokens)
      keys = [np.asarray(decode.completion_key(key, p * sampling.n + s))
              for s in range(sampling.n)]
      out.append(engine_lib.Request(
          ids, limit, keys, sampling.temperature, sampling.top_k, sampling.top_p,
          self.served.stop_ids, sampling.stop, logprobs=sampling.logprobs,
          top_logprobs=sampling.top_logprobs))
    return out

  def submit(self, requests: List[engine_lib.Request]) -> _Run:
    load = self.served.engine.load()
    if load["waiting"] + len(requests) > self.config.max_queue:
      raise protocol.APIError(429, f"{load['waiting']} requests are waiting; retry later.",
                              kind="rate_limit_error",
                              headers={"Retry-After": str(self.config.retry_after)})
    n = len(requests[0].keys)
    run = _Run(asyncio.get_running_loop(), len(requests) * n)
    for p, request in enumerate(requests):
      try:
        request_id = self.served.engine.submit(
            request, lambda event, p=p: run.on_event(event, p * n + event.sample))
      except ValueError as e:
        for other in run.ids:
          self.served.engine.cancel(other)
        raise protocol.APIError(400, str(e)) from None
      run.ids.append(request_id)
    return run

  def cancel(self, run: _Run) -> None:
    for request_id in run.ids:
      self.served.engine.cancel(request_id)


@dataclasses.dataclass
class _Choice:
  """A completion as it builds up, for the response and the log."""
  text: str = ""
  tokens: List[int] = dataclasses.field(default_factory=list)
  logprobs: List[float] = dataclasses.field(default_factory=list)
  top: List[Any] = dataclasses.field(default_factory=list)
  finish_reason: Optional[str] = None
  count: int = 0  # tokens generated


class _Timing:
  """A request's clock: time to first token, tokens per second."""

  def __init__(self, metrics: _Metrics):
    self.metrics, self.start = metrics, time.perf_counter()
    self.first: Optional[float] = None
    self.last: Optional[float] = None
    self.tokens = 0

  def tokens_arrived(self, n: int) -> None:
    now = time.perf_counter()
    if self.first is None:
      self.first = now
      self.metrics.ttft.observe(now - self.start)
    elif self.last is not None:
      for _ in range(n):
        self.metrics.itl.observe((now - self.last) / n)
    self.last, self.tokens = now, self.tokens + n
    self.metrics.generated.inc(n)

  def line(self) -> str:
    ttft = "-" if self.first is None else f"{self.first - self.start:.3f}s"
    seconds = time.perf_counter() - self.start
    rate = self.tokens / seconds if seconds > 0 else 0.0
    return f"ttft={ttft} tokens_per_s={rate:.1f} seconds={seconds:.2f}"


def _visible(event: engine_lib.Event, stop_ids: Sequence[int]):
  """The event's tokens that are part of the text (not its end-of-turn id), with theirs."""
  keep = [i for i, t in enumerate(event.tokens) if t not in stop_ids]
  pick = lambda xs: [xs[i] for i in keep if i < len(xs)]
  return pick(list(event.tokens)), pick(list(event.logprobs)), pick(list(event.top_logprobs))


def create_app(served: Served, config: ServerConfig = ServerConfig()) -> Starlette:
  """The server's ASGI application. Its lifespan starts the engine's thread (compiling
  first: `GET /health` answers 503 until then) and stops it at shutdown."""
  server = _Server(served, config)

  def error_response(e: protocol.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

  def log_line(meta_id: str, status: int, prompt_tokens: int, choices: List[_Choice],
               timing: _Timing, note: str = "") -> None:
    server.metrics.requests.labels(str(status)).inc()
    finish = ",".join(c.finish_reason or "-" for c in choices) or "-"
    LOG.info("request %s status=%d prompt_tokens=%d completion_tokens=%d %s finish=%s%s",
             meta_id, status, prompt_tokens, sum(c.count for c in choices), timing.line(),
             finish, f" {note}" if note else "")

  async def answer(request: HTTPRequest, kind: str) -> Response:
    timing = _Timing(server.metrics)
    number = next(server.numbers)
    meta = protocol.Meta.new("chatcmpl" if kind == "chat" else "cmpl", number,
                             served.model_name)
    prompt_tokens = 0
    try:
      server.check_open(request)
      body = await server.read_json(request)
      tok = served.tokenizer
      if kind == "chat":
        parsed = protocol.parse_chat(body, config.limits)
        server.check_model(parsed.model)
        if served.chat_format is None:
          raise protocol.APIError(400, "this model has no chat template; use "
                                       "/v1/completions.", param="messages")
        try:
          prompts = [chat.encode(tok, served.chat_format, parsed.messages,
                                 add_generation_prompt=True)]
        except ValueError as e:  # chat.ChatTemplateError, or a tokenizer's refusal
          raise protocol.APIError(400, f"the chat template refused the messages: {e}",
                                  param="messages") from None
        param = "messages"
      else:
        parsed = protocol.parse_completion(body, config.limits, tok.vocab_size)
        server.check_model(parsed.model)
        prompts = [tokenizers.prompt_ids(tok, p) if isinstance(p, str) else p
                   for p in parsed.prompts]
        if not all(prompts):
          raise protocol.APIError(400, "a prompt encodes to no tokens.", param="prompt")
        param = "prompt"
      prompt_tokens = sum(len(p) for p in prompts) * parsed.sampling.n
      run = server.submit(server.engine_requests(prompts, parsed.sampling, param))
    except protocol.APIError as e:
      log_line(meta.id, e.status, prompt_tokens, [], timing, f'error="{e.message}"')
      return error_response(e)
    server.metrics.prompt.inc(prompt_tokens)
    server.runs[number] = (run, run.ids)
    sampling = parsed.sampling
    choices = [_Choice() for _ in range(run.left)]
    if sampling.stream:
      return StreamingResponse(
          _stream(server, run, number, meta, kind, sampling, choices, prompt_tokens, timing,
                  log_line),
          media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _whole(server, request, run, number, meta, kind, sampling, choices,
                        prompt_tokens, timing, log_line)

  async def chat_completions(request: HTTPRequest) -> Response:
    return await _guarded(answer, request, "chat")

  async def completions(request: HTTPRequest) -> Response:
    return await _guarded(answer, request, "completions")

  async def models(request: HTTPRequest) -> Response:
    try:
      if config.api_key is not None:
        server.check_open(request)
    except protocol.APIError as e:
      if e.status == 401:
        return error_response(e)
    return JSONResponse(protocol.models_list(served.model_name, server.created))

  async def health(request: HTTPRequest) -> Response:
    del request
    if server.failed is not None:
      return JSONResponse({"status": "error", "message": server.failed}, status_code=503)
    if server.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    if not server.ready.is_set():
      return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok", "model": served.model_name, **served.engine.load()})

  async def metrics(request: HTTPRequest) -> Response:
    if config.api_key is not None:
      try:
        server.check_open(request)
      except protocol.APIError as e:
        if e.status == 401:
          return error_response(e)
    return Response(prometheus_client.generate_latest(server.metrics.registry),
                    media_type=prometheus_client.CONTENT_TYPE_LATEST)

  async def page(request: HTTPRequest) -> Response:
    del request
    return HTMLResponse(PAGE.read_text(encoding="utf-8"))

  async def _guarded(handler, request, kind):
    try:
      return await handler(request, kind)
    except Exception as e:  # pylint: disable=broad-except
      LOG.error("request failed: %s: %s", type(e).__name__, e)
      return error_response(protocol.APIError(500, "the server failed on this request.",
                                              kind="server_error"))

  @contextlib.asynccontextmanager
  async def lifespan(app):
    del app
    server.start()
    try:
      yield
    finally:
      server.shutdown()

  routes = [
      Route("/v1/chat/completions", chat_completions, methods=["POST"]),
      Route("/v1/completions", completions, methods=["POST"]),
      Route("/v1/models", models, methods=["GET"]),
      Route("/health", health, methods=["GET"]),
      Route("/metrics", metrics, methods=["GET"]),
      Route("/", page, methods=["GET"]),
  ]
  app = Starlette(routes=routes, lifespan=lifespan,
                  exception_handlers={404: _not_found, 405: _not_allowed})
  app.state.server = server
  return app


async def _not_found(request, exc):
  del exc
  return JSONResponse(protocol.APIError(404, f"no route {request.url.path}.",
                                        code="not_found").body(), status_code=404)


async def _not_allowed(request, exc):
  del exc
  return JSONResponse(protocol.APIError(405, f"{request.method} is not allowed on "
                                             f"{request.url.path}.").body(), status_code=405)


def _events_text(server: _Server, kind: str, sampling: protocol.Sampling, choice: _Choice,
                 event: engine_lib.Event) -> Optional[Dict[str, Any]]:
  """Adds `event` to `choice`; returns the new tokens' log-probabilities in the API's form."""
  tokens, lps, tops = _visible(event, server.served.stop_ids)
  choice.text += event.text
  choice.count += len(event.tokens)
  if not sampling.logprobs:
    return None
  choice.tokens += tokens
  choice.logprobs += lps
  choice.top += tops
  if kind == "chat":
    return protocol.chat_logprobs(tokens, lps, tops, server.text_of)
  return protocol.completion_logprobs(tokens, lps, tops, server.text_of)


async def _next_event(run: _Run):
  slot, event = await run.queue.get()
  if event is None:
    raise RuntimeError("the engine stopped")
  return slot, event


async def _whole(server, request, run, number, meta, kind, sampling, choices, prompt_tokens,
                 timing, log_line) -> Response:
  """A non-streamed answer: waits for every completion, cancelling if the client leaves."""
  status = 200
  try:
    while run.left:
      try:
        slot, event = await asyncio.wait_for(_next_event(run), timeout=1.0)
      except asyncio.TimeoutError:
        if await request.is_disconnected():
          server.cancel(run)
          status = 499
          log_line(meta.id, status, prompt_tokens, choices, timing, "client went away")
          return Response(status_code=499)
        continue
      if event.tokens:
        timing.tokens_arrived(len(event.tokens))
      _events_text(server, kind, sampling, choices[slot], event)
      if event.completion is not None:
        choices[slot].finish_reason = event.finish_reason
        run.left -= 1
  except RuntimeError as e:
    log_line(meta.id, 500, prompt_tokens, choices, timing, f'error="{e}"')
    return JSONResponse(protocol.APIError(500, str(e), kind="server_error").body(), 500)
  finally:
    server.runs.pop(number, None)
  use = protocol.usage(prompt_tokens, sum(c.count for c in choices))
  if kind == "chat":
    body = protocol.chat_response(meta, [
        protocol.chat_choice(i, c.text, c.finish_reason, protocol.chat_logprobs(
            c.tokens, c.logprobs, c.top, server.text_of) if sampling.logprobs else None)
        for i, c in enumerate(choices)], use)
  else:
    body = protocol.completion_response(meta, [
        protocol.completion_choice(i, c.text, c.finish_reason, protocol.completion_logprobs(
            c.tokens, c.logprobs, c.top, server.text_of) if sampling.logprobs else None)
        for i, c in enumerate(choices)], use)
  log_line(meta.id, status, prompt_tokens, choices, timing)
  return JSONResponse(body)


def _sse(data: Any) -> bytes:
  return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode("utf-8")


async def _stream(server, run, number, meta, kind, sampling, choices, prompt_tokens, timing,
                  log_line):
  """A streamed answer as server-sent events, OpenAI's chunks; the request is cancelled
  if the client goes away (the generator is closed)."""
  usage_flag = sampling.include_usage
  note, status = "", 200
  try:
    if kind == "chat":
      for i in range(len(choices)):
        yield _sse(protocol.chat_chunk(meta, i, {"role": "assistant", "content": ""},
                                       with_usage=usage_flag))
    while run.left:
      slot, event = await _next_event(run)
      choice = choices[slot]
      if event.tokens:
        timing.tokens_arrived(len(event.tokens))
      logprobs = _events_text(server, kind, sampling, choice, event)
      done = event.completion is not None
      if done:
        choice.finish_reason = event.finish_reason
        run.left -= 1
      if event.text or logprobs or done:
        if kind == "chat":
          delta = {"content": event.text} if event.text else {}
          yield _sse(protocol.chat_chunk(meta, slot, delta, choice.finish_reason if done else
                                         None, logprobs, with_usage=usage_flag))
        else:
          yield _sse(protocol.completion_chunk(meta, [protocol.completion_choice(
              slot, event.text, choice.finish_reason if done else None, logprobs)],
              with_usage=usage_flag))
    if usage_flag:
      use = protocol.usage(prompt_tokens, sum(c.count for c in choices))
      chunk = (protocol.chat_chunk(meta, usage_=use, with_usage=True) if kind == "chat" else
               protocol.completion_chunk(meta, [], use, with_usage=True))
      yield _sse(chunk)
    yield b"data: [DONE]\n\n"
  except RuntimeError as e:
    status, note = 500, f'error="{e}"'
    yield _sse(protocol.APIError(500, str(e), kind="server_error").body())
  except (asyncio.CancelledError, GeneratorExit):
    status, note = 499, "client went away"
    server.cancel(run)
    raise
  finally:
    server.runs.pop(number, None)
    if run.left and status == 200:
      server.cancel(run)
    log_line(meta.id, status, prompt_tokens, choices, timing, note)

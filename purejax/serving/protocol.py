"""OpenAI's API, the part purejax serves: requests checked field by field, and responses.

    request = protocol.parse_chat(body, limits)       # raises APIError(400, ..., param)
    chunk = protocol.chat_chunk(meta, index=0, delta={"content": "Hi"})

A field the server knows and cannot honour (`tools`, `response_format` other
than text, `logit_bias`, ...) is refused with a 400 naming it; a field it
does not know is ignored, as vLLM ignores them, so clients that send extras
keep working. Every error has OpenAI's shape: `{"error": {"message", "type",
"param", "code"}}`.
"""

import dataclasses
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union


class APIError(Exception):
  """An error the client caused (or a refusal), as an HTTP status and OpenAI's error body."""

  def __init__(self, status: int, message: str, param: Optional[str] = None,
               kind: str = "invalid_request_error", code: Optional[str] = None,
               headers: Optional[Dict[str, str]] = None):
    super().__init__(message)
    self.status, self.message, self.param, self.kind = status, message, param, kind
    self.code, self.headers = code, headers or {}

  def body(self) -> Dict[str, Any]:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may ask for.

  Attributes:
    max_body_bytes: the request body's size.
    max_messages: messages in a chat request.
    max_tokens: new tokens per completion (also the default where the request
      gives none, within the context).
    max_n: completions per request.
    max_temperature: the softmax temperature.
    max_top_k: top-k (0 and -1 mean every token).
    max_stop: stop strings.
    max_stop_bytes: UTF-8 bytes of each stop string.
    max_top_logprobs: most likely tokens reported per step.
    max_prompts: prompts in one completions request.
  """
  max_body_bytes: int = 1 << 20
  max_messages: int = 64
  max_tokens: int = 1024
  max_n: int = 4
  max_temperature: float = 2.0
  max_top_k: int = 1000
  max_stop: int = 4
  max_stop_bytes: int = 32
  max_top_logprobs: int = 20
  max_prompts: int = 8


# Fields of OpenAI's API that change what a completion is and that this server does not do:
# refused unless given at a value that changes nothing.
UNSUPPORTED = {
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
    "parallel_tool_calls": lambda v: True,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "min_tokens": lambda v: v in (None, 0),
}


@dataclasses.dataclass
class Sampling:
  """The settings of a request's completions, checked."""
  max_tokens: Optional[int]
  temperature: float
  top_p: float
  top_k: int
  seed: Optional[int]
  stop: Tuple[str, ...]
  n: int
  stream: bool
  include_usage: bool
  logprobs: bool
  top_logprobs: int


@dataclasses.dataclass
class ChatRequest:
  messages: List[Dict[str, str]]
  sampling: Sampling
  model: Optional[str]


@dataclasses.dataclass
class CompletionRequest:
  prompts: List[Union[str, List[int]]]
  sampling: Sampling
  model: Optional[str]


def _bad(param: str, message: str) -> APIError:
  return APIError(400, message, param)


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: Mapping[str, Any], name: str, default, low: int, high: int) -> Optional[int]:
  value = body.get(name, default)
  if value is None:
    return default
  if not _is_int(value):
    raise _bad(name, f"'{name}' must be an integer, got {type(value).__name__}.")
  if not low <= value <= high:
    raise _bad(name, f"'{name}' must be between {low} and {high}, got {value}.")
  return value


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
  value = body.get(name, default)
  if value is None:
    return default
  if not _is_number(value):
    raise _bad(name, f"'{name}' must be a number, got {type(value).__name__}.")
  if not (low < value if low_open else low <= value) or value > high:
    interval = f"{'(' if low_open else '['}{low}, {high}]"
    raise _bad(name, f"'{name}' must be in {interval}, got {value}.")
  return float(value)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
  value = body.get(name, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise _bad(name, f"'{name}' must be true or false, got {type(value).__name__}.")
  return value


def check_body(body: Any) -> Dict[str, Any]:
  """The request body as a JSON object, and no field the server cannot honour."""
  if not isinstance(body, dict):
    raise APIError(400, f"the request body must be a JSON object, got "
                        f"{type(body).__name__}.")
  for name, harmless in UNSUPPORTED.items():
    if name in body and not harmless(body[name]):
      raise _bad(name, f"'{name}' is not supported by this server; leave it out.")
  model = body.get("model")
  if model is not None and not isinstance(model, str):
    raise _bad("model", "'model' must be a string.")
  return body


def _sampling(body: Mapping[str, Any], limits: Limits, chat: bool) -> Sampling:
  max_tokens = _int(body, "max_tokens", None, 1, limits.max_tokens)
  if chat and body.get("max_completion_tokens") is not None:
    completion_tokens = _int(body, "max_completion_tokens", None, 1, limits.max_tokens)
    max_tokens = completion_tokens if max_tokens is None else min(max_tokens, completion_tokens)
  temperature = _number(body, "temperature", 1.0, 0.0, limits.max_temperature)
  top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
  top_k = _int(body, "top_k", 0, -1, limits.max_top_k)
  seed = _int(body, "seed", None, -(1 << 63), (1 << 64) - 1)
  stop = body.get("stop")
  if stop is None:
    stop = []
  elif isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
    raise _bad("stop", "'stop' must be a string or a list of strings.")
  stop = [s for s in stop if s]
  if len(stop) > limits.max_stop:
    raise _bad("stop", f"'stop' holds {len(stop)} strings; at most {limits.max_stop}.")
  for s in stop:
    if len(s.encode("utf-8")) > limits.max_stop_bytes:
      raise _bad("stop", f"a stop string is {len(s.encode('utf-8'))} bytes; at most "
                         f"{limits.max_stop_bytes}.")
  n = _int(body, "n", 1, 1, limits.max_n)
  stream = _bool(body, "stream", False)
  options = body.get("stream_options")
  include_usage = False
  if options is not None:
    if not isinstance(options, dict):
      raise _bad("stream_options", "'stream_options' must be an object.")
    if not stream:
      raise _bad("stream_options", "'stream_options' is only allowed with 'stream': true.")
    include_usage = _bool(options, "include_usage", False)
  if chat:
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", 0, 0, limits.max_top_logprobs)
    if top_logprobs and not logprobs:
      raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
  else:  # the completions API's logprobs is how many most likely tokens, 0 to 5
    value = _int(body, "logprobs", None, 0, min(5, limits.max_top_logprobs))
    logprobs, top_logprobs = value is not None, value or 0
  return Sampling(max_tokens, temperature, top_p, 0 if top_k in (-1, 0) else top_k, seed,
                  tuple(stop), n, stream, include_usage, logprobs, top_logprobs)


def _text_of(content: Any, where: str) -> str:
  """A message's content as text: a string, or a list of text parts."""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    texts = []
    for part in content:
      if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
          part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise _bad(where, f"{where}: only text parts are supported, got {kind!r}.")
      texts.append(part["text"])
    return "".join(texts)
  raise _bad(where, f"{where} must be a string or a list of text parts.")


def parse_chat(body: Any, limits: Limits) -> ChatRequest:
  """A `POST /v1/chat/completions` body, checked (`APIError` 400 naming the field)."""
  body = check_body(body)
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise _bad("messages", "'messages' must be a non-empty list of messages.")
  if len(messages) > limits.max_messages:
    raise _bad("messages", f"'messages' holds {len(messages)} messages; at most "
                           f"{limits.max_messages}.")
  plain = []
  for i, m in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(m, dict):
      raise _bad(where, f"{where} must be an object with 'role' and 'content'.")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant"):
      raise _bad(f"{where}.role", f"{where}.role must be 'system', 'user' or 'assistant', "
                                  f"got {role!r}.")
    if m.get("tool_calls"):
      raise _bad(f"{where}.tool_calls", "tool calls are not supported by this server.")
    plain.append({"role": "system" if role == "developer" else role,
                  "content": _text_of(m.get("content"), f"{where}.content")})
  return ChatRequest(plain, _sampling(body, limits, chat=True), body.get("model"))


def parse_completion(body: Any, limits: Limits, vocab_size: int) -> CompletionRequest:
  """A `POST /v1/completions` body, checked (`APIError` 400 naming the field)."""
  body = check_body(body)
  prompt = body.get("prompt")
  if isinstance(prompt, str):
    prompts = [prompt]
  elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
    prompts = list(prompt)
  elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
    prompts = [list(prompt)]
  elif isinstance(prompt, list) and prompt and all(
      isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
    prompts = [list(p) for p in prompt]
  else:
    raise _bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids "
                         "or a list of such lists, none empty.")
  if len(prompts) > limits.max_prompts:
    raise _bad("prompt", f"'prompt' holds {len(prompts)} prompts; at most {limits.max_prompts}.")
  for p in prompts:
    if isinstance(p, str) and not p:
      raise _bad("prompt", "a prompt is empty.")
    if isinstance(p, list) and any(not 0 <= t < vocab_size for t in p):
      raise _bad("prompt", f"a prompt holds token ids outside the model's {vocab_size}.")
  return CompletionRequest(prompts, _sampling(body, limits, chat=False), body.get("model"))


# ----------------------------------------------------------------------------
# Responses.


@dataclasses.dataclass(frozen=True)
class Meta:
  """What every response and chunk of one request repeats."""
  id: str
  created: int
  model: str

  @staticmethod
  def new(prefix: str, request_number: int, model: str) -> "Meta":
    return Meta(f"{prefix}-{int(time.time() * 1000):x}{request_number:06x}", int(time.time()),
                model)


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(tokens: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[Sequence[Tuple[int, float]]],
                  text_of: Any) -> Dict[str, List[Dict[str, Any]]]:
  """The chat API's `logprobs` of some tokens (`text_of(id)` -> the token's text)."""
  def entry(token, value):
    text = text_of(token)
    return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
  out = []
  for i, (token, value) in enumerate(zip(tokens, logprobs)):
    item = entry(token, value)
    item["top_logprobs"] = [entry(t, v) for t, v in tops[i]] if i < len(tops) else []
    out.append(item)
  return {"content": out}


def completion_logprobs(tokens: Sequence[int], logprobs: Sequence[float],
                        tops: Sequence[Sequence[Tuple[int, float]]], text_of: Any,
                        offset: int = 0) -> Dict[str, List[Any]]:
  """The completions API's `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""
  texts = [text_of(t) for t in tokens]
  offsets, at = [], offset
  for text in texts:
    offsets.append(at)
    at += len(text)
  return {"tokens": texts, "token_logprobs": list(logprobs),
          "top_logprobs": [{text_of(t): v for t, v in top} for top in tops] if tops else None,
          "text_offset": offsets}


def chat_response(meta: Meta, choices: List[Dict[str, Any]],
                  usage_: Dict[str, int]) -> Dict[str, Any]:
  return {"id": meta.id, "object": "chat.completion", "created": meta.created,
          "model": meta.model, "choices": choices, "usage": usage_,
          "system_fingerprint": None}


def chat_choice(index: int, text: str, finish_reason: str,
                logprobs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
  return {"index": index, "message": {"role": "assistant", "content": text},
          "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(meta: Meta, index: Optional[int] = None, delta: Optional[Dict[str, Any]] = None,
               finish_reason: Optional[str] = None, logprobs: Optional[Dict[str, Any]] = None,
               usage_: Optional[Dict[str, int]] = None, with_usage: bool = False
               ) -> Dict[str, Any]:
  choices = [] if index is None else [{"index": index, "delta": delta or {},
                                       "logprobs": logprobs, "finish_reason": finish_reason}]
  chunk = {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
           "model": meta.model, "choices": choices, "system_fingerprint": None}
  if with_usage:
    chunk["usage"] = usage_
  return chunk


def completion_response(meta: Meta, choices: List[Dict[str, Any]],
                        usage_: Dict[str, int]) -> Dict[str, Any]:
  return {"id": meta.id, "object": "text_completion", "created": meta.created,
          "model": meta.model, "choices": choices, "usage": usage_,
          "system_fingerprint": None}


def completion_choice(index: int, text: str, finish_reason: Optional[str],
                      logprobs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
  return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(meta: Meta, choices: List[Dict[str, Any]],
                     usage_: Optional[Dict[str, int]] = None,
                     with_usage: bool = False) -> Dict[str, Any]:
  chunk = {"id": meta.id, "object": "text_completion", "created": meta.created,
           "model": meta.model, "choices": choices, "system_fingerprint": None}
  if with_usage:
    chunk["usage"] = usage_
  return chunk


def models_list(model: str, created: int) -> Dict[str, Any]:
  return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                      "owned_by": "purejax"}]}

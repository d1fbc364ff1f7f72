"""The generation engine: requests decoded side by side in a fixed set of cache rows,
admitted as they arrive, streamed out as they decode.

    completions = engine.generate(params, prompts, config, key, max_new_tokens=256,
                                  rows=16, stop_ids=[eos])          # [prompt][sample]

    eng = engine.Engine(params, config, engine.EngineConfig(rows=16), decode_text=tok.decode)
    eng.submit(engine.Request(prompt_ids, max_new_tokens=128, temperature=0.7,
                              keys=[jax.random.PRNGKey(seed)]), on_event)
    while eng.step(): pass                                          # or eng.run(stop) in a thread

Every sampler in purejax runs here: `generate` (a batch of prompts, the
end-of-training sample, `python -m purejax.sample`, HumanEval and the
harness's generation), `python -m purejax.chat` (one row whose cache keeps the
conversation) and `python -m purejax.serve` (requests from many clients).

On the device there are three pure programs of a `cache_rows.Rows` state in
and out (`purejax/cache_rows.py`), each of one fixed shape:

* `prefill`: `[prefill_rows, prefill_chunk]` prompt tokens, each call row a
  chunk of some prompt at its own positions, written into that prompt's cache
  row (several chunks of one prompt may share a call); a prompt's last chunk
  draws its completion's first token, which leaves with the prefill;
* `decode_chunk`: up to `chunk_steps` tokens of every row: each row feeds its
  newest token at its own position and draws the next by its own settings
  (`decode.sample_logits`, noise `decode.token_noise`), checking its stop ids
  and strings; it returns early when a row ends and a request is waiting;
* `copy_row`: one row's cache and logits into another, which draws its own
  first token (a prompt's samples share its prefill).

Because each program has one shape and a row's arithmetic never mixes with
another's (`attention.attend_with_cache`), a request's tokens are the same
bits whatever else is in the batch: greedy output equals the prompt decoded
alone, and seeded sampling does not depend on the company. Between programs
the host (`Engine.step`) admits waiting requests into free rows, frees rows
whose requests ended or were cancelled, and hands each request its new
tokens and text (`decode.TextStream`).
"""

import collections
import dataclasses
import functools
import threading
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np

from purejax import cache_rows
from purejax import decode
from purejax import gpt
from purejax import host_memory
from purejax import kv_cache
from purejax.ops import kernels

Params = gpt.Params


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """The engine's shapes, fixed for its life (each program compiles once).

  Attributes:
    rows: completions decoded side by side (the batch of each decoding step).
    length: cache positions per row, prompt and completion together (None: the
      model's context, `block_size`).
    prefill_rows: prompt chunks fed per prefill call.
    prefill_chunk: tokens per chunk.
    short_prefill_chunks: smaller chunks for a prompt's tail: a prompt is fed in
      whole calls' worth of `prefill_chunk` chunks, then what is left (under
      `prefill_rows * prefill_chunk` tokens) in the smallest chunk that holds it
      in `prefill_rows` rows, so its last call pads little (a program for each
      size). How a prompt is cut depends on its length alone, never on what
      else waits, so its bits do not either.
    prefill_calls: prefill calls per round at most while rows are decoding
      (while none is, every waiting prompt is fed before decoding starts). A
      decoding step costs about the same with one row live as with all, so
      prompts fed first keep the steps full; the cap bounds how long a long
      prompt holds up the tokens of the rows already decoding.
    chunk_steps: decoding steps per call at most: the longest a new request waits
      for its prefill, and how often the host sees new tokens.
    stop_strings: stop strings a request may have, at most.
    stop_string_bytes: bytes of the longest stop string.
    top_logprobs: most likely tokens reported per step, at most.
    reuse_prefix: a request continues the free row whose cached tokens share the
      longest prefix with its prompt, and feeds only the rest (a conversation:
      each turn feeds its own tokens). Its tokens are then no longer the bits
      of the prompt fed afresh (other chunks, other rounding).
  """
  rows: int = 16
  length: Optional[int] = None
  prefill_rows: int = 4
  prefill_chunk: int = 64
  short_prefill_chunks: Tuple[int, ...] = ()
  prefill_calls: int = 4
  chunk_steps: int = 16
  stop_strings: int = 8
  stop_string_bytes: int = 32
  top_logprobs: int = 20
  reuse_prefix: bool = False

  def __post_init__(self):
    for name in ("rows", "prefill_rows", "prefill_chunk", "prefill_calls", "chunk_steps",
                 "stop_strings", "stop_string_bytes"):
      if getattr(self, name) < 1:
        raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}.")
    if self.top_logprobs < 0:
      raise ValueError(f"EngineConfig.top_logprobs must be >= 0, got {self.top_logprobs}.")
    if not all(1 <= c < self.prefill_chunk for c in self.short_prefill_chunks):
      raise ValueError(f"EngineConfig.short_prefill_chunks={self.short_prefill_chunks}: each "
                       f"must be 1 to prefill_chunk - 1 ({self.prefill_chunk - 1}).")

  @property
  def prefill_chunks(self) -> Tuple[int, ...]:
    """Every chunk size, smallest first."""
    return tuple(sorted(set(self.short_prefill_chunks) | {self.prefill_chunk}))

  def chunk_at(self, tokens: int, fed: int) -> int:
    """The size of the next chunk of a prompt of `tokens` tokens to feed, `fed` of them
    fed (`short_prefill_chunks`)."""
    tail = tokens % (self.prefill_rows * self.prefill_chunk)  # past whole calls
    if tokens - fed > tail:
      return self.prefill_chunk
    return next(c for c in self.prefill_chunks if tail <= self.prefill_rows * c)

  @property
  def ring_room(self) -> int:
    """Tokens one prefill call may write into a row (`kv_cache.layer_lengths`)."""
    return self.prefill_rows * self.prefill_chunk


# ----------------------------------------------------------------------------
# On the host: requests, and the loop that runs them.


@dataclasses.dataclass
class Request:
  """A prompt to complete, with its settings.

  Attributes:
    prompt: token ids, at least one.
    max_new_tokens: new tokens per completion, at most (>= 1).
    keys: one key per completion (`n = len(keys)` completions of the prompt, which
      is fed once); token `i` of completion `j` is drawn with
      `decode.token_noise(keys[j], i)`.
    temperature, top_k, top_p: token choice (`decode.sample_logits`; 0, 0 and 1:
      greedy, no filters).
    stop_ids: ids that end a completion (the id is its last token).
    stop_strings: strings that end a completion (its text is cut before them).
    logprobs: report each token's log-probability.
    top_logprobs: report this many most likely tokens per step.
    slide: at the cache's end, go on from the last half of the context
      (nanoGPT's sampling past its context); else the completion ends there.
  """
  prompt: Sequence[int]
  max_new_tokens: int
  keys: Sequence[Any] = (None,)
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  stop_ids: Sequence[int] = ()
  stop_strings: Sequence[str] = ()
  logprobs: bool = False
  top_logprobs: int = 0
  slide: bool = False


class Event(NamedTuple):
  """What a request hears about one of its completions.

  Attributes:
    request: the request's id (`Engine.submit`).
    sample: which completion of it.
    tokens: new tokens since the last event.
    text: new text since the last event (with `decode_text`; else "").
    logprobs: the new tokens' log-probabilities (with `Request.logprobs`).
    top_logprobs: per new token, `((id, logprob), ...)` (with `Request.top_logprobs`).
    finish_reason: None while it runs; then "stop", "length", "cancelled" or
      "error".
    completion: when it has finished, the whole `decode.Completion`.
    prompt_fed: prompt tokens fed for it (fewer than the prompt's where a row's
      cache held its start).
  """
  request: int
  sample: int
  tokens: Tuple[int, ...] = ()
  text: str = ""
  logprobs: Tuple[float, ...] = ()
  top_logprobs: Tuple[Tuple[Tuple[int, float], ...], ...] = ()
  finish_reason: Optional[str] = None
  completion: Optional[decode.Completion] = None
  prompt_fed: int = 0


class _Sample:
  """One completion in the engine: where it is and what it has so far."""

  def __init__(self, request_id: int, index: int, request: Request, on_event, stream):
    self.request_id, self.index, self.request = request_id, index, request
    self.on_event, self.stream = on_event, stream
    self.row: Optional[int] = None
    self.tokens: List[int] = []
    self.logprobs: List[float] = []
    self.top: List[Tuple[Tuple[int, float], ...]] = []
    self.feed: List[int] = []  # tokens still to prefill
    self.fed = 0  # of them, fed so far
    self.start = 0  # the position the feed starts at
    self.prompt_fed = 0
    self.live = False  # decoding
    self.finished = False
    self.copy_from: Optional["_Sample"] = None  # shares this sample's prefill


class Engine:
  """Runs requests through one model's rows. Not thread-safe except `submit` and
  `cancel`, which any thread may call while one thread runs `step` (or `run`).

  Args:
    params, config: the model.
    settings: the engine's shapes (`EngineConfig`).
    forms: execution forms; None: those of the platform `params` live on.
    valid_vocab: ids from this one on are never drawn (a padded vocabulary).
    token_texts: each id's text inside a longer text (`tokenizers.token_texts`):
      needed for stop strings to end rows inside the decoding loop.
    decode_text: ids -> text (a tokenizer's `decode`): events then carry text
      (`decode.TextStream`), and stop strings are also found in the text.
  """

  def __init__(self, params: Params, config: gpt.GPTConfig,
               settings: EngineConfig = EngineConfig(), *,
               forms: Optional[kernels.Forms] = None, valid_vocab: Optional[int] = None,
               token_texts: Optional[Sequence[str]] = None,
               decode_text: Optional[Callable[[Sequence[int]], str]] = None):
    length = settings.length or config.block_size
    if not 1 <= length <= config.block_size:
      raise ValueError(f"EngineConfig.length={length}: give 1 to the model's context, "
                       f"block_size={config.block_size}.")
    self.config, self.settings, self.length = config, dataclasses.replace(
        settings, length=length), length
    self.forms = forms or kernels.select(kernels.platform_of(params))
    self.valid_vocab = valid_vocab
    self.decode_text = decode_text
    self.model = kv_cache.prepare(params, config)
    self.table = (None if token_texts is None else
                  decode.stop_bytes(token_texts, config.vocab_size))
    width = (decode.text_width(self.table, settings.stop_string_bytes)
             if self.table is not None else 1)
    n = settings.rows
    self.rows = cache_rows.init_rows(config, n, length, settings.ring_room, width)
    self._settings = dict(
        keys=np.zeros((n, 2), np.uint32), temperature=np.zeros(n, np.float32),
        top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
        limit=np.ones(n, np.int32), stop_ids=np.full((n, 1), -1, np.int32),
        strings=np.full((n, settings.stop_strings, settings.stop_string_bytes), -1, np.int32),
        active=np.zeros(n, bool), logprobs=np.zeros(n, bool), top=np.zeros(n, bool))
    self._held: List[Optional[_Sample]] = [None] * n  # the sample each row holds
    self._cached: List[Tuple[int, ...]] = [()] * n  # the tokens each row's cache holds
    self._waiting: Deque[_Sample] = collections.deque()  # in arrival order
    self._prefilling: List[_Sample] = []  # admitted, their prompt being fed
    self._inbox: Deque[Tuple[str, Any]] = collections.deque()
    self._lock = threading.Condition()
    self._next_id = 0
    self._samples: Dict[int, List[_Sample]] = {}
    self.counters = collections.Counter()  # tokens generated, prefill calls, ...

  def update_params(self, params: Params) -> None:
    """Decodes from now on with `params` (of the same config): a trainer's new weights,
    as reinforcement learning samples with each step's policy. No request may be in the
    engine; what the rows' caches hold came from the old weights, so none is reused.

    Raises:
      ValueError: requests are still waiting or decoding.
    """
    if self.busy():
      raise ValueError("update_params needs an idle engine; let its requests finish (or "
                       "cancel them) first.")
    self.model = kv_cache.prepare(params, self.config)
    self._cached = [()] * self.settings.rows

  # -- what other threads may call --------------------------------------------

  def check(self, request: Request) -> None:
    """Raises a ValueError naming what is wrong with `request` for this engine."""
    prompt, limit = list(request.prompt), request.max_new_tokens
    if not prompt:
      raise ValueError("the prompt is empty; give at least one token.")
    if any(not 0 <= int(i) < self.config.vocab_size for i in prompt):
      raise ValueError(f"the prompt holds ids outside the model's {self.config.vocab_size}.")
    if limit < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {limit}.")
    if not request.slide and len(prompt) + limit > self.length:
      raise ValueError(f"the prompt ({len(prompt)} tokens) and max_new_tokens={limit} "
                       f"exceed the context of {self.length} tokens; lower max_new_tokens "
                       f"or shorten the prompt.")
    if not 1 <= len(request.keys) <= self.settings.rows:
      raise ValueError(f"{len(request.keys)} completions of one prompt; give 1 to "
                       f"{self.settings.rows} (the engine's rows).")
    if request.top_k < 0 or not 0 < request.top_p <= 1 or request.temperature < 0:
      raise ValueError(f"top_k >= 0, top_p in (0, 1] and temperature >= 0, got "
                       f"{request.top_k}, {request.top_p} and {request.temperature}.")
    if not 0 <= request.top_logprobs <= self.settings.top_logprobs:
      raise ValueError(f"top_logprobs={request.top_logprobs}: at most "
                       f"{self.settings.top_logprobs}.")
    if request.stop_strings and self.table is None and self.decode_text is None:
      raise ValueError("stop strings need the tokenizer's token texts (Engine's "
                       "token_texts or decode_text).")
    if request.stop_strings:
      decode.encode_stop_strings(request.stop_strings, self.settings.stop_strings,
                                 self.settings.stop_string_bytes)

  def submit(self, request: Request, on_event: Callable[[Event], None]) -> int:
    """Queues `request` (checked first: `check`); returns its id. `on_event(Event)` is
    called from the thread running the engine as its completions advance."""
    self.check(request)
    with self._lock:
      request_id = self._next_id
      self._next_id += 1
      self._inbox.append(("submit", (request_id, request, on_event)))
      self._lock.notify_all()
    return request_id

  def cancel(self, request_id: int) -> None:
    """Ends a request's completions (finish reason "cancelled"); its rows are free for
    the next request after the current program."""
    with self._lock:
      self._inbox.append(("cancel", request_id))
      self._lock.notify_all()

  def load(self) -> Dict[str, int]:
    """`{"waiting": requests not yet in a row, "rows_in_use": rows prefilling or decoding}`."""
    return {"waiting": len(self._waiting) + len(self._inbox),
            "rows_in_use": sum(s is not None for s in self._held)}

  # -- the loop ---------------------------------------------------------------

  def run(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
    """Steps until `stop` is set, sleeping while there is nothing to do."""
    while not stop.is_set():
      if not self.step():
        with self._lock:
          if not self._inbox:
            self._lock.wait(idle_wait)

  def busy(self) -> bool:
    """Whether any request is waiting, prefilling or decoding."""
    return bool(self._inbox or self._waiting or any(s is not None for s in self._held))

  def step(self) -> bool:
    """One round: takes new requests and cancellations, feeds the waiting prompts (up
    to `prefill_calls` calls while rows decode), decodes one chunk, and tells each
    request what it got. Returns whether work remains."""
    self._read_inbox()
    self._admit()
    calls, cap = 0, self.settings.prefill_calls if self._decoding() else None
    while self._prefilling and (cap is None or calls < cap):
      self._prefill_call()
      calls += 1
    if self._decoding():
      self._decode_call()
    return self.busy()

  def _decoding(self) -> bool:
    return any(s is not None and s.live for s in self._held)

  def warm_up(self) -> None:
    """Compiles the engine's programs (with nothing to feed and every row done)."""
    p, n = self.settings.prefill_rows, self.settings.rows
    settings = self._device_settings()
    for c in self.settings.prefill_chunks:
      self.rows, first = cache_rows.prefill(
          self.model, self.rows, settings, self.table, jnp.zeros((p, c), jnp.int32),
          jnp.full(p, n, jnp.int32), jnp.zeros(p, jnp.int32), jnp.zeros(p, jnp.int32),
          jnp.zeros(p, bool), jnp.zeros(p, jnp.int32), **self._statics())
    self.rows, copied = cache_rows.copy_row(self.rows, settings, self.table, 0, 0,
                                            kv=self.config.kv_heads, **self._draw_statics())
    self.rows = self.rows._replace(done=jnp.ones(n, bool))  # every row done again
    self.rows, out = cache_rows.decode_chunk(self.model, self.rows, settings, self.table,
                                             jnp.int32(0), False, steps=self.settings.chunk_steps,
                                             **self._statics())
    jax.block_until_ready((self.rows, first, copied, out))

  # -- its parts ----------------------------------------------------------------

  def _read_inbox(self) -> None:
    with self._lock:
      inbox, self._inbox = self._inbox, collections.deque()
    for kind, item in inbox:
      if kind == "submit":
        request_id, request, on_event = item
        samples = []
        for j in range(len(request.keys)):
          stream = (decode.TextStream(self.decode_text, request.stop_strings)
                    if self.decode_text is not None else None)
          samples.append(_Sample(request_id, j, request, on_event, stream))
        for s in samples[1:]:
          s.copy_from = samples[0]
        self._samples[request_id] = samples
        self._waiting.extend(samples)
      else:
        for s in self._samples.get(item, []):
          if not s.finished:
            self._finish(s, "cancelled")

  def _admit(self) -> None:
    """Gives waiting samples free rows: a prompt's first sample to be fed, the others
    as copies of it once it is."""
    while self._waiting:
      head = self._waiting[0]
      siblings = [s for s in self._waiting if s.request_id == head.request_id]
      free = [r for r, s in enumerate(self._held) if s is None]
      if len(free) < len(siblings):
        return  # a request's completions start together
      first, *others = siblings
      row = self._pick_row(free, first.request)
      for s in siblings:
        self._waiting.remove(s)
      self._place(first, row)
      for s in others:
        self._place(s, next(r for r in free if self._held[r] is None))
      prompt = tuple(int(i) for i in first.request.prompt)
      if first.request.slide and len(prompt) > self.length:
        prompt = prompt[-self.length:]  # conditioned on the context's last tokens
      reused = self._reusable(row, prompt)
      first.feed, first.start, first.fed = list(prompt[reused:]), reused, 0
      first.prompt_fed = len(prompt) - reused
      self._cached[row] = prompt[:reused]
      self._prefilling.append(first)

  def _pick_row(self, free: List[int], request: Request) -> int:
    if not self.settings.reuse_prefix:
      return free[0]
    prompt = list(request.prompt)
    return max(free, key=lambda r: self._reusable(r, prompt))

  def _reusable(self, row: int, prompt: Sequence[int]) -> int:
    """Prompt tokens row `row`'s cache already holds (with `reuse_prefix`; one is always
    fed, for its logits)."""
    if not self.settings.reuse_prefix:
      return 0
    cached = self._cached[row]
    same = min(decode.common_prefix(cached, prompt), len(prompt) - 1)
    # A ring (a sliding layer's) has room for this many positions past a query's window:
    # rewriting more of what it holds would overwrite keys the new tokens see.
    room = self.settings.prefill_rows * self.settings.prefill_chunk
    if 1 in self.config.layer_kinds and len(cached) - same > room:
      return 0
    return same

  def _place(self, sample: _Sample, row: int) -> None:
    sample.row = row
    self._held[row] = sample
    r, s = sample.request, self._settings
    key = r.keys[sample.index]
    s["keys"][row] = np.asarray(jax.random.PRNGKey(0) if key is None else key, np.uint32)
    s["temperature"][row], s["top_k"][row], s["top_p"][row] = r.temperature, r.top_k, r.top_p
    s["limit"][row] = r.max_new_tokens
    ids = list(r.stop_ids)
    if len(ids) > s["stop_ids"].shape[1]:
      grown = np.full((self.settings.rows, len(ids)), -1, np.int32)
      grown[:, :s["stop_ids"].shape[1]] = s["stop_ids"]
      s["stop_ids"] = grown
    s["stop_ids"][row] = -1
    s["stop_ids"][row, :len(ids)] = ids
    s["strings"][row] = decode.encode_stop_strings(
        r.stop_strings if self.table is not None else (), self.settings.stop_strings,
        self.settings.stop_string_bytes)
    s["top"][row] = r.top_logprobs > 0
    s["logprobs"][row] = r.logprobs or r.top_logprobs > 0
    s["active"][row] = False

  def _prefill_call(self) -> None:
    """Feeds up to `prefill_rows` chunks of the prompts being fed, oldest first (those
    fed in the oldest one's chunk size)."""
    p, n = self.settings.prefill_rows, self.settings.rows
    chunk_of = lambda s: self.settings.chunk_at(len(s.feed), s.fed)
    c = chunk_of(self._prefilling[0])
    tokens = np.zeros((p, c), np.int32)
    row_of, starts = np.full(p, n, np.int32), np.zeros(p, np.int32)
    counts, finishing = np.zeros(p, np.int32), np.zeros(p, bool)
    count_after = np.zeros(p, np.int32)
    call, done = 0, []
    for sample in self._prefilling:
      while call < p and sample.fed < len(sample.feed) and chunk_of(sample) == c:
        ids = sample.feed[sample.fed:sample.fed + c]
        tokens[call, :len(ids)] = ids
        row_of[call], starts[call] = sample.row, sample.start + sample.fed
        counts[call] = len(ids)
        sample.fed += len(ids)
        if sample.fed == len(sample.feed):
          finishing[call], count_after[call] = True, len(sample.tokens)
          done.append(sample)
        call += 1
    self.rows, first = cache_rows.prefill(
        self.model, self.rows, self._device_settings(), self.table, tokens, row_of, starts,
        counts, finishing, count_after, **self._statics())
    self.counters["prefill_calls"] += 1
    self.counters["prompt_tokens"] += int(counts.sum())
    started = []  # (sample, its first token's index in `first`, or None: a copy's)
    for sample in done:
      self._prefilling.remove(sample)
      row = sample.row
      self._cached[row] = self._cached[row] + tuple(sample.feed)
      sample.feed, sample.live = [], True
      self._settings["active"][row] = True
      started.append((sample, int(np.flatnonzero(finishing & (row_of == row))[0])))
    first = jax.device_get(first)
    copies = []
    for sample, _ in list(started):
      for other in self._samples[sample.request_id]:
        if other.copy_from is sample and other.row is not None and not other.finished:
          self.rows, copied = cache_rows.copy_row(
              self.rows, self._device_settings(), self.table, sample.row, other.row,
              kv=self.config.kv_heads, **self._draw_statics())
          self._cached[other.row] = self._cached[sample.row]
          other.live, other.prompt_fed, other.copy_from = True, 0, None
          self._settings["active"][other.row] = True
          copies.append((other, copied))
    state = jax.device_get((self.rows.done, self.rows.stopped, self.rows.count))
    for sample, i in started:
      self._first_token(sample, first, i, state)
    for sample, copied in copies:
      self._first_token(sample, jax.device_get(copied), 0, state)

  def _first_token(self, sample: _Sample, emitted, i: int, state) -> None:
    """Hands a completion its first token, drawn where its prompt was fed; ends it there
    if that token already ends it."""
    token = int(emitted.tokens[i])
    self._cached[sample.row] = self._cached[sample.row] + (token,)
    self.counters["tokens"] += 1
    self._tell(sample, [token], emitted.logprobs[i:i + 1], emitted.top_ids[i:i + 1],
               emitted.top_logprobs[i:i + 1])
    self._ended(sample, state)

  def _ended(self, sample: _Sample, state) -> None:
    """Finishes `sample` (or slides it) if its row is done on the device."""
    done, stopped, count = state
    row = sample.row
    if sample.finished or not done[row]:
      return
    if stopped[row]:
      self._finish(sample, "stop")
    elif count[row] >= sample.request.max_new_tokens or not sample.request.slide:
      self._finish(sample, "length")
    else:
      self._slide(sample)

  def _device_settings(self) -> cache_rows.Settings:
    return cache_rows.Settings(**{k: jnp.asarray(v) for k, v in self._settings.items()})

  def _draw_statics(self) -> Dict[str, Any]:
    return dict(top=self.settings.top_logprobs, valid_vocab=self.valid_vocab)

  def _statics(self) -> Dict[str, Any]:
    return dict(config=self.config, forms=self.forms, **self._draw_statics())

  def _decode_call(self) -> None:
    waiting = bool(self._waiting or self._inbox)
    self.rows, out = cache_rows.decode_chunk(
        self.model, self.rows, self._device_settings(), self.table,
        jnp.int32(self.settings.chunk_steps), waiting, steps=self.settings.chunk_steps,
        **self._statics())
    out, *state = jax.device_get((out, self.rows.done, self.rows.stopped, self.rows.count))
    self.counters["decode_calls"] += 1
    for row, sample in enumerate(self._held):
      if sample is None or not sample.live:
        continue
      ran = out.emitted[:, row]
      new = [int(t) for t in out.tokens[ran, row]]
      self._cached[row] = self._cached[row] + tuple(new)
      self.counters["tokens"] += len(new)
      self._tell(sample, new, out.logprobs[ran, row], out.top_ids[ran, row],
                 out.top_logprobs[ran, row])
      self._ended(sample, state)

  def _tell(self, sample: _Sample, new: List[int], logprobs, top_ids, top_lps) -> None:
    """Hands `sample`'s new tokens (and text) to its request."""
    if not new:
      return
    r = sample.request
    sample.tokens.extend(new)
    lps = tuple(float(x) for x in logprobs) if r.logprobs else ()
    tops = tuple(tuple((int(i), float(v)) for i, v in zip(ids[:r.top_logprobs],
                                                           vals[:r.top_logprobs]))
                 for ids, vals in zip(top_ids, top_lps)) if r.top_logprobs else ()
    sample.logprobs.extend(lps)
    sample.top.extend(tops)
    text = ""
    if sample.stream is not None:
      shown = [t for t in new if t not in r.stop_ids]
      text = sample.stream.push(shown)
    sample.on_event(Event(sample.request_id, sample.index, tuple(new), text, lps, tops))
    if sample.stream is not None and sample.stream.stopped:
      self._finish(sample, "stop")

  def _slide(self, sample: _Sample) -> None:
    """Refeeds the last half of the context into `sample`'s row from position 0, then
    decoding goes on (the sampling of `generate` past the context)."""
    context = list(sample.request.prompt) + sample.tokens
    keep = max(self.length // 2, 1)
    sample.feed, sample.start, sample.fed, sample.live = context[-keep:], 0, 0, False
    self._cached[sample.row] = ()
    self._settings["active"][sample.row] = False
    self._prefilling.append(sample)

  def _finish(self, sample: _Sample, reason: str) -> None:
    was_live = sample.live
    sample.finished, sample.live = True, False
    if sample in self._waiting:
      self._waiting.remove(sample)
    if sample in self._prefilling:
      self._prefilling.remove(sample)
    if sample.row is not None:
      self._settings["active"][sample.row] = False
      self._held[sample.row] = None
      if reason == "cancelled" and sample.feed:  # half fed: what it holds is unknown
        self._cached[sample.row] = ()
      elif was_live and sample.tokens:  # its newest token was drawn, never fed
        self._cached[sample.row] = self._cached[sample.row][:-1]
    text = sample.stream.finish() if sample.stream is not None else ""
    completion = decode.Completion(
        tuple(sample.tokens), reason == "stop",
        tuple(sample.logprobs) if sample.request.logprobs else None,
        tuple(sample.top) if sample.request.top_logprobs else None)
    if all(s.finished for s in self._samples.get(sample.request_id, [])):
      self._samples.pop(sample.request_id, None)
    sample.on_event(Event(sample.request_id, sample.index, (), text, finish_reason=reason,
                          completion=completion, prompt_fed=sample.prompt_fed))


# ----------------------------------------------------------------------------
# A batch of prompts.


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  config: gpt.GPTConfig, caller: str) -> None:
  """Raises a ValueError naming `caller` unless there are prompts, none empty, and the
  longest fits the context with `max_new_tokens`."""
  if not len(prompts) or not all(len(p) for p in prompts):
    raise ValueError(f"{caller} needs at least one prompt, each of at least one token.")
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > config.block_size:
    raise ValueError(f"the longest prompt ({longest} tokens) and max_new_tokens="
                     f"{max_new_tokens} exceed block_size={config.block_size}; lower "
                     f"max_new_tokens or shorten the prompts.")


def cache_length(prompt_lengths: Sequence[int], max_new_tokens: int, chunk: int,
                 config: gpt.GPTConfig) -> int:
  """Cache positions a row of a batch needs: the longest prompt rounded up to whole
  chunks, and `max_new_tokens`, within the model's context."""
  return min(config.block_size, -(-max(prompt_lengths) // chunk) * chunk + max_new_tokens)


def _stop_lists(stop_ids, n_prompts: int) -> List[Tuple[int, ...]]:
  """`stop_ids` (None, one list, or a list per prompt) as a list per prompt."""
  if stop_ids is None or not len(stop_ids):
    return [()] * n_prompts
  if isinstance(stop_ids[0], (int, np.integer)):
    return [tuple(int(i) for i in stop_ids)] * n_prompts
  if len(stop_ids) != n_prompts:
    raise ValueError(f"stop_ids has {len(stop_ids)} lists for {n_prompts} prompts.")
  return [tuple(int(i) for i in s) for s in stop_ids]


def generate(
    params: Params,
    prompts: Union[chex.Array, Sequence[Sequence[int]]],
    config: gpt.GPTConfig,
    key: chex.PRNGKey,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    valid_vocab: Optional[int] = None,
    stop_ids: Union[None, Sequence[int], Sequence[Sequence[int]]] = None,
    stop_strings: Sequence[str] = (),
    token_texts: Optional[Sequence[str]] = None,
    num_samples: int = 1,
    logprobs: bool = False,
    top_logprobs: int = 0,
    slide: bool = False,
    rows: int = 16,
    prefill_rows: int = 4,
    prefill_chunk: int = 64,
    short_prefill_chunks: Optional[Sequence[int]] = None,
    forms: Optional[kernels.Forms] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> List[List[decode.Completion]]:
  """Completes every prompt: `[prompt][sample]` completions.

  `rows` completions decode side by side; a row whose completion ends takes
  the next prompt at once, so the steps run are about the tokens the
  completions need divided by `rows`. A prompt's samples share its prefill.
  Completion `j = prompt * num_samples + sample` draws token `i` with
  `decode.token_noise(decode.completion_key(key, j), i)`: the same tokens
  whatever `rows` is, and greedy completions are each prompt's decoded alone.

  Args:
    params, config: the model.
    prompts: token ids, at least one each (a `[batch, time]` array, or lists).
    key: the sampling key.
    max_new_tokens: new tokens per completion, at most.
    temperature, top_k, top_p, valid_vocab: token choice (`decode.sample_logits`;
      temperature 0: greedy).
    stop_ids: ids that end a completion: one list for all prompts, or a list per
      prompt.
    stop_strings: strings that end a completion inside the decoding loop (its
      tokens run through the one that completes the string; the caller cuts
      the text), with `token_texts` (`tokenizers.token_texts`).
    num_samples: completions per prompt.
    logprobs, top_logprobs: report log-probabilities (`decode.Completion`).
    slide: past the context, go on from its last half (nanoGPT's sampling; a
      longer prompt is cut to the context's last tokens); else prompt and
      `max_new_tokens` must fit it.
    rows, prefill_rows, prefill_chunk, short_prefill_chunks: the engine's shapes
      (`EngineConfig`); short chunks None: 32 and 48, those below `prefill_chunk`.
    forms: execution forms; None: those of the platform `params` live on.
    progress: optional `progress(prompts_done, prompts)`, called as each prompt's
      last completion ends.

  Raises:
    ValueError: no prompts, an empty one, one that does not fit the context
      (without `slide`), stop ids for another number of prompts, stop strings
      without token texts, or `rows`, `num_samples` or `max_new_tokens` below 1.
  """
  prompts = [[int(i) for i in p] for p in (np.asarray(prompts).tolist()
                                           if hasattr(prompts, "shape") else prompts)]
  check_prompts(prompts, 0 if slide else max_new_tokens,
                dataclasses.replace(config, block_size=1 << 30) if slide else config, "generate")
  if min(rows, num_samples, max_new_tokens) < 1:
    raise ValueError(f"generate needs rows, num_samples and max_new_tokens >= 1, got "
                     f"{rows}, {num_samples} and {max_new_tokens}.")
  if stop_strings and token_texts is None:
    raise ValueError("stop_strings need token_texts (tokenizers.token_texts(tokenizer)).")
  per_prompt = _stop_lists(stop_ids, len(prompts))
  rows = max(min(rows, len(prompts) * num_samples), num_samples)
  length = (config.block_size if slide else
            cache_length([len(p) for p in prompts], max_new_tokens, prefill_chunk, config))
  settings = EngineConfig(rows=rows, length=length, prefill_rows=prefill_rows,
                          prefill_chunk=prefill_chunk,
                          short_prefill_chunks=tuple(
                              short_prefill_chunks if short_prefill_chunks is not None
                              else (c for c in (32, 48) if c < prefill_chunk)),
                          stop_strings=max(1, len(stop_strings)),
                          stop_string_bytes=max([1] + [len(s.encode()) for s in stop_strings]),
                          top_logprobs=top_logprobs)
  eng = Engine(params, config, settings, forms=forms, valid_vocab=valid_vocab,
               token_texts=token_texts if stop_strings else None)
  results: Dict[Tuple[int, int], decode.Completion] = {}
  finished = collections.Counter()

  def on_event(event: Event, prompt: int) -> None:
    if event.completion is None:
      return
    results[prompt, event.sample] = event.completion
    finished[prompt] += 1
    if progress is not None and finished[prompt] == num_samples:
      progress(sum(n == num_samples for n in finished.values()), len(prompts))

  # Longest prompts first: rows decoded together are of like lengths, so a step reads
  # little more of the cache than its rows need.
  for p in sorted(range(len(prompts)), key=lambda p: -len(prompts[p])):
    keys = [decode.completion_key(key, p * num_samples + s) for s in range(num_samples)]
    eng.submit(Request(prompts[p], max_new_tokens, keys, max(temperature, 0.0), top_k or 0,
                       1.0 if top_p is None else top_p, per_prompt[p], tuple(stop_strings),
                       logprobs, top_logprobs, slide),
               functools.partial(on_event, prompt=p))
  while eng.step():
    pass
  host_memory.release_freed()  # what the programs' compiles freed (glibc keeps it)
  return [[results[p, s] for s in range(num_samples)] for p in range(len(prompts))]


def sample_text(params: Params, tokenizer, config: gpt.GPTConfig, key: chex.PRNGKey,
                num_tokens: int, prompt: Union[str, Sequence[int]] = "\n", *,
                stop_ids: Optional[Sequence[int]] = None,
                forms: Optional[kernels.Forms] = None) -> str:
  """`num_tokens` sampled after `prompt` (temperature 0.8, top-k 200), decoded to text.

  Args:
    params, config: the model.
    tokenizer: anything with `encode(str) -> ids`, `decode(ids) -> str` and
      `vocab_size` (ids past it, a padded vocabulary's rows, are never sampled).
    key: the sampling key.
    num_tokens: tokens to sample, at most (past the context, it slides).
    prompt: the text to continue, or its ids (a chat template's, whose
      special tokens a plain `encode` would spell out).
    stop_ids: ids that end the sample early (kept in it), e.g. an end of turn.
    forms: as in `generate`.

  Returns the prompt and its continuation, as text.
  """
  ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
  (completion,), = generate(params, [ids], config, key, num_tokens, temperature=0.8,
                            top_k=200, valid_vocab=tokenizer.vocab_size, stop_ids=stop_ids,
                            slide=True, rows=1, prefill_rows=1, forms=forms)
  return tokenizer.decode(list(ids) + list(completion.tokens))

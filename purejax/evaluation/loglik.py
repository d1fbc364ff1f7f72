"""Log-likelihoods of continuations, many requests per compiled call.

    requests = [loglik.Request(context_ids, continuation_ids), ...]
    scored = loglik.score(params, config, requests, batch_size=8)
    scored[0].logprob, scored[0].greedy   # sum of log p(continuation | context); argmax all along?

Requests are sorted by length (longest first, as lm-evaluation-harness
does), cut into batches, right-padded to a length bucket and run through
`gpt.forward`: padding follows every real token, so the causal mask alone
keeps it out of every real position's attention, and positions start at 0
in every row as when the text is scored alone. Buckets (multiples of 64 up
to the context) bound the number of compiled shapes.
"""

import functools
from typing import Callable, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from purejax import gpt
from purejax.ops import kernels
from purejax.ops import loss

BUCKET = 64


class Request(NamedTuple):
  """A continuation to score after its context (token ids)."""
  context: Sequence[int]
  continuation: Sequence[int]


class Scored(NamedTuple):
  """What the model makes of a request.

  Attributes:
    logprob: sum over the continuation's tokens of log p(token | all before).
    greedy: whether every continuation token is the model's argmax there.
    tokens: the continuation's length in tokens.
  """
  logprob: float
  greedy: bool
  tokens: int


@functools.partial(jax.jit, static_argnames=("config", "forms"))
def _token_logprobs(params, ids, targets, config: gpt.GPTConfig, forms: kernels.Forms):
  """`[batch, time]` log p(target) and whether each target is the argmax."""
  logits = gpt.forward(params, ids, config, forms=forms)
  return loss.target_log_probs(logits, targets), jnp.argmax(logits, axis=-1) == targets


def _window(request: Request, block_size: int) -> List[int]:
  """Context then continuation, cut from the left to `block_size + 1` tokens."""
  if not request.continuation:
    raise ValueError("a request has an empty continuation; there is nothing to score.")
  if len(request.continuation) > block_size:
    raise ValueError(f"a continuation of {len(request.continuation)} tokens is longer than "
                     f"the model's context of {block_size}; shorten it.")
  if not request.context:
    raise ValueError("a request has an empty context; begin it with at least one token "
                     "(e.g. the tokenizer's BOS or end-of-text).")
  return list(request.context)[-(block_size + 1 - len(request.continuation)):] + list(
      request.continuation)


def score(params, config: gpt.GPTConfig, requests: Sequence[Request], *, batch_size: int = 8,
          forms: Optional[kernels.Forms] = None,
          progress: Optional[Callable[[int], None]] = None) -> List[Scored]:
  """Scores every request; returns them in the order given.

  Args:
    params, config: the model.
    requests: contexts and continuations, as token ids. A context longer
      than the model's `block_size` loses its oldest tokens.
    batch_size: requests per compiled call.
    forms: execution forms; None: those of the platform `params` live on.
    progress: called with the number of requests done after each batch.

  Raises:
    ValueError: an empty context or continuation, or a continuation longer
      than the context window; a non-positive `batch_size`.
  """
  if batch_size < 1:
    raise ValueError(f"`batch_size={batch_size}` must be a positive integer.")
  forms = forms or kernels.select(kernels.platform_of(params))
  windows = [_window(r, config.block_size) for r in requests]
  order = sorted(range(len(windows)), key=lambda i: -len(windows[i]))
  out: List[Optional[Scored]] = [None] * len(windows)
  for start in range(0, len(order), batch_size):
    batch = order[start:start + batch_size]
    longest = len(windows[batch[0]]) - 1
    length = min(config.block_size, -(-longest // BUCKET) * BUCKET)
    ids = np.zeros((batch_size, length), np.int32)  # rows past the batch stay padding
    targets = np.zeros((batch_size, length), np.int32)
    for row, i in enumerate(batch):
      w = windows[i]
      ids[row, :len(w) - 1], targets[row, :len(w) - 1] = w[:-1], w[1:]
    logprobs, greedy = jax.device_get(_token_logprobs(params, jnp.asarray(ids),
                                                      jnp.asarray(targets), config, forms))
    for row, i in enumerate(batch):
      n, end = len(requests[i].continuation), len(windows[i]) - 1
      out[i] = Scored(float(np.sum(logprobs[row, end - n:end], dtype=np.float64)),
                      bool(np.all(greedy[row, end - n:end])), n)
    if progress is not None:
      progress(min(start + batch_size, len(order)))
  return out

"""Language-model batches: drawn on the device, or read by the host one call ahead.

    x, y = sample_batch(key, ids, block_size, batch_size)          # inside a jit
    windows = sample_windows(memmap, block_size, batch_size, seed, step)  # numpy

Corpora that fit on the device (`corpus.fits_on_device`) stay there and
every step draws its batch inside the jitted step, with no host round-trip.
Larger ones are memory-mapped: the host reads each call's windows in a
background thread while the device runs the previous call (`BatchPrefetcher`,
`host_feed`). Both are functions of `(seed or key, step)`, so a resumed run
draws what the first run drew.

What a step is given says which of the two it is: `DeviceTokens` (the ids,
from which the step draws), `HostWindows` (the windows themselves) or
`DeviceRows` (whole rows with a weight per target) or `DevicePairs` (preference
pairs: two rows with weights, and the reference's log-probabilities). Each kind draws its own
batches: a jitted step asks it what its scan slices per step (`per_step`) and
for each step's batch (`draw`), and never which kind it has.
"""

import queue
import threading
from typing import Callable, Dict, NamedTuple, Optional, Tuple, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np


Batch = Tuple[chex.Array, ...]  # (inputs, targets) or (inputs, targets, weights)


class DeviceTokens(NamedTuple):
  """A token stream on the device, from which each step draws its own windows.

  Attributes:
    ids: `[num_tokens]` int32 ids, `num_tokens > block_size`.
  """
  ids: chex.Array

  on_device = True  # every run of a sweep can draw its own batches from it

  def per_step(self, num_steps: int, block_size: int, batch_size: int) -> None:
    """What a scan over `num_steps` steps slices for each step: nothing (each draws)."""
    del num_steps, block_size, batch_size
    return None

  def draw(self, key: chex.PRNGKey, sliced: None, block_size: int, batch_size: int) -> Batch:
    """One step's `(inputs, targets)`, `[batch_size, block_size]` each (`sample_batch`)."""
    del sliced
    return sample_batch(key, self.ids, block_size, batch_size)


class HostWindows(NamedTuple):
  """Windows the host read, one batch per step (`sample_windows`, stacked).

  Attributes:
    windows: `[num_batches, batch_size, block_size + 1]` ids; a window's
      first `block_size` tokens are the inputs, its last `block_size` the
      targets.
  """
  windows: chex.Array

  on_device = False  # read for one run by the host

  def per_step(self, num_steps: int, block_size: int, batch_size: int) -> chex.Array:
    """What a scan over `num_steps` steps slices for each step: its windows."""
    chex.assert_shape(self.windows, (num_steps, batch_size, block_size + 1))
    return self.windows

  def draw(self, key: chex.PRNGKey, sliced: chex.Array, block_size: int, batch_size: int
           ) -> Batch:
    """One step's `(inputs, targets)`, cut from its windows `sliced` `[batch, block + 1]`."""
    del key, block_size, batch_size
    return sliced[:, :-1].astype(jnp.int32), sliced[:, 1:].astype(jnp.int32)


class DeviceRows(NamedTuple):
  """Fixed rows on the device, one example each, with a weight per target.

  The form of conversations (`purejax.data.conversations`): each row is one
  conversation, padded; a step draws whole rows (`sample_rows`), never a
  window across two, and only the weighted targets (the assistant's
  tokens) count in the loss.

  Attributes:
    rows: `[num_rows, block_size + 1]` int32 ids; a row's first
      `block_size` are the inputs, its last `block_size` the targets.
    weights: `[num_rows, block_size]` float32, each target's weight (0 or 1:
      whether the loss counts it).
  """
  rows: chex.Array
  weights: chex.Array

  on_device = True

  def per_step(self, num_steps: int, block_size: int, batch_size: int) -> None:
    """What a scan over `num_steps` steps slices for each step: nothing (each draws)."""
    del num_steps, batch_size
    chex.assert_shape(self.rows, (None, block_size + 1))
    chex.assert_shape(self.weights, (self.rows.shape[0], block_size))
    return None

  def draw(self, key: chex.PRNGKey, sliced: None, block_size: int, batch_size: int) -> Batch:
    """One step's `(inputs, targets, weights)` (`sample_rows`), the weights of mean 1
    over the batch (`normalized_weights`)."""
    del sliced, block_size
    x, y, weights = sample_rows(key, self, batch_size)
    return x, y, normalized_weights(weights)


class PairBatch(NamedTuple):
  """One step's preference pairs (`DevicePairs.draw`), each pair's two answers side by side.

  Attributes:
    tokens: `[pairs, 2, block_size + 1]` ids, the chosen answer's row then the rejected's.
    weights: `[pairs, 2, block_size]`, 1 on the answer's targets, 0 on the prompt and
      padding.
    reference: `[pairs, 2]` float32, the reference model's summed log-probability of
      each answer (the weighted targets').
  """
  tokens: chex.Array
  weights: chex.Array
  reference: chex.Array


class DevicePairs(NamedTuple):
  """Preference pairs on the device, from which each step draws whole pairs.

  The form of preference data (`purejax.data.preferences`): each pair is its prompt
  with the chosen answer and with the rejected one, padded as conversations are
  (`DeviceRows`), with the reference model's log-probability of each answer computed
  once before training (`preference.reference_logps`), so no reference model is held.

  Attributes:
    rows: `[num_pairs, 2, block_size + 1]` int32 ids.
    weights: `[num_pairs, 2, block_size]` float32.
    reference: `[num_pairs, 2]` float32.
  """
  rows: chex.Array
  weights: chex.Array
  reference: chex.Array

  on_device = True

  def per_step(self, num_steps: int, block_size: int, batch_size: int) -> None:
    """What a scan over `num_steps` steps slices for each step: nothing (each draws)."""
    del num_steps, batch_size
    chex.assert_shape(self.rows, (None, 2, block_size + 1))
    chex.assert_shape(self.weights, (self.rows.shape[0], 2, block_size))
    chex.assert_shape(self.reference, (self.rows.shape[0], 2))
    return None

  def draw(self, key: chex.PRNGKey, sliced: None, block_size: int, batch_size: int
           ) -> PairBatch:
    """`batch_size` random pairs (with replacement, as `sample_rows`)."""
    del sliced, block_size
    picked = jax.random.randint(key, (batch_size,), 0, self.rows.shape[0])
    return PairBatch(self.rows[picked], self.weights[picked], self.reference[picked])


Tokens = Union[DeviceTokens, HostWindows, DeviceRows, DevicePairs]


def sample_batch(
    key: chex.PRNGKey, data: chex.Array, block_size: int, batch_size: int
) -> Tuple[chex.Array, chex.Array]:
  """Random windows of a token stream, drawn on the device.

  Args:
    key: PRNG key.
    data: `[num_tokens]` int ids, with `num_tokens > block_size`.
    block_size: window length.
    batch_size: windows per batch.

  Returns:
    `(inputs, targets)`, each `[batch_size, block_size]`; targets are the
    inputs shifted one token ahead.
  """
  starts = jax.random.randint(key, (batch_size,), 0, data.shape[0] - block_size)
  take = jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(data, s, block_size + 1))
  windows = take(starts)  # [batch, block + 1]
  return windows[:, :-1], windows[:, 1:]


def sample_rows(key: chex.PRNGKey, data: DeviceRows, batch_size: int
                ) -> Tuple[chex.Array, chex.Array, chex.Array]:
  """Random rows of `data`, drawn on the device (with replacement, like `sample_batch`).

  Returns:
    `(inputs, targets, weights)`, each `[batch_size, block_size]`; the
    weights as stored (`normalized_weights` turns them into a mean).
  """
  picked = jax.random.randint(key, (batch_size,), 0, data.rows.shape[0])
  rows = data.rows[picked]
  return rows[:, :-1], rows[:, 1:], data.weights[picked]


def normalized_weights(weights: chex.Array) -> chex.Array:
  """`weights` scaled to mean 1 over the whole batch (all zero: left zero).

  `gpt.loss` averages `weights * losses` over every position, so with these
  it is the mean over the weighted targets, and any cut of the batch into
  equal parts (microbatches, devices) averages back to that same mean.
  """
  weights = weights.astype(jnp.float32)
  return weights * (weights.size / jnp.maximum(jnp.sum(weights), 1.0))


def sample_windows(tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
                   step: int) -> np.ndarray:
  """Random windows of a token stream, a function of `(seed, step)` only.

  Resuming at step `s` draws what the first run drew at `s`. Only the
  windows are read from a memmap.

  Args:
    tokens: `[num_tokens]` ids (array or memmap), `num_tokens > block_size`.
    block_size: model context; each window has one token more.
    batch_size: windows per batch.
    seed: the stream's seed (use different seeds for train and val).
    step: the training step.

  Returns:
    `[batch_size, block_size + 1]` int32; inputs are `[:, :-1]`, targets `[:, 1:]`.
  """
  if len(tokens) <= block_size:
    raise ValueError(f"block_size {block_size} needs more than {len(tokens)} tokens; "
                     f"lower `block_size`.")
  rng = np.random.default_rng((seed, step))
  starts = rng.integers(0, len(tokens) - block_size, size=batch_size)
  return np.asarray(tokens[starts[:, None] + np.arange(block_size + 1)], dtype=np.int32)


class BatchPrefetcher:
  """Prepares the next call's windows in a background thread.

  Each item is `(first_step, windows)`: `windows` is
  `[n, batch_size, block_size + 1]` int32, stacking
  `sample_windows(tokens, block_size, batch_size, seed, s)` for the steps
  `s` of one device call, in order from `start_step`; so a run resumed at
  `start_step` sees the batches of the first. At most two items wait in the
  queue (the host reads ahead while the device computes). Use as an
  iterator; `close()` (or a `with` block) stops the thread.

  Args:
    tokens: `[num_tokens]` ids, e.g. `Corpus.train` (a memmap).
    block_size: model context.
    batch_size: windows per step.
    seed: the stream's seed.
    start_step: the first step drawn.
    steps_per_call: steps per item: a number, or a function of the item's
      first step (the training loop's calls stop at log and eval steps).
    end_step: no item goes past this step (None: endless).
  """

  def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
               start_step: int, steps_per_call: Union[int, Callable[[int], int]] = 1,
               end_step: Optional[int] = None):
    self._args = (tokens, block_size, batch_size, seed)
    self._queue = queue.Queue(maxsize=2)
    self._stop = threading.Event()
    length = steps_per_call if callable(steps_per_call) else lambda _: steps_per_call
    self._thread = threading.Thread(target=self._fill, args=(start_step, length, end_step),
                                    daemon=True)
    self._thread.start()

  def _put(self, item) -> bool:
    """Waits for room in the queue, or for `close()`; False when closed."""
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        pass
    return False

  def _fill(self, step: int, length: Callable[[int], int], end: Optional[int]) -> None:
    try:
      while end is None or step < end:
        n = length(step) if end is None else min(length(step), end - step)
        if not self._put((step, np.stack([sample_windows(*self._args, s)
                                          for s in range(step, step + n)]))):
          return
        step += n
      self._put(StopIteration())
    except Exception as e:  # pylint: disable=broad-except  # re-raised by __next__
      self._put(e)

  def __iter__(self) -> "BatchPrefetcher":
    return self

  def __next__(self) -> Tuple[int, np.ndarray]:
    if self._stop.is_set():
      raise StopIteration
    item = self._queue.get()
    if isinstance(item, BaseException):
      self.close()
      raise item
    return item

  def close(self) -> None:
    self._stop.set()
    self._thread.join()

  def __enter__(self) -> "BatchPrefetcher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# ----------------------------------------------------------------------------
# What the training loop feeds its steps


class Feed(NamedTuple):
  """Where the training loop's steps and evaluations get their batches.

  Attributes:
    train: `train(step, num_steps)` -> the `tokens` argument of
      `steps.train_steps` for those steps.
    eval: `{"train_loss": tokens, "val_loss": tokens}`: the `tokens`
      argument of `steps.evaluate` for each split.
    on_device: whether batches are drawn on the device.
    close: stops any background reading.
  """
  train: Callable[[int, int], Tokens]
  eval: Dict[str, Tokens]
  on_device: bool
  close: Callable[[], None]


def device_feed(train_ids: np.ndarray, val_ids: np.ndarray, put: Callable) -> Feed:
  """Both splits on every device (`put`), where each step draws its own batch."""
  train_ids, val_ids = put((np.asarray(train_ids, np.int32), np.asarray(val_ids, np.int32)))
  train, val = DeviceTokens(train_ids), DeviceTokens(val_ids)
  return Feed(lambda step, num_steps: train, {"train_loss": train, "val_loss": val}, True,
              lambda: None)


def pairs_feed(train: DevicePairs, val: DevicePairs, put: Callable) -> Feed:
  """Preference pairs (`DevicePairs`) of both splits on every device."""
  train, val = (DevicePairs(*put(tuple(pairs))) for pairs in (train, val))
  return Feed(lambda step, num_steps: train, {"train_loss": train, "val_loss": val}, True,
              lambda: None)


def rows_feed(train: Tuple[np.ndarray, np.ndarray], val: Tuple[np.ndarray, np.ndarray],
              put: Callable) -> Feed:
  """Fixed rows with target weights (`DeviceRows`) of both splits on every device."""
  train, val = (DeviceRows(*put((np.asarray(rows, np.int32), np.asarray(w, np.float32))))
                for rows, w in (train, val))
  return Feed(lambda step, num_steps: train, {"train_loss": train, "val_loss": val}, True,
              lambda: None)


class _ReadAhead:
  """The training windows of a host feed, handed out in the order they were read."""

  def __init__(self, prefetcher: BatchPrefetcher, put: Callable):
    self._prefetcher, self._put = prefetcher, put

  def __call__(self, step: int, num_steps: int) -> HostWindows:
    """The windows of steps `step .. step + num_steps - 1`.

    Raises:
      ValueError: the loop asked for other steps than the next ones read
        (the feed's `steps_per_call` must give the loop's call lengths).
    """
    first, windows = next(self._prefetcher)
    if (first, len(windows)) != (step, num_steps):
      raise ValueError(
          f"the host read steps {first}..{first + len(windows) - 1} ahead, but the loop "
          f"asked for {step}..{step + num_steps - 1}; pass host_feed the loop's own "
          f"steps_per_call.")
    return HostWindows(self._put(windows))


def train_windows_seed(seed: int) -> int:
  """The host's seed of a run's training windows (`sample_windows(..., this, step)`).

  A run's seed gives two disjoint host streams, training (even) and evaluation
  (odd), so neither repeats the other's windows.
  """
  return 2 * seed


def eval_windows_seed(seed: int) -> int:
  """The host's seed of a run's fixed evaluation windows (`train_windows_seed` + 1)."""
  return 2 * seed + 1


def host_feed(train_ids: np.ndarray, val_ids: np.ndarray, put: Callable, *, block_size: int,
              batch_size: int, eval_batches: int, seed: int, start_step: int,
              end_step: int, steps_per_call: Callable[[int], int]) -> Feed:
  """Windows read by the host from the (memory-mapped) splits, one call ahead.

  Training windows follow `(train_windows_seed(seed), step)`; the evaluation's
  are fixed, `eval_batches` of them per split from `(eval_windows_seed(seed), i)`,
  read once.
  `steps_per_call(step)` is the length of the loop's call starting at `step`;
  the loop must ask for exactly those calls, in order.
  """
  ahead = BatchPrefetcher(train_ids, block_size, batch_size, train_windows_seed(seed), start_step,
                          steps_per_call, end_step)
  evals = {name: HostWindows(put(np.stack([
      sample_windows(ids, block_size, batch_size, eval_windows_seed(seed), i)
      for i in range(eval_batches)])))
           for name, ids in (("train_loss", train_ids), ("val_loss", val_ids))}
  return Feed(_ReadAhead(ahead, put), evals, False, ahead.close)

"""batches: windows on the device and on the host, and the host's read-ahead."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax.data import batches


def test_sample_batch_targets_are_shifted_inputs():
  data = jnp.arange(100, dtype=jnp.int32)
  x, y = batches.sample_batch(jax.random.PRNGKey(0), data, 8, 5)
  chex.assert_shape((x, y), (5, 8))
  chex.assert_trees_all_equal(y, x + 1)
  chex.assert_trees_all_equal(x[:, 1:], x[:, :-1] + 1)  # contiguous windows


def test_sample_windows_deterministic_in_range_and_shifted(tmp_path):
  path = tmp_path / "ids.bin"
  np.arange(1000, dtype=np.uint16).tofile(path)
  tokens = np.memmap(path, dtype=np.uint16, mode="r")
  a = batches.sample_windows(tokens, 16, 8, seed=3, step=5)
  assert a.shape == (8, 17) and a.dtype == np.int32
  np.testing.assert_array_equal(a, batches.sample_windows(tokens, 16, 8, seed=3, step=5))
  assert not np.array_equal(a, batches.sample_windows(tokens, 16, 8, seed=3, step=6))
  assert not np.array_equal(a, batches.sample_windows(tokens, 16, 8, seed=4, step=5))
  assert a.min() >= 0 and a.max() <= 999
  inputs, targets = a[:, :-1], a[:, 1:]
  np.testing.assert_array_equal(targets, inputs + 1)  # consecutive ids: a window of the stream
  ends = batches.sample_windows(np.arange(17), 16, 4, seed=0, step=0)
  np.testing.assert_array_equal(ends, np.tile(np.arange(17), (4, 1)))  # the only window
  with pytest.raises(ValueError, match="block_size 16 needs more than 16 tokens"):
    batches.sample_windows(np.arange(16), 16, 4, seed=0, step=0)


def test_prefetcher_yields_what_direct_calls_give():
  tokens = np.arange(500, dtype=np.uint16)
  with batches.BatchPrefetcher(tokens, 8, 4, seed=7, start_step=10,
                               steps_per_call=3) as prefetcher:
    items = [next(prefetcher) for _ in range(4)]
  for i, (first, item) in enumerate(items):
    assert first == 10 + 3 * i and item.shape == (3, 4, 9)
    for k in range(3):
      np.testing.assert_array_equal(item[k],
                                    batches.sample_windows(tokens, 8, 4, 7, 10 + 3 * i + k))
  assert not prefetcher._thread.is_alive()  # pylint: disable=protected-access


def test_prefetcher_follows_the_loops_calls_and_stops_at_the_end():
  # The loop's calls stop at log and eval steps: lengths vary with the step.
  tokens = np.arange(500, dtype=np.uint16)
  length = lambda step: 5 - step % 5  # 10 -> 5 steps, 15 -> 5, ...; 12 -> 3
  with batches.BatchPrefetcher(tokens, 8, 4, seed=7, start_step=12, steps_per_call=length,
                               end_step=24) as prefetcher:
    items = list(prefetcher)
  assert [(first, len(item)) for first, item in items] == [(12, 3), (15, 5), (20, 4)]
  np.testing.assert_array_equal(items[1][1][0], batches.sample_windows(tokens, 8, 4, 7, 15))


def test_prefetcher_raises_the_samplers_error_and_closes_unread():
  with pytest.raises(ValueError, match="block_size 8 needs more than 5 tokens"):
    next(batches.BatchPrefetcher(np.arange(5), 8, 2, seed=0, start_step=0))
  unread = batches.BatchPrefetcher(np.arange(100), 8, 2, seed=0, start_step=0)
  unread.close()  # returns although the queue is full and nothing was read


def test_host_feed_hands_out_the_calls_it_read_and_refuses_others():
  tokens = np.arange(500, dtype=np.uint16)
  feed = batches.host_feed(tokens, tokens, lambda x: x, block_size=8, batch_size=4,
                           eval_batches=2, seed=1, start_step=0, end_step=10,
                           steps_per_call=lambda step: 5)
  try:
    first = feed.train(0, 5)
    assert isinstance(first, batches.HostWindows) and first.windows.shape == (5, 4, 9)
    assert feed.eval["val_loss"].windows.shape == (2, 4, 9)
    with pytest.raises(ValueError, match="read steps 5..9 ahead, but the loop asked for 5..7"):
      feed.train(5, 3)
  finally:
    feed.close()

"""bench/gpu.py's pieces that decide what runs; the GPU itself is not needed."""

import pathlib

from absl import app
import numpy as np
import pytest

from bench import gpu

CANDIDATES = [12, 16, 24, 32, 48, 64, 96, 128, 192]


def run_search(fits_up_to, start):
  tried = []

  def attempt(batch):
    tried.append(batch)
    return batch <= fits_up_to

  gpu.search_largest(CANDIDATES, attempt, lambda first, rest: start, lambda: False)
  return tried


@pytest.mark.parametrize("start,expected", [
    (3, [12, 16, 64, 96, 128]),   # predicted 64: fits, so up until one fails
    (6, [12, 16, 192, 128, 96]),  # predicted 192: too big, so down until one fits
    (None, [12, 16, 24, 32, 48, 64, 96, 128]),  # no prediction: one by one
])
def test_search_finds_the_largest_fitting_batch(start, expected):
  tried = run_search(fits_up_to=100, start=start)
  assert tried == expected
  assert max(b for b in tried if b <= 100) == 96


def test_search_stops_when_the_first_batch_fails_or_the_budget_is_spent():
  assert run_search(fits_up_to=8, start=3) == [12]
  tried = []
  gpu.search_largest(CANDIDATES, lambda b: tried.append(b) or True, lambda f, r: 0,
                     lambda: True)
  assert tried == [12, 16]


def test_predicted_start_from_two_peaks():
  gib = 2**30
  # 1 GiB fixed + 0.5 GiB per sequence, 80 GiB limit: 0.9 * 80 GiB fits 142.
  records = [{"peak_bytes": gib + 12 * gib // 2}, {"peak_bytes": gib + 16 * gib // 2,
                                                   "limit_bytes": 80 * gib}]
  rest = CANDIDATES[2:]
  assert rest[gpu.predicted_start(records, [12, 16], rest)] == 128
  assert gpu.predicted_start([{}, {}], [12, 16], rest) is None  # no memory stats (CPU)


def test_select_jobs():
  assert gpu.select_jobs(["j"]) == ["j.sample"]
  assert gpu.select_jobs(["h.max_batch", "h.train"]) == [
      "h.train", "h.max_batch.purejax", "h.max_batch.torch", "h.max_batch.purejax_unrolled"]
  assert len(gpu.select_jobs(["h", "i", "j"])) == len(gpu.JOBS)
  assert gpu.select_jobs(["h.feed"]) == ["h.feed"]
  assert gpu.select_jobs(["h"])[:2] == ["h.train", "h.feed"]
  with pytest.raises(app.UsageError, match="unknown"):
    gpu.select_jobs(["k"])


def test_host_feed_reads_the_token_file_one_call_ahead(tmp_path):
  path = tmp_path / "train.bin"
  gpu.write_token_file(path, 5000, vocab=300, chunk=1024)
  tokens = np.memmap(path, dtype=np.uint16, mode="r")
  assert tokens.shape == (5000,) and tokens.max() < 300 and len(np.unique(tokens)) > 200
  feed = gpu.HostFeed(tokens, block_size=16, batch_size=4, seed=0, steps_per_call=3)
  try:
    for step in (0, 3, 9):  # 9: not the call read ahead, so read now
      windows = feed.windows(step)
      assert windows.shape == (3, 4, 17) and windows.dtype == np.int32
      for k in range(3):
        np.testing.assert_array_equal(
            windows[k], gpu.batches.sample_windows(tokens, 16, 4, 0, step + k))
    assert len(feed.waits) == 3
  finally:
    feed.close()
  # 0, 3, 6 (read ahead, unused), 9, and 12 unless close() cancelled it before it started
  assert len(feed.reads) in (4, 5)


def test_consecutive_calls_keeps_the_timed_calls_waits():
  class Feed:
    waits = []
  calls = iter([9.0, 1.0, 3.0, 9.0, 2.0, 2.0])

  def run():
    Feed.waits.append(len(Feed.waits))
    return next(calls)

  waits = []
  timed = gpu.consecutive_calls(run, 2, Feed, waits)
  assert timed() == 2.0 and timed() == 2.0
  assert waits == [1, 2, 4, 5]  # not the untimed first call of each round


def test_summarise_pairs_rounds_with_the_reference():
  rows = gpu.summarise({"ours": [1.0, 2.0, 1.0], "twin": [2.0, 3.0]}, {"twin": "ours"}, "s/iter")
  assert rows["ours"]["median"] == 1.0 and "ratio" not in rows["ours"]
  np.testing.assert_allclose(rows["twin"]["ratio"], 1.75)  # median of 2/1 and 3/2
  assert rows["twin"]["vs"] == "ours"


def test_results_are_never_overwritten(tmp_path):
  first = gpu.unused_results_path(tmp_path, "2026-01-01-gpu-hij")
  first.write_text("{}")
  second = gpu.unused_results_path(tmp_path, "2026-01-01-gpu-hij")
  assert second.name == "2026-01-01-gpu-hij-2.json"
  gpu.update_job(second, "j.sample", {"status": "done", "rows": {}})
  assert gpu.read_results(second)["results"]["j.sample"]["status"] == "done"


def test_markdown_takes_partial_and_failed_jobs():
  table = gpu.markdown({
      "h.train": {"rows": {"purejax": {"median": 0.05, "min": 0.04, "max": 0.06,
                                       "unit": "s/iter", "tokens_per_s": 2.4e5, "mfu": 0.4,
                                       "peak_bytes": 2**31}}},
      "h.medium": {"status": "crashed", "errors": {"process": "exit code 1"}},
      "i.purejax_recipe": {"rows": {"purejax": {"median": 0.01, "min": None, "max": None,
                                                "unit": "s/iter", "best_val_loss": 1.47}}},
  })
  assert "50.00 ms/iter (40.00-60.00)" in table and "40.0%" in table and "| 2.0 |" in table
  assert "status crashed" in table and "best val 1.4700" in table
  feed = gpu.markdown({"h.feed": {"host_vs_device": 1.01, "feed_costs_nothing": True, "rows": {
      "host": {"median": 0.1, "min": 0.1, "max": 0.1, "unit": "s/iter",
               "read_ms_median": 3.5}}}})
  assert "read 3.50 ms/call" in feed and "host/device 1.010: the feed costs nothing" in feed


def test_shakespeare_is_split_as_nanogpt_splits_it():
  text = gpu.shakespeare()
  raw = (pathlib.Path(gpu.data_lib.EMBEDDED_SHAKESPEARE_DIR) / "input.txt").read_text()
  chars = sorted(set(raw))
  assert text.tokenizer.chars == "".join(chars) and text.vocab_size == 65
  n = int(len(raw) * 0.9)
  assert len(text.train) == n and len(text.val) == len(raw) - n
  assert text.tokenizer.decode(text.val[:50]) == raw[n:n + 50]

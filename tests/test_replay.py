"""replay: a step replayed from a saved state, or from a run's start, computes the logged loss
bit for bit; a folder that is not a run says what it is."""

import dataclasses

import chex
import jax
import numpy as np
import pytest

from purejax import checkpoint
from purejax import gpt
from purejax.data import corpus as corpus_lib
from purejax.optimizers import optim
from purejax.training.effects import runs
from purejax.training.loops import gpt_loop
from purejax.training.loops import recipes
from purejax.training.pure import steps
from purejax.training.pure.state import TrainState
from purejax.training.tools import replay
from helpers.data import SHAKESPEARE
from helpers.models import CPU_FORMS, TINY, random_tokens
from helpers.suite import built_once

CONFIG = dataclasses.replace(TINY, dropout=0.1)
OPT = optim.make_optimizer(optim.from_flat(
    learning_rate=1e-2, warmup_iters=2, decay_iters=30, weight_decay=0.1, grad_clip=1.0))


def train_like_the_loop(data, key, *, grad_accum_steps=1, host_seed=None):
  """30 updates in calls of 10, as the loop runs them; the state after 10, every loss."""
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(0))
  state = TrainState(params, OPT.init(params), {"train": jax.numpy.array(key)})
  saved, losses, norms = None, [], []
  for start in (0, 10, 20):
    if start == 10:
      saved = jax.tree.map(np.array, state)  # the checkpoint at step 10
    tokens = replay.tokens_for(data, start, 10, CONFIG, 8, host_seed)
    state, metrics = steps.train_steps(state, tokens, start, config=CONFIG, optimizer=OPT,
                                       batch_size=8, num_steps=10, forms=CPU_FORMS,
                                       grad_accum_steps=grad_accum_steps)
    losses += list(np.asarray(metrics.loss))
    norms += list(np.asarray(metrics.grad_norm))
  return saved, losses, norms


@pytest.mark.slow  # 20 s or more each: the full suite runs them
@pytest.mark.parametrize("grad_accum_steps, host_seed, steps_per_call", [
    (1, None, 7), (1, None, 10), (2, None, 7), (1, 3, 7)])
@pytest.mark.budget(35)
def test_the_replayed_step_computes_the_logged_loss_bit_for_bit(grad_accum_steps, host_seed,
                                                                 steps_per_call):
  """Updates 10..23 replay in calls of 7, or a call of 10 and the last 4 one by one."""
  data = random_tokens(jax.random.PRNGKey(1), (500,))
  if host_seed is not None:
    data = np.asarray(data)
  key = jax.random.PRNGKey(2)
  saved, losses, norms = train_like_the_loop(data, key, grad_accum_steps=grad_accum_steps,
                                             host_seed=host_seed)
  run = dict(config=CONFIG, optimizer=OPT, batch_size=8, grad_accum_steps=grad_accum_steps,
             host_seed=host_seed, forms=CPU_FORMS)
  state = replay.replay_to(jax.tree.map(jax.numpy.asarray, saved), data, 10, 24,
                           steps_per_call=steps_per_call, **run)
  report = replay.inspect_step(state, data, 24, **run)
  assert report.loss == losses[24]  # exactly
  assert report.grad_norm == norms[24]
  chex.assert_shape(report.tokens, (8, CONFIG.block_size + 1))
  chex.assert_shape(report.token_losses, (8, CONFIG.block_size))
  np.testing.assert_allclose(report.token_losses.mean(), report.loss, rtol=1e-5)
  # the batch is the one the step drew
  np.testing.assert_array_equal(
      report.tokens, replay.step_windows(data, key, 24, config=CONFIG, batch_size=8,
                                         host_seed=host_seed))
  chex.assert_shape(report.grad_norms["blocks.attn.qkv.w"], (CONFIG.n_layer,))
  total = np.sqrt(sum(np.sum(v ** 2) for k, v in report.grad_norms.items() if k != "blocks"))
  np.testing.assert_allclose(total, report.grad_norm, rtol=1e-5)
  np.testing.assert_allclose(report.grad_norms["blocks"] ** 2, sum(
      v ** 2 for k, v in report.grad_norms.items() if k.startswith("blocks.")), rtol=1e-6)


# ----------------------------------------------------------------------------
# A run's folder


def train_a_run(folder, max_iters, **options):
  """A run of `max_iters` steps in `folder/run` that logs every step's loss and saves a
  checkpoint every 10; returns `(run folder, cache_dir)`."""
  text = folder / "notes.txt"
  text.write_text(SHAKESPEARE[:20_000])
  cache = str(folder / "cache")
  corpus = corpus_lib.load_corpus(str(text), cache_dir=cache)
  config = gpt.GPTConfig(vocab_size=corpus.vocab_size, block_size=16, n_layer=1, n_head=2,
                         n_embd=16, dropout=0.1)
  train = gpt_loop.GPTTrainConfig(batch_size=4, max_iters=max_iters, eval_interval=10,
                              eval_iters=2, log_interval=1, steps_per_call=5,
                              sample_tokens=0, progress=False)
  opt = dataclasses.replace(recipes.GPT_OPTIMIZER, warmup_iters=2)
  keep = options.pop("keep_checkpoints", 2)
  init = options.pop("init_from", None)
  init_params = None if init is None else gpt.init_params(config, jax.random.PRNGKey(5))
  gpt_loop.train_gpt(config, corpus, train, opt, runs.RunConfig(out_dir=str(folder / "run"),
                                                             keep_checkpoints=keep),
                 data=str(text), init_params=init_params, init_from=init)
  return folder / "run", cache


@pytest.fixture(scope="session")
def pruned_run():
  """A 30-step run that kept its 2 newest checkpoints (20, 30); every step's loss logged.
  Trained once per test run (`built_once`); replay only reads it."""
  folder = built_once("replay_pruned_run", lambda folder: train_a_run(folder, 30))
  return folder / "run", str(folder / "cache")


@pytest.mark.slow  # over 5 s: the full suite runs it
@pytest.mark.parametrize("step, start", [(1, None), (17, None), (25, 20)])
def test_a_step_before_every_kept_checkpoint_replays_from_the_runs_start(pruned_run, step,
                                                                          start):
  out, cache = pruned_run
  assert sorted(p.name for p in out.glob("ckpt_0*.npz")) == [
      "ckpt_000000020.npz", "ckpt_000000030.npz"]  # 10 was pruned
  replayed = replay.replay_run(str(out), step, forms=CPU_FORMS, cache_dir=cache, write=False)
  assert replayed.logged is not None
  assert replayed.report.loss == replayed.logged  # exactly
  if start is None:
    assert replayed.checkpoint is None
    assert "from the run's start" in replay.describe(replayed)[0]
  else:
    assert replayed.checkpoint == out / f"ckpt_{start:09d}.npz"


def test_a_folder_that_is_not_a_run_says_what_it_is_and_what_to_pass(tmp_path):
  # replay tells a run's folder by its checkpoints' names, before it reads any file.
  cases = {tmp_path / "nothing": "is not a folder; pass as `out_dir` the folder a GPT run",
           tmp_path: "is not a run's folder (no ckpt_*.npz in it); pass as `out_dir`"}
  sweep_dir = tmp_path / "sweep"
  for name in ("run0_seed=0", "run1_seed=1"):
    checkpoint.save(str(sweep_dir / name), 30, {"params": {"w": np.zeros(3, np.float32)}}, {})
  cases[sweep_dir] = (f"is a sweep's folder, holding the runs run0_seed=0, run1_seed=1; pass "
                      f"one run's folder as `out_dir` (e.g. {sweep_dir / 'run0_seed=0'})")
  for folder, message in cases.items():
    with pytest.raises(ValueError) as e:
      replay.replay_run(str(folder), 5, forms=CPU_FORMS, cache_dir=str(tmp_path / "cache"),
                        write=False)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "later step" not in str(e.value)


@pytest.mark.slow  # over 5 s: the full suite runs it
def test_a_fine_tunes_step_before_its_checkpoints_says_to_replay_a_later_one(tmp_path):
  """A fine-tune started from weights replay does not load: only its checkpoints replay."""
  out, cache = train_a_run(tmp_path, 10, keep_checkpoints=1, init_from="my-weights")
  with pytest.raises(ValueError, match="step 3 is before .* oldest checkpoint \\(step 10\\), "
                     "and the run started from the weights of my-weights, which replay does "
                     "not load; replay a step after 10"):
    replay.replay_run(str(out), 3, forms=CPU_FORMS, cache_dir=cache, write=False)

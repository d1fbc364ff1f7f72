"""replay: a step replayed from a saved state computes the logged loss bit for bit."""

import dataclasses

import chex
import jax
import numpy as np
import pytest

from purejax import gpt
from purejax.training import optim
from purejax.training import replay
from purejax.training import steps
from purejax.training.state import TrainState
from conftest import CPU_FORMS, TINY, random_tokens

CONFIG = dataclasses.replace(TINY, dropout=0.1)
OPT = optim.make_optimizer(optim.OptimizerConfig(
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


@pytest.mark.parametrize("grad_accum_steps, host_seed", [
    (1, None), pytest.param(2, None, marks=pytest.mark.slow),
    pytest.param(1, 3, marks=pytest.mark.slow)])
def test_the_replayed_step_computes_the_logged_loss_bit_for_bit(grad_accum_steps, host_seed):
  data = random_tokens(jax.random.PRNGKey(1), (500,))
  if host_seed is not None:
    data = np.asarray(data)
  key = jax.random.PRNGKey(2)
  saved, losses, norms = train_like_the_loop(data, key, grad_accum_steps=grad_accum_steps,
                                             host_seed=host_seed)
  run = dict(config=CONFIG, optimizer=OPT, batch_size=8, grad_accum_steps=grad_accum_steps,
             host_seed=host_seed, forms=CPU_FORMS)
  state = replay.replay_to(jax.tree.map(jax.numpy.asarray, saved), data, 10, 24,
                           steps_per_call=7, **run)
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

"""steps: fused training steps and evaluation, on device-drawn or host-read batches."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import optax
from absl.testing import parameterized

from purejax import gpt
from purejax.data import batches
from purejax.optimizers import optim
from purejax.training.pure import steps
from purejax.training.pure.state import TrainState
from helpers.models import CPU_FORMS, TINY, random_tokens


class TrainStepsTest(parameterized.TestCase):

  @pytest.mark.budget(25)
  @pytest.mark.slow
  def test_chunking_does_not_change_the_run(self):
    # 6 steps as one call or as 2 + 4 calls: same params, bit for bit.
    config = dataclasses.replace(TINY, dropout=0.1)
    data = random_tokens(jax.random.PRNGKey(0), (500,))
    opt = optim.make_optimizer(optim.from_flat(
        learning_rate=1e-2, warmup_iters=2, decay_iters=6, weight_decay=0.1, grad_clip=1.0))
    key = jax.random.PRNGKey(3)

    def run(chunks):
      params = gpt.init_params(config, jax.random.PRNGKey(0))
      # The state is donated, its keys too: each run gets its own copy.
      state, step = TrainState(params, opt.init(params), {"train": jnp.copy(key)}), 0
      for n in chunks:
        state, _ = steps.train_steps(state, batches.DeviceTokens(data), step, config=config,
                                     optimizer=opt, batch_size=4, num_steps=n,
                                     forms=CPU_FORMS)
        step += n
      return state.params

    chex.assert_trees_all_equal(run([6]), run([2, 4]))

  def test_training_lowers_the_loss(self):
    # A repeating pattern is learnable: the loss must fall well below ln(vocab).
    data = jnp.tile(jnp.arange(TINY.vocab_size, dtype=jnp.int32), 50)
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    opt = optax.adam(1e-2)
    state = TrainState(params, opt.init(params), {"train": jax.random.PRNGKey(1)})
    state, metrics = steps.train_steps(state, batches.DeviceTokens(data), 0, config=TINY,
                                       optimizer=opt, batch_size=8, num_steps=60,
                                       forms=CPU_FORMS)
    losses = metrics.loss
    assert float(losses[0]) > 2.0
    assert float(losses[-1]) < 0.5
    val = steps.evaluate(state.params, batches.DeviceTokens(data), jax.random.PRNGKey(2),
                         config=TINY, batch_size=8, num_batches=4, forms=CPU_FORMS)
    assert float(val) < 0.5

  def test_weight_decay_only_on_matrices(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    mask = optim.decay_mask(params)
    assert mask["blocks"]["attn"]["qkv"]["w"] and mask["wte"]["embedding"]
    # Stacked per-layer biases and norms are [n_layer, dim] yet must not decay.
    assert params["blocks"]["attn"]["qkv"]["b"].ndim == 2
    assert not mask["blocks"]["attn"]["qkv"]["b"] and not mask["blocks"]["ln_1"]["scale"]
    assert not mask["ln_f"]["scale"]

  @pytest.mark.slow
  def test_host_windows_train_and_evaluate_as_device_batches(self):
    # Windows read by the host are the same steps as batches drawn on the
    # device, when they hold the same tokens.
    data = random_tokens(jax.random.PRNGKey(0), (300,))
    # SGD: Adam would turn the rounding of a zero gradient (the key bias's) into a step.
    key, opt = jax.random.PRNGKey(3), optax.sgd(0.1)

    def device_window(s):  # what step s draws on the device, as one window
      batch_key = jax.random.split(jax.random.fold_in(key, s))[0]
      x, y = batches.sample_batch(batch_key, data, TINY.block_size, 4)
      return jnp.concatenate([x, y[:, -1:]], axis=1)

    windows = jnp.stack([device_window(s) for s in range(5, 11)])  # [6, 4, block + 1]

    def run(tokens):
      params = gpt.init_params(TINY, jax.random.PRNGKey(0))
      return steps.train_steps(TrainState(params, opt.init(params), {"train": jnp.copy(key)}),
                               tokens,
                               5, config=TINY, optimizer=opt, batch_size=4, num_steps=6,
                               forms=CPU_FORMS)

    chex.assert_trees_all_close(run(batches.HostWindows(windows)),
                                run(batches.DeviceTokens(data)), rtol=1e-6, atol=1e-7)
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    chex.assert_trees_all_close(
        steps.evaluate(params, batches.HostWindows(windows), key, config=TINY, batch_size=4,
                       num_batches=6, forms=CPU_FORMS),
        np.mean([gpt.loss(params, w[:, :-1], w[:, 1:], TINY) for w in windows]), rtol=1e-6)

  def test_bare_arrays_are_refused_with_the_types_to_use(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    with pytest.raises(TypeError, match="DeviceTokens, batches.DeviceRows or batches.HostWindows"):
      steps.evaluate(params, jnp.zeros((100,), jnp.int32), jax.random.PRNGKey(0),
                     config=TINY, batch_size=2, num_batches=1, forms=CPU_FORMS)

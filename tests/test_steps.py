"""steps: batches, fused training steps, evaluation; data.sample_batch."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import optax
from absl.testing import parameterized

from purejax import data as data_lib
from purejax import gpt
from purejax import optim
from purejax import steps
from test_gpt import TINY, random_tokens


class TrainStepsTest(parameterized.TestCase):

  def test_sample_batch_targets_are_shifted_inputs(self):
    data = jnp.arange(100, dtype=jnp.int32)
    x, y = data_lib.sample_batch(jax.random.PRNGKey(0), data, 8, 5)
    chex.assert_shape((x, y), (5, 8))
    chex.assert_trees_all_equal(y, x + 1)
    chex.assert_trees_all_equal(x[:, 1:], x[:, :-1] + 1)  # contiguous windows

  def test_chunking_does_not_change_the_run(self):
    # 6 steps as one call or as 2 + 4 calls: same params, bit for bit.
    config = dataclasses.replace(TINY, dropout=0.1)
    data = random_tokens(jax.random.PRNGKey(0), (500,))
    opt = optim.make_optimizer(optim.OptimizerConfig(
        learning_rate=1e-2, warmup_iters=2, decay_iters=6, weight_decay=0.1, grad_clip=1.0))
    key = jax.random.PRNGKey(3)

    def run(chunks):
      params = gpt.init_params(config, jax.random.PRNGKey(0))
      state, step = opt.init(params), 0
      for n in chunks:
        params, state, _ = steps.train_steps(params, state, data, key, step, config=config,
                                           optimizer=opt, batch_size=4, num_steps=n)
        step += n
      return params

    chex.assert_trees_all_equal(run([6]), run([2, 4]))

  def test_training_lowers_the_loss(self):
    # A repeating pattern is learnable: the loss must fall well below ln(vocab).
    data = jnp.tile(jnp.arange(TINY.vocab_size, dtype=jnp.int32), 50)
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    opt = optax.adam(1e-2)
    state = opt.init(params)
    params, state, metrics = steps.train_steps(params, state, data, jax.random.PRNGKey(1), 0,
                                               config=TINY, optimizer=opt, batch_size=8,
                                               num_steps=60)
    losses = metrics.loss
    assert float(losses[0]) > 2.0
    assert float(losses[-1]) < 0.5
    val = steps.evaluate(params, data, jax.random.PRNGKey(2), config=TINY, batch_size=8,
                         num_batches=4)
    assert float(val) < 0.5

  def test_weight_decay_only_on_matrices(self):
    params = gpt.init_params(TINY, jax.random.PRNGKey(0))
    mask = optim.decay_mask(params)
    assert mask["blocks"]["attn"]["qkv"]["w"] and mask["wte"]["embedding"]
    # Stacked per-layer biases and norms are [n_layer, dim] yet must not decay.
    assert params["blocks"]["attn"]["qkv"]["b"].ndim == 2
    assert not mask["blocks"]["attn"]["qkv"]["b"] and not mask["blocks"]["ln_1"]["scale"]
    assert not mask["ln_f"]["scale"]

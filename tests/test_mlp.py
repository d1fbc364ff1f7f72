"""mlp: the JAX-MNIST-style MLP, its batching, gradients and training."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import test_util as jtu

from purejax import mlp
from purejax.training.pure import steps
from purejax.training.pure.state import TrainState

SIZES = [16, 32, 32, 4]


def numpy_predict(params, images):
  """Reference MLP in plain numpy."""
  x = np.asarray(images, np.float64)
  n = len(params)
  for i in range(n):
    x = x @ np.asarray(params[f"dense_{i}"]["w"]) + np.asarray(params[f"dense_{i}"]["b"])
    if i < n - 1:
      x = np.maximum(x, 0)
  return x


def synthetic_task(key, n=512, dim=16, classes=4):
  """Linearly separable blobs: the class is the argmax of a fixed projection."""
  x = jax.random.normal(key, (n, dim))
  proj = jax.random.normal(jax.random.fold_in(key, 1), (dim, classes))
  return x, jnp.argmax(x @ proj, axis=-1).astype(jnp.int32)


class MlpTest(chex.TestCase):

  def test_param_shapes(self):
    params = mlp.init_network_params([784, 512, 512, 10], jax.random.PRNGKey(0))
    chex.assert_shape(params["dense_0"]["w"], (784, 512))
    chex.assert_shape(params["dense_1"]["b"], (512,))
    chex.assert_shape(params["dense_2"]["w"], (512, 10))
    assert mlp.num_layers(params) == 3

  def test_init_rejects_bad_sizes(self):
    with pytest.raises(ValueError, match="sizes"):
      mlp.init_network_params([784], jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="sizes"):
      mlp.init_network_params([784, 0, 10], jax.random.PRNGKey(0))

  def test_predict_shapes(self):
    params = mlp.init_network_params(SIZES, jax.random.PRNGKey(0))
    chex.assert_shape(mlp.predict(params, jnp.ones(16)), (4,))
    chex.assert_shape(mlp.batched_predict(params, jnp.ones((7, 16))), (7, 4))
    with pytest.raises(AssertionError):
      mlp.predict(params, jnp.ones((7, 16)))  # predict is per example

  def test_vmap_batching_equals_looping_predict(self):
    params = mlp.init_network_params(SIZES, jax.random.PRNGKey(0), scale=0.5)
    images = jax.random.normal(jax.random.PRNGKey(1), (5, 16))
    looped = jnp.stack([mlp.predict(params, image) for image in images])
    chex.assert_trees_all_close(mlp.batched_predict(params, images), looped,
                                rtol=1e-5, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_batched_predict_matches_numpy(self):
    params = mlp.init_network_params(SIZES, jax.random.PRNGKey(0), scale=0.5)
    images = jax.random.normal(jax.random.PRNGKey(1), (5, 16))
    out = self.variant(mlp.batched_predict)(params, images)
    chex.assert_trees_all_close(out, numpy_predict(params, images).astype(np.float32),
                                rtol=1e-4, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_loss_jit_and_nojit_agree(self):
    params = mlp.init_network_params(SIZES, jax.random.PRNGKey(0), scale=0.5)
    x, y = synthetic_task(jax.random.PRNGKey(2), n=32)
    value = self.variant(mlp.loss)(params, x, y)
    logits = numpy_predict(params, x)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                           keepdims=True)) - logits.max(-1, keepdims=True)
    expected = -logp[np.arange(32), np.asarray(y)].mean()
    chex.assert_trees_all_close(value, np.float32(expected), rtol=1e-4)

  @pytest.mark.slow
  def test_gradients_match_finite_differences(self):
    params = mlp.init_network_params([5, 4, 3], jax.random.PRNGKey(0), scale=0.5)
    x, y = synthetic_task(jax.random.PRNGKey(3), n=6, dim=5, classes=3)
    params64 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    jtu.check_grads(lambda p: mlp.loss(p, x, y), (params64,), order=1,
                    modes=("rev",), atol=1e-2, rtol=1e-2)

  @pytest.mark.slow
  def test_same_seed_gives_identical_params_after_training(self):
    def run(seed):
      key = jax.random.PRNGKey(seed)
      params = mlp.init_network_params(SIZES, key)
      x, y = synthetic_task(jax.random.fold_in(key, 7))
      opt = optax.adam(1e-2)
      state = TrainState(params, opt.init(params), {"data": key})
      for epoch in range(3):
        state, _ = steps.train_epoch(state, x, y, epoch, optimizer=opt, batch_size=64)
      return state.params

    chex.assert_trees_all_equal(run(0), run(0))
    with pytest.raises(AssertionError):
      chex.assert_trees_all_equal(run(0), run(1))

  def test_loss_falls_and_task_is_learned(self):
    key = jax.random.PRNGKey(0)
    params = mlp.init_network_params(SIZES, key, scale=0.1)
    x, y = synthetic_task(key)
    opt = optax.adam(1e-2)
    state = TrainState(params, opt.init(params), {"data": key})
    losses = []
    for epoch in range(10):
      state, loss = steps.train_epoch(state, x, y, epoch, optimizer=opt, batch_size=32)
      losses.append(float(loss))
    assert losses[-1] < 0.3 * losses[0], losses
    assert float(mlp.evaluate_accuracy(state.params, x, y, batch_size=100)) > 0.9

  def test_train_epoch_equals_python_loop_of_updates(self):
    key = jax.random.PRNGKey(0)
    params = mlp.init_network_params(SIZES, key, scale=0.1)
    x, y = synthetic_task(key, n=100)
    opt = optax.sgd(0.1)
    # Epoch 0 is shuffled with fold_in(data key, 1) and drops the remainder:
    # 100 // 32 = 3 batches of the permutation.
    perm = np.asarray(jax.random.permutation(jax.random.fold_in(key, 1), 100))
    looped, state = jax.tree.map(jnp.copy, params), opt.init(params)
    for idx in perm[:96].reshape(3, 32):
      looped, state, _ = mlp.update(looped, state, x[idx], y[idx], optimizer=opt)
    scanned, _ = steps.train_epoch(
        TrainState(jax.tree.map(jnp.copy, params), opt.init(params), {"data": key}),
        x, y, 0, optimizer=opt, batch_size=32)
    chex.assert_trees_all_close(scanned.params, looped, rtol=1e-5, atol=1e-6)

  def test_evaluate_accuracy_handles_partial_chunks(self):
    params = mlp.init_network_params(SIZES, jax.random.PRNGKey(0), scale=0.5)
    x, y = synthetic_task(jax.random.PRNGKey(4), n=250)
    whole = mlp.accuracy(params, x, y)
    chunked = mlp.evaluate_accuracy(params, x, y, batch_size=100)
    chex.assert_trees_all_close(chunked, whole, atol=1e-6)

  def test_input_size_mismatch_is_a_clear_error(self):
    params = mlp.init_network_params([100, 8, 10], jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="`layer_sizes=784"):
      mlp.check_input_size(params, 784)
    with pytest.raises(ValueError, match="exceeds"):
      steps.train_epoch(
          TrainState(params, optax.sgd(0.1).init(params), {"data": jax.random.PRNGKey(0)}),
          jnp.ones((10, 100)), jnp.zeros((10,), jnp.int32), 0, optimizer=optax.sgd(0.1),
          batch_size=64)

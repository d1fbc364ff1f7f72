"""nn: each layer's init gives the documented shapes and its apply the documented maths."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from purejax import nn
from purejax.ops import dropout as dropouts
from purejax.ops import loss
from purejax.ops.matmul import row_major_transpose
from purejax.ops.matmul import matmul


class NNTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_dense_matches_numpy(self):
    params = nn.init_dense(3, 5, jax.random.PRNGKey(0), scale=1.0)
    params["b"] = jnp.arange(5.0)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 3))
    y = self.variant(nn.dense)(params, x)
    chex.assert_shape(y, (2, 4, 5))
    chex.assert_trees_all_close(y, np.asarray(x) @ np.asarray(params["w"]) + np.arange(5.0),
                                rtol=1e-5, atol=1e-5)

  def test_dense_without_bias_and_bf16_compute(self):
    params = nn.init_dense(3, 5, jax.random.PRNGKey(0), bias=False)
    assert set(params) == {"w"}
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 3))
    y = nn.dense(params, x, compute_dtype=jnp.bfloat16)
    assert y.dtype == jnp.float32  # bf16 operands, float32 accumulation and result
    assert params["w"].dtype == jnp.float32
    chex.assert_trees_all_close(y, nn.dense(params, x), rtol=2e-2, atol=2e-3)

  @parameterized.parameters((6, 8, 4, False), (5, 7, 3, False), (6, 8, 4, True),
                            (64, 32, 65, True))
  def test_bf16_matmul_gradients_are_float32_and_close(self, rows, inner, cols, tied):
    # `tied` multiplies by a transposed table, as the GPT's tied output head
    # does (`x @ embedding.T`): its gradient is transposed back, which must
    # still compile and run under jit.
    # Scaled so the products are O(1), where sin is well conditioned.
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, inner)) / np.sqrt(inner)
    w = jax.random.normal(jax.random.PRNGKey(1), (cols, inner) if tied else (inner, cols))
    product = lambda x, w, dtype: matmul(x, w.T if tied else w, compute_dtype=dtype)
    f = jax.jit(lambda x, w, dtype: jax.grad(
        lambda x, w: jnp.sum(jnp.sin(product(x, w, dtype))), argnums=(0, 1))(x, w),
                static_argnums=2)
    low, high = f(x, w, jnp.bfloat16), f(x, w, None)
    assert all(g.dtype == jnp.float32 for g in low)
    chex.assert_trees_all_close(low, high, rtol=5e-2, atol=5e-2)

  @parameterized.parameters((4, 6), (3, 5), (2, 3, 4, 6))
  def test_row_major_transpose_swaps_the_last_two_axes(self, *shape):
    a = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    chex.assert_trees_all_equal(jax.jit(row_major_transpose)(a), jnp.swapaxes(a, -1, -2))

  def test_dense_rejects_wrong_width(self):
    params = nn.init_dense(3, 5, jax.random.PRNGKey(0))
    with pytest.raises(AssertionError):
      nn.dense(params, jnp.ones((2, 4)))

  @chex.variants(with_jit=True, without_jit=True)
  def test_layer_norm_normalises(self):
    params = nn.init_layer_norm(8)
    x = 3.0 + 5.0 * jax.random.normal(jax.random.PRNGKey(0), (4, 8))
    y = self.variant(nn.layer_norm)(params, x)
    chex.assert_trees_all_close(y.mean(-1), jnp.zeros(4), atol=1e-5)
    chex.assert_trees_all_close(y.std(-1), jnp.ones(4), atol=1e-3)

  def test_layer_norm_keeps_bf16_dtype(self):
    y = nn.layer_norm(nn.init_layer_norm(8, bias=False), jnp.ones((2, 8), jnp.bfloat16))
    assert y.dtype == jnp.bfloat16

  def test_embedding_lookup_and_tied_logits(self):
    params = nn.init_embedding(10, 4, jax.random.PRNGKey(0))
    ids = jnp.array([[1, 2], [3, 9]])
    x = nn.embed(params, ids)
    chex.assert_shape(x, (2, 2, 4))
    chex.assert_trees_all_close(x[1, 1], params["embedding"][9])
    logits = nn.embedding_logits(params, x)
    chex.assert_shape(logits, (2, 2, 10))
    chex.assert_trees_all_close(logits, x @ params["embedding"].T)

  def test_dropout_semantics(self):
    x = jnp.ones((1000,))
    key = jax.random.PRNGKey(0)
    # deterministic ignores the key and the rate.
    chex.assert_trees_all_equal(dropouts.dropout(key, x, 0.5, deterministic=True), x)
    y = dropouts.dropout(key, x, 0.5, deterministic=False)
    kept = np.asarray(y) != 0
    assert 0.4 < kept.mean() < 0.6
    np.testing.assert_allclose(np.asarray(y)[kept], 2.0)  # rescaled by 1/(1-rate)
    chex.assert_trees_all_equal(y, dropouts.dropout(key, x, 0.5, deterministic=False))
    assert not np.array_equal(y, dropouts.dropout(jax.random.PRNGKey(1), x, 0.5,
                                            deterministic=False))

  @parameterized.parameters(0.1, 0.5)
  def test_dropout_at_an_array_rate_equals_the_float_rate(self, rate):
    # An array rate (a sweep's, traced) draws the same mask and scale.
    x = jax.random.normal(jax.random.PRNGKey(1), (4000,))
    key = jax.random.PRNGKey(2)
    at_float = dropouts.dropout(key, x, rate, deterministic=False)
    chex.assert_trees_all_equal(dropouts.dropout(key, x, jnp.float32(rate), deterministic=False),
                                at_float)
    drop = jax.jit(lambda x, r: dropouts.dropout(key, x, r, deterministic=False))
    y = drop(x, jnp.float32(rate))
    # compiled, XLA may divide by a runtime scalar as a product with its
    # reciprocal: the same mask, values within one float32 rounding
    chex.assert_trees_all_equal(y == 0, at_float == 0)
    chex.assert_trees_all_close(y, at_float, rtol=2.4e-7, atol=0)
    kept = np.asarray(y) != 0
    assert abs(kept.mean() - (1 - rate)) < 0.03
    np.testing.assert_allclose(np.asarray(y)[kept], np.asarray(x)[kept] / (1 - rate),
                               rtol=1e-6)
    half = dropouts.dropout(key, x.astype(jnp.bfloat16), jnp.float32(rate), deterministic=False)
    assert half.dtype == jnp.bfloat16
    chex.assert_trees_all_equal(half, dropouts.dropout(key, x.astype(jnp.bfloat16), rate,
                                                 deterministic=False))
    # deterministic still ignores the rate and the key
    chex.assert_trees_all_equal(dropouts.dropout(None, x, jnp.float32(rate), deterministic=True), x)

  def test_dropout_at_an_array_rate_of_zero_is_the_identity(self):
    x = jax.random.normal(jax.random.PRNGKey(1), (1000,)).astype(jnp.bfloat16)
    y = dropouts.dropout(jax.random.PRNGKey(0), x, jnp.float32(0.0), deterministic=False)
    chex.assert_trees_all_equal(y, x)
    assert dropouts.drops(jnp.float32(0.0), deterministic=False)  # a traced rate always draws
    assert not dropouts.drops(0.0, deterministic=False)
    assert not dropouts.drops(jnp.float32(0.5), deterministic=True)

  @parameterized.parameters(-0.1, 1.0, 1.5)
  def test_dropout_rejects_bad_rate(self, rate):
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
      dropouts.dropout(jax.random.PRNGKey(0), jnp.ones(3), rate, deterministic=False)

  def test_dropout_needs_key_when_training(self):
    with pytest.raises(ValueError, match="key"):
      dropouts.dropout(None, jnp.ones(3), 0.5, deterministic=False)

  def test_activations(self):
    chex.assert_trees_all_close(nn.relu(jnp.array([-1.0, 2.0])), jnp.array([0.0, 2.0]))
    x = jnp.linspace(-3, 3, 7)
    tanh_gelu = 0.5 * x * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    chex.assert_trees_all_close(nn.gelu(x), tanh_gelu, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_cross_entropy_and_accuracy(self):
    logits = jnp.log(jnp.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
    labels = jnp.array([0, 1])
    ce = self.variant(loss.cross_entropy)(logits, labels)
    chex.assert_trees_all_close(ce, -(np.log(0.7) + np.log(0.1)) / 2, rtol=1e-6)
    chex.assert_trees_all_close(self.variant(nn.accuracy)(logits, labels), 0.5)

  def test_cross_entropy_uniform_logits_is_log_classes(self):
    ce = loss.cross_entropy(jnp.zeros((4, 3, 65)), jnp.zeros((4, 3), jnp.int32))
    chex.assert_trees_all_close(ce, np.log(65), rtol=1e-6)

  def test_cross_entropy_rejects_float_labels(self):
    with pytest.raises(AssertionError):
      loss.cross_entropy(jnp.zeros((2, 3)), jnp.zeros((2,)))

"""rng: key helpers are pure and give independent keys."""

import chex
import jax
import numpy as np
import pytest

from purejax import rng


def test_split_named_is_deterministic_and_distinct():
  key = jax.random.PRNGKey(0)
  a = rng.split_named(key, ("params", "dropout", "data"))
  b = rng.split_named(key, ("params", "dropout", "data"))
  chex.assert_trees_all_equal(a, b)
  values = [tuple(np.asarray(k)) for k in a.values()]
  assert len(set(values)) == 3


def test_split_named_rejects_duplicates():
  with pytest.raises(ValueError, match="distinct"):
    rng.split_named(jax.random.PRNGKey(0), ("a", "a"))


def test_fold_in_step_depends_only_on_key_and_step():
  key = jax.random.PRNGKey(1)
  chex.assert_trees_all_equal(rng.fold_in_step(key, 5), rng.fold_in_step(key, 5))
  assert not np.array_equal(rng.fold_in_step(key, 5), rng.fold_in_step(key, 6))
  # Works on traced steps inside jit.
  chex.assert_trees_all_equal(jax.jit(rng.fold_in_step)(key, 5), rng.fold_in_step(key, 5))


def test_layer_keys_one_per_layer():
  keys = rng.layer_keys(jax.random.PRNGKey(0), 4)
  chex.assert_shape(keys, (4, 2))
  assert len({tuple(np.asarray(k)) for k in keys}) == 4
  with pytest.raises(ValueError, match="n_layer"):
    rng.layer_keys(jax.random.PRNGKey(0), 0)


def test_every_init_function_takes_its_key_last():
  # One convention, as JAX's MNIST example: the key is the last positional argument.
  import inspect
  from purejax import gpt, lora, mlp, nn
  for function in (nn.init_dense, nn.init_embedding, gpt.init_block, gpt.init_params,
                   mlp.init_network_params, lora.init):
    positional = [p.name for p in inspect.signature(function).parameters.values()
                  if p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty]
    assert positional[-1] == "key", function.__name__

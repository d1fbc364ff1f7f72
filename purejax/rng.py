"""Explicit PRNG key threading.

JAX has no global random state: every random draw takes a key, and a key must
never be used twice. These helpers make the usual patterns one call each, so
that model and training code read as plain data flow:

    keys = split_named(key, ("params", "dropout", "data"))
    params = init_params(config, keys["params"])

All functions are pure: the same key in gives the same keys out.

Every init function takes its key last among its positional arguments, as
JAX's MNIST example does (`init_network_params(sizes, key)`,
`random_layer_params(m, n, key)`): `nn.init_dense(in_dim, out_dim, key)`,
`gpt.init_block(config, key)`, `gpt.init_params(config, key)`,
`lora.init(params, rank, targets, key)`.
"""

from typing import Dict, Sequence

import chex
import jax


def split_named(key: chex.PRNGKey, names: Sequence[str]) -> Dict[str, chex.PRNGKey]:
  """Splits `key` into one independent key per name.

  Args:
    key: a PRNG key.
    names: distinct names, e.g. `("params", "dropout")`.

  Returns:
    A dict from each name to its own key. The mapping depends on the order of
    `names`, so keep the order fixed for reproducible runs.

  Example:
    >>> keys = split_named(jax.random.PRNGKey(0), ("params", "data"))
    >>> sorted(keys)
    ['data', 'params']
  """
  names = tuple(names)
  if len(set(names)) != len(names):
    raise ValueError(f"split_named: names must be distinct, got {names}.")
  subkeys = jax.random.split(key, len(names))
  return {name: subkeys[i] for i, name in enumerate(names)}


def fold_in_step(key: chex.PRNGKey, step: chex.Numeric) -> chex.PRNGKey:
  """Derives the key for training step `step` from a base key.

  Folding the step in (rather than splitting a carried key every step) makes
  the key of step `n` a function of `(key, n)` alone, so a run resumed at step
  `n` draws exactly what an uninterrupted run would have drawn.

  Args:
    key: the base key of a random stream (e.g. the data-sampling key).
    step: an integer step; may be a traced value inside `jit`/`scan`.

  Returns:
    A key unique to `(key, step)`.

  Example:
    >>> base = jax.random.PRNGKey(0)
    >>> bool((fold_in_step(base, 3) == fold_in_step(base, 3)).all())
    True
  """
  return jax.random.fold_in(key, step)


def layer_keys(key: chex.PRNGKey, n_layer: int) -> chex.Array:
  """Returns `n_layer` keys stacked on a leading axis, one per layer.

  The result can be passed as the `xs` of a `jax.lax.scan` over stacked layer
  params, so every layer gets its own key without any Python loop.

  Args:
    key: a PRNG key.
    n_layer: number of layers (>= 1).

  Returns:
    Keys of shape `[n_layer, *key.shape]`.

  Example:
    >>> layer_keys(jax.random.PRNGKey(0), 4).shape
    (4, 2)
  """
  if n_layer < 1:
    raise ValueError(f"layer_keys: n_layer must be >= 1, got {n_layer}.")
  return jax.random.split(key, n_layer)

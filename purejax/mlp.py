"""A multi-layer perceptron for MNIST, in the style of JAX's own MNIST example.

    params = init_network_params([784, 512, 512, 10], jax.random.PRNGKey(0))
    logits = batched_predict(params, images)          # [batch, 10]
    params, opt_state, loss = update(params, opt_state, images, labels, optimizer=opt)

`predict` is written for one example and batched with `jax.vmap`. A whole
epoch as one jitted `lax.scan` of steps, across devices, is the training
layer's (`purejax.training.pure.steps.train_epoch`).
"""

import functools
from typing import Dict, Sequence, Tuple

import chex
import jax
import jax.numpy as jnp
import optax

from purejax import nn
from purejax.ops.loss import cross_entropy

Params = Dict[str, Dict[str, chex.Array]]


def init_network_params(
    sizes: Sequence[int], key: chex.PRNGKey, scale: float = 1e-2
) -> Params:
  """Initialises dense layers `sizes[0] -> sizes[1] -> ... -> sizes[-1]`.

  As in JAX's MNIST example, weights and biases are drawn from N(0, scale^2).

  Args:
    sizes: layer widths, input first, e.g. `[784, 512, 512, 10]`.
    key: PRNG key.
    scale: standard deviation of the initial weights and biases.

  Returns:
    `{"dense_0": {"w": [sizes[0], sizes[1]], "b": [sizes[1]]}, "dense_1": ...}`.
  """
  sizes = list(sizes)
  if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
    raise ValueError(
        f"init_network_params: sizes must list >= 2 positive widths, got {sizes}.")
  params = {}
  for i, (key_i, m, n) in enumerate(
      zip(jax.random.split(key, len(sizes) - 1), sizes[:-1], sizes[1:])):
    w_key, b_key = jax.random.split(key_i)
    params[f"dense_{i}"] = {
        "w": scale * jax.random.normal(w_key, (m, n)),
        "b": scale * jax.random.normal(b_key, (n,)),
    }
  return params


def num_layers(params: Params) -> int:
  return len(params)


def predict(params: Params, image: chex.Array) -> chex.Array:
  """Logits for one flattened image.

  Args:
    params: from `init_network_params`.
    image: `[in_dim]` float pixels.

  Returns:
    `[num_classes]` unnormalised logits.
  """
  chex.assert_rank(image, 1)
  activations = image
  n = num_layers(params)
  for i in range(n - 1):
    activations = nn.relu(nn.dense(params[f"dense_{i}"], activations))
  return nn.dense(params[f"dense_{n - 1}"], activations)


# [batch, in_dim] -> [batch, num_classes]
batched_predict = jax.vmap(predict, in_axes=(None, 0))


def loss(params: Params, images: chex.Array, labels: chex.Array) -> chex.Array:
  """Mean cross-entropy over a batch: images `[batch, in_dim]`, labels `[batch]`."""
  return cross_entropy(batched_predict(params, images), labels)


def accuracy(params: Params, images: chex.Array, labels: chex.Array) -> chex.Array:
  """Fraction of `images` `[batch, in_dim]` classified as `labels` `[batch]`."""
  return nn.accuracy(batched_predict(params, images), labels)


def check_input_size(params: Params, in_dim: int) -> None:
  """Raises a clear error if the network's input width is not `in_dim`."""
  expected = params["dense_0"]["w"].shape[0]
  if expected != in_dim:
    raise ValueError(
        f"MLP input size {expected} does not match the data's {in_dim} features "
        f"per example; make the first layer size {in_dim} (e.g. `layer_sizes="
        f"{in_dim},512,512,10`).")


@functools.partial(jax.jit, static_argnames="optimizer", donate_argnums=(0, 1))
def update(
    params: Params,
    opt_state: optax.OptState,
    images: chex.Array,
    labels: chex.Array,
    *,
    optimizer: optax.GradientTransformation,
) -> Tuple[Params, optax.OptState, chex.Array]:
  """One optimisation step on a batch.

  Args:
    params: current params (donated: do not reuse after the call).
    opt_state: `optimizer.init(params)` or a later state (donated).
    images: `[batch, in_dim]`.
    labels: `[batch]` integers.
    optimizer: any optax `GradientTransformation`.

  Returns:
    `(new_params, new_opt_state, loss_before_the_step)`.
  """
  value, grads = jax.value_and_grad(loss)(params, images, labels)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, value


@functools.partial(jax.jit, static_argnames="batch_size")
def evaluate_accuracy(
    params: Params, images: chex.Array, labels: chex.Array, *, batch_size: int = 10_000
) -> chex.Array:
  """Accuracy over a whole dataset, in chunks to bound memory.

  Args:
    params: network params.
    images: `[num_examples, in_dim]`.
    labels: `[num_examples]`.
    batch_size: examples per chunk; the last chunk may be partial.

  Returns:
    Scalar accuracy in [0, 1].
  """
  num_examples = images.shape[0]
  num_full = num_examples // batch_size
  correct = jnp.zeros((), jnp.int32)
  if num_full:
    chunks_x = images[: num_full * batch_size].reshape(num_full, batch_size, -1)
    chunks_y = labels[: num_full * batch_size].reshape(num_full, batch_size)

    def body(total, xy):
      x, y = xy
      hits = jnp.argmax(batched_predict(params, x), -1) == y
      return total + jnp.sum(hits, dtype=jnp.int32), None

    correct, _ = jax.lax.scan(body, correct, (chunks_x, chunks_y))
  if num_examples % batch_size:
    x, y = images[num_full * batch_size:], labels[num_full * batch_size:]
    correct += jnp.sum(jnp.argmax(batched_predict(params, x), -1) == y,
                       dtype=jnp.int32)
  return correct / num_examples

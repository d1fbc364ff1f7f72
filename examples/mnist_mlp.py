"""Train the MNIST MLP with purejax as a library, in a dozen lines.

    python examples/mnist_mlp.py ~/data/mnist    # offline, from MNIST's four .gz files
    python examples/mnist_mlp.py                 # TFDS downloads MNIST
"""

import sys

import jax
import optax

import purejax
from purejax import mlp
from purejax.training.pure import steps

manual_dir = sys.argv[1] if len(sys.argv) > 1 else None
mnist = purejax.data.datasets.load_mnist(manual_dir=manual_dir)
train_x, train_y = jax.device_put((mnist.train_images, mnist.train_labels))

key = jax.random.PRNGKey(0)
params = mlp.init_network_params([784, 512, 512, 10], key)
optimizer = optax.adamw(optax.cosine_decay_schedule(1e-3, decay_steps=5 * 468))
state = purejax.TrainState(params, optimizer.init(params), {"data": key})

for epoch in range(5):  # each epoch: one jitted lax.scan over its shuffled batches
  state, loss = steps.train_epoch(state, train_x, train_y, epoch, optimizer=optimizer,
                                  batch_size=128)
  test_acc = mlp.evaluate_accuracy(state.params, mnist.test_images, mnist.test_labels)
  print(f"epoch {epoch}: loss {float(loss):.4f}, test accuracy {float(test_acc):.4f}")

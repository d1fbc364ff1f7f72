"""Seconds per 60,000-example MNIST epoch of the purejax MLP (784-512-512-10).

    python -m bench.mlp_epoch [--optimizer=sgd] [--epochs=10]

Reports the median of epochs 2..N (epoch 1 includes compilation). The data
are random arrays of MNIST's shapes: the time of an epoch does not depend on
the pixel values.
"""

import time

from absl import app
from absl import flags
import jax
import numpy as np
import optax

from purejax import mlp
from purejax.training.pure import steps
from purejax.training.pure.state import TrainState

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adamw"], "Optimizer.")
  flags.DEFINE_integer("epochs", 10, "Epochs to time (the first is dropped).")
  flags.DEFINE_integer("batch_size", 128, "Batch size.")


def epoch_times(optimizer_name: str, epochs: int, batch_size: int):
  key = jax.random.PRNGKey(0)
  images = jax.random.uniform(key, (60_000, 784))
  labels = jax.random.randint(key, (60_000,), 0, 10)
  params = mlp.init_network_params([784, 512, 512, 10], key)
  optimizer = optax.sgd(0.01) if optimizer_name == "sgd" else optax.adamw(1e-3)
  state = TrainState(params, optimizer.init(params), {"data": key})
  times = []
  for epoch in range(epochs):
    start = time.perf_counter()
    state, loss = steps.train_epoch(state, images, labels, epoch, optimizer=optimizer,
                                    batch_size=batch_size)
    loss.block_until_ready()
    times.append(time.perf_counter() - start)
  return times


def main(_):
  times = epoch_times(FLAGS.optimizer, FLAGS.epochs, FLAGS.batch_size)
  steady = times[1:]
  print(f"purejax MLP, {FLAGS.optimizer}, batch {FLAGS.batch_size}: median "
        f"{np.median(steady):.3f} s/epoch over epochs 2-{len(times)} "
        f"(min {min(steady):.3f}, max {max(steady):.3f}); epoch 1 {times[0]:.3f} s")


if __name__ == "__main__":
  define_flags()
  app.run(main)

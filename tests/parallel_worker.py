"""Trains on synthetic data under a device count set by the caller; prints JSON.

Run by tests/test_parallel.py in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`, because JAX fixes the
number of CPU devices when it starts:

    python tests/parallel_worker.py '{"model": "gpt", "num_devices": 4, "fsdp": true}'

It uses the same pieces as `purejax.train`: a `ShardingPlan`, state put with
the plan's shardings, and the step jitted by `parallel.jit_train_step`.
"""

import json
import sys

import jax
import numpy as np
import optax

from bench import hlo
from purejax import gpt
from purejax import mlp
from purejax.data import batches
from purejax.ops import kernels
from purejax.training.pure import parallel
from purejax.training.pure import state as state_lib
from purejax.training.pure import steps

GPT_CONFIG = dict(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=True)


def main(options):
  model = options["model"]
  plan = parallel.ShardingPlan(parallel.make_mesh(options.get("num_devices")),
                               fsdp=options.get("fsdp", False))
  accum = options.get("grad_accum_steps", 1)
  batch_size, num_steps = options.get("batch_size", 16), options.get("num_steps", 20)
  optimizer = optax.adamw(1e-3, weight_decay=0.1)
  key = jax.random.PRNGKey(0)
  if model == "gpt":
    config = gpt.GPTConfig(**GPT_CONFIG, dropout=options.get("dropout", 0.0))
    params = gpt.init_params(config, key)
    data = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (4096,), 0, 65))
    step_fn, static = steps.train_steps_fn, dict(config=config, num_steps=num_steps,
                                                 forms=kernels.select("cpu"))
    keys = {"train": jax.random.PRNGKey(2)}
    data_args = (batches.DeviceTokens(data), 0)
  else:
    params = mlp.init_network_params([32, 64, 64, 10], key, scale=0.1)
    images = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (batch_size * num_steps, 32)))
    labels = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (batch_size * num_steps,), 0, 10))
    # steps.train_epoch_fn returns the epoch's mean loss; one step per call gives
    # every step's loss.
    step_fn, static = steps.train_epoch_fn, {}
    keys = {"data": jax.random.PRNGKey(3)}

  state, shardings = state_lib.shard(
      state_lib.TrainState(params, optimizer.init(params), keys), plan)
  jitted = parallel.jit_train_step(step_fn, plan, shardings, optimizer=optimizer,
                                   batch_size=batch_size, grad_accum_steps=accum, **static)
  if model == "gpt":
    data_args = parallel.put(data_args, plan.replicated)
    hlo_text = jitted.lower(state, *data_args).compile().as_text()
    state, metrics = jitted(state, *data_args)
    losses = np.asarray(metrics.loss).tolist()
  else:
    losses = []
    images, labels = parallel.put((images, labels), plan.replicated)
    for i in range(num_steps):
      rows = slice(i * batch_size, (i + 1) * batch_size)
      args = (images[rows], labels[rows], i)
      if i == 0:
        hlo_text = jitted.lower(state, *args).compile().as_text()
      state, loss = jitted(state, *args)
      losses.append(float(loss))
  params = state.params
  held = parallel.bytes_per_device(params)
  steps_compiled = num_steps if model == "gpt" else 1  # per call: 20 steps, or 1
  print(json.dumps({
      "losses": losses,
      "param_bytes": int(sum(x.nbytes for x in jax.tree.leaves(params))),
      "param_bytes_per_device": sorted(held.values()),
      "collective_bytes_per_step": {
          kind: nbytes / steps_compiled
          for kind, nbytes in hlo.collective_bytes(hlo_text).items()},
      "params": {jax.tree_util.keystr(k): np.asarray(v).ravel()[:64].tolist()
                 for k, v in jax.tree_util.tree_leaves_with_path(parallel.fetch(params))},
  }))


if __name__ == "__main__":
  main(json.loads(sys.argv[1]))

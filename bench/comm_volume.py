"""Bytes each device sends through collectives per GPT training step, from the HLO.

    python -m bench.comm_volume                 # 4 devices, both bench sizes
    python -m bench.comm_volume --devices=8

The count comes from the compiled program, not a run: each training step is
compiled as `purejax.train` compiles it (a `ShardingPlan`, explicit in/out
shardings) for `--devices` CPU devices, and `bench.hlo.collective_bytes` sums
the result size of every all-reduce, all-gather, reduce-scatter, all-to-all
and collective-permute, once per loop trip. The figure is per device and per
optimisation step. Other backends (GPU, TPU) partition the same program and
may pick other collectives (e.g. reduce-scatter where the CPU backend keeps
an all-reduce), so read the CPU numbers as the shape of the traffic.
"""

import dataclasses
import os
import sys


def _devices_from_argv(default=4):
  for arg in sys.argv[1:]:
    if arg.startswith("--devices="):
      return int(arg.split("=", 1)[1])
  return default


# JAX fixes the number of CPU devices when it starts.
os.environ.setdefault("XLA_FLAGS",
                      f"--xla_force_host_platform_device_count={_devices_from_argv()}")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import hlo as hlo_lib  # noqa: E402
from purejax import gpt  # noqa: E402
from purejax.data import batches  # noqa: E402
from purejax.ops import kernels  # noqa: E402
from purejax.optimizers import optim  # noqa: E402
from purejax.training.loops import recipes  # noqa: E402
from purejax.training.pure import parallel  # noqa: E402
from purejax.training.pure import state as state_lib  # noqa: E402
from purejax.training.pure import steps  # noqa: E402
from purejax.training.pure.state import TrainState  # noqa: E402

FLAGS = flags.FLAGS

SIZES = {
    # name: (config, global batch, rounded up to 4 rows per device)
    "recipe 4L/128 T64": (recipes.SHAKESPEARE_CHAR, 12),
    "heavy 6L/384 T256": (dataclasses.replace(recipes.SHAKESPEARE_CHAR, block_size=256,
                                              n_layer=6, n_head=6, n_embd=384), 16),
}
# label, FSDP, microbatches
PLANS = [("replicated", False, 1), ("replicated, 4 microbatches", False, 4),
         ("FSDP", True, 1), ("FSDP, 4 microbatches", True, 4)]


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_integer("devices", 4, "CPU devices to partition over.")


def step_collectives(config, batch_size, plan, grad_accum_steps):
  # purejax.train's optimizer; its cosine schedule needs an end, which changes nothing
  # that crosses devices
  optimizer = optim.make_optimizer(optim.replace(recipes.GPT_OPTIMIZER, decay_iters=5000))
  params = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  opt_state = jax.eval_shape(optimizer.init, params)
  state = TrainState(params, opt_state, {"train": jax.ShapeDtypeStruct((2,), np.uint32)})
  step = parallel.jit_train_step(
      steps.train_steps_fn, plan, state_lib.shardings(state, plan), config=config,
      optimizer=optimizer, batch_size=batch_size, num_steps=1,
      grad_accum_steps=grad_accum_steps, forms=kernels.select(kernels.platform_of(plan)))
  data = batches.DeviceTokens(jax.ShapeDtypeStruct((100_000,), np.int32))
  hlo = step.lower(state, data, 0).compile().as_text()
  param_bytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
  return hlo_lib.collective_bytes(hlo), int(param_bytes)


def main(argv):
  del argv
  if jax.device_count() != FLAGS.devices:
    raise app.UsageError(f"JAX sees {jax.device_count()} devices; XLA_FLAGS was set "
                         f"before this script: unset it or make it match --devices.")
  mesh = parallel.make_mesh()
  print(f"Per device, per optimisation step, on {FLAGS.devices} CPU devices "
        f"(MB = 1e6 bytes):\n")
  print("| size | plan | params MB | all-reduce MB | all-gather MB | other MB | "
        "total / params |")
  print("|---|---|---:|---:|---:|---:|---:|")
  for name, (config, batch) in SIZES.items():
    batch = max(batch, FLAGS.devices * 4) // (FLAGS.devices * 4) * (FLAGS.devices * 4)
    for label, fsdp, accum in PLANS:
      volume, param_bytes = step_collectives(
          config, batch, parallel.ShardingPlan(mesh, fsdp), accum)
      other = sum(v for k, v in volume.items() if k not in ("all-reduce", "all-gather"))
      total = sum(volume.values())
      print(f"| {name} (batch {batch}) | {label} | {param_bytes / 1e6:.2f} | "
            f"{volume.get('all-reduce', 0) / 1e6:.2f} | "
            f"{volume.get('all-gather', 0) / 1e6:.2f} | {other / 1e6:.2f} | "
            f"{total / param_bytes:.2f} |")


if __name__ == "__main__":
  define_flags()
  app.run(main)

"""The memory plan of `bench.gpu`'s GPT-2 124M step (batch 12), compiled without a GPU.

    JAX_PLATFORMS=cpu python -m bench.deviceless_plan --gpu=h200 > plan.json
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_load_autotune_results_from=tuned.textproto \\
        python -m bench.deviceless_plan --gpu=h200 > plan-tuned.json

The same program `bench.gpu`'s `h.plan` job compiles for and runs on a GPU
(`gpu_plan.train_step_program`, one step per call), here compiled for a card
named in `gpu_plan.TARGETS` on a CPU host (JAX's CUDA plugin needed), so the
two plans and the GPU's measured peak can be set side by side. Prints JSON:
the plan's bytes, its custom calls and how long the compile took.
"""

import json
import os
import time

from absl import app
from absl import flags
import jax

from bench import gpu
from purejax.ops import kernels
from purejax.training.tools import gpu_plan

FLAGS = flags.FLAGS


def plan(card: str, batch: int) -> dict:
  """The deviceless plan of `gpu.GPT2_124M`'s step at `batch` for `card`, as a dict."""
  devices = gpu_plan.target_devices(card)
  start = time.perf_counter()
  program = gpu_plan.read_program(gpu_plan.compile_train_step(
      gpu.GPT2_124M, devices, batch_size=batch, forms=kernels.select("gpu"),
      opt_config=gpu.GPT2_OPTIMIZER))
  return {"gpu": card, "batch": batch, "jax": jax.__version__,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "compile_s": time.perf_counter() - start, **program.memory(),
          "custom_calls": dict(program.custom_calls)}


def main(argv):
  del argv
  print(json.dumps(plan(FLAGS.gpu, FLAGS.batch_size), indent=1))


if __name__ == "__main__":
  flags.DEFINE_string("gpu", "h100", f"The card: {', '.join(gpu_plan.TARGETS)}.")
  flags.DEFINE_integer("batch_size", 12, "Sequences per step.")
  app.run(main)

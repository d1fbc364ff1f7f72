"""Where the GPT-2 124M step's GPU time goes: purejax's forms against the torch twin, per kernel.

    python -m bench.gpu_profile --steps=3 > kernels.txt

Each arm (`bench.harness`'s train arms, batch 12, one step per call) is
built and warmed up, then `--steps` calls run under `torch.profiler`, whose
CUPTI tracing records every kernel the process launches, JAX's included.
Prints per arm the GPU time per step, its split into kernel kinds (matrix
products, attention, the rest) and the kernels that take the most time.
"""

import collections
import re
from typing import Dict, List, Tuple

from absl import app
from absl import flags

from bench import gpu
from bench import harness
from purejax.ops import kernels

FLAGS = flags.FLAGS

# Kernel kind by name: the first pattern found in the kernel's name.
KINDS = (
    ("attention", re.compile(r"fmha|flash|cudnn|sdpa|attention", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|_mma|wgmma", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
)


def kind_of(name: str) -> str:
  return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def kernel_times(run, steps: int) -> Dict[str, Tuple[float, int]]:
  """{kernel name: (total GPU microseconds, launches)} over `steps` calls of `run`."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch.profiler import profile, ProfilerActivity  # pylint: disable=g-import-not-at-top
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
      run()
    torch.cuda.synchronize()
  totals: Dict[str, List[float]] = collections.defaultdict(lambda: [0.0, 0])
  for event in prof.events():
    if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
      totals[event.name][0] += event.device_time
      totals[event.name][1] += 1
  return {name: (t, n) for name, (t, n) in totals.items()}


def report(name: str, times: Dict[str, Tuple[float, int]], steps: int, top: int) -> str:
  total = sum(t for t, _ in times.values()) / steps
  if not total:
    return f"## {name}: no GPU kernels recorded"
  kinds = collections.Counter()
  for kernel, (t, _) in times.items():
    kinds[kind_of(kernel)] += t / steps
  lines = [f"## {name}: {total / 1000:.2f} ms of kernels per step, "
           f"{sum(n for _, n in times.values()) / steps:.0f} launches per step",
           "by kind: " + ", ".join(f"{kind} {t / 1000:.2f} ms ({t / total:.0%})"
                                   for kind, t in kinds.most_common())]
  for kernel, (t, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[:top]:
    lines.append(f"{t / steps / 1000:8.3f} ms  x{n / steps:<4.0f} {kind_of(kernel):9s} "
                 f"{kernel[:150]}")
  return "\n".join(lines)


def main(argv):
  del argv
  config, opt, batch = gpu.GPT2_124M, gpu.GPT2_OPTIMIZER, 12
  arms = {
      "purejax, scanned, remat full (auto)": lambda: harness.purejax_train_arm(
          config, opt, batch, 1, forms=kernels.select("gpu")),
      "purejax, unrolled, remat none": lambda: harness.purejax_train_arm(
          config, opt, batch, 1, forms=kernels.select("gpu", scan_layers=False)),
      "torch twin (torch.compile, bf16 autocast, fused AdamW)": lambda: harness.torch_train_arm(
          config, opt, batch, 1, device="cuda", compile_model=True),
  }
  for name, make in arms.items():
    try:
      run = make()
      for _ in range(2):
        run()
      print(report(name, kernel_times(run, FLAGS.steps), FLAGS.steps, FLAGS.top), flush=True)
    except Exception as e:  # pylint: disable=broad-except  # the other arms still run
      print(f"## {name}: failed: {type(e).__name__}: {e}", flush=True)
    print(flush=True)


if __name__ == "__main__":
  flags.DEFINE_integer("steps", 3, "Profiled steps per arm.")
  flags.DEFINE_integer("top", 30, "Kernels listed per arm.")
  app.run(main)

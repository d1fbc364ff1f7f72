r"""Sliding windows on this CPU: the blocked attention's time with a window against
without, and the compile time of a scanned model of mixed layers by depth.

    python -m bench.sliding_window --out=bench/results/DATE-sliding-window.json

1. Attention alone, forward and backward (`jax.grad` of a sum), in the
   blocked form (`attention.causal_attention(form="blocked")`, the CPU's
   default) at T=1024, batch 4, 4 heads of 64, blocks of 64: full causal
   against a window of 128. The arms alternate in A B B A rounds,
   `--repeats` rounds (two runs of each arm a round); medians are reported,
   and their ratio (the target: <= 0.5).
2. Compile time (lower and compile, caches cleared before each) of a
   Gemma-style training step's gradient, scanned layers: 2 layers ("SL")
   against 12 ("SSSSSL" twice), alternated; medians and their ratio (the
   target: <= 1.3).
"""

import json
import platform
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from purejax import gpt
from purejax.ops import attention
from purejax.ops import kernels

flags.DEFINE_integer("repeats", 15, "Timed runs of each attention arm.")
flags.DEFINE_integer("compiles", 5, "Compiles of each depth.")
flags.DEFINE_string("out", None, "Where to write the results (JSON).")
FLAGS = flags.FLAGS


def attention_times(repeats: int) -> dict:
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(key, (4, 1024, 4, 64)) for key in keys)
  steps = {}
  for name, window in (("full", None), ("window_128", 128)):
    loss = lambda q, k, v, window=window: jnp.sum(
        attention.causal_attention(q, k, v, form="blocked", block=64, window=window))
    steps[name] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(steps[name](q, k, v))  # compile and warm up
  times = {name: [] for name in steps}
  order = list(steps)
  for _ in range(repeats):
    # A B, then B A: each arm follows the other as often as itself (the call right
    # after the full form's ran ~10 ms slower, whichever arm it was).
    for name in order + order[::-1]:
      start = time.perf_counter()
      jax.block_until_ready(steps[name](q, k, v))
      times[name].append(1e3 * (time.perf_counter() - start))
  medians = {name: statistics.median(t) for name, t in times.items()}
  return {"ms": medians, "ratio": medians["window_128"] / medians["full"], "runs_ms": times}


def compile_times(compiles: int) -> dict:
  def compile_seconds(n_layer, pattern):
    config = gpt.GPTConfig(**{**gpt.ARCHITECTURES["gemma3"], **dict(
        vocab_size=512, block_size=256, n_layer=n_layer, n_head=4, n_embd=128, n_kv_head=1,
        window=64, window_pattern=pattern)})
    params = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
    tokens = jax.ShapeDtypeStruct((8, 256), jnp.int32)
    step = jax.jit(jax.grad(lambda p, x: gpt.loss(
        p, x, x, config, forms=kernels.select("cpu", scan_layers=True))))
    jax.clear_caches()
    start = time.perf_counter()
    step.lower(params, tokens).compile()
    return time.perf_counter() - start

  arms = {"2_layers": (2, "SL"), "12_layers": (12, "SSSSSL")}
  times = {name: [] for name in arms}
  for _ in range(compiles):
    for name, (n_layer, pattern) in arms.items():
      times[name].append(compile_seconds(n_layer, pattern))
  medians = {name: statistics.median(t) for name, t in times.items()}
  return {"s": medians, "ratio": medians["12_layers"] / medians["2_layers"], "runs_s": times}


def main(argv):
  del argv
  results = {"machine": platform.processor() or platform.machine(),
             "cpus": jax.local_device_count(), "jax": jax.__version__,
             "attention_T1024_fwd_bwd": attention_times(FLAGS.repeats),
             "compile_mixed_layers": compile_times(FLAGS.compiles)}
  text = json.dumps(results, indent=1)
  print(text)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)

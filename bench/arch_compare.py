r"""The Llama-style block against GPT-2's on the Tiny Shakespeare character recipe.

    python -m bench.arch_compare                       # 3 seeds x 2 arms, 2000 steps each
    python -m bench.arch_compare --seeds=0 --max_iters=20 --time_rounds=2   # a smoke run

Both arms are nanoGPT's CPU recipe (4 layers, 4 heads, width 128, context
64, batch 12, its optimizer and schedule), trained through `python -m
purejax.train` as a user would; they differ only in `--arch`: GPT-2's block
(LayerNorm, learned positions, GELU MLP) or the Llama block (RMSNorm, RoPE,
SwiGLU at 8/3 the width, so the parameter counts match within 1 %). For
each arm it reports the median final val loss over the seeds, and the step
time of both in one process: the arms' jitted training calls alternate
(`bench.harness`), so both see the same machine load, and the ratio is the
median of the per-round ratios llama/gpt2. A
markdown table goes to stdout and everything to `--out` as JSON. Run it on a
quiet machine; every run trains in a subprocess of its own.
"""

import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from absl import app
from absl import flags
from absl import logging

from bench import harness

ARMS = ("gpt2", "llama")
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of each arm's training runs.")
  flags.DEFINE_integer("max_iters", 2000, "Training steps per run.")
  flags.DEFINE_integer("eval_iters", 200, "Batches of the final evaluation.")
  flags.DEFINE_integer("time_rounds", 30, "Alternating timed calls per arm.")
  flags.DEFINE_integer("steps_per_call", 10, "Steps per timed call.")
  flags.DEFINE_string("out", "bench/results/arch_compare.json", "Results file (JSON).")


def train_run(arch: str, seed: int, out_dir: str) -> float:
  """Final val loss of one `purejax.train` run of `arch`."""
  cmd = [sys.executable, "-m", "purejax.train", f"--arch={arch}", f"--seed={seed}",
         f"--out_dir={out_dir}", f"--max_iters={FLAGS.max_iters}",
         f"--eval_interval={FLAGS.max_iters}", f"--eval_iters={FLAGS.eval_iters}",
         "--sample_tokens=0", "--progress=false"]
  done = subprocess.run(cmd, capture_output=True, text=True,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), check=False)
  final = re.search(r"^final (\{.*\})$", done.stdout + done.stderr, re.M)
  if done.returncode or not final:
    raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): "
                       f"{(done.stderr or done.stdout)[-500:]}")
  return float(json.loads(final.group(1))["val_loss"])


def step_times() -> Dict[str, List[float]]:
  """Seconds per step of each arm, timed in alternation in this process."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from purejax import gpt  # pylint: disable=import-outside-toplevel
  from purejax.training.loops import recipes  # pylint: disable=import-outside-toplevel
  arms = {arm: (dataclasses.replace(recipes.SHAKESPEARE_CHAR, **gpt.ARCHITECTURES[arm]),
                recipes.GPT_OPTIMIZER) for arm in ARMS}
  return harness.recipe_step_times(arms, FLAGS.max_iters, FLAGS.time_rounds,
                                   FLAGS.steps_per_call)


def param_counts() -> Dict[str, int]:
  import dataclasses  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from purejax import gpt  # pylint: disable=import-outside-toplevel
  from purejax.training.loops import recipes  # pylint: disable=import-outside-toplevel
  counts = {}
  for arm in ARMS:
    config = dataclasses.replace(recipes.SHAKESPEARE_CHAR, **gpt.ARCHITECTURES[arm])
    shapes = jax.eval_shape(lambda k, c=config: gpt.init_params(c, k), jax.random.PRNGKey(0))
    counts[arm] = sum(x.size for x in jax.tree.leaves(shapes))
  return counts


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # JAX's backend probing at INFO
  seeds = [int(s) for s in FLAGS.seeds]
  losses = {arm: [] for arm in ARMS}
  with tempfile.TemporaryDirectory() as scratch:
    for seed in seeds:
      for arm in ARMS:
        losses[arm].append(train_run(arch=arm, seed=seed,
                                     out_dir=os.path.join(scratch, f"{arm}-{seed}")))
        print(f"{arm} seed {seed}: val loss {losses[arm][-1]:.4f}", flush=True)
  times = step_times()
  counts = param_counts()
  summary = harness.summarise(times, "gpt2", "s/step")
  medians = {arm: 1e3 * summary[arm]["median"] for arm in ARMS}
  rows = ["| block | params (all) | val loss, median of seeds | val losses | ms/step (median) |",
          "| --- | --- | --- | --- | --- |"]
  for arm in ARMS:
    rows.append(f"| {arm} | {counts[arm]:,} | **{statistics.median(losses[arm]):.4f}** | "
                f"{', '.join(f'{x:.4f}' for x in losses[arm])} | {medians[arm]:.2f} |")
  ratio = summary["llama"]["ratio"]
  print("\n".join(rows))
  print(f"\nstep time llama / gpt2: **{ratio:.3f}x** (median of the per-round ratios over "
        f"{FLAGS.time_rounds} alternating calls of {FLAGS.steps_per_call} steps; seeds "
        f"{seeds}, {FLAGS.max_iters} steps)")
  import jax  # pylint: disable=import-outside-toplevel
  result = {"command": " ".join(["python -m bench.arch_compare"] + sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
            "seeds": seeds, "max_iters": FLAGS.max_iters, "params": counts,
            "val_loss": losses, "step_times": summary, "step_time_ratio": ratio}
  out = pathlib.Path(FLAGS.out)
  harness.write_results(out, result)
  print(f"wrote {out}")


if __name__ == "__main__":
  define_flags()
  app.run(main)

"""Muon's train step against AdamW's on nanoGPT's CPU recipe, alternated in one run.

    python -m bench.optimizers                 # 4L/4H/128, T=64, B=12, 10 steps per call
    python -m bench.optimizers --quick         # a smoke run

Both arms are `steps.train_steps` of the same model, batch and schedule
(`loop.SHAKESPEARE_CHAR`, `loop.GPT_OPTIMIZER`), one with `--optimizer=muon`
(Newton-Schulz on the blocks' matrices, AdamW on the rest). Each round times
one call of each; the first call of each compiles and is not timed. It prints
each arm's median ms per step and the median per-round ratio muon/adamw (the
target: at most 1.3), by the wall clock and by the process's CPU time (all
its threads: on a machine other jobs load, the CPU time a step takes is
steadier than its wall time), and writes them to
`bench/results/<date>-optimizers.json`.
"""

import dataclasses
import datetime
import json
import pathlib
import time

from absl import app
from absl import flags

from bench import harness
from purejax.training import loop

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_integer("rounds", 21, "Rounds of the alternation.")
  flags.DEFINE_integer("steps_per_call", 10, "Steps per jitted call.")
  flags.DEFINE_bool("quick", False, "Few rounds: a smoke run.")
  flags.DEFINE_string("out", None, "Results file (default bench/results/<date>-optimizers.json).")


def main(argv):
  del argv
  config, batch_size = loop.SHAKESPEARE_CHAR, loop.GPTTrainConfig().batch_size
  adamw = dataclasses.replace(loop.GPT_OPTIMIZER, decay_iters=1000)
  rounds = 3 if FLAGS.quick else FLAGS.rounds
  cpu = {}

  def timed(name, arm):
    def run():
      start = time.process_time()
      seconds = arm()
      cpu.setdefault(name, []).append((time.process_time() - start) / FLAGS.steps_per_call)
      return seconds
    return run

  arms = {name: timed(name, harness.purejax_train_arm(
              config, dataclasses.replace(adamw, name=name), batch_size, FLAGS.steps_per_call))
          for name in ("adamw", "muon")}
  rows = harness.summarise(harness.alternate(arms, rounds), "adamw", "s/iter")
  cpu_rows = harness.summarise(cpu, "adamw", "CPU s/iter")
  for clock, table in (("wall", rows), ("CPU", cpu_rows)):
    for name, row in table.items():
      ratio = (f", {row['ratio']:.3f}x adamw (min {row['ratio_min']:.3f}, max "
               f"{row['ratio_max']:.3f})" if "ratio" in row else "")
      print(f"{name}: median {1000 * row['median']:.3f} {clock} ms/iter over {row['n']} "
            f"rounds{ratio}")
  results = {"case": "optimizers", "model": str(config), "batch_size": batch_size,
             "steps_per_call": FLAGS.steps_per_call, "rows": rows, "cpu_rows": cpu_rows}
  out = pathlib.Path(FLAGS.out) if FLAGS.out else harness.unused_results_path(
      pathlib.Path(__file__).parent / "results",
      f"{datetime.date.today().isoformat()}-optimizers")
  harness.write_results(out, results)
  print(f"results: {out}")
  print(json.dumps({"muon_vs_adamw": rows["muon"]["ratio"],
                    "muon_vs_adamw_cpu_time": cpu_rows["muon"]["ratio"]}))


if __name__ == "__main__":
  define_flags()
  app.run(main)

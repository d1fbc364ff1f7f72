"""Muon's train step against AdamW's on nanoGPT's CPU recipe, alternated in one run.

    python -m bench.optimizers                 # 4L/4H/128, T=64, B=12, 10 steps per call
    python -m bench.optimizers --quick         # a smoke run

The purejax arms are `steps.train_steps` of the same model, batch and
schedule (`recipes.SHAKESPEARE_CHAR`, `recipes.GPT_OPTIMIZER`), one with
`--optimizer=muon` (Newton-Schulz on the blocks' matrices, AdamW on the
rest). The peer's arms are the PyTorch twin's step (`harness.torch_train_arm`)
with AdamW, with PyTorch's own Muon (`torch.optim.Muon` on the blocks'
matrices, AdamW on the rest: `torch_gpt.MuonAdamW`; its Newton-Schulz runs in
bf16, as the reference's) and with the same Muon in float32, same rates. Each round
times one call of each arm; the first call of each is not timed. It prints
each arm's median ms per step and the median per-round ratio muon/adamw of
each library (purejax's target: at most 1.3), by the wall clock and by the
process's CPU time (all its threads: on a machine other jobs load, the CPU
time a step takes is steadier than its wall time), and writes them to
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
from purejax.optimizers import optim
from purejax.training.loops import gpt_loop
from purejax.training.loops import recipes

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_integer("rounds", 21, "Rounds of the alternation.")
  flags.DEFINE_integer("steps_per_call", 10, "Steps per jitted call.")
  flags.DEFINE_bool("quick", False, "Few rounds: a smoke run.")
  flags.DEFINE_bool("torch", True, "Also time the PyTorch twin with AdamW and with torch's Muon.")
  flags.DEFINE_integer("muon_ns_steps", 5, "Newton-Schulz steps of both libraries' Muon.")
  flags.DEFINE_enum("muon_ns_coeffs", "keller", ["keller", "minimax"], "purejax's quintics "
                    "(PyTorch's Muon has Keller Jordan's only; a step costs the same with "
                    "either).")
  flags.DEFINE_string("out", None, "Results file (default bench/results/<date>-optimizers.json).")


def main(argv):
  del argv
  config, batch_size = recipes.SHAKESPEARE_CHAR, gpt_loop.GPTTrainConfig().batch_size
  # The twin's `c_attn` is one Linear, which PyTorch's Muon orthogonalises whole:
  # so does purejax's arm here (`muon_split_qkv=False`), for the same work.
  adamw = dataclasses.replace(recipes.GPT_OPTIMIZER, decay_iters=1000)
  optimizers = {"adamw": adamw, "muon": optim.replace(
      adamw, name="muon", muon_ns_steps=FLAGS.muon_ns_steps, muon_split_qkv=False,
      muon_ns_coeffs=FLAGS.muon_ns_coeffs)}
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
              config, optimizers[name], batch_size, FLAGS.steps_per_call))
          for name in ("adamw", "muon")}
  reference = {"muon": "adamw"}
  if FLAGS.torch:
    for arm, name, float32 in (("torch_adamw", "adamw", False), ("torch_muon", "muon", False),
                               ("torch_muon_float32", "muon", True)):
      arms[arm] = timed(arm, harness.torch_train_arm(
          config, optimizers[name], batch_size, FLAGS.steps_per_call,
          muon_float32=float32))
      if name == "muon":
        reference[arm] = "torch_adamw"
  rows = harness.summarise(harness.alternate(arms, rounds), reference, "s/iter")
  cpu_rows = harness.summarise(cpu, reference, "CPU s/iter")
  for clock, table in (("wall", rows), ("CPU", cpu_rows)):
    for name, row in table.items():
      ratio = (f", {row['ratio']:.3f}x {row['vs']} (min {row['ratio_min']:.3f}, max "
               f"{row['ratio_max']:.3f})" if "ratio" in row else "")
      print(f"{name}: median {1000 * row['median']:.3f} {clock} ms/iter over {row['n']} "
            f"rounds{ratio}")
  results = {"case": "optimizers", "model": str(config), "batch_size": batch_size,
             "muon_ns_steps": FLAGS.muon_ns_steps, "muon_ns_coeffs": FLAGS.muon_ns_coeffs,
             "steps_per_call": FLAGS.steps_per_call, "rows": rows, "cpu_rows": cpu_rows}
  out = pathlib.Path(FLAGS.out) if FLAGS.out else harness.unused_results_path(
      pathlib.Path(__file__).parent / "results",
      f"{datetime.date.today().isoformat()}-optimizers")
  harness.write_results(out, results)
  print(f"results: {out}")
  print(json.dumps({f"{name}_vs_{row['vs']}" + suffix: row["ratio"]
                    for table, suffix in ((rows, ""), (cpu_rows, "_cpu_time"))
                    for name, row in table.items() if "ratio" in row}))


if __name__ == "__main__":
  define_flags()
  app.run(main)

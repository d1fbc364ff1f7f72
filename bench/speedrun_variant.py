"""One variant of `bench.speedrun`'s recipes, trained at a given number of steps.

    python -m bench.speedrun_variant --name=ns4 --base=modern --steps=1605 \
        --optimizer='{"muon_ns_steps": 4}'
    python -m bench.speedrun_variant --name=llama --base=llama --steps=2031

A variant is a recipe of `bench.speedrun.RECIPES` (`--base`) with some
`GPTConfig` fields (`--model`, JSON) and `OptimizerConfig` fields
(`--optimizer`, JSON) changed. Each seed trains `--steps` steps on a schedule
that ends there, at the cpu size, through `bench.speedrun.child` (a run is
deterministic given its steps), evaluated at its last step. For an
equal-wall-time comparison take the steps from one timing of all the arms
(`bench.speedrun.step_times`, as `python -m bench.speedrun` does). Prints one
line per seed and the median val bits per byte; appends them to `--out`.
"""

import json
import os
import statistics
import tempfile
import time

from absl import app
from absl import flags

from bench import speedrun
from purejax.optimizers import optim

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("name", None, "The variant's name.", required=True)
  flags.DEFINE_enum("base", "modern", list(speedrun.RECIPES), "The recipe it changes.")
  flags.DEFINE_integer("steps", None, "Steps of each run (its schedule's end).", required=True)
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
  flags.DEFINE_string("model", "{}", "GPTConfig fields changed, as JSON.")
  flags.DEFINE_string("optimizer", "{}", "OptimizerConfig fields changed, as JSON.")
  flags.DEFINE_string("out", "bench/results/speedrun-variants.jsonl", "Results (JSON lines).")


def main(argv):
  del argv
  options, optimizer = speedrun.RECIPES[FLAGS.base]
  model, opt = json.loads(FLAGS.model), json.loads(FLAGS.optimizer)
  speedrun.RECIPES[FLAGS.name] = ({**options, **model}, optim.replace(optimizer, **opt))
  size = speedrun.SIZES["cpu"]
  finals = []
  with tempfile.TemporaryDirectory() as scratch:
    # A variant trains on its base's tokens.
    bpe_file = speedrun.train_bpe(scratch) if speedrun.uses_bpe(FLAGS.base) else None
    for seed in (int(s) for s in FLAGS.seeds):
      out_dir = os.path.join(scratch, f"{FLAGS.name}-{seed}")
      speedrun.child(dict(size="cpu", arm=FLAGS.name, seed=seed, steps=FLAGS.steps,
                          schedule_steps=FLAGS.steps, eval_interval=FLAGS.steps,
                          eval_iters=size.eval_iters, out_dir=out_dir,
                          tokenizer_file=bpe_file))
      with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
      last = [r for r in records if r.get("kind") == "eval"][-1]
      finals.append({"seed": seed, "val_loss": last["val_loss"], "val_bpb": last["val_bpb"]})
      print(f"{FLAGS.name} seed {seed}, {FLAGS.steps} steps: val loss {last['val_loss']:.4f}, "
            f"val bpb {last['val_bpb']:.4f}", flush=True)
  median = statistics.median(r["val_bpb"] for r in finals)
  print(f"{FLAGS.name}: median val bpb {median:.4f}")
  with open(FLAGS.out, "a", encoding="utf-8") as f:
    f.write(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "name": FLAGS.name, "base": FLAGS.base, "model": model,
                        "optimizer": opt, "steps": FLAGS.steps, "runs": finals,
                        "median_val_bpb": median}) + "\n")


if __name__ == "__main__":
  define_flags()
  app.run(main)

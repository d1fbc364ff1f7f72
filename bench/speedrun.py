r"""A speedrun on Tiny Shakespeare: nanoGPT's recipe against today's (nanochat's block + Muon).

    python -m bench.speedrun                                  # 3 seeds, every arm; ~1 h on 2 cores
    python -m bench.speedrun --seeds=0 --ablations=false --scale=0.05   # a smoke run
    python -m bench.speedrun --seeds= --ablation_seeds=0    # the ablations alone

Every arm trains the character-level Tiny Shakespeare model at nanoGPT's
CPU recipe's parameter count (~0.8M), batch (12) and context (64):

- `nanogpt`: the recipe itself, GPT-2's block with AdamW for 2000 steps. Its
  median final val loss over the seeds is the target.
- `llama`: the Llama block with the same AdamW, the best recipe before this
  one, trained for the nanoGPT recipe's wall time.
- `modern`: nanochat's block (`--arch=nanochat`) with Muon on the blocks'
  matrices, trained for the nanoGPT recipe's wall time.
- `modern_speedrun`: the same recipe on a schedule of `--speedrun_steps`
  steps, the speedrun proper: the time until its val loss first reaches the
  target.

Wall time is steps times the arm's median step time, and the step times are
measured in one process with the arms' jitted training calls alternated
(`bench.harness.alternate`), so every arm sees the same machine; evaluation
and compilation are not counted, as in modded-nanogpt's record times.
"Equal wall time" gives every arm `round(budget / its ms per step)` steps,
the budget being the nanoGPT recipe's 2000 steps. Each run trains in a
process of its own through `loop.train_gpt` and logs its evaluations to its
`metrics.jsonl`, whose `val_loss` and `val_bpb` (bits per UTF-8 byte) are
read here.

The ablations take one piece out of the modern recipe at a time and train it
on the speedrun's schedule, so each row says what that piece buys in val
loss at the same step count, and what it costs per step.
"""

import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from absl import app
from absl import flags
from absl import logging

from bench import harness
from purejax import gpt
from purejax.training import loop

FLAGS = flags.FLAGS
REFERENCE_STEPS = 2000  # the nanoGPT recipe's steps

# The modern recipe's optimizer: Muon on the blocks' matrices, AdamW (the
# recipe's betas, decay and clipping) on embeddings, head and value embeddings.
MODERN_OPTIMIZER = dataclasses.replace(
    loop.GPT_OPTIMIZER, name="muon", learning_rate=1e-2, min_lr=1e-4, warmup_iters=20,
    muon_learning_rate=1e-2)

# arm -> (GPTConfig options, OptimizerConfig)
RECIPES = {
    "nanogpt": ({}, loop.GPT_OPTIMIZER),
    "llama": (gpt.ARCHITECTURES["llama"], loop.GPT_OPTIMIZER),
    "modern": (gpt.ARCHITECTURES["nanochat"], MODERN_OPTIMIZER),
}

# ablation -> what it changes in the modern recipe: (GPTConfig options, optimizer)
ABLATIONS = {
    "AdamW instead of Muon": ({}, dataclasses.replace(loop.GPT_OPTIMIZER, warmup_iters=20)),
    "no QK-norm": (dict(qk_norm=False), None),
    "GELU MLP instead of ReLU^2": (dict(mlp="gelu"), None),
    "no logit soft-cap": (dict(logit_softcap=None), None),
    "random-init projections": (dict(zero_init_proj=False), None),
    "tied head": (dict(tie_embeddings=True), None),
    "no value embeddings": (dict(value_embeds=False), None),
    "learned positions instead of RoPE": (dict(position="learned"), None),
    "RMSNorm with scales, no embedding norm": (dict(norm_scale=True, embed_norm=False), None),
}


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of each recipe's runs (none: the "
                    "ablations alone).")
  flags.DEFINE_integer("speedrun_steps", 400, "Steps of the modern recipe's speedrun schedule.")
  flags.DEFINE_float("scale", 1.0, "Multiplies every run's steps (a smoke run: 0.05).")
  flags.DEFINE_bool("ablations", True, "Also train the ablations (seeds: --ablation_seeds).")
  flags.DEFINE_list("ablation_seeds", ["0", "1", "2"], "Seeds of each ablation.")
  flags.DEFINE_integer("eval_iters", 200, "Batches of every evaluation.")
  flags.DEFINE_integer("speedrun_eval_interval", 25, "Steps between the speedrun's evaluations.")
  flags.DEFINE_integer("time_rounds", 20, "Alternating timed calls per arm.")
  flags.DEFINE_integer("steps_per_call", 10, "Steps per timed call.")
  flags.DEFINE_string("child", None, "Internal: one run, as JSON.")
  flags.DEFINE_string("out", "bench/results/speedrun.json", "Results file (JSON).")


def arm_configs(name: str):
  """`(GPTConfig, OptimizerConfig)` of a recipe or an ablation of the modern recipe."""
  if name in RECIPES:
    options, optimizer = RECIPES[name]
  else:
    changes, optimizer = ABLATIONS[name]
    options = {**RECIPES["modern"][0], **changes}
    optimizer = optimizer or RECIPES["modern"][1]
  return dataclasses.replace(loop.SHAKESPEARE_CHAR, **options), optimizer


# ----------------------------------------------------------------------------
# One run, in a process of its own


def child(spec: dict) -> None:
  """Trains one run (`spec`: arm, seed, steps, eval_interval, eval_iters, out_dir)."""
  from purejax.data import corpus  # pylint: disable=import-outside-toplevel
  from purejax.training import runs  # pylint: disable=import-outside-toplevel
  config, optimizer = arm_configs(spec["arm"])
  text = corpus.load_corpus("tiny_shakespeare", tokenizer="char")
  train = loop.GPTTrainConfig(
      max_iters=spec["steps"], eval_interval=spec["eval_interval"],
      eval_iters=spec["eval_iters"], log_interval=spec["eval_interval"],
      sample_tokens=0, seed=spec["seed"], progress=False,
      checkpoint_every=spec["steps"])
  loop.train_gpt(config, text, train, optimizer, runs.RunConfig(out_dir=spec["out_dir"]))


def train_run(arm: str, seed: int, steps: int, eval_interval: int, scratch: str) -> List[dict]:
  """The evaluations `{"step", "val_loss", "val_bpb"}` of one run of `arm`."""
  out_dir = os.path.join(scratch, f"{arm}-{seed}-{steps}".replace(" ", "_"))
  spec = dict(arm=arm, seed=seed, steps=steps, eval_interval=eval_interval,
              eval_iters=FLAGS.eval_iters, out_dir=out_dir)
  cmd = [sys.executable, "-m", "bench.speedrun", f"--child={json.dumps(spec)}"]
  done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  if done.returncode:
    raise RuntimeError(f"{arm} seed {seed} failed ({done.returncode}): "
                       f"{(done.stderr or done.stdout)[-800:]}")
  with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  return [{k: r[k] for k in ("step", "val_loss", "val_bpb")}
          for r in records if r.get("kind") == "eval" and r["step"] > 0]


# ----------------------------------------------------------------------------
# Step times, alternated in one process


def step_times(arms: List[str]) -> Dict[str, List[float]]:
  """Seconds per step of each arm, its jitted training calls alternated in this process."""
  return harness.recipe_step_times({arm: arm_configs(arm) for arm in arms}, REFERENCE_STEPS,
                                   FLAGS.time_rounds, FLAGS.steps_per_call)


def param_count(arm: str) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  config, _ = arm_configs(arm)
  shapes = jax.eval_shape(lambda k: gpt.init_params(config, k), jax.random.PRNGKey(0))
  return sum(x.size for x in jax.tree.leaves(shapes))


# ----------------------------------------------------------------------------
# The measures


def first_reaching(evals: List[dict], target: float) -> Optional[int]:
  """The first evaluated step whose val loss is at most `target`, or None."""
  return next((e["step"] for e in evals if e["val_loss"] <= target), None)


def median(xs) -> Optional[float]:
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else None


def recipe_runs(seeds: List[int], ms: Dict[str, float], equal_steps: Dict[str, int],
                speedrun_steps: int, scratch: str, out: pathlib.Path, result: dict) -> None:
  """The recipes at equal wall time, and the speedrun; their measures into `result`."""
  runs = {arm: [] for arm in list(RECIPES) + ["modern_speedrun"]}
  every = max(1, min(FLAGS.speedrun_eval_interval, speedrun_steps))
  for seed in seeds:
    for arm in RECIPES:
      steps = equal_steps[arm]
      runs[arm].append(train_run(arm, seed, steps, steps, scratch))
      print(f"{arm} seed {seed}, {steps} steps: {runs[arm][-1][-1]}", flush=True)
    runs["modern_speedrun"].append(train_run("modern", seed, speedrun_steps, every, scratch))
    print(f"modern_speedrun seed {seed}: {runs['modern_speedrun'][-1][-1]}", flush=True)
    result["runs"] = runs
    harness.write_results(out, result)

  final = lambda arm, key: median(r[-1][key] for r in runs[arm])
  target = final("nanogpt", "val_loss")
  reached = [first_reaching(r, target) for r in runs["modern_speedrun"]]
  reach_ms = [None if s is None else s * ms["modern"] for s in reached]
  reference_ms = REFERENCE_STEPS * ms["nanogpt"]
  time_fraction = (None if any(x is None for x in reach_ms)
                   else median(reach_ms) / reference_ms)
  bpb = {arm: final(arm, "val_bpb") for arm in RECIPES}
  result.update(
      target_val_loss=target, speedrun_steps_to_target=reached,
      speedrun_time_fraction=time_fraction, equal_time_val_bpb=bpb,
      equal_time_val_loss={arm: final(arm, "val_loss") for arm in RECIPES},
      modern_bpb_vs_llama=bpb["modern"] / bpb["llama"] - 1)
  harness.write_results(out, result)

  print(f"\ntarget: the nanoGPT recipe's val loss after {REFERENCE_STEPS} steps, median of "
        f"seeds {seeds}: {target:.4f} ({reference_ms / 1e3:.1f} s of training)")
  print(f"modern speedrun ({speedrun_steps} steps): first reaches it at steps {reached}; "
        + ("not reached by every seed" if time_fraction is None else
           f"{median(reach_ms) / 1e3:.1f} s, **{100 * time_fraction:.1f} %** of the "
           f"nanoGPT recipe's time"))
  rows = ["| recipe | params | ms/step | steps | val loss (median) | val bpb (median) | "
          "val bpb, seeds |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
  for arm in RECIPES:
    seeds_bpb = ", ".join(f"{r[-1]['val_bpb']:.4f}" for r in runs[arm])
    rows.append(f"| {arm} | {result['params'][arm]:,} | {ms[arm]:.1f} | {equal_steps[arm]} | "
                f"{final(arm, 'val_loss'):.4f} | **{bpb[arm]:.4f}** | {seeds_bpb} |")
  print("\nequal wall time:\n" + "\n".join(rows))
  print(f"modern vs llama val bpb: {100 * result['modern_bpb_vs_llama']:+.2f} %")


def ablation_runs(seeds: List[int], ms: Dict[str, float], steps: int, scratch: str,
                  out: pathlib.Path, result: dict) -> None:
  """The modern recipe and each ablation on the speedrun's schedule; into `result`."""
  runs = {}
  for name in ["modern"] + list(ABLATIONS):
    runs[name] = [train_run(name, seed, steps, steps, scratch) for seed in seeds]
    print(f"{name}: {[r[-1] for r in runs[name]]}", flush=True)
    result["ablation_runs"] = runs
    harness.write_results(out, result)
  loss = {name: median(r[-1]["val_loss"] for r in rs) for name, rs in runs.items()}
  rows = ["| modern recipe, minus | params | ms/step | val loss (median) | vs modern |",
          "| --- | ---: | ---: | ---: | ---: |",
          f"| (nothing) | {result['params']['modern']:,} | {ms['modern']:.1f} | "
          f"{loss['modern']:.4f} | |"]
  for name in ABLATIONS:
    rows.append(f"| {name} | {result['params'][name]:,} | {ms[name]:.1f} | {loss[name]:.4f} | "
                f"{loss[name] - loss['modern']:+.4f} |")
  print(f"\nablations ({steps} steps, seeds {seeds}):\n" + "\n".join(rows))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if FLAGS.child:
    child(json.loads(FLAGS.child))
    return
  seeds = [int(s) for s in FLAGS.seeds]
  ablation_seeds = [int(s) for s in FLAGS.ablation_seeds] if FLAGS.ablations else []
  arms = list(RECIPES) + (list(ABLATIONS) if ablation_seeds else [])
  out = pathlib.Path(FLAGS.out)
  result = {"command": " ".join(["python -m bench.speedrun"] + sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu_count": os.cpu_count(), "seeds": seeds, "ablation_seeds": ablation_seeds,
            "recipes": {arm: {"model": RECIPES[arm][0], "optimizer": dataclasses.asdict(
                RECIPES[arm][1])} for arm in RECIPES},
            "params": {arm: param_count(arm) for arm in arms}}

  # Step times: every arm alternated in this process.
  summary = harness.summarise(step_times(arms), "nanogpt", "s/step")
  ms = {arm: 1e3 * row["median"] for arm, row in summary.items()}
  budget_ms = REFERENCE_STEPS * ms["nanogpt"]
  equal_steps = {arm: max(1, round(FLAGS.scale * budget_ms / ms[arm])) for arm in RECIPES}
  equal_steps["nanogpt"] = round(FLAGS.scale * REFERENCE_STEPS)
  result.update(step_times=summary, equal_time_steps=equal_steps)
  print("ms/step: " + ", ".join(f"{arm} {ms[arm]:.1f}" for arm in ms), flush=True)
  speedrun_steps = max(1, round(FLAGS.scale * FLAGS.speedrun_steps))
  with tempfile.TemporaryDirectory() as scratch:
    if seeds:
      recipe_runs(seeds, ms, equal_steps, speedrun_steps, scratch, out, result)
    if ablation_seeds:
      ablation_runs(ablation_seeds, ms, speedrun_steps, scratch, out, result)
  print(f"wrote {out}")


if __name__ == "__main__":
  define_flags()
  app.run(main)

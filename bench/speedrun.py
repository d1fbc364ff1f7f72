r"""A speedrun on Tiny Shakespeare: nanoGPT's recipe against today's (nanochat's block + Muon).

    python -m bench.speedrun                                  # 3 seeds, every arm; ~1 h on 2 cores
    python -m bench.speedrun --seeds=0 --ablations=false --scale=0.05   # a smoke run
    python -m bench.speedrun --seeds= --ablation_seeds=0    # the ablations alone
    python -m bench.speedrun --size=gpu --ablations=false --parallel=6  # on a GPU, ~7 min

Every arm trains the character-level Tiny Shakespeare model at one of
nanoGPT's recipes' sizes (`--size`, `SIZES`): the CPU recipe's parameter
count (~0.8M), batch (12) and context (64), or the GPU recipe's (6 layers,
384 wide, T=256, batch 64, dropout 0.2, bf16; ~10.7M):

- `nanogpt`: the recipe itself, GPT-2's block with AdamW on the recipe's
  schedule (cpu: 2000 steps; gpu: the first 2500 of its 5000). The median
  over seeds of its best evaluated val loss is the target (on the cpu it
  is evaluated once, at the end; on the gpu every 250 steps, since its val
  loss bottoms out near step 1750 and then rises).
- `llama`: the Llama block with the same AdamW, the best recipe before this
  one, trained for the nanoGPT recipe's wall time.
- `modern`: nanochat's block (`--arch=nanochat`, but with RMSNorm's learned
  scales and no embedding norm) with Muon on the blocks' matrices (3 minimax
  Newton-Schulz steps), trained for the nanoGPT recipe's wall time.
- `modern_speedrun`: the same recipe on a schedule of `--speedrun_steps`
  steps, the speedrun proper: the time until its val loss first reaches the
  target, against the nanoGPT recipe's time to its best evaluation.
- `llama_bpe` and `modern_bpe`: the Llama block with AdamW, and the modern
  recipe (without value embeddings), each on a byte-level BPE of
  `BPE_VOCAB_SIZE` tokens trained on the corpus's train split with its own
  bytes as the alphabet (`bpe_train`, `alphabet="corpus"`), as nanochat
  trains its own tokenizer. Bits per byte compare them with the character
  arms; val loss (nats per token) does not.

Wall time is steps times the arm's median step time, and the step times are
measured in one process with the arms' jitted training calls alternated
(`bench.harness.alternate`), before any run trains, so every arm sees the
same machine; evaluation and compilation are not counted, as in
modded-nanogpt's record times. "Equal wall time" gives every arm
`round(budget / its ms per step)` steps, the budget being the nanoGPT
recipe's steps. Each run trains in a process of its own through
`gpt_loop.train_gpt` (`--parallel` of them at a time) and logs its evaluations
to its `metrics.jsonl`, whose `val_loss` and `val_bpb` (bits per UTF-8 byte)
are read here.

The ablations take one piece out of the modern recipe at a time (or put
back nanochat's choice, or the reference's Newton-Schulz) and train it on
the speedrun's schedule, so each row says what that piece buys in val loss
at the same step count, and what it costs per step.
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
from concurrent import futures
from typing import Dict, List, Optional

from absl import app
from absl import flags
from absl import logging

from bench import harness
from purejax import gpt
from purejax.optimizers import optim
from purejax.training.loops import gpt_loop
from purejax.training.loops import recipes

FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Size:
  """One size of the speedrun: the nanoGPT recipe's model, batch and schedule there.

  Attributes:
    model: the nanoGPT recipe's model (every arm changes only the block).
    batch_size: sequences per step.
    schedule_steps: the nanoGPT recipe's cosine schedule, in steps.
    reference_steps: steps the nanoGPT recipe trains here (its schedule's first
      `reference_steps`); also the equal-wall-time budget, in its steps.
    reference_eval_interval: steps between the nanoGPT recipe's evaluations.
    speedrun_steps: the modern recipe's speedrun schedule (default of
      `--speedrun_steps`).
    eval_iters: batches per evaluation (default of `--eval_iters`).
  """
  model: gpt.GPTConfig
  batch_size: int
  schedule_steps: int
  reference_steps: int
  reference_eval_interval: int
  speedrun_steps: int
  eval_iters: int


SIZES = {
    # nanoGPT's CPU recipe: 4L/128, T=64, batch 12, 2000 steps, evaluated at the end.
    "cpu": Size(recipes.SHAKESPEARE_CHAR, batch_size=12, schedule_steps=2000,
                reference_steps=2000, reference_eval_interval=2000, speedrun_steps=400,
                eval_iters=200),
    # nanoGPT's GPU recipe (config/train_shakespeare_char.py): 6L/384, T=256, batch 64,
    # dropout 0.2, a 5000-step schedule, bf16 matmuls. Its val loss bottoms out near
    # step 1750 and then rises (the model overfits), so the run stops at 2500 and its
    # target is its best evaluation, as nanoGPT reports it.
    "gpu": Size(dataclasses.replace(recipes.SHAKESPEARE_CHAR, block_size=256, n_layer=6,
                                    n_head=6, n_embd=384, dropout=0.2,
                                    compute_dtype="bfloat16"),
                batch_size=64, schedule_steps=5000, reference_steps=2500,
                reference_eval_interval=250, speedrun_steps=1000, eval_iters=100),
}

# The modern recipe: the library's (`recipes.RECIPES["modern"]`, which
# `python -m purejax.train --recipe=modern` trains): its optimizer, and its
# block as GPTConfig options.
MODERN_OPTIMIZER = recipes.RECIPES["modern"].optimizer
MODERN_BLOCK = recipes.RECIPES["modern"].block_options()

# The BPE arms' tokenizer: byte-level BPE over the train split's own bytes
# (Tiny Shakespeare has 65), nanochat's split pattern.
BPE_VOCAB_SIZE = 256

# arm -> (GPTConfig options, OptimizerConfig)
RECIPES = {
    "nanogpt": ({}, recipes.GPT_OPTIMIZER),
    "llama": (gpt.ARCHITECTURES["llama"], recipes.GPT_OPTIMIZER),
    "modern": (MODERN_BLOCK, MODERN_OPTIMIZER),
    "llama_bpe": ({**gpt.ARCHITECTURES["llama"], "vocab_size": BPE_VOCAB_SIZE},
                  recipes.GPT_OPTIMIZER),
    # Value embeddings are `vocab x kv width` tables: 65k parameters at 256 tokens,
    # which would put this arm 14 % above the nanoGPT recipe's size (6 % without).
    "modern_bpe": ({**MODERN_BLOCK, "value_embeds": False, "vocab_size": BPE_VOCAB_SIZE},
                   MODERN_OPTIMIZER),
}


def uses_bpe(arm: str) -> bool:
  """Whether `arm` trains on the BPE tokenizer (`train_bpe`) instead of characters."""
  return arm.endswith("_bpe")


def train_bpe(folder: str) -> str:
  """The BPE arms' tokenizer, trained on the train split into `folder`; its path."""
  from purejax.data import bpe_train  # pylint: disable=import-outside-toplevel
  with bpe_train.corpus_text("tiny_shakespeare") as chunks:
    tok = bpe_train.train(chunks, BPE_VOCAB_SIZE, split="nanochat", alphabet="corpus")
  path = os.path.join(folder, f"bpe-{BPE_VOCAB_SIZE}.json")
  tok.save(path)
  return path

# ablation -> what it changes in the modern recipe: (GPTConfig options, optimizer)
ABLATIONS = {
    "AdamW instead of Muon": ({}, dataclasses.replace(recipes.GPT_OPTIMIZER, warmup_iters=20)),
    "no QK-norm": (dict(qk_norm=False), None),
    "GELU MLP instead of ReLU^2": (dict(mlp="gelu"), None),
    "no logit soft-cap": (dict(logit_softcap=None), None),
    "random-init projections": (dict(zero_init_proj=False), None),
    "tied head": (dict(tie_embeddings=True), None),
    "no value embeddings": (dict(value_embeds=False), None),
    "learned positions instead of RoPE": (dict(position="learned"), None),
    "nanochat's norms: no scales, embedding norm": (dict(norm_scale=False, embed_norm=True),
                                                    None),
    "Keller Jordan's quintic, 3 steps": (
        {}, optim.replace(MODERN_OPTIMIZER, muon_ns_coeffs="keller")),
    "Keller Jordan's quintic, 5 steps": (
        {}, optim.replace(MODERN_OPTIMIZER, muon_ns_coeffs="keller", muon_ns_steps=5)),
    "qkv as three matrices": ({}, optim.replace(MODERN_OPTIMIZER, muon_split_qkv=True)),
}


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_enum("size", "cpu", list(SIZES), "The nanoGPT recipe's size: cpu (4L/128, "
                    "T=64, batch 12) or gpu (6L/384, T=256, batch 64, dropout 0.2).")
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of each recipe's runs (none: the "
                    "ablations alone).")
  flags.DEFINE_integer("speedrun_steps", None, "Steps of the modern recipe's speedrun "
                       "schedule (default: the size's, 400 on cpu, 1000 on gpu).")
  flags.DEFINE_float("scale", 1.0, "Multiplies every run's steps (a smoke run: 0.05).")
  flags.DEFINE_bool("ablations", True, "Also train the ablations (seeds: --ablation_seeds).")
  flags.DEFINE_list("ablation_seeds", ["0", "1", "2"], "Seeds of each ablation.")
  flags.DEFINE_integer("eval_iters", None, "Batches of every evaluation (default: the "
                       "size's, 200 on cpu, 100 on gpu).")
  flags.DEFINE_integer("parallel", 1, "Training runs at a time, each a process of its own "
                       "(on a GPU they share the device; step times are measured apart).")
  flags.DEFINE_integer("speedrun_eval_interval", 25, "Steps between the speedrun's evaluations.")
  flags.DEFINE_integer("time_rounds", 20, "Alternating timed calls per arm.")
  flags.DEFINE_integer("steps_per_call", 10, "Steps per timed call.")
  flags.DEFINE_string("child", None, "Internal: one run, as JSON.")
  flags.DEFINE_string("out", "bench/results/speedrun.json", "Results file (JSON).")


def arm_configs(name: str, size: Size):
  """`(GPTConfig, OptimizerConfig)` of a recipe or an ablation of the modern recipe."""
  if name in RECIPES:
    options, optimizer = RECIPES[name]
  else:
    changes, optimizer = ABLATIONS[name]
    options = {**RECIPES["modern"][0], **changes}
    optimizer = optimizer or RECIPES["modern"][1]
  return dataclasses.replace(size.model, **options), optimizer


# ----------------------------------------------------------------------------
# One run, in a process of its own


def child(spec: dict) -> None:
  """Trains one run (`spec`: size, arm, seed, steps, schedule_steps, eval_interval,
  eval_iters, out_dir, and tokenizer_file for the BPE arms)."""
  # pylint: disable=import-outside-toplevel
  from purejax.data import corpus
  from purejax.data import tokenizer_json
  from purejax.training.effects import runs
  size = SIZES[spec["size"]]
  config, optimizer = arm_configs(spec["arm"], size)
  optimizer = dataclasses.replace(optimizer, decay_iters=spec["schedule_steps"])
  tokenizer = (tokenizer_json.load(spec["tokenizer_file"]) if spec.get("tokenizer_file")
               else "char")
  text = corpus.load_corpus("tiny_shakespeare", tokenizer=tokenizer)
  if text.vocab_size != config.vocab_size:
    raise ValueError(f"{spec['arm']}: the tokenizer has {text.vocab_size} tokens, the "
                     f"model {config.vocab_size}.")
  train = gpt_loop.GPTTrainConfig(
      batch_size=size.batch_size, max_iters=spec["steps"],
      eval_interval=spec["eval_interval"], eval_iters=spec["eval_iters"],
      log_interval=spec["eval_interval"], sample_tokens=0, seed=spec["seed"],
      progress=False, checkpoint_every=spec["steps"])
  gpt_loop.train_gpt(config, text, train, optimizer, runs.RunConfig(out_dir=spec["out_dir"]))


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run: `steps` steps of `arm` on a schedule of `schedule_steps`, its
  results filed under `label` (default: the arm)."""
  arm: str
  seed: int
  steps: int
  eval_interval: int
  schedule_steps: int
  label: Optional[str] = None
  tokenizer_file: Optional[str] = None

  @property
  def name(self) -> str:
    return self.label or self.arm


def train_run(run: Run, size: str, eval_iters: int, scratch: str) -> List[dict]:
  """The evaluations `{"step", "val_loss", "val_bpb"}` of `run`, trained in a child process."""
  out_dir = os.path.join(scratch, f"{run.name}-{run.seed}-{run.steps}".replace(" ", "_"))
  spec = dict(dataclasses.asdict(run), size=size, eval_iters=eval_iters, out_dir=out_dir)
  cmd = [sys.executable, "-m", "bench.speedrun", f"--child={json.dumps(spec)}"]
  # Runs may share one GPU: each takes memory as it needs it, not 75 % of it up front.
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", XLA_PYTHON_CLIENT_PREALLOCATE="false")
  done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
  if done.returncode:
    raise RuntimeError(f"{run.name} seed {run.seed} failed ({done.returncode}): "
                       f"{(done.stderr or done.stdout)[-800:]}")
  with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  return [{k: r[k] for k in ("step", "val_loss", "val_bpb")}
          for r in records if r.get("kind") == "eval" and r["step"] > 0]


def train_runs(runs: List[Run], eval_iters: int, scratch: str, out: pathlib.Path,
               result: dict, key: str) -> Dict[str, List[List[dict]]]:
  """Trains `runs`, `--parallel` at a time; after each, `result[key]` (`{name: [evals
  per seed, in seed order]}`) is brought up to date and written to `out`. Returns it."""
  by_name: Dict[str, Dict[int, List[dict]]] = {}
  with futures.ThreadPoolExecutor(max_workers=max(1, FLAGS.parallel)) as pool:
    pending = {pool.submit(train_run, run, FLAGS.size, eval_iters, scratch): run
               for run in runs}
    for future in futures.as_completed(pending):
      run = pending[future]
      evals = future.result()
      print(f"{run.name} seed {run.seed}, {run.steps} steps: {evals[-1]}", flush=True)
      by_name.setdefault(run.name, {})[run.seed] = evals
      result[key] = {name: [by_seed[s] for s in sorted(by_seed)]
                     for name, by_seed in by_name.items()}
      harness.write_results(out, result)
  return result[key]


# ----------------------------------------------------------------------------
# Step times, alternated in one process


def step_times(arms: List[str], size: Size) -> Dict[str, List[float]]:
  """Seconds per step of each arm, its jitted training calls alternated in this process."""
  return harness.recipe_step_times({arm: arm_configs(arm, size) for arm in arms},
                                   size.schedule_steps, FLAGS.time_rounds,
                                   FLAGS.steps_per_call, batch_size=size.batch_size)


def param_count(arm: str, size: Size) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  config, _ = arm_configs(arm, size)
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


def best(evals: List[dict]) -> dict:
  """The evaluation with the lowest val loss."""
  return min(evals, key=lambda e: e["val_loss"])


def recipe_runs(seeds: List[int], size: Size, ms: Dict[str, float], equal_steps: Dict[str, int],
                speedrun_steps: int, eval_iters: int, scratch: str, out: pathlib.Path,
                result: dict) -> None:
  """The recipes at equal wall time, and the speedrun; their measures into `result`.

  The target is the median over seeds of the nanoGPT recipe's best evaluated val
  loss (at the cpu size it is evaluated once, at its last step), and the
  recipe's time the median over seeds of the step of its best evaluation.
  """
  every = max(1, min(FLAGS.speedrun_eval_interval, speedrun_steps))
  plan = []
  bpe_file = train_bpe(scratch) if any(map(uses_bpe, RECIPES)) else None
  if bpe_file:
    from purejax.data import bpe_train  # pylint: disable=import-outside-toplevel
    from purejax.data import tokenizer_json  # pylint: disable=import-outside-toplevel
    bpe = tokenizer_json.load(bpe_file)
    with bpe_train.corpus_text("tiny_shakespeare") as chunks:
      ratio = bpe_train.bytes_per_token(bpe.tokenizer, chunks)[0]
    result["bpe"] = {"vocab_size": BPE_VOCAB_SIZE, "alphabet": "corpus", "split": "nanochat",
                     "train_bytes_per_token": ratio, "fingerprint": bpe.fingerprint}
    print(f"BPE: {BPE_VOCAB_SIZE} tokens, {ratio:.3f} bytes/token on the train split",
          flush=True)
  for seed in seeds:
    for arm in RECIPES:
      steps = equal_steps[arm]
      # The nanoGPT recipe keeps its own schedule; the others end theirs at the budget.
      schedule = round(FLAGS.scale * size.schedule_steps) if arm == "nanogpt" else steps
      plan.append(Run(arm, seed, steps, min(size.reference_eval_interval, steps), schedule,
                      tokenizer_file=bpe_file if uses_bpe(arm) else None))
    plan.append(Run("modern", seed, speedrun_steps, every, speedrun_steps,
                    label="modern_speedrun"))
  runs = train_runs(plan, eval_iters, scratch, out, result, "runs")

  best_of = lambda arm, key: median(best(r)[key] for r in runs[arm])
  final = lambda arm, key: median(r[-1][key] for r in runs[arm])
  target = best_of("nanogpt", "val_loss")
  reference_reached = [best(r)["step"] for r in runs["nanogpt"]]
  reached = [first_reaching(r, target) for r in runs["modern_speedrun"]]
  reach_ms = [None if s is None else s * ms["modern"] for s in reached]
  reference_ms = median(reference_reached) * ms["nanogpt"]
  time_fraction = (None if any(x is None for x in reach_ms)
                   else median(reach_ms) / reference_ms)
  bpb = {arm: final(arm, "val_bpb") for arm in RECIPES}
  result.update(
      target_val_loss=target, reference_steps_to_best=reference_reached,
      speedrun_steps_to_target=reached, speedrun_time_fraction=time_fraction,
      equal_time_val_bpb=bpb, equal_time_best_val_bpb={arm: best_of(arm, "val_bpb")
                                                       for arm in RECIPES},
      equal_time_val_loss={arm: final(arm, "val_loss") for arm in RECIPES},
      bpb_vs_llama={arm: bpb[arm] / bpb["llama"] - 1 for arm in RECIPES})
  harness.write_results(out, result)

  print(f"\ntarget: the nanoGPT recipe's best val loss, median of seeds {seeds}: "
        f"{target:.4f}; its runs' best at steps {reference_reached} "
        f"({reference_ms / 1e3:.1f} s of training)")
  print(f"modern speedrun ({speedrun_steps} steps): first reaches it at steps {reached}; "
        + ("not reached by every seed" if time_fraction is None else
           f"{median(reach_ms) / 1e3:.1f} s, **{100 * time_fraction:.1f} %** of the "
           f"nanoGPT recipe's time"))
  rows = ["| recipe | params | ms/step | steps | val loss (median) | val bpb (median) | "
          "best val bpb (median) | val bpb, seeds |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
  for arm in RECIPES:
    seeds_bpb = ", ".join(f"{r[-1]['val_bpb']:.4f}" for r in runs[arm])
    rows.append(f"| {arm} | {result['params'][arm]:,} | {ms[arm]:.1f} | {equal_steps[arm]} | "
                f"{final(arm, 'val_loss'):.4f} | **{bpb[arm]:.4f}** | "
                f"{best_of(arm, 'val_bpb'):.4f} | {seeds_bpb} |")
  print("\nequal wall time:\n" + "\n".join(rows))
  print("val bpb against llama's: " + ", ".join(
      f"{arm} {100 * change:+.2f} %" for arm, change in result["bpb_vs_llama"].items()))


def ablation_runs(seeds: List[int], ms: Dict[str, float], steps: int, eval_iters: int,
                  scratch: str, out: pathlib.Path, result: dict) -> None:
  """The modern recipe and each ablation on the speedrun's schedule; into `result`."""
  names = ["modern"] + list(ABLATIONS)
  runs = train_runs([Run(name, seed, steps, steps, steps) for name in names for seed in seeds],
                    eval_iters, scratch, out, result, "ablation_runs")
  loss = {name: median(r[-1]["val_loss"] for r in runs[name]) for name in names}
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
  size = SIZES[FLAGS.size]
  seeds = [int(s) for s in FLAGS.seeds]
  ablation_seeds = [int(s) for s in FLAGS.ablation_seeds] if FLAGS.ablations else []
  arms = list(RECIPES) + (list(ABLATIONS) if ablation_seeds else [])
  eval_iters = FLAGS.eval_iters or size.eval_iters
  out = pathlib.Path(FLAGS.out)
  import jax  # pylint: disable=import-outside-toplevel
  result = {"command": " ".join(["python -m bench.speedrun"] + sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu_count": os.cpu_count(), "device": str(jax.devices()[0].device_kind),
            "size": FLAGS.size, "batch_size": size.batch_size,
            "model": dataclasses.asdict(size.model), "eval_iters": eval_iters,
            "seeds": seeds, "ablation_seeds": ablation_seeds,
            "recipes": {arm: {"model": RECIPES[arm][0], "optimizer": optim.to_saved(
                RECIPES[arm][1])} for arm in RECIPES},
            "params": {arm: param_count(arm, size) for arm in arms}}

  # Step times: every arm alternated in this process, before any run trains.
  summary = harness.summarise(step_times(arms, size), "nanogpt", "s/step")
  ms = {arm: 1e3 * row["median"] for arm, row in summary.items()}
  budget_ms = size.reference_steps * ms["nanogpt"]
  equal_steps = {arm: max(1, round(FLAGS.scale * budget_ms / ms[arm])) for arm in RECIPES}
  equal_steps["nanogpt"] = round(FLAGS.scale * size.reference_steps)
  result.update(step_times=summary, equal_time_steps=equal_steps)
  print("ms/step: " + ", ".join(f"{arm} {ms[arm]:.1f}" for arm in ms), flush=True)
  speedrun_steps = max(1, round(FLAGS.scale * (FLAGS.speedrun_steps or size.speedrun_steps)))
  with tempfile.TemporaryDirectory() as scratch:
    if seeds:
      recipe_runs(seeds, size, ms, equal_steps, speedrun_steps, eval_iters, scratch, out,
                  result)
    if ablation_seeds:
      ablation_runs(ablation_seeds, ms, speedrun_steps, eval_iters, scratch, out, result)
  print(f"wrote {out}")


if __name__ == "__main__":
  define_flags()
  app.run(main)

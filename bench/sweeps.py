"""A sweep of N runs in one program against the same runs one after another, and one run.

    python -m bench.sweeps                          # 4 runs of nanoGPT's CPU recipe
    python -m bench.sweeps --runs=8 --recipe=gpu    # 8 runs of the Tiny Shakespeare GPU recipe
    python -m bench.sweeps --quick                  # a smoke run (tiny model)

Arms, timed over the same steps:
* "sweep": `sweep.train_steps` with the platform's forms (`kernels.select`)
  and `sweep_batch` (`sweep.choose_sweep_batch`: every run vmapped at once on
  a GPU, one run at a time inside the program on the CPU);
* "vmapped" (CPU only): the sweep with every run vmapped at once
  (`sweep_batch=None`), which the CPU does not choose;
* "sequential": the same runs trained one after another, each by its own
  call, as separate processes would;
* "one": one of the runs alone.
Each round times one call of `steps_per_call` steps of every arm, the arms
alternating so that slow drifts of a shared machine hit all alike. The runs
differ in learning rate and seed, as a sweep's do. The first call of each
arm compiles and is not timed. It prints each arm's median ms per step, the
per-round ratios (medians) sequential/sweep (1 or more: the sweep is no
slower than the runs one by one; the CPU's target is >= 0.95) and
sweep/one (how many single runs' time the sweep takes; the GPU's target for
8 runs is <= 2), and each sweep program's scratch memory.
"""

import dataclasses
import json
import time

from absl import app
from absl import flags
import jax
import numpy as np

from bench import gpu as gpu_bench
from bench import harness
from purejax import gpt
from purejax.data import batches
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.loops import recipes
from purejax.training.pure import steps
from purejax.training.pure import sweep
from purejax.training.pure.state import TrainState

FLAGS = flags.FLAGS
RECIPES = {  # (model, batch size, optimizer)
    "cpu": (recipes.SHAKESPEARE_CHAR, 12, dataclasses.replace(recipes.GPT_OPTIMIZER,
                                                           decay_iters=2000)),
    "gpu": (gpu_bench.SHAKESPEARE_GPU, 64, gpu_bench.SHAKESPEARE_OPTIMIZER),
}


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_integer("runs", 4, "Runs in the sweep.")
  flags.DEFINE_enum("recipe", "cpu", list(RECIPES),
                    "nanoGPT's CPU recipe (batch 12) or the Tiny Shakespeare GPU recipe "
                    "(batch 64, bf16, dropout 0.2).")
  flags.DEFINE_integer("rounds", 7, "Timed rounds (each times every arm once).")
  flags.DEFINE_integer("steps_per_call", 10, "Steps per jitted call (the CLI's default).")
  flags.DEFINE_bool("quick", False, "A tiny model and 2 rounds: a smoke run.")


def main(argv):
  del argv
  config, batch_size, base = RECIPES[FLAGS.recipe]
  rounds, n = FLAGS.rounds, FLAGS.steps_per_call
  if FLAGS.quick:
    config, rounds = dataclasses.replace(config, block_size=16, n_layer=1, n_head=2,
                                         n_embd=16), 2
  ids = batches.DeviceTokens(jax.numpy.asarray(gpu_bench.shakespeare().train, np.int32))
  runs = sweep.expand(base, seed=0, grid={"learning_rate": tuple(
      base.learning_rate * (1 + i) / FLAGS.runs for i in range(FLAGS.runs))})
  runs = [r._replace(seed=i) for i, r in enumerate(runs)]
  make = optim.RunOptimizer(base)
  hyper = sweep.hyperparams(runs)
  platform = kernels.platform_of()
  forms = kernels.select(platform)
  params = [gpt.init_params(config, jax.random.PRNGKey(r.seed)) for r in runs]
  opt_states = [make().init(p) for p in params]
  keys = [jax.random.PRNGKey(100 + r.seed) for r in runs]
  scratch = {}

  def sweep_arm(forms, sweep_batch):
    state = [TrainState(sweep.stack(params), sweep.stack(opt_states),
                        {"train": sweep.stack(keys)})]
    kwargs = dict(config=config, make_optimizer=make, batch_size=batch_size, num_steps=n,
                  forms=forms, sweep_batch=sweep_batch)
    compiled = sweep.train_steps.lower(state[0], ids, 0, hyper, **kwargs).compile()
    scratch[sweep_batch or "all"] = compiled.memory_analysis().temp_size_in_bytes / 1e6
    step = [0]

    def arm():
      start = time.perf_counter()
      state[0], metrics = sweep.train_steps(state[0], ids, step[0], hyper, **kwargs)
      metrics.loss.block_until_ready()
      step[0] += n
      return (time.perf_counter() - start) / n
    return arm

  def solo_arm(indices):
    solo = [TrainState(jax.tree.map(jax.numpy.copy, params[i]),
                       jax.tree.map(jax.numpy.copy, opt_states[i]),
                       {"train": jax.numpy.copy(keys[i])})
            for i in indices]
    optimizers = [optim.make_optimizer(runs[i].opt_config) for i in indices]
    step = [0]

    def arm():
      start = time.perf_counter()
      for j, optimizer in enumerate(optimizers):
        solo[j], metrics = steps.train_steps(solo[j], ids, step[0], config=config,
                                             optimizer=optimizer, batch_size=batch_size,
                                             num_steps=n, forms=forms)
        metrics.loss.block_until_ready()
      step[0] += n
      return (time.perf_counter() - start) / n
    return arm

  sweep_batch = sweep.choose_sweep_batch(platform)
  arms = {"sweep": sweep_arm(forms, sweep_batch)}
  if sweep_batch is not None:
    arms["vmapped"] = sweep_arm(forms, None)
  arms.update(sequential=solo_arm(range(len(runs))), one=solo_arm([0]))
  for fn in arms.values():  # compile
    fn()
  times = harness.alternate(arms, rounds)
  rows = harness.summarise(times, "sweep", "s/step")

  def ratio(arm, reference):  # median over rounds of arm / reference
    return float(np.median(np.asarray(times[arm]) / np.asarray(times[reference])))

  result = {
      "runs": len(runs), "recipe": FLAGS.recipe, "model": str(config),
      "batch_size": batch_size, "steps_per_call": n, "rounds": rounds,
      "device": jax.devices()[0].device_kind, "forms": forms.describe(),
      **{f"{name}_ms_per_step": 1000 * row["median"] for name, row in rows.items()},
      "ratio_sequential_over_sweep": ratio("sequential", "sweep"),
      "ratio_sequential_over_sweep_range": [rows["sequential"]["ratio_min"],
                                            rows["sequential"]["ratio_max"]],
      "ratio_sweep_over_one_run": ratio("sweep", "one"),
      "scratch_mb": scratch,
  }
  if "vmapped" in times:
    result["ratio_sequential_over_vmapped"] = ratio("sequential", "vmapped")
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  define_flags()
  app.run(main)

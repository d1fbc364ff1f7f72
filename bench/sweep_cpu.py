"""N runs as one vmapped step against the same N runs one after another.

    python -m bench.sweep_cpu                       # 4 runs of nanoGPT's CPU recipe
    python -m bench.sweep_cpu --runs=8 --rounds=5
    python -m bench.sweep_cpu --quick               # a smoke run (tiny model)

Three arms: the sweep as the CPU runs it (`sweep_batch=1`: one run at a
time inside the one program), the sweep with every run vmapped at once
(`sweep_batch=0`), and the same runs trained one after another, each by its
own call, as separate processes would. Each round times one call of
`steps_per_call` steps of every arm, the arms alternating so that slow
drifts of a shared machine hit all alike. The runs differ in learning rate
and seed, as a sweep's do. The first call of each arm compiles and is not
timed. It prints each arm's median ms per step (all runs together), the
median of the per-round ratios sequential/arm (1 or more: the sweep is no
slower; the target on a 2-core CPU is >= 0.95) and each program's scratch
memory.
"""

import dataclasses
import json
import time

from absl import app
from absl import flags
import jax
import numpy as np

from bench import harness
from purejax import gpt
from purejax.data import batches
from purejax.data import corpus
from purejax.ops import kernels
from purejax.training import loop
from purejax.training import optim
from purejax.training import steps
from purejax.training import sweep
from purejax.training.state import TrainState

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_integer("runs", 4, "Runs in the sweep.")
  flags.DEFINE_integer("rounds", 7, "Timed rounds (each times both arms once).")
  flags.DEFINE_integer("steps_per_call", 10, "Steps per jitted call (the CLI's default).")
  flags.DEFINE_bool("quick", False, "A tiny model and 2 rounds: a smoke run.")


def main(argv):
  del argv
  config, batch_size = loop.SHAKESPEARE_CHAR, 12
  rounds = FLAGS.rounds
  if FLAGS.quick:
    config, rounds = gpt.GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2,
                                   n_embd=16, bias=False), 2
  text = corpus.load_corpus("tiny_shakespeare")
  ids = batches.DeviceTokens(jax.numpy.asarray(np.asarray(text.train, np.int32)))
  base = dataclasses.replace(loop.GPT_OPTIMIZER, decay_iters=2000)
  runs = sweep.expand(base, seed=0, grid={"learning_rate": tuple(
      1e-3 * (1 + i) / FLAGS.runs for i in range(FLAGS.runs))})
  runs = [r._replace(seed=i) for i, r in enumerate(runs)]
  make = sweep.RunOptimizer(base)
  n = FLAGS.steps_per_call

  def fresh_state():
    params = [gpt.init_params(config, jax.random.PRNGKey(r.seed)) for r in runs]
    return params, [make().init(p) for p in params]

  params, states = fresh_state()
  keys = [jax.random.PRNGKey(100 + r.seed) for r in runs]
  solo = [(TrainState(p, s, {"train": k}), optim.make_optimizer(r.opt_config))
          for p, s, k, r in zip(params, states, keys, runs)]
  hyper = sweep.hyperparams(runs)
  sequential_step, scratch = [0], {}

  def sweep_arm(sweep_batch):
    forms = kernels.select("cpu", sweep_batch=sweep_batch)
    stacked = [TrainState(sweep.stack(params), sweep.stack(states),
                          {"train": sweep.stack(keys)})]
    step = [0]
    kwargs = dict(config=config, make_optimizer=make, batch_size=batch_size, num_steps=n,
                  forms=forms)
    scratch[sweep_batch] = sweep.train_steps.lower(
        stacked[0], ids, 0, hyper, **kwargs).compile().memory_analysis().temp_size_in_bytes

    def arm():
      start = time.perf_counter()
      state, m = sweep.train_steps(stacked[0], ids, step[0], hyper, **kwargs)
      m.loss.block_until_ready()
      stacked[0] = state
      step[0] += n
      return (time.perf_counter() - start) / n
    return arm

  def sequential():
    start = time.perf_counter()
    for i, (state, opt) in enumerate(solo):
      state, m = steps.train_steps(state, ids, sequential_step[0], config=config,
                                   optimizer=opt, batch_size=batch_size, num_steps=n)
      m.loss.block_until_ready()
      solo[i] = (state, opt)
    sequential_step[0] += n
    return (time.perf_counter() - start) / n

  arms = {"mapped": sweep_arm(1), "vmapped": sweep_arm(0), "sequential": sequential}
  for fn in arms.values():  # compile
    fn()
  result = {"runs": len(runs), "model": str(config), "batch_size": batch_size,
            "steps_per_call": n, "rounds": rounds, "device": jax.devices()[0].device_kind}
  times = harness.alternate(arms, rounds)
  for name in ("mapped", "vmapped"):
    rows = harness.summarise(times, name, "s/step")
    ratio = rows["sequential"]
    result.update({f"{name}_ms_per_step": 1000 * rows[name]["median"],
                   f"ratio_sequential_over_{name}": ratio["ratio"],
                   f"ratio_{name}_min": ratio["ratio_min"],
                   f"ratio_{name}_max": ratio["ratio_max"]})
  result["sequential_ms_per_step"] = 1000 * rows["sequential"]["median"]
  result["scratch_mb"] = {"mapped": scratch[1] / 1e6, "vmapped": scratch[0] / 1e6}
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  define_flags()
  app.run(main)

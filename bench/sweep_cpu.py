"""N runs as one vmapped step against the same N runs one after another.

    python -m bench.sweep_cpu                       # 4 runs of nanoGPT's CPU recipe
    python -m bench.sweep_cpu --runs=8 --rounds=5
    python -m bench.sweep_cpu --quick               # a smoke run (tiny model)

Each round times one call of `steps_per_call` steps of every arm, the arms
alternating (vmapped, sequential, vmapped, ...) so that slow drifts of a
shared machine hit both alike. The runs differ in learning rate and seed, as
a sweep's do. The first call of each arm compiles and is not timed. It prints
each arm's median ms per step (all runs together) and the median of the
per-round ratio sequential/vmapped: 1 or more means the vmapped sweep is no
slower (the target on a 2-core CPU is >= 0.95).
"""

import dataclasses
import json
import time

from absl import app
from absl import flags
import jax
import numpy as np

from purejax import gpt
from purejax.data import corpus
from purejax.training import loop
from purejax.training import optim
from purejax.training import steps
from purejax.training import sweep

_RUNS = flags.DEFINE_integer("runs", 4, "Runs in the sweep.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Timed rounds (each times both arms once).")
_STEPS = flags.DEFINE_integer("steps_per_call", 10, "Steps per jitted call (the CLI's default).")
_QUICK = flags.DEFINE_bool("quick", False, "A tiny model and 2 rounds: a smoke run.")


def main(argv):
  del argv
  config, batch_size = loop.SHAKESPEARE_CHAR, 12
  rounds = _ROUNDS.value
  if _QUICK.value:
    config, rounds = gpt.GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2,
                                   n_embd=16, bias=False), 2
  text = corpus.load_corpus("tiny_shakespeare")
  ids = jax.numpy.asarray(np.asarray(text.train, np.int32))
  base = dataclasses.replace(loop.GPT_OPTIMIZER, decay_iters=2000)
  runs = sweep.expand(base, seed=0, grid={"learning_rate": tuple(
      1e-3 * (1 + i) / _RUNS.value for i in range(_RUNS.value))})
  runs = [r._replace(seed=i) for i, r in enumerate(runs)]
  make = sweep.RunOptimizer(base)
  n = _STEPS.value

  def fresh_state():
    params = [gpt.init_params(config, jax.random.PRNGKey(r.seed)) for r in runs]
    return params, [make().init(p) for p in params]

  params, states = fresh_state()
  solo = [(p, s, optim.make_optimizer(r.opt_config)) for p, s, r in zip(params, states, runs)]
  keys = [jax.random.PRNGKey(100 + r.seed) for r in runs]
  stacked = [sweep.stack(params), sweep.stack(states)]
  stacked_keys, hyper = sweep.stack(keys), sweep.hyperparams(runs)
  step = [0]

  def vmapped():
    p, s, m = sweep.train_steps(*stacked, ids, stacked_keys, step[0], hyper, config=config,
                                make_optimizer=make, batch_size=batch_size, num_steps=n)
    m.loss.block_until_ready()
    stacked[:] = [p, s]

  def sequential():
    for i, (p, s, opt) in enumerate(solo):
      p, s, m = steps.train_steps(p, s, ids, keys[i], step[0], config=config, optimizer=opt,
                                  batch_size=batch_size, num_steps=n)
      m.loss.block_until_ready()
      solo[i] = (p, s, opt)

  arms = {"vmapped": vmapped, "sequential": sequential}
  for fn in arms.values():  # compile
    fn()
  times = {name: [] for name in arms}
  for _ in range(rounds):
    step[0] += n
    for name, fn in arms.items():
      start = time.perf_counter()
      fn()
      times[name].append((time.perf_counter() - start) / n * 1000)
  ratios = np.array(times["sequential"]) / np.array(times["vmapped"])
  result = {"runs": len(runs), "model": str(config), "batch_size": batch_size,
            "steps_per_call": n, "rounds": rounds, "device": jax.devices()[0].device_kind,
            **{f"{name}_ms_per_step": float(np.median(t)) for name, t in times.items()},
            "ratio_sequential_over_vmapped": float(np.median(ratios)),
            "ratio_min": float(ratios.min()), "ratio_max": float(ratios.max())}
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  app.run(main)

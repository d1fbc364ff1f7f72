"""NanoGPT speed on nanoGPT's CPU recipe: train step, compile time, sampling.

    python -m bench.gpt_speed                 # all three
    python -m bench.gpt_speed --only=sample

Train: median ms/iter of `train_steps` calls of `--steps_per_call` steps
(the first call, which compiles, is dropped), fp32 and bf16.
Compile: seconds to lower and compile the train step for n_layer 2 and 12.
Sample: tokens/s generating 1000 tokens from a one-token prompt after
compilation (median of 5).
"""

import dataclasses
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from purejax import gpt
from purejax import optim

_ONLY = flags.DEFINE_enum("only", None, ["train", "compile", "sample"], "Run one part.")
_STEPS_PER_CALL = flags.DEFINE_integer("steps_per_call", 10, "Steps per jitted call.")
_CALLS = flags.DEFINE_integer("calls", 15, "Timed calls per dtype.")

RECIPE = gpt.GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 12


def recipe_optimizer(max_iters=2000):
  return optim.make_optimizer(optim.OptimizerConfig(
      learning_rate=1e-3, warmup_iters=100, decay_iters=max_iters, min_lr=1e-4,
      beta2=0.99, weight_decay=0.1, grad_clip=1.0))


def train_ms_per_iter(config, steps_per_call, calls):
  key = jax.random.PRNGKey(0)
  data = jax.random.randint(key, (1_000_000,), 0, config.vocab_size)
  params = gpt.init_params(config, key)
  optimizer = recipe_optimizer()
  state = optimizer.init(params)
  times = []
  for call in range(calls + 1):
    start = time.perf_counter()
    params, state, losses = gpt.train_steps(
        params, state, data, key, call * steps_per_call, config=config,
        optimizer=optimizer, batch_size=BATCH, num_steps=steps_per_call)
    losses.block_until_ready()
    times.append(1000 * (time.perf_counter() - start) / steps_per_call)
  return np.median(times[1:]), min(times[1:]), max(times[1:])


def compile_seconds(config):
  key = jax.random.PRNGKey(0)
  data = jnp.zeros((10_000,), jnp.int32)
  params = gpt.init_params(config, key)
  optimizer = recipe_optimizer()
  state = optimizer.init(params)
  start = time.perf_counter()
  gpt.train_steps.lower(params, state, data, key, 0, config=config, optimizer=optimizer,
                        batch_size=BATCH, num_steps=1).compile()
  return time.perf_counter() - start


def sample_tokens_per_s(config, new_tokens=1000, repeats=5):
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  prompt = jnp.zeros((1,), jnp.int32)
  gpt.generate(params, prompt, config, jax.random.PRNGKey(0), new_tokens).block_until_ready()
  rates = []
  for r in range(repeats):
    start = time.perf_counter()
    gpt.generate(params, prompt, config, jax.random.PRNGKey(r + 1), new_tokens,
                 top_k=200).block_until_ready()
    rates.append(new_tokens / (time.perf_counter() - start))
  return np.median(rates), min(rates), max(rates)


def main(_):
  only = _ONLY.value
  if only in (None, "train"):
    for dtype in ("float32", "bfloat16"):
      med, lo, hi = train_ms_per_iter(dataclasses.replace(RECIPE, compute_dtype=dtype),
                                      _STEPS_PER_CALL.value, _CALLS.value)
      print(f"train {dtype}: median {med:.2f} ms/iter (min {lo:.2f}, max {hi:.2f})")
  if only in (None, "compile"):
    seconds = {n: compile_seconds(dataclasses.replace(RECIPE, n_layer=n)) for n in (2, 12)}
    print(f"compile train step: 2 layers {seconds[2]:.2f} s, 12 layers {seconds[12]:.2f} s, "
          f"ratio {seconds[12] / seconds[2]:.2f}")
  if only in (None, "sample"):
    med, lo, hi = sample_tokens_per_s(RECIPE)
    print(f"sample 1000 tokens: median {med:.0f} tokens/s (min {lo:.0f}, max {hi:.0f})")


if __name__ == "__main__":
  app.run(main)

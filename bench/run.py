"""purejax side by side with its PyTorch twins (and the seed's style), in one run.

    python -m bench.run            # every case (about 15 minutes on 2 cores)
    python -m bench.run --quick    # a smoke run of every case (about 2 minutes)

Each case runs its arms alternately, A B A B ..., so that slow drifts of this
shared machine hit every arm alike. It reports each arm's median and min-max,
and for each peer the median (and min-max) of the per-round ratio
peer/purejax: above 1 means purejax is faster. Results go to
`bench/results/<date>.json` (`<date>-<cases>.json` for some cases), and a
markdown table is printed.
"""

import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench import harness
from bench.harness import alternate
from bench.harness import summarise
from purejax import gpt
from purejax import mlp
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.pure import parallel
from purejax.training.pure import steps as steps_lib
from purejax.training.pure.state import TrainState

ALL_CASES = {"a", "b", "c", "d", "e", "f", "g"}
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_bool("quick", False, "Few rounds and small sizes: a smoke run.")
  flags.DEFINE_list("cases", ",".join(sorted(ALL_CASES)), "Cases to run.")
  flags.DEFINE_integer(
      "cpu_devices", min(2, os.cpu_count() or 1),
      "CPU devices for the data-parallel arms of cases a and b, as `purejax.train "
      "--cpu_devices` makes them (1: leave those arms out).")
  flags.DEFINE_string(
      "out", None, "Results file (default bench/results/<date>.json, or <date>-2.json, ... "
      "when that exists).")
  flags.DEFINE_string("tfds_data_dir", None, "TFDS data dir (case d).")
  flags.DEFINE_string("tfds_manual_dir", None,
                      "MNIST's original files, for case d's TFDS-pipeline arm offline.")


SMALL = gpt.GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
HEAVY = gpt.GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)
# Batch size of each bench size, keyed by its context length.
BATCH_BY_BLOCK = {SMALL.block_size: 12, HEAVY.block_size: 16}
# Both frameworks' optimizer (the twin at the constant peak rate).
OPTIMIZER = optim.from_flat(learning_rate=1e-3, warmup_iters=10, decay_iters=1000,
                                  min_lr=1e-4, beta2=0.99, weight_decay=0.1, grad_clip=1.0)


def batch_of(config):
  return BATCH_BY_BLOCK[config.block_size]


# ----------------------------------------------------------------------------
# GPT train step: purejax fp32 / bf16, torch eager, torch.compile


def purejax_train_arm(config, steps, num_devices=1):
  """One device, or data parallel over `num_devices` as `purejax.train` runs it."""
  return harness.purejax_train_arm(config, OPTIMIZER, batch_of(config), steps,
                                   num_devices=num_devices)


def torch_train_arm(config, steps, compile_model=False):
  return harness.torch_train_arm(config, OPTIMIZER, batch_of(config), steps,
                                 compile_model=compile_model)


def _key_of(arm):
  """"purejax fp32, 2 CPU devices" -> "fp32_2_cpu_devices"."""
  return arm.removeprefix("purejax ").replace(",", "").replace(" ", "_").lower()


def train_case(config, rounds, steps, with_compile, cpu_devices=1):
  arms = {"purejax fp32": purejax_train_arm(config, steps),
          "purejax bf16": purejax_train_arm(dataclasses.replace(config,
                                                                compute_dtype="bfloat16"), steps),
          "torch eager fp32": torch_train_arm(config, steps)}
  if cpu_devices > 1 and jax.default_backend() == "cpu":  # a GPU run has no such arms
    for dtype, name in (("float32", "fp32"), ("bfloat16", "bf16")):
      arms[f"purejax {name}, {cpu_devices} CPU devices"] = purejax_train_arm(
          dataclasses.replace(config, compute_dtype=dtype), steps, cpu_devices)
  notes = {}
  if with_compile:
    try:
      arms["torch.compile fp32"] = torch_train_arm(config, steps, compile_model=True)
    except Exception as e:  # pylint: disable=broad-except
      notes["torch.compile"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
  times = alternate(arms, rounds)
  return {"rows": summarise(times, "purejax fp32", "s/iter"),
          # Each other purejax arm against torch eager, as the fp32 rows are.
          "extra": {_key_of(arm) + "_vs_torch_eager": summarise(
              {arm: times[arm], "torch eager fp32": times["torch eager fp32"]}, arm, "s")
                    for arm in times if arm.startswith("purejax ") and arm != "purejax fp32"},
          "notes": notes}


# ----------------------------------------------------------------------------
# Sampling


def sample_case(rounds, new_tokens):
  import torch  # pylint: disable=g-import-not-at-top
  from bench import torch_gpt  # pylint: disable=g-import-not-at-top
  params = gpt.init_params(SMALL, jax.random.PRNGKey(0))
  sample = lambda key: harness.sample_completion(params, SMALL, key, new_tokens, top_k=200)
  sample(jax.random.PRNGKey(0))  # compiles
  twin = torch_gpt.load_purejax_params(torch_gpt.TorchGPT(SMALL), params).eval()
  counter = iter(range(1, 10_000))

  def ours():
    start = time.perf_counter()
    sample(jax.random.PRNGKey(next(counter)))  # returns the tokens on the host
    return (time.perf_counter() - start) / new_tokens

  def theirs():
    start = time.perf_counter()
    twin.generate(torch.zeros((1, 1), dtype=torch.long), new_tokens, top_k=200)
    return (time.perf_counter() - start) / new_tokens

  times = alternate({"purejax engine (KV cache)": ours, "torch twin (recompute)": theirs},
                    rounds)
  rows = summarise(times, "purejax engine (KV cache)", "s/token")
  for row in rows.values():
    row["tokens_per_s"] = 1.0 / row["median"]
  return {"rows": rows}


# ----------------------------------------------------------------------------
# MNIST epoch: purejax scan epoch, torch loop, the seed's tf.data + Python loop


def mnist_case(rounds, tfds_data_dir=None, tfds_manual_dir=None):
  import torch  # pylint: disable=g-import-not-at-top
  from bench import torch_mlp  # pylint: disable=g-import-not-at-top
  sizes, batch = [784, 512, 512, 10], 128
  rng = np.random.default_rng(0)
  images = rng.random((60_000, 784), dtype=np.float32)
  labels = rng.integers(0, 10, 60_000).astype(np.int32)
  key = jax.random.PRNGKey(0)
  optimizer = optax.sgd(0.01)

  params = mlp.init_network_params(sizes, key)
  state = {"train": TrainState(params, optimizer.init(params), {"data": key})}
  x_dev, y_dev = jnp.asarray(images), jnp.asarray(labels)
  epoch = iter(range(10_000))

  def ours():
    start = time.perf_counter()
    state["train"], loss = steps_lib.train_epoch(
        state["train"], x_dev, y_dev, next(epoch), optimizer=optimizer, batch_size=batch)
    loss.block_until_ready()
    return time.perf_counter() - start

  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  seed_state = {"params": mlp.init_network_params(sizes, key)}
  seed_state["opt"] = optimizer.init(seed_state["params"])
  dataset = tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(
      60_000, seed=0).batch(batch, drop_remainder=True)

  def seed_style():
    start = time.perf_counter()
    for x, y in dataset.as_numpy_iterator():
      seed_state["params"], seed_state["opt"], loss = mlp.update(
          seed_state["params"], seed_state["opt"], x, y, optimizer=optimizer)
    loss.block_until_ready()
    return time.perf_counter() - start

  torch.manual_seed(0)
  model = torch_mlp.TorchMLP(sizes)
  torch_opt = torch.optim.SGD(model.parameters(), lr=0.01)
  tx, ty = torch.from_numpy(images), torch.from_numpy(labels).long()
  gen = torch.Generator().manual_seed(0)

  def theirs():
    start = time.perf_counter()
    torch_mlp.train_epoch(model, torch_opt, tx, ty, batch, gen)
    return time.perf_counter() - start

  arms = {"purejax scan epoch": ours, "torch twin": theirs,
          "seed style, in-memory tf.data + Python loop": seed_style}
  notes = {}
  tutorial = tutorial_style_arm(sizes, batch, optimizer, tfds_data_dir, tfds_manual_dir)
  if isinstance(tutorial, str):
    notes["seed style, TFDS pipeline"] = tutorial
  else:
    arms["seed style, TFDS pipeline (JAX tutorial)"] = tutorial
  for arm in arms.values():
    arm()  # warm up and compile
  times = alternate(arms, rounds)
  return {"rows": summarise(times, "purejax scan epoch", "s/epoch"), "notes": notes}


def tutorial_style_arm(sizes, batch, optimizer, data_dir, manual_dir):
  """JAX's TFDS MNIST tutorial's epoch: stream `tfds.load(...).batch(128)`,
  reshape each batch on the host and call a jitted `update` per batch.

  Returns the arm, or a string saying why it could not run.
  """
  from purejax.data import datasets  # pylint: disable=g-import-not-at-top
  try:
    datasets.load_tfds_splits("mnist", ("test",), data_dir=data_dir,
                              manual_dir=manual_dir)  # prepares if needed
  except datasets.DataUnavailableError as e:
    return f"skipped: {e}"
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  key = jax.random.PRNGKey(0)
  state = {"params": mlp.init_network_params(sizes, key)}
  state["opt"] = optimizer.init(state["params"])

  def run():
    start = time.perf_counter()
    ds = tfds.load("mnist", split="train", as_supervised=True,
                   data_dir=data_dir).batch(batch).prefetch(1)
    for x, y in tfds.as_numpy(ds):
      x = np.reshape(x, (len(x), -1)).astype(np.float32)
      state["params"], state["opt"], loss = mlp.update(
          state["params"], state["opt"], x, y.astype(np.int32), optimizer=optimizer)
    loss.block_until_ready()
    return time.perf_counter() - start

  return run


# ----------------------------------------------------------------------------
# Compile time vs depth: scan over layers vs an unrolled Python loop


def scanned_loss(params, tokens, targets, config):
  """gpt.loss with the layers in a scan and no remat."""
  return gpt.loss(params, tokens, targets, config, forms=kernels.select(remat="none"))


def unrolled_loss(params, tokens, targets, config):
  """The same model with the layers unrolled into a Python loop, no remat."""
  return gpt.loss(params, tokens, targets, config,
                  forms=kernels.select(scan_layers=False, remat="none"))


def compile_seconds(config, loss_fn):
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  optimizer = optax.adamw(1e-3)
  tokens = jnp.zeros((batch_of(SMALL), config.block_size), jnp.int32)

  def step(params, opt_state, x, y):
    grads = jax.grad(loss_fn)(params, x, y, config)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  start = time.perf_counter()
  jax.jit(step).lower(params, optimizer.init(params), tokens, tokens).compile()
  return time.perf_counter() - start


def compile_case(depths):
  compile_seconds(dataclasses.replace(SMALL, n_layer=1), gpt.loss)  # warm up the compiler
  rows = {}
  for n in depths:
    config = dataclasses.replace(SMALL, n_layer=n)
    rows[f"n_layer={n}"] = {"scan_s": compile_seconds(config, scanned_loss),
                            "unrolled_s": compile_seconds(config, unrolled_loss)}
  first, last = rows[f"n_layer={depths[0]}"], rows[f"n_layer={depths[-1]}"]
  growth = {"scan": last["scan_s"] / first["scan_s"],
            "unrolled": last["unrolled_s"] / first["unrolled_s"]}
  return {"rows": rows, "growth_first_to_last": growth}


# ----------------------------------------------------------------------------
# Peak memory (RSS) of a train step, each arm in its own process


# The peak is VmHWM from /proc: getrusage's ru_maxrss survives fork+exec on
# Linux, so a child started from this (large) process would report our peak.
RSS_SCRIPT = """
import sys, dataclasses
from bench import run
config = {config}
arm = {arm!r}
if arm.startswith("purejax"):
    dtype = "bfloat16" if "bf16" in arm else "float32"
    fn = run.purejax_train_arm(dataclasses.replace(config, compute_dtype=dtype), 2)
else:
    fn = run.torch_train_arm(config, 2)
fn()
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(int(hwm.split()[1]))
"""


def rss_case(config_name):
  rows = {}
  for arm in ("purejax fp32", "purejax bf16", "torch eager fp32"):
    script = RSS_SCRIPT.format(config=f"run.{config_name}", arm=arm)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=pathlib.Path(__file__).parents[1], timeout=900)
    if out.returncode:
      rows[arm] = {"error": out.stderr[-300:]}
      continue
    rows[arm] = {"peak_rss_mb": int(out.stdout.strip().splitlines()[-1]) / 1024}
  return {"rows": rows, "config": config_name}


# ----------------------------------------------------------------------------
# Achieved GFLOP/s against this machine's measured matmul peak


def peak_shapes(config, n):
  """`(m, k, n)` products whose fastest rate counts as this machine's peak.

  A big square one, and the dense products of `config`'s own train step
  (`tokens x embd` times each weight, and a weight gradient): on this CPU
  the bf16 kernels run some of those model shapes well above the square
  one, and a peak is the best rate measured, not one shape's rate.
  """
  tokens, c = batch_of(config) * config.block_size, config.n_embd
  return [(n, n, n), (tokens, c, 3 * c), (tokens, c, 4 * c), (tokens, 4 * c, c),
          (c, tokens, 4 * c)]


def matmul_rate(shape, dtype, repeats=7):
  """Median GFLOP/s of one jitted `[m, k] @ [k, n]` (float32 accumulation)."""
  m, k, n = shape
  a = jax.random.normal(jax.random.PRNGKey(0), (m, k), dtype)
  b = jax.random.normal(jax.random.PRNGKey(1), (k, n), dtype)
  f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  f(a, b).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * m * k * n / np.median(times) / 1e9


def matmul_peak(dtype, shapes):
  """(best GFLOP/s over `shapes`, {"MxKxN": GFLOP/s})."""
  rates = {"x".join(map(str, s)): matmul_rate(s, dtype) for s in shapes}
  return max(rates.values()), rates


def train_step_flops(config):
  """XLA's FLOP count of one forward + backward pass.

  Counted on the unrolled layer loop: XLA's cost analysis counts the body of
  a `while` loop once, so on `gpt.loss` (a scan over layers) it reports about
  1/n_layer of the work. (Until 2026-11-22 this case made that mistake.)
  """
  key = jax.random.PRNGKey(0)
  params = gpt.init_params(config, key)
  tokens = jnp.zeros((batch_of(config), config.block_size), jnp.int32)
  grad = jax.jit(jax.grad(unrolled_loss), static_argnums=3)
  cost = grad.lower(params, tokens, tokens, config).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["flops"])


def analytic_train_flops(config):
  """6 FLOPs per parameter per token, plus causal attention's two products.

  The dense layers and the head: 2 FLOPs per weight per token forward, 4
  backward. Attention: q.k and p.v over the keys each query sees (on
  average (T + 1) / 2 of them), 2 * 2 * d per key forward, twice that
  backward. A cross-check on XLA's count, which also includes the
  elementwise work.
  """
  c, t, b, layers = config.n_embd, config.block_size, batch_of(config), config.n_layer
  weights = layers * (c * 3 * c + c * c + 2 * c * 4 * c) + c * config.vocab_size
  tokens = b * t
  attention = layers * 3 * 2 * 2 * c * (t + 1) / 2 * tokens
  return 6 * weights * tokens + attention


def flops_case(train_result, config, config_name, n):
  shapes = peak_shapes(config, n)
  peaks, by_shape = {}, {}
  for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
    peaks[name], by_shape[name] = matmul_peak(dtype, shapes)
  rows = {}
  for arm, dtype in (("purejax fp32", "float32"), ("purejax bf16", "bfloat16")):
    flops = train_step_flops(dataclasses.replace(config, compute_dtype=dtype))
    seconds = train_result["rows"][arm]["median"]
    achieved = flops / seconds / 1e9
    rows[arm] = {"gflop_per_step": flops / 1e9, "gflop_per_s": achieved,
                 "fraction_of_peak": achieved / peaks[dtype], "peak_dtype": dtype}
  return {"rows": rows, "matmul_peak_gflop_per_s": peaks,
          "matmul_gflop_per_s_by_shape": by_shape, "config": config_name,
          "analytic_gflop_per_step": analytic_train_flops(config) / 1e9,
          "note": "FLOPs of forward + backward from XLA's cost analysis of the unrolled "
                  "model, without rematerialisation's recompute; optimizer FLOPs are "
                  "negligible."}


# ----------------------------------------------------------------------------


def markdown(results):
  def median(row):
    if "median" in row:
      return f"{row['median']:.4g} {row['unit']}"
    return json.dumps(row)
  return harness.markdown(results, [
      ("median", median),
      ("min-max", lambda row: f"{row['min']:.4g}-{row['max']:.4g}" if "median" in row else ""),
      ("peer/purejax (min-max)",
       lambda row: harness.ratio_text(row, "reference") if "median" in row else "")])


def main(_):
  quick, cases, cpu_devices = FLAGS.quick, set(FLAGS.cases), FLAGS.cpu_devices
  if cpu_devices > 1:
    # Before anything starts JAX's backends. The one-device arms run on the
    # first device, as in a one-device process.
    parallel.set_cpu_devices(cpu_devices)
  results = {}
  started = time.time()
  if "a" in cases:
    results["a: GPT train, 4L/4H/128 T=64 B=12"] = train_case(
        SMALL, rounds=3 if quick else 9, steps=5 if quick else 10, with_compile=not quick,
        cpu_devices=cpu_devices)
  if "b" in cases or "g" in cases:
    heavy = train_case(HEAVY, rounds=1 if quick else 5, steps=1 if quick else 2,
                       with_compile=not quick, cpu_devices=cpu_devices)
    if "b" in cases:
      results["b: GPT train, 6L/6H/384 T=256 B=16"] = heavy
  if "c" in cases:
    results["c: sample 1000 tokens"] = sample_case(rounds=3 if quick else 7,
                                                   new_tokens=200 if quick else 1000)
  if "d" in cases:
    results["d: MNIST epoch, batch 128"] = mnist_case(
        rounds=2 if quick else 7, tfds_data_dir=FLAGS.tfds_data_dir,
        tfds_manual_dir=FLAGS.tfds_manual_dir)
  if "e" in cases:
    results["e: compile time vs depth"] = compile_case((2, 4) if quick else (2, 4, 8, 12))
  if "f" in cases:
    results["f: peak RSS, train step"] = rss_case("SMALL" if quick else "HEAVY")
  if "g" in cases:
    results["g: achieved GFLOP/s (case b)"] = flops_case(heavy, HEAVY, "HEAVY",
                                                        1024 if quick else 4096)
  meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "quick": quick, "jax": jax.__version__, "seconds": time.time() - started,
          "machine": f"{jax.devices()[0].device_kind}, {os.cpu_count()} cpus"}
  try:
    import torch  # pylint: disable=g-import-not-at-top
    meta["torch"] = torch.__version__
  except ImportError:
    pass
  # Named by date and cases: <date>.json for every case, <date>-ac.json for a and c.
  stem = datetime.date.today().isoformat()
  if cases != ALL_CASES:
    stem += "-" + "".join(sorted(cases))
  out = pathlib.Path(FLAGS.out) if FLAGS.out else harness.unused_results_path(
      harness.RESULTS_DIR, stem + ("-quick" if quick else ""))
  harness.write_results(out, {"meta": meta, "results": results})
  table = markdown(results)
  print(table)
  if not quick and cases == ALL_CASES:
    (pathlib.Path(__file__).parent / "RESULTS.md").write_text(
        f"# Latest full run\n\n{meta['date']}, {meta['machine']}, jax {meta['jax']}, "
        f"torch {meta.get('torch', '-')}; written by `python -m bench.run`.\n\n{table}\n")
  for case, result in results.items():
    for key in ("extra", "notes", "growth_first_to_last", "matmul_peak_gflop_per_s",
                "matmul_gflop_per_s_by_shape"):
      if result.get(key):
        print(f"{case} {key}: {json.dumps(result[key])}")
    if case.startswith(("e:", "f:", "g:")):
      print(f"{case}: {json.dumps(result['rows'])}")
  print(f"wrote {out}")


if __name__ == "__main__":
  define_flags()
  app.run(main)

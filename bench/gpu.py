"""purejax against its PyTorch twin on one GPU: cases h, i and j of bench/README.md.

    python -m bench.gpu                          # every case (about 25 minutes on an H100)
    python -m bench.gpu --cases=h.train,h.medium --time_budget_s=420 --out_dir=$OUT
    python -m bench.gpu --cases=h.feed --time_budget_s=420 --out_dir=$OUT
    python -m bench.gpu --quick --cases=h,i,j    # smoke run; on a CPU, with tiny models

Each case is made of jobs, and `--cases` takes cases or jobs:

* h, GPT-2 124M train step (T=1024, bf16 compute, AdamW + clipping):
  `h.train` alternates purejax (layers scanned, the backend's forms), purejax
  with `scan_layers=False` and the twin (`torch.compile`, bf16 autocast,
  fused AdamW) at batch 12; `h.feed` alternates purejax fed random ids on
  the device (as h.train) with purejax fed windows that a background thread
  reads from a uint16 token file on disk through `np.memmap`, one call
  ahead (as `loop.train_gpt` feeds a corpus too large for the device);
  `h.medium` asks whether purejax trains GPT-2 medium at batch 8;
  `h.max_batch.purejax`, `h.max_batch.torch` and
  `h.max_batch.purejax_unrolled` find each arm's largest batch and its peak
  memory from batch 12 up.
* i, nanoGPT's Tiny Shakespeare GPU recipe (shakespeare_char): the whole run
  with evaluations by purejax (`i.purejax_recipe`, through
  `purejax.training.loop.train_gpt`) and by the twin (`i.torch_recipe`), then
  `i.speed` alternates 200 iterations of each with dropout 0.2 and 0.
* j, sampling 1000 tokens at batch 1 through a KV cache: `j.sample`
  alternates purejax's `decode.generate` with the twin's `generate_kv`, eager
  and compiled.

Every job runs in a process of its own; this process only schedules them. So
one job's GPU memory, crash or hang cannot touch the next, and peak memory
and the largest batches are measured from an empty GPU. Within a job the
arms run alternately, A B A B ..., and each is compared with its purejax
reference by the median of the per-round ratio arm/purejax: for the twin,
above 1 means purejax is faster.

Results go to `<out_dir>/<date>-gpu-<cases>.json` (an existing file is never
overwritten: -2, -3, ... are added), rewritten after every round, so a run
that is killed keeps what it measured; the jobs' own output goes to the
`.log` beside it. Once `--time_budget_s` is spent, jobs add no more rounds
and no new job starts; a job still running `--job_grace_s` later is killed.
Only JAX, PyTorch, optax, chex, absl and numpy are needed (no TensorFlow,
no network).
"""

import concurrent.futures
import dataclasses
import datetime
import functools
import gc
from importlib import metadata
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from purejax.data import batches
from purejax.training import checkpoint
from purejax.data import corpus as corpus_lib
from purejax.data import datasets as data_lib
from purejax import decode
from purejax.training import flops
from purejax import gpt
from purejax.ops import attention
from purejax.ops import kernels
from purejax.training import loop
from purejax.training import optim
from purejax.training import parallel
from purejax.training import runs
from purejax.training import steps as steps_lib
from purejax.data import tokenizers

RESULTS_DIR = pathlib.Path(__file__).parent / "results"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

_CASES = flags.DEFINE_list(
    "cases", "h,i,j", "Cases (h, i, j) or jobs (h.train, h.feed, h.medium, h.max_batch, "
    "h.max_batch.torch, i.purejax_recipe, i.torch_recipe, i.speed, j.sample) to run.")
_QUICK = flags.DEFINE_bool(
    "quick", False, "Fewer rounds, 200 recipe iterations, 200 sampled tokens, a 32 MiB "
    "token file for h.feed; on a CPU every run uses tiny models.")
_BUDGET = flags.DEFINE_float(
    "time_budget_s", 1500.0, "Seconds after which jobs add no rounds and no job starts.")
_GRACE = flags.DEFINE_float(
    "job_grace_s", 300.0, "A job still running this long after the budget is killed (what "
    "it measured is kept).")
_OUT_DIR = flags.DEFINE_string("out_dir", str(RESULTS_DIR),
                               "Folder of the results file and its log.")
_OUT = flags.DEFINE_string("out", None, "Results file (overrides the name in --out_dir).")
_TORCH_COMPILE = flags.DEFINE_enum(
    "torch_compile", "auto", ["auto", "yes", "no"],
    "Run the twin under torch.compile: auto = on CUDA only.")
# Set by the scheduling process for the job processes.
_WORKER = flags.DEFINE_string("worker", None, "(internal) Run this one job here.")
_RESULTS = flags.DEFINE_string("results", None, "(internal) Results file of the run.")
_DEADLINE = flags.DEFINE_float("deadline", 0.0, "(internal) Unix time the budget ends.")
_GPU = flags.DEFINE_bool("gpu", False, "(internal) Whether the run has a GPU.")
_PEAK_FLOPS = flags.DEFINE_float("peak_flops", 0.0, "(internal) bf16 peak FLOP/s, 0: unknown.")

# ----------------------------------------------------------------------------
# What runs

# GPT-2 124M as nanoGPT trains it (vocab padded to 50304, no biases), bf16 matmuls.
GPT2_124M = gpt.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12,
                          n_embd=768, dropout=0.0, bias=False, compute_dtype="bfloat16")
GPT2_MEDIUM = dataclasses.replace(GPT2_124M, n_layer=24, n_head=16, n_embd=1024)
GPT2_OPTIMIZER = optim.OptimizerConfig(
    name="adamw", learning_rate=6e-4, schedule="constant", beta1=0.9, beta2=0.95,
    weight_decay=0.1, grad_clip=1.0)
# nanoGPT's config/train_shakespeare_char.py, in bf16.
SHAKESPEARE_GPU = gpt.GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6,
                                n_embd=384, dropout=0.2, bias=False, compute_dtype="bfloat16")
SHAKESPEARE_OPTIMIZER = optim.OptimizerConfig(
    name="adamw", learning_rate=1e-3, schedule="cosine", warmup_iters=100, decay_iters=5000,
    min_lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1, grad_clip=1.0)
DATA_TOKENS = 1 << 20  # random token ids the GPT-2 arms sample their batches from
GPT2_TOKENIZER_VOCAB = 50257  # ids in h.feed's token file are below this (GPT-2's BPE)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Models and counts of one run (GPU, GPU quick, or the CPU smoke run)."""
  gpt2: gpt.GPTConfig
  gpt2_medium: gpt.GPTConfig
  train_batch: int
  medium_batch: int
  batch_candidates: Tuple[int, ...]  # tried from the left by h.max_batch
  steps_per_call: int  # steps per timed call (purejax: one jitted lax.scan)
  train_rounds: int
  probe_rounds: int
  shakespeare: gpt.GPTConfig
  recipe_batch: int
  recipe_iters: int
  eval_interval: int
  eval_iters: int
  speed_iters: int  # per arm, in i.speed
  speed_rounds: int
  sample_tokens: int
  sample_rounds: int
  feed_tokens: int  # uint16 ids in h.feed's token file (2 bytes each)
  feed_calls: int  # timed calls per arm and round in h.feed, after one untimed call
  min_rounds: int = 2  # rounds run even past the budget


def make_sizes(gpu: bool, quick: bool) -> Sizes:
  if gpu:
    return Sizes(
        gpt2=GPT2_124M, gpt2_medium=GPT2_MEDIUM, train_batch=12, medium_batch=8,
        batch_candidates=(12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512),
        steps_per_call=10, train_rounds=4 if quick else 10, probe_rounds=1 if quick else 2,
        shakespeare=SHAKESPEARE_GPU, recipe_batch=64, recipe_iters=200 if quick else 5000,
        eval_interval=250, eval_iters=200, speed_iters=200, speed_rounds=4,
        sample_tokens=200 if quick else 1000, sample_rounds=3 if quick else 5,
        feed_tokens=(16 if quick else 512) << 20, feed_calls=5)
  # No GPU: the same jobs on tiny models, to check that everything runs.
  tiny = gpt.GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64,
                       bias=False, compute_dtype="bfloat16")
  return Sizes(
      gpt2=tiny, gpt2_medium=dataclasses.replace(tiny, n_head=4), train_batch=12,
      medium_batch=8, batch_candidates=(12, 16), steps_per_call=10, train_rounds=2,
      probe_rounds=1, shakespeare=dataclasses.replace(SHAKESPEARE_GPU, block_size=64,
                                                      n_layer=2, n_head=2, n_embd=64),
      recipe_batch=16, recipe_iters=20, eval_interval=10, eval_iters=4, speed_iters=20,
      speed_rounds=2, sample_tokens=30, sample_rounds=2, feed_tokens=1 << 20, feed_calls=2)


JOBS = {
    "h.train": "h: GPT-2 124M train step, batch 12",
    "h.feed": "h: the memory-mapped loader feeds the GPT-2 124M step without slowing it",
    "h.medium": "h: GPT-2 medium train step, batch 8 (purejax)",
    "h.max_batch.purejax": "h: largest batch, purejax (scan)",
    "h.max_batch.torch": "h: largest batch, torch twin",
    "h.max_batch.purejax_unrolled": "h: largest batch, purejax (scan_layers=False)",
    "i.purejax_recipe": "i: Shakespeare GPU recipe, purejax (loop.train_gpt)",
    "i.torch_recipe": "i: Shakespeare GPU recipe, torch twin",
    "i.speed": "i: Shakespeare GPU recipe, ms/iter, dropout 0.2 and 0",
    "j.sample": "j: sample 1000 tokens, batch 1, KV cache",
}


def select_jobs(cases: List[str]) -> List[str]:
  """Jobs named by `cases` (a case, a job, or a job prefix such as h.max_batch), in run order."""
  picked = [job for job in JOBS
            if any(job == c or job.startswith(c + ".") for c in cases)]
  unknown = [c for c in cases if not any(j == c or j.startswith(c + ".") for j in JOBS)]
  if unknown:
    raise app.UsageError(f"--cases: unknown {unknown}; choose among h, i, j and {list(JOBS)}.")
  return picked


# ----------------------------------------------------------------------------
# The results file


def read_results(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return {"meta": {}, "results": {}}


def write_results(path: pathlib.Path, results: dict) -> None:
  """Writes atomically, so a kill mid-write leaves the previous version."""
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(results, indent=2, default=str))
  os.replace(tmp, path)


def update_job(path: pathlib.Path, job: str, value: dict) -> None:
  """Sets one job's entry; the scheduler waits on each job, so only one process writes."""
  results = read_results(path)
  results.setdefault("results", {})[job] = value
  write_results(path, results)


def unused_results_path(out_dir: pathlib.Path, stem: str) -> pathlib.Path:
  """`<stem>.json`, or `<stem>-2.json`, ...: an earlier run is never overwritten."""
  out, n = out_dir / f"{stem}.json", 1
  while out.exists():
    n += 1
    out = out_dir / f"{stem}-{n}.json"
  return out


def describe(e: BaseException) -> str:
  """An exception in a line or two, with where it was raised."""
  frames = traceback.extract_tb(e.__traceback__)
  where = f" (at {pathlib.Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
  message = str(e).strip().replace("\n", " | ")
  if len(message) > 800:
    message = message[:500] + " ... " + message[-300:]
  return f"{type(e).__name__}: {message}{where}"


def is_oom(e: BaseException) -> bool:
  text = f"{type(e).__name__} {e}".lower()
  return "resource_exhausted" in text or "out of memory" in text or "outofmemory" in text


# ----------------------------------------------------------------------------
# Timing


class Job:
  """One job in its process: its sizes and deadline, and its entry in the results file."""

  def __init__(self, name: str, path: pathlib.Path, deadline: float, gpu: bool, quick: bool,
               peak_flops: Optional[float], compile_torch: bool):
    self.name, self.path, self.deadline, self.gpu = name, path, deadline, gpu
    self.quick, self.peak_flops, self.compile_torch = quick, peak_flops, compile_torch
    self.sizes = make_sizes(gpu, quick)
    self.result = {"title": JOBS.get(name, name), "status": "running", "rows": {}, "errors": {},
                   "notes": []}

  def save(self) -> None:
    update_job(self.path, self.name, self.result)

  def past_deadline(self) -> bool:
    return time.time() > self.deadline

  def error(self, where: str, e: BaseException) -> None:
    self.result["errors"][where] = describe(e)
    print(f"[{self.name}] {where}: {traceback.format_exc()}", flush=True)
    self.save()

  def note(self, text: str) -> None:
    if text not in self.result["notes"]:
      self.result["notes"].append(text)


def alternate(job: Job, arms: Dict[str, Callable[[], float]], rounds: int,
              publish: Callable[[Dict[str, List[float]]], None]) -> Dict[str, List[float]]:
  """Runs `arms` ({name: fn() -> seconds}) round-robin, A B A B ...

  Stops adding rounds once the budget is spent (after `min_rounds`). An arm
  that raises is dropped from later rounds, its error recorded. `publish`
  gets the times after every round (to save partial results).
  """
  times = {name: [] for name in arms}
  failed = set()
  for r in range(rounds):
    if r >= job.sizes.min_rounds and job.past_deadline():
      job.note(f"stopped after {r} of {rounds} rounds: time budget spent")
      break
    for name, fn in arms.items():
      if name in failed:
        continue
      try:
        times[name].append(fn())
      except Exception as e:  # pylint: disable=broad-except
        failed.add(name)
        job.error(name, e)
    publish(times)
    job.save()
  return times


def summarise(times: Dict[str, List[float]], reference_of: Dict[str, str], unit: str) -> dict:
  """Median, min, max per arm and, per `reference_of[arm]`, the per-round ratios arm/reference."""
  rows = {}
  for name, ts in times.items():
    if not ts:
      continue
    row = {"median": float(np.median(ts)), "min": float(min(ts)), "max": float(max(ts)),
           "unit": unit, "n": len(ts)}
    ref = reference_of.get(name)
    n = min(len(ts), len(times.get(ref, [])))
    if n:
      ratios = np.array(ts[:n]) / np.array(times[ref][:n])
      row.update(vs=ref, ratio=float(np.median(ratios)), ratio_min=float(ratios.min()),
                 ratio_max=float(ratios.max()))
    rows[name] = row
  return rows


def add_speed(row: dict, tokens_per_step: int, flops_per_token: Optional[float],
              peak_flops: Optional[float]) -> dict:
  """ms/iter, tokens/s and MFU of a row whose median is seconds per step."""
  tokens_per_s = tokens_per_step / row["median"]
  row.update(ms_per_iter=1000 * row["median"], tokens_per_s=tokens_per_s)
  if flops_per_token:
    row["flops_per_token"] = flops_per_token
    row["mfu"] = flops.mfu(flops_per_token, tokens_per_s, peak_flops or None)
  return row


@functools.lru_cache(maxsize=None)
def flops_per_token(config: gpt.GPTConfig) -> float:
  """`flops.transformer_flops_per_token` of `config`, params counted without a device."""
  shapes = jax.eval_shape(lambda k: gpt.init_params(config, k),
                          jax.ShapeDtypeStruct((2,), jnp.uint32))
  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  n_params -= config.block_size * config.n_embd  # as nanoGPT: no position embeddings
  return flops.transformer_flops_per_token(n_params, config.n_layer, config.n_head,
                                             config.head_dim, config.block_size)


# ----------------------------------------------------------------------------
# Memory


def jax_memory() -> dict:
  """The process's JAX peak and limit on device 0 ({} where the backend keeps no stats)."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    return {}
  return {k: stats[s] for k, s in (("peak_bytes", "peak_bytes_in_use"),
                                   ("limit_bytes", "bytes_limit")) if s in stats}


def torch_memory() -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  if not torch.cuda.is_available():
    return {}
  return {"peak_bytes": torch.cuda.max_memory_allocated(),
          "limit_bytes": torch.cuda.get_device_properties(0).total_memory}


def free_memory(torch_too: bool, drop_compiled: bool = False) -> None:
  """Returns what the last arm held; `drop_compiled` also forgets every compiled program.

  Only between tries of h.max_batch may compiled programs go: elsewhere other
  arms still run theirs, and would compile again inside a timed round.
  """
  gc.collect()
  if drop_compiled:
    jax.clear_caches()
  if torch_too:
    import torch  # pylint: disable=g-import-not-at-top
    if drop_compiled:
      torch._dynamo.reset()  # pylint: disable=protected-access
    if torch.cuda.is_available():
      torch.cuda.empty_cache()
      torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------
# Training arms


def purejax_train_arm(config: gpt.GPTConfig, batch: int, opt_config: optim.OptimizerConfig,
                      steps: int, info: dict, data=None, feed: Optional["HostFeed"] = None,
                      forms: Optional[kernels.Forms] = None) -> Callable[[], float]:
  """`steps_lib.train_steps` of `steps` steps per call; returns fn() -> seconds per step.

  Batches are random windows of `data` (default: random token ids), drawn on
  the device inside the jitted scan; or, with `feed`, windows the host read
  one call ahead, which a call waits for and `jax.device_put`s inside its
  timing, as `loop.train_gpt` runs a corpus too large for the device. The
  first call, which compiles, runs here.
  """
  key = jax.random.PRNGKey(0)
  if data is None and feed is None:
    data = jax.random.randint(key, (DATA_TOKENS,), 0, config.vocab_size, dtype=jnp.int32)
  params = gpt.init_params(config, key)
  optimizer = optim.make_optimizer(opt_config)
  state = {"params": params, "opt": optimizer.init(params), "step": 0}
  forms = forms or kernels.select(kernels.platform_of(params))
  train_steps = functools.partial(steps_lib.train_steps, config=config, optimizer=optimizer,
                                  batch_size=batch, num_steps=steps, forms=forms)
  info["forms"] = {"attention": attention_run(config, forms), "remat": forms.remat}

  def run():
    start = time.perf_counter()
    tokens = data if feed is None else jax.device_put(feed.windows(state["step"]))
    state["params"], state["opt"], metrics = train_steps(state["params"], state["opt"],
                                                         tokens, key, state["step"])
    losses = np.asarray(metrics.loss)  # waits for the steps
    seconds = time.perf_counter() - start
    state["step"] += steps
    info["last_loss"] = float(losses[-1])
    if not np.isfinite(losses).all():
      raise FloatingPointError(f"non-finite loss {losses} by step {state['step']}")
    return seconds / steps

  run()
  return run


def torch_device(job: Job):
  import torch  # pylint: disable=g-import-not-at-top
  if job.gpu and not torch.cuda.is_available():
    raise RuntimeError("JAX sees a GPU but torch.cuda.is_available() is False: this torch "
                       "build cannot run the twin on it.")
  device = torch.device("cuda" if job.gpu else "cpu")
  if device.type == "cuda":  # as nanoGPT: TF32 for whatever stays float32
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
  return torch, device


def torch_sync(torch, device) -> None:
  if device.type == "cuda":
    torch.cuda.synchronize()


def torch_train_arm(job: Job, config: gpt.GPTConfig, batch: int,
                    opt_config: optim.OptimizerConfig, steps: int, info: dict,
                    data=None) -> Callable[[], float]:
  """The twin's train step, nanoGPT's way; returns fn() -> seconds per step.

  `torch.compile` (unless --torch_compile=no, or auto on a CPU), bf16
  autocast when `config.compute_dtype` is bfloat16, AdamW fused on CUDA,
  gradient clipping, constant learning rate. Batches: one fixed random batch
  on the device (as nanoGPT's bench.py), or random windows of `data` (a
  device tensor) drawn on the device. No host sync inside a call.
  """
  torch, device = torch_device(job)
  from bench import torch_gpt  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  with torch.device(device):
    model = torch_gpt.TorchGPT(config)
  optimizer = torch_gpt.make_optimizer(
      model, opt_config.learning_rate, opt_config.weight_decay,
      (opt_config.beta1, opt_config.beta2), fused=device.type == "cuda")
  step_model = torch.compile(model) if job.compile_torch else model
  info["torch"] = {"compiled": job.compile_torch, "fused_adamw": device.type == "cuda",
                   "autocast": config.compute_dtype}
  bf16 = config.compute_dtype == "bfloat16"
  t = config.block_size
  if data is None:
    fixed = torch.randint(config.vocab_size, (batch, t + 1), device=device)
    fixed_xy = fixed[:, :-1].contiguous(), fixed[:, 1:].contiguous()
    next_batch = lambda: fixed_xy
  else:
    offsets = torch.arange(t, device=device)

    def next_batch():
      ix = torch.randint(len(data) - t, (batch, 1), device=device) + offsets
      return data[ix], data[ix + 1]

  def one_step():
    x, y = next_batch()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
      _, loss = step_model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if opt_config.grad_clip:
      torch.nn.utils.clip_grad_norm_(model.parameters(), opt_config.grad_clip)
    optimizer.step()
    return loss

  def run():
    torch_sync(torch, device)
    start = time.perf_counter()
    for _ in range(steps):
      loss = one_step()
    torch_sync(torch, device)
    seconds = time.perf_counter() - start
    info["last_loss"] = loss.item()
    if not math.isfinite(info["last_loss"]):
      raise FloatingPointError(f"non-finite loss {info['last_loss']}")
    return seconds / steps

  run()  # compiles (forward, then backward) and builds the optimizer state
  return run


def torch_arm_name(job: Job, extra: str = "") -> str:
  how = "torch.compile" if job.compile_torch else "eager"
  adam = "fused AdamW" if job.gpu else "AdamW"
  return f"torch twin ({how}, bf16 autocast, {adam}{extra})"


def build_arms(job: Job, factories: Dict[str, Callable[[], Callable[[], float]]]
               ) -> Dict[str, Callable[[], float]]:
  """Builds (and warms up) each arm; one that fails is recorded and left out."""
  arms = {}
  for name, factory in factories.items():
    if arms and job.past_deadline():
      job.error(name, TimeoutError("not built: time budget spent"))
      continue
    try:
      arms[name] = factory()
    except Exception as e:  # pylint: disable=broad-except
      job.error(name, e)
      free_memory(torch_too="torch" in name)
  return arms


# ----------------------------------------------------------------------------
# Case h: GPT-2 train step


def job_h_train(job: Job) -> None:
  s = job.sizes
  config, batch = s.gpt2, s.train_batch
  ref, unrolled, twin = ("purejax (scan_layers=True, auto forms)",
                         "purejax (scan_layers=False)", torch_arm_name(job))
  job.result["config"] = {"model": dataclasses.asdict(config), "batch": batch,
                          "steps_per_call": s.steps_per_call,
                          "optimizer": dataclasses.asdict(GPT2_OPTIMIZER)}
  job.note("peak_bytes of purejax arms is the process's JAX peak after that arm's first call "
           "(JAX's counter cannot be reset, so the second arm's includes the first's); "
           "h.max_batch.* measures each arm alone from batch 12.")
  infos = {ref: {}, unrolled: {}, twin: {}}

  def with_memory(name, make, torch_arm):
    def factory():
      if torch_arm:
        free_memory(torch_too=True)  # resets torch's peak counter
      fn = make(infos[name])
      infos[name].update(torch_memory() if torch_arm else jax_memory())
      return fn
    return factory

  arms = build_arms(job, {
      ref: with_memory(ref, lambda i: purejax_train_arm(
          config, batch, GPT2_OPTIMIZER, s.steps_per_call, i), False),
      unrolled: with_memory(unrolled, lambda i: purejax_train_arm(
          config, batch, GPT2_OPTIMIZER, s.steps_per_call, i,
          forms=kernels.select(scan_layers=False)), False),
      twin: with_memory(twin, lambda i: torch_train_arm(
          job, config, batch, GPT2_OPTIMIZER, s.steps_per_call, i), True),
  })

  def publish(times):
    rows = summarise(times, {unrolled: ref, twin: ref}, "s/iter")
    for name, row in rows.items():
      add_speed(row, batch * config.block_size, flops_per_token(config), job.peak_flops)
      row.update(infos[name])
    job.result["rows"] = rows

  alternate(job, arms, s.train_rounds, publish)


# h.feed: batches read by the host from a token file on disk.


def write_token_file(path: pathlib.Path, num_tokens: int, vocab: int, seed: int = 0,
                     chunk: int = 1 << 24) -> bool:
  """Writes `num_tokens` random uint16 ids below `vocab` to `path` through `np.memmap`.

  Then syncs the file and asks the kernel to drop it from the page cache, so
  the reads start from the disk, as a corpus larger than memory would.

  Returns:
    Whether the page cache could be dropped (`os.posix_fadvise`).
  """
  rng = np.random.default_rng(seed)
  out = np.memmap(path, dtype=np.uint16, mode="w+", shape=(num_tokens,))
  for start in range(0, num_tokens, chunk):
    stop = min(start + chunk, num_tokens)
    out[start:stop] = rng.integers(0, vocab, size=stop - start, dtype=np.uint16)
  out.flush()
  del out
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
    if hasattr(os, "posix_fadvise"):
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      return True
    return False
  finally:
    os.close(fd)


def filesystem_of(path: pathlib.Path) -> Optional[str]:
  """`"<fstype> <device>"` of the mount holding `path` (from /proc/mounts), or None."""
  try:
    mounts = [line.split()[:3] for line in pathlib.Path("/proc/mounts").read_text().splitlines()]
  except OSError:
    return None
  path = str(pathlib.Path(path).resolve())
  best = None
  for device, point, fstype in (m for m in mounts if len(m) == 3):
    if (path == point or path.startswith(point.rstrip("/") + "/")) and (
        best is None or len(point) > len(best[1])):
      best = (device, point, fstype)
  return f"{best[2]} {best[0]}" if best else None


class HostFeed:
  """Each call's windows, read in a background thread one call ahead.

  `windows(step)` returns `[steps_per_call, batch_size, block_size + 1]`
  int32: `batches.sample_windows(tokens, block_size, batch_size, seed, s)` for
  `s = step .. step + steps_per_call - 1`, and starts reading the call after.
  `reads` holds the seconds each read took (in the thread), `waits` the
  seconds each `windows` call waited for its read.

  The training loop's `batches.host_feed` reads ahead with
  `batches.BatchPrefetcher`, which queues up to two calls; this reads only one
  ahead and times every read, so a read slower than a call shows here.
  """

  def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
               steps_per_call: int):
    self._read_args = (tokens, block_size, batch_size, seed)
    self.steps_per_call = steps_per_call
    self.reads: List[float] = []
    self.waits: List[float] = []
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    self._ahead: Optional[Tuple[int, concurrent.futures.Future]] = None

  def _read(self, step: int) -> np.ndarray:
    start = time.perf_counter()
    out = np.stack([batches.sample_windows(*self._read_args, s)
                    for s in range(step, step + self.steps_per_call)])
    self.reads.append(time.perf_counter() - start)
    return out

  def windows(self, step: int) -> np.ndarray:
    ahead, self._ahead = self._ahead, None
    future = ahead[1] if ahead and ahead[0] == step else self._pool.submit(self._read, step)
    start = time.perf_counter()
    out = future.result()
    self.waits.append(time.perf_counter() - start)
    after = step + self.steps_per_call
    self._ahead = (after, self._pool.submit(self._read, after))
    return out

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)


def consecutive_calls(run: Callable[[], float], calls: int,
                      feed: Optional[HostFeed] = None,
                      timed_waits: Optional[List[float]] = None) -> Callable[[], float]:
  """One untimed call of `run`, then the mean seconds per step of `calls` more.

  The untimed call's windows were read while the other arm ran; from the
  next call on, each read overlaps only the call before it, as in training.
  With `feed`, its waits during the timed calls go to `timed_waits`.
  """
  def timed():
    run()
    begin = len(feed.waits) if feed else 0
    seconds = float(np.mean([run() for _ in range(calls)]))
    if feed:
      timed_waits.extend(feed.waits[begin:])
    return seconds
  return timed


def ms_stats(seconds: List[float], prefix: str) -> dict:
  if not seconds:
    return {}
  ms = 1000 * np.asarray(seconds)
  return {f"{prefix}_ms_median": float(np.median(ms)), f"{prefix}_ms_max": float(ms.max()),
          f"{prefix}_n": len(ms)}


def job_h_feed(job: Job) -> None:
  """Does reading batches from a memory-mapped file on disk slow the GPT-2 124M step?

  Arms, alternated: purejax fed random ids on the device (h.train's
  reference arm), and purejax fed `[steps, batch, block + 1]` windows read
  from a uint16 token file by `HostFeed`. A round is one untimed call and
  `feed_calls` timed calls of each arm.
  """
  s = job.sizes
  config, batch, steps = s.gpt2, s.train_batch, s.steps_per_call
  device, host = ("purejax, random ids on the device (as h.train)",
                  "purejax, windows read from a memmapped token file, one call ahead")
  vocab = min(GPT2_TOKENIZER_VOCAB, config.vocab_size)
  job.result["config"] = {"model": dataclasses.asdict(config), "batch": batch,
                          "steps_per_call": steps, "timed_calls_per_round": s.feed_calls,
                          "optimizer": dataclasses.asdict(GPT2_OPTIMIZER)}
  job.note("host/device is the per-round ratio of the two arms' ms/iter; at most 1.02 means "
           "the feed costs nothing. read_ms: one call's windows read from the memmap (in the "
           "background thread); wait_ms: how long a timed call waited for them.")
  with tempfile.TemporaryDirectory(prefix="purejax-feed-") as tmp:
    path = pathlib.Path(tmp) / "train.bin"
    start = time.perf_counter()
    dropped = write_token_file(path, s.feed_tokens, vocab)
    job.result["token_file"] = {
        "path": str(path), "tokens": s.feed_tokens, "bytes": path.stat().st_size,
        "ids_below": vocab, "filesystem": filesystem_of(path),
        "write_s": time.perf_counter() - start, "page_cache_dropped": dropped}
    job.save()
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    feed = HostFeed(tokens, config.block_size, batch, seed=0, steps_per_call=steps)
    infos, waits = {device: {}, host: {}}, []
    try:
      arms = build_arms(job, {
          device: lambda: consecutive_calls(purejax_train_arm(
              config, batch, GPT2_OPTIMIZER, steps, infos[device]), s.feed_calls),
          host: lambda: consecutive_calls(purejax_train_arm(
              config, batch, GPT2_OPTIMIZER, steps, infos[host], feed=feed), s.feed_calls,
                                          feed, waits),
      })

      def publish(times):
        rows = summarise(times, {host: device}, "s/iter")
        for name, row in rows.items():
          add_speed(row, batch * config.block_size, flops_per_token(config), job.peak_flops)
          row.update(infos[name])
        if host in rows:
          rows[host].update(ms_stats(list(feed.reads), "read"), **ms_stats(waits, "wait"))
          job.result["read_ms_median"] = rows[host].get("read_ms_median")
          if "ratio" in rows[host]:
            job.result["host_vs_device"] = rows[host]["ratio"]
            job.result["feed_costs_nothing"] = rows[host]["ratio"] <= 1.02
        job.result["rows"] = rows

      alternate(job, arms, s.train_rounds, publish)
    finally:
      feed.close()

def job_h_medium(job: Job) -> None:
  s = job.sizes
  config, batch = s.gpt2_medium, s.medium_batch
  name = "purejax GPT-2 medium (scan_layers=True, auto forms)"
  job.result["config"] = {"model": dataclasses.asdict(config), "batch": batch,
                          "steps_per_call": 1}
  info = {}
  try:
    run = purejax_train_arm(config, batch, GPT2_OPTIMIZER, 1, info)
  except Exception as e:  # pylint: disable=broad-except
    job.result["trains_without_oom"] = False if is_oom(e) else None
    job.error(name, e)
    return
  job.result["trains_without_oom"] = True
  info.update(jax_memory())

  def publish(times):
    rows = summarise(times, {}, "s/iter")
    for row in rows.values():
      add_speed(row, batch * config.block_size, flops_per_token(config), job.peak_flops)
      row.update(info)
    job.result["rows"] = rows

  alternate(job, {name: run}, 5, publish)


def job_h_max_batch(job: Job, arm: str) -> None:
  """Largest batch of `arm` that trains, from `batch_candidates`; and the memory of each.

  Batches 12 and 16 run first; the peak memory of the two gives the memory
  per sequence, from which the largest fitting candidate is predicted and
  tried, then its neighbours up (if it fits) or down (if not), until one
  fits and the next does not. Every try compiles, so this saves minutes
  over trying every candidate.
  """
  s = job.sizes
  torch_arm = arm == "torch"
  config = s.gpt2
  forms = kernels.select(scan_layers=arm != "purejax_unrolled")
  candidates = list(s.batch_candidates)
  job.result["config"] = {"model": dataclasses.asdict(config), "arm": arm,
                          "candidates": candidates}
  batches = job.result.setdefault("batches", {})
  after_oom = []

  def attempt(batch: int) -> bool:
    record, info, run = {}, {}, None
    free_memory(torch_too=torch_arm, drop_compiled=True)
    try:
      if torch_arm:
        run = torch_train_arm(job, config, batch, GPT2_OPTIMIZER, s.steps_per_call, info)
      else:
        run = purejax_train_arm(config, batch, GPT2_OPTIMIZER, s.steps_per_call, info,
                                forms=forms)
      times = [run() for _ in range(s.probe_rounds)]
      row = {"median": float(np.median(times)), "min": min(times), "max": max(times),
             "unit": "s/iter", "n": len(times)}
      add_speed(row, batch * config.block_size, flops_per_token(config), job.peak_flops)
      record = {"fits": True, **row, **info, **(torch_memory() if torch_arm else jax_memory())}
      if after_oom and not torch_arm:
        record["peak_note"] = "measured after an out-of-memory try: may be that try's peak"
    except Exception as e:  # pylint: disable=broad-except
      record = {"fits": False, "oom": is_oom(e), "error": describe(e)}
      print(f"[{job.name}] batch {batch}: {traceback.format_exc()}", flush=True)
      if record["oom"]:
        after_oom.append(batch)
    finally:
      del run
      free_memory(torch_too=torch_arm, drop_compiled=True)
    batches[str(batch)] = record
    fitting = [int(b) for b, r in batches.items() if r.get("fits")]
    failed = [int(b) for b, r in batches.items() if not r.get("fits")]
    job.result["largest_batch"] = max(fitting) if fitting else None
    job.result["smallest_failed_batch"] = min(failed) if failed else None
    if fitting:
      best = batches[str(max(fitting))]
      job.result["rows"] = {f"{arm}, batch {max(fitting)} (largest that fits)": {
          k: v for k, v in best.items() if k != "fits"}}
    job.save()
    if not record["fits"] and not record["oom"]:
      raise RuntimeError(f"batch {batch} failed with an error other than out of memory: "
                         f"{record['error']}")
    return record["fits"]

  def over_budget() -> bool:
    if job.past_deadline():
      job.note("stopped: time budget spent")
      return True
    return False

  def predict(first, rest):
    start = predicted_start([batches[str(b)] for b in first], first, rest)
    job.result["predicted_largest_batch"] = None if start is None else rest[start]
    return start

  search_largest(candidates, attempt, predict, over_budget)


def search_largest(candidates: List[int], attempt: Callable[[int], bool],
                   predict: Callable[[List[int], List[int]], Optional[int]],
                   over_budget: Callable[[], bool]) -> None:
  """Calls `attempt(batch) -> fits` on candidates until the largest fitting one is known.

  The first two always run (they measure memory); then `predict(first, rest)`
  picks where in the rest to start (None: at its beginning), and the search
  goes up from there while batches fit, or down until one does.
  """
  first, rest = candidates[:2], candidates[2:]
  for batch in first:
    if not attempt(batch):
      return
  if not rest or over_budget():
    return
  i = predict(first, rest) or 0
  if attempt(rest[i]):
    for batch in rest[i + 1:]:  # up until one fails
      if over_budget() or not attempt(batch):
        return
  else:
    for batch in reversed(rest[:i]):  # down until one fits
      if over_budget() or attempt(batch):
        return


def predicted_start(records: List[dict], first: List[int], rest: List[int]) -> Optional[int]:
  """Index in `rest` of the largest batch a straight line through two peaks allows.

  Args:
    records: the tries of the batches `first`, with "peak_bytes" and "limit_bytes".
    first: the two batches tried.
    rest: candidates, ascending.

  Returns:
    The index, 0 if even `rest[0]` looks too big, None without usable figures.
  """
  (b0, b1), (r0, r1) = first, records
  p0, p1, limit = r0.get("peak_bytes"), r1.get("peak_bytes"), r1.get("limit_bytes")
  if not (p0 and p1 and limit) or p1 <= p0:
    return None
  per_sequence = (p1 - p0) / (b1 - b0)
  # 90% of the limit: allocator fragmentation and the compiler's own choices
  # make the line a little optimistic.
  largest = (0.9 * limit - (p1 - per_sequence * b1)) / per_sequence
  fitting = [i for i, b in enumerate(rest) if b <= largest]
  return fitting[-1] if fitting else 0


# ----------------------------------------------------------------------------
# Case i: the Tiny Shakespeare GPU recipe


def shakespeare() -> corpus_lib.Corpus:
  """Tiny Shakespeare read as plain text, split exactly as nanoGPT's prepare.py does.

  The vocabulary is the sorted set of the text's characters; the first 90% of
  the ids train, the last 10% validate.
  """
  path = pathlib.Path(data_lib.EMBEDDED_SHAKESPEARE_DIR) / "input.txt"
  text = path.read_text(encoding="utf-8")
  tokenizer = tokenizers.CharTokenizer.from_text(text)
  ids = tokenizer.encode(text)
  n = int(len(ids) * 0.9)
  return corpus_lib.Corpus(tokenizer, ids[:n], ids[n:], "tiny_shakespeare (plain text)")


def recipe_config(job: Job) -> dict:
  s = job.sizes
  return {"model": dataclasses.asdict(s.shakespeare), "batch": s.recipe_batch,
          "max_iters": s.recipe_iters, "eval_interval": s.eval_interval,
          "eval_iters": s.eval_iters, "optimizer": dataclasses.asdict(SHAKESPEARE_OPTIMIZER)}


def summarise_run(history: List[dict], iter_seconds: List[float], wall: float) -> dict:
  """ms/iter (median, the first two timed calls left out: they compile), wall time, losses."""
  timed = iter_seconds[2:] or iter_seconds
  return {"median": float(np.median(timed)), "min": float(min(timed)),
          "max": float(max(timed)), "unit": "s/iter", "n": len(timed), "wall_s": wall,
          **losses_of(history)}


def losses_of(history: List[dict]) -> dict:
  if not history:
    return {}
  return {"best_val_loss": min(h["val_loss"] for h in history),
          "final_val_loss": history[-1]["val_loss"],
          "final_train_loss": history[-1]["train_loss"], "evals": len(history)}


def job_i_purejax_recipe(job: Job) -> None:
  s = job.sizes
  text, config = shakespeare(), s.shakespeare
  job.result["config"] = recipe_config(job)
  name = f"purejax (dropout {config.dropout}: {attention_run(config)} attention)"
  train = loop.GPTTrainConfig(
      batch_size=s.recipe_batch, max_iters=s.recipe_iters, eval_interval=s.eval_interval,
      eval_iters=s.eval_iters, log_interval=s.eval_interval, steps_per_call=10,
      sample_tokens=0, seed=0)
  with tempfile.TemporaryDirectory() as out_dir:
    start = time.perf_counter()
    try:
      metrics = loop.train_gpt(config, text, train, SHAKESPEARE_OPTIMIZER,
                               runs.RunConfig(out_dir=out_dir, keep_checkpoints=1),
                               parallel.ParallelConfig(num_devices=1))  # one GPU, as the twin
      wall = time.perf_counter() - start
      history = checkpoint.latest_meta(out_dir)[1].get("history", [])
      row = {"median": metrics["ms_per_iter"] / 1000, "min": None, "max": None,
             "unit": "s/iter", "wall_s": wall, "via": "loop.train_gpt", **losses_of(history)}
      job.result["history"] = history
      job.result["rows"] = {name: add_speed(row, s.recipe_batch * config.block_size,
                                            flops_per_token(config), job.peak_flops)}
      return
    except Exception as e:  # pylint: disable=broad-except
      job.error("loop.train_gpt", e)
  # loop.train_gpt's signature may have moved on: the same recipe, written out.
  free_memory(torch_too=False, drop_compiled=True)
  history, seconds, wall = purejax_recipe_loop(job, text, config)
  row = summarise_run(history, seconds, wall)
  row["via"] = "bench.gpu's own loop over steps.train_steps and steps.evaluate"
  job.result["history"] = history
  job.result["rows"] = {name: add_speed(row, s.recipe_batch * config.block_size,
                                        flops_per_token(config), job.peak_flops)}


def purejax_recipe_loop(job: Job, text: corpus_lib.Corpus, config: gpt.GPTConfig
                        ) -> Tuple[List[dict], List[float], float]:
  """The recipe with `steps.train_steps` (10 steps per call) and `steps.evaluate`."""
  s = job.sizes
  start = time.perf_counter()
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  params = gpt.init_params(config, keys[0])
  optimizer = optim.make_optimizer(SHAKESPEARE_OPTIMIZER)
  opt_state = optimizer.init(params)
  train_data, val_data = jnp.asarray(text.train), jnp.asarray(text.val)
  evaluate = functools.partial(steps_lib.evaluate, config=config, batch_size=s.recipe_batch,
                               num_batches=s.eval_iters)
  history, seconds, step = [], [], 0
  while True:
    if step % s.eval_interval == 0 or step == s.recipe_iters:
      history.append({"step": step,
                      "train_loss": float(evaluate(params, train_data, keys[2])),
                      "val_loss": float(evaluate(params, val_data, keys[2]))})
    if step == s.recipe_iters:
      break
    n = min(10, s.recipe_iters - step, s.eval_interval - step % s.eval_interval)
    call_start = time.perf_counter()
    params, opt_state, losses = steps_lib.train_steps(
        params, opt_state, train_data, keys[1], step, config=config, optimizer=optimizer,
        batch_size=s.recipe_batch, num_steps=n)
    np.asarray(losses)
    seconds.append((time.perf_counter() - call_start) / n)
    step += n
  return history, seconds, time.perf_counter() - start


def job_i_torch_recipe(job: Job) -> None:
  """nanoGPT's train.py loop with the twin: compiled, bf16 autocast, SDPA with dropout, fused AdamW.

  The schedule is nanoGPT's get_lr; evaluation every `eval_interval` steps
  (and at the end) over `eval_iters` random batches of each split, and a
  checkpoint (model and optimizer) saved at each, as `loop.train_gpt` does.
  Batches are drawn on the device, as purejax draws them (nanoGPT copies
  them from the host). Time is measured over 10 steps between syncs, like
  purejax's 10-step calls.
  """
  s = job.sizes
  torch, device = torch_device(job)
  from bench import torch_gpt  # pylint: disable=g-import-not-at-top
  text, config, opt = shakespeare(), s.shakespeare, SHAKESPEARE_OPTIMIZER
  job.result["config"] = recipe_config(job)
  name = torch_arm_name(job, ", SDPA dropout 0.2")

  def lr_at(it):  # nanoGPT's get_lr, which optim.warmup_cosine_schedule also computes
    if it < opt.warmup_iters:
      return opt.learning_rate * (it + 1) / (opt.warmup_iters + 1)
    ratio = min((it - opt.warmup_iters) / max(opt.decay_iters - opt.warmup_iters, 1), 1.0)
    return opt.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (opt.learning_rate - opt.min_lr)
  start = time.perf_counter()
  torch.manual_seed(0)
  with torch.device(device):
    model = torch_gpt.TorchGPT(config)
  optimizer = torch_gpt.make_optimizer(model, opt.learning_rate, opt.weight_decay,
                                       (opt.beta1, opt.beta2), fused=device.type == "cuda")
  step_model = torch.compile(model) if job.compile_torch else model
  splits = {"train": torch.from_numpy(text.train.astype(np.int64)).to(device),
            "val": torch.from_numpy(text.val.astype(np.int64)).to(device)}
  t, b = config.block_size, s.recipe_batch
  offsets = torch.arange(t, device=device)
  autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16,
                                    enabled=config.compute_dtype == "bfloat16")

  def get_batch(split):
    data = splits[split]
    ix = torch.randint(len(data) - t, (b, 1), device=device) + offsets
    return data[ix], data[ix + 1]

  history, seconds = [], []

  def publish(done):
    row = summarise_run(history, seconds, time.perf_counter() - start)
    row["torch"] = {"compiled": job.compile_torch, "fused_adamw": device.type == "cuda"}
    if not done:
      row["partial"] = f"up to step {history[-1]['step']} of {s.recipe_iters}"
    job.result["history"] = history
    job.result["rows"] = {name: add_speed(row, b * t, flops_per_token(config), job.peak_flops)}
    job.save()

  with tempfile.TemporaryDirectory() as out_dir:

    def evaluate(step):
      model.eval()
      losses = {}
      with torch.no_grad():
        for split in ("train", "val"):
          total = torch.zeros((), device=device)
          for _ in range(s.eval_iters):
            with autocast():
              total += step_model(*get_batch(split))[1].float()
          losses[f"{split}_loss"] = total.item() / s.eval_iters
      model.train()
      history.append({"step": step, **losses})
      torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                 os.path.join(out_dir, "ckpt.pt"))
      print(f"[{job.name}] step {step}: {losses}", flush=True)

    step = 0
    while True:
      if step % s.eval_interval == 0 or step == s.recipe_iters:
        evaluate(step)
        if seconds:
          publish(done=step == s.recipe_iters)
      if step == s.recipe_iters:
        break
      n = min(10, s.recipe_iters - step, s.eval_interval - step % s.eval_interval)
      torch_sync(torch, device)
      call_start = time.perf_counter()
      for it in range(step, step + n):
        for group in optimizer.param_groups:
          group["lr"] = lr_at(it)
        x, y = get_batch("train")
        with autocast():
          _, loss = step_model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optimizer.step()
      torch_sync(torch, device)
      seconds.append((time.perf_counter() - call_start) / n)
      step += n


def job_i_speed(job: Job) -> None:
  """ms/iter of the recipe's step, alternating: dropout 0.2 (purejax runs plain attention) and 0."""
  s = job.sizes
  text, config = shakespeare(), s.shakespeare
  no_dropout = dataclasses.replace(config, dropout=0.0)
  job.result["config"] = recipe_config(job)
  job.result["config"].update(iters_per_arm=s.speed_iters, rounds=s.speed_rounds)
  per_round = max(s.speed_iters // s.speed_rounds, 1)
  calls = max(per_round // 10, 1)
  steps = per_round // calls
  names = {"pj": f"purejax, dropout {config.dropout} ({attention_run(config)} attention)",
           "pj0": f"purejax, dropout 0 ({attention_run(no_dropout)} attention)",
           "tw": torch_arm_name(job, ", dropout 0.2"),
           "tw0": torch_arm_name(job, ", dropout 0")}
  infos = {name: {} for name in names.values()}
  train_ids = jnp.asarray(text.train)

  def purejax_arm(cfg, name):
    def factory():
      one_call = purejax_train_arm(cfg, s.recipe_batch, SHAKESPEARE_OPTIMIZER, steps,
                                   infos[name], data=train_ids)
      return lambda: sum(one_call() for _ in range(calls)) / calls
    return factory

  def torch_arm(cfg, name):
    def factory():
      torch, device = torch_device(job)
      data = torch.from_numpy(text.train.astype(np.int64)).to(device)
      return torch_train_arm(job, cfg, s.recipe_batch, SHAKESPEARE_OPTIMIZER, per_round,
                             infos[name], data=data)
    return factory

  arms = build_arms(job, {names["pj"]: purejax_arm(config, names["pj"]),
                          names["pj0"]: purejax_arm(no_dropout, names["pj0"]),
                          names["tw"]: torch_arm(config, names["tw"]),
                          names["tw0"]: torch_arm(no_dropout, names["tw0"])})

  def publish(times):
    rows = summarise(times, {names["pj0"]: names["pj"], names["tw"]: names["pj"],
                             names["tw0"]: names["pj0"]}, "s/iter")
    for name, row in rows.items():
      add_speed(row, s.recipe_batch * config.block_size, flops_per_token(config),
                job.peak_flops)
      row.update(infos[name])
    job.result["rows"] = rows

  alternate(job, arms, s.speed_rounds, publish)


def attention_run(config: gpt.GPTConfig, forms: kernels.Forms) -> str:
  """The attention form a training step of `config` runs under `forms`."""
  if forms.attention == "cudnn" and attention.cudnn_unsupported(
      (1, config.block_size, config.n_head, config.head_dim),
      config.matmul_dtype or jnp.float32, config.dropout > 0):
    return "xla"
  return forms.attention


# ----------------------------------------------------------------------------
# Case j: sampling with a KV cache


def job_j_sample(job: Job) -> None:
  """Batch 1, a 1-token prompt, top_k 200, temperature 1, bf16 compute, same random weights."""
  s = job.sizes
  config, new_tokens = s.gpt2, s.sample_tokens
  job.result["config"] = {"model": dataclasses.asdict(config), "new_tokens": new_tokens,
                          "prompt_tokens": 1, "batch": 1, "top_k": 200}
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  prompt = jnp.zeros((1, 1), jnp.int32)
  counter = iter(range(1, 1_000_000))

  def purejax_arm():
    def run():
      start = time.perf_counter()
      out = decode.generate(params, prompt, config, jax.random.PRNGKey(next(counter)),
                            new_tokens, top_k=200)
      np.asarray(out)
      return (time.perf_counter() - start) / new_tokens
    run()  # compiles
    return run

  twin_state = {}

  def twin_arm(compile_mode):
    def factory():
      torch, device = torch_device(job)
      from bench import torch_gpt  # pylint: disable=g-import-not-at-top
      if "model" not in twin_state:
        twin = torch_gpt.load_purejax_params(torch_gpt.TorchGPT(config), params)
        twin_state["model"] = twin.to(device).eval()
      twin, idx = twin_state["model"], torch.zeros((1, 1), dtype=torch.long, device=device)

      def run():
        torch_sync(torch, device)
        start = time.perf_counter()
        out = twin.generate_kv(idx, new_tokens, top_k=200, autocast_dtype=torch.bfloat16,
                               compile_mode=compile_mode)
        out.cpu()
        return (time.perf_counter() - start) / new_tokens
      run()  # compiles (and records the CUDA graphs)
      return run
    return factory

  arms = {}
  ref = "purejax decode.generate (one jitted lax.scan)"
  eager = "torch twin generate_kv, eager (bf16 autocast)"
  arms.update(build_arms(job, {ref: purejax_arm, eager: twin_arm(False)}))
  compiled = None
  if job.compile_torch:
    # CUDA graphs ("reduce-overhead") are the fast way for one token at a
    # time; if they fail here, the default mode still compiles the step.
    for mode in (("reduce-overhead", None) if job.gpu else (None,)):
      name = f"torch twin generate_kv, torch.compile mode={mode or 'default'} (bf16 autocast)"
      built = build_arms(job, {name: twin_arm(mode)})
      if built:
        arms.update(built)
        compiled = name
        break
  else:
    job.note("torch.compile arm not run (--torch_compile=no, or auto without CUDA)")

  def publish(times):
    rows = summarise(times, {eager: ref, compiled: ref}, "s/token")
    for row in rows.values():
      row["tokens_per_s"] = 1.0 / row["median"]
    job.result["rows"] = rows
    twins = [name for name in (eager, compiled) if name in rows]
    if twins:
      job.result["fastest_twin"] = min(twins, key=lambda name: rows[name]["median"])

  alternate(job, arms, s.sample_rounds, publish)


# ----------------------------------------------------------------------------
# The environment


def job_env(job: Job) -> None:
  """Devices and versions, as JAX, torch and nvidia-smi see them."""
  env = job.result
  try:
    device = jax.devices()[0]
    env.update(jax=jax.__version__, backend=jax.default_backend(),
               device_kind=device.device_kind, devices=[str(d) for d in jax.devices()],
               peak_flops_bf16=flops.device_peak_flops(device, "bfloat16"), **jax_memory())
  except Exception as e:  # pylint: disable=broad-except
    job.error("jax", e)
  try:
    import torch  # pylint: disable=g-import-not-at-top
    env.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
               torch_cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
      env.update(torch_device_name=torch.cuda.get_device_name(),
                 torch_capability=list(torch.cuda.get_device_capability()),
                 cudnn=torch.backends.cudnn.version())
  except Exception as e:  # pylint: disable=broad-except
    job.error("torch", e)
  if shutil.which("nvidia-smi"):
    try:
      out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=60)
      env["nvidia_smi"] = out.stdout.strip()
    except Exception as e:  # pylint: disable=broad-except
      job.error("nvidia-smi", e)


def package_versions() -> dict:
  versions = {}
  for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "torch", "optax",
               "chex", "numpy", "absl-py"):
    try:
      versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  return versions


# ----------------------------------------------------------------------------
# Running the jobs


def run_worker() -> None:
  name = _WORKER.value
  job = Job(name, pathlib.Path(_RESULTS.value), _DEADLINE.value, _GPU.value, _QUICK.value,
            _PEAK_FLOPS.value or None, compile_torch(_GPU.value))
  job.save()
  try:
    if name == "env":
      job_env(job)
    elif name.startswith("h.max_batch."):
      job_h_max_batch(job, name.split(".")[-1])
    else:
      {"h.train": job_h_train, "h.feed": job_h_feed, "h.medium": job_h_medium,
       "i.purejax_recipe": job_i_purejax_recipe, "i.torch_recipe": job_i_torch_recipe,
       "i.speed": job_i_speed, "j.sample": job_j_sample}[name](job)
    job.result["status"] = "done"
  except Exception as e:  # pylint: disable=broad-except
    job.result["status"] = "failed"
    job.error("job", e)
  job.save()


def compile_torch(gpu: bool) -> bool:
  return {"yes": True, "no": False, "auto": gpu}[_TORCH_COMPILE.value]


def worker_env() -> dict:
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  # JAX shares the GPU with torch in the same process, so it allocates as
  # needed instead of taking 75% up front; its pool may still grow to 95%,
  # which the largest-batch search needs.
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  return env


def spawn(job: str, results: pathlib.Path, log: pathlib.Path, deadline: float, gpu: bool,
          peak_flops: Optional[float], timeout: float) -> Tuple[Optional[int], float]:
  """Runs one job in its own process (group); returns (exit code or None if killed, seconds)."""
  args = [sys.executable, "-m", "bench.gpu", f"--worker={job}", f"--results={results}",
          f"--deadline={deadline}", f"--gpu={gpu}", f"--peak_flops={peak_flops or 0}",
          f"--quick={_QUICK.value}", f"--torch_compile={_TORCH_COMPILE.value}"]
  start = time.time()
  with open(log, "a") as out:
    out.write(f"\n===== {job} ({datetime.datetime.now().isoformat(timespec='seconds')}) =====\n")
    out.flush()
    # A session of its own: on a timeout the whole group goes, torch's compile workers too.
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=worker_env(), stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
      return proc.wait(timeout=max(timeout, 1.0)), time.time() - start
    except subprocess.TimeoutExpired:
      return None, time.time() - start
    finally:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def log_tail(log: pathlib.Path, chars: int = 1500) -> str:
  try:
    return log.read_text(errors="replace")[-chars:]
  except OSError:
    return ""


def run_env(log: pathlib.Path) -> dict:
  """The env job, into a scratch file (the results file is named after it)."""
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "env.json"
    code, _ = spawn("env", path, log, time.time() + 300, False, None, timeout=300)
    env = read_results(path).get("results", {}).get("env", {})
  for key in ("title", "rows", "notes", "status"):
    env.pop(key, None)
  if not env.get("errors"):
    env.pop("errors", None)
  if code != 0:
    env.setdefault("errors", {})["process"] = f"exit code {code}: {log_tail(log, 600)}"
  return env


def main(argv):
  del argv
  if _WORKER.value:
    run_worker()
    return
  jobs = select_jobs(_CASES.value)
  started = time.time()
  deadline = started + _BUDGET.value
  out_dir = pathlib.Path(_OUT_DIR.value)
  out_dir.mkdir(parents=True, exist_ok=True)
  scratch_log = out_dir / f".gpu-env-{os.getpid()}.log"
  print("bench.gpu: reading the devices ...", flush=True)
  env = run_env(scratch_log)
  gpu = env.get("backend") not in (None, "cpu")
  peak_flops = env.get("peak_flops_bf16")
  cases = "".join(_CASES.value) if all(len(c) == 1 for c in _CASES.value) else "_".join(
      _CASES.value)
  stem = (f"{datetime.date.today().isoformat()}-{'gpu' if gpu else 'cpu'}-{cases}"
          f"{'-quick' if _QUICK.value else ''}")
  path = pathlib.Path(_OUT.value) if _OUT.value else unused_results_path(out_dir, stem)
  log = path.with_suffix(".log")
  log.write_text(log_tail(scratch_log, 1 << 20))
  scratch_log.unlink(missing_ok=True)
  meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "command": " ".join(["python -m bench.gpu"] + sys.argv[1:]),
          "quick": _QUICK.value, "time_budget_s": _BUDGET.value, "jobs": jobs,
          "gpu": env.get("torch_device_name") or env.get("device_kind"),
          "device_kind": env.get("device_kind"), "peak_flops_bf16": peak_flops,
          "torch_compile": compile_torch(gpu), "versions": package_versions(), "env": env,
          "sizes": "GPU sizes" if gpu else "no GPU: tiny models (a smoke run)",
          "ratio": "per-round arm/reference time, median (min-max); for a twin, above 1 "
                   "means purejax is faster"}
  write_results(path, {"meta": meta, "results": {}})
  print(f"bench.gpu: {meta['gpu']}, jax {env.get('jax')}, torch {env.get('torch')}; "
        f"jobs {jobs}; results in {path}", flush=True)
  for job in jobs:
    remaining = deadline - time.time()
    if remaining <= 0:
      update_job(path, job, {"title": JOBS[job], "status": "skipped",
                             "errors": {"job": "not started: time budget spent"}})
      print(f"  {job}: skipped (time budget spent)", flush=True)
      continue
    code, seconds = spawn(job, path, log, deadline, gpu, peak_flops,
                          timeout=remaining + _GRACE.value)
    entry = read_results(path).get("results", {}).get(job) or {"title": JOBS[job],
                                                                "errors": {}}
    if code != 0 or entry.get("status") == "running":
      entry["status"] = "killed" if code is None else "crashed"
      entry.setdefault("errors", {})["process"] = (
          f"killed after {seconds:.0f} s (time budget + --job_grace_s)" if code is None else
          f"exit code {code}; log tail: {log_tail(log, 800)}")
      update_job(path, job, entry)
    errors = entry.get("errors") or {}
    print(f"  {job}: {entry.get('status')} in {seconds:.0f} s"
          + (f"; errors: {list(errors)}" if errors else ""), flush=True)
  results = read_results(path)
  results["meta"]["seconds"] = time.time() - started
  write_results(path, results)
  versions = meta["versions"]
  print(f"\n{meta['gpu']}; jax {versions.get('jax')}, jaxlib {versions.get('jaxlib')}, "
        f"torch {versions.get('torch')}; {meta['sizes']}; ratio = arm time / reference "
        f"time per round, median (min-max), above 1: the reference is faster; the reference "
        f"(`vs` in the file) is the job's first purejax arm, in i.speed purejax with the "
        f"same dropout\n")
  print(markdown(results["results"]))
  print(f"wrote {path} (job output: {log})")


# ----------------------------------------------------------------------------
# The table


def _fmt(value, spec=".3g", scale=1.0, suffix=""):
  return "" if value is None else f"{value * scale:{spec}}{suffix}"


def markdown(results: dict) -> str:
  lines = ["| job | arm | median (min-max) | tokens/s | MFU | peak GiB | ratio vs ref | other |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for job, result in results.items():
    for arm, row in (result.get("rows") or {}).items():
      unit = row.get("unit", "")
      if unit == "s/iter":
        median = f"{_fmt(row.get('median'), '.2f', 1000)} ms/iter"
        spread = (f" ({_fmt(row['min'], '.2f', 1000)}-{_fmt(row['max'], '.2f', 1000)})"
                  if row.get("min") is not None else "")
      else:
        median = f"{_fmt(row.get('median'), '.3g', 1000)} ms/token"
        spread = (f" ({_fmt(row['min'], '.3g', 1000)}-{_fmt(row['max'], '.3g', 1000)})"
                  if row.get("min") is not None else "")
      ratio = (f"{row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
               if "ratio" in row else "")
      other = []
      for key, label in (("wall_s", "wall {:.0f} s"), ("best_val_loss", "best val {:.4f}"),
                         ("final_val_loss", "final val {:.4f}"),
                         ("read_ms_median", "read {:.2f} ms/call"),
                         ("wait_ms_max", "waited at most {:.2f} ms"), ("n", "n={}")):
        if row.get(key) is not None:
          other.append(label.format(row[key]))
      mfu = row.get("mfu")
      lines.append(
          f"| {job} | {arm} | {median}{spread} | {_fmt(row.get('tokens_per_s'), ',.0f')} | "
          f"{_fmt(mfu, '.1%') if mfu is not None else ''} | "
          f"{_fmt(row.get('peak_bytes'), '.1f', 1 / 2**30)} | {ratio} | {', '.join(other)} |")
    extra = []
    if "trains_without_oom" in result:
      extra.append(f"trains without OOM: {result['trains_without_oom']}")
    if "largest_batch" in result:
      extra.append(f"largest batch {result['largest_batch']}, first failing "
                   f"{result.get('smallest_failed_batch')}")
    if "host_vs_device" in result:
      extra.append(f"host/device {result['host_vs_device']:.3f}: the feed "
                   f"{'costs nothing' if result.get('feed_costs_nothing') else 'slows the step'}"
                   f" (<= 1.02 is free)")
    if result.get("status") not in ("done", None):
      extra.append(f"status {result['status']}")
    for where, error in (result.get("errors") or {}).items():
      extra.append(f"error in {where}: {error[:160]}")
    for text in extra:
      lines.append(f"| {job} | | | | | | | {text} |")
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)

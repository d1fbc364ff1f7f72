"""purejax against its PyTorch twin on one GPU: cases h, i and j of bench/README.md.

    python -m bench.gpu --cases=h.train,h.medium --time_budget_s=420 --out_dir=$OUT
    python -m bench.gpu --quick --cases=h,i,j    # smoke run; on a CPU, with tiny models

`--cases` takes cases or jobs (`JOBS`): h, the GPT-2 124M train step (scanned
and unrolled against `torch.compile`; a memory-mapped feed; GPT-2 medium; the
largest batches); i, nanoGPT's Tiny Shakespeare GPU recipe (whole runs, and
dropout 0.2 against 0); j, sampling through a KV cache. Each job runs in a
process of its own (`bench.jobs`), its arms alternating (`bench.harness`);
each purejax arm records its compiled program's cuDNN attention calls and
planned peak memory next to ms/iter and MFU (`bench.gpu_rows`, which also
prints the table). Results go to `<out_dir>/<date>-gpu-<cases>.json`,
rewritten after every round.
"""

import dataclasses
import functools
import os
import pathlib
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from bench import gpu_rows
from bench import harness
from bench import jobs
from purejax import checkpoint
from purejax import gpt
from purejax.data import batches
from purejax.data import corpus as corpus_lib
from purejax.data import datasets
from purejax.data import tokenizers
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.effects import runs
from purejax.training.loops import gpt_loop
from purejax.training.pure import flops
from purejax.training.pure import parallel
from purejax.training.tools import gpu_plan

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  jobs.define_flags("h,i,j", f"Cases (h, i, j) or jobs ({', '.join(JOBS)}).")
  flags.DEFINE_enum("torch_compile", "auto", ["auto", "yes", "no"],
                    "Run the twin under torch.compile: auto = on CUDA only.")


# GPT-2 124M as nanoGPT trains it (vocab padded to 50304, no biases), bf16 matmuls.
GPT2_124M = gpt.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12,
                          n_embd=768, dropout=0.0, bias=False, compute_dtype="bfloat16")
GPT2_MEDIUM = dataclasses.replace(GPT2_124M, n_layer=24, n_head=16, n_embd=1024)
GPT2_OPTIMIZER = optim.from_flat(
    name="adamw", learning_rate=6e-4, schedule="constant", beta1=0.9, beta2=0.95,
    weight_decay=0.1, grad_clip=1.0)
# nanoGPT's config/train_shakespeare_char.py, in bf16.
SHAKESPEARE_GPU = gpt.GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6,
                                n_embd=384, dropout=0.2, bias=False, compute_dtype="bfloat16")
SHAKESPEARE_OPTIMIZER = optim.from_flat(
    name="adamw", learning_rate=1e-3, schedule="cosine", warmup_iters=100, decay_iters=5000,
    min_lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1, grad_clip=1.0)
GPT2_TOKENIZER_VOCAB = 50257  # ids in h.feed's token file are below this (GPT-2's BPE)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Models and counts of one run (GPU, GPU quick, or the CPU smoke run)."""
  gpt2: gpt.GPTConfig = GPT2_124M
  gpt2_medium: gpt.GPTConfig = GPT2_MEDIUM
  train_batch: int = 12
  medium_batch: int = 8
  batch_candidates: Tuple[int, ...] = (12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
  steps_per_call: int = 10  # steps per timed call (purejax: one jitted lax.scan)
  train_rounds: int = 10
  probe_rounds: int = 2  # timed calls per try of h.max_batch
  shakespeare: gpt.GPTConfig = SHAKESPEARE_GPU
  recipe_batch: int = 64
  recipe_iters: int = 5000
  eval_interval: int = 250
  eval_iters: int = 200
  speed_iters: int = 200  # per arm, in i.speed
  speed_rounds: int = 4
  sample_tokens: int = 1000
  sample_rounds: int = 5
  feed_tokens: int = 512 << 20  # uint16 ids in h.feed's token file (2 bytes each)
  feed_calls: int = 5  # timed calls per arm and round in h.feed
  min_rounds: int = 2  # rounds run even past the budget


def make_sizes(gpu: bool, quick: bool) -> Sizes:
  if gpu:
    return Sizes(train_rounds=4, probe_rounds=1, recipe_iters=200, sample_tokens=200,
                 sample_rounds=3, feed_tokens=16 << 20) if quick else Sizes()
  # No GPU: the same jobs on tiny models, to check that everything runs.
  tiny = gpt.GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64,
                       bias=False, compute_dtype="bfloat16")
  return Sizes(
      gpt2=tiny, gpt2_medium=dataclasses.replace(tiny, n_head=4), batch_candidates=(12, 16),
      train_rounds=2, probe_rounds=1, recipe_batch=16, recipe_iters=20, eval_interval=10,
      eval_iters=4, speed_iters=20, speed_rounds=2, sample_tokens=30, sample_rounds=2,
      feed_tokens=1 << 20, feed_calls=2, shakespeare=dataclasses.replace(
          SHAKESPEARE_GPU, block_size=64, n_layer=2, n_head=2, n_embd=64))


# ----------------------------------------------------------------------------
# A job in its process


class Job(jobs.Job):
  """A GPU bench job: its sizes, the GPU's peak, whether the twin compiles, its arms' infos."""

  def __init__(self, name: str, path: pathlib.Path, deadline: float, quick: bool,
               torch_compile: str = "auto"):
    super().__init__(name, path, deadline, TITLES.get(name, name))
    self.gpu = jax.default_backend() != "cpu"
    self.peak_flops = flops.device_peak_flops(jax.devices()[0], "bfloat16")
    self.compile_torch = {"yes": True, "no": False, "auto": self.gpu}[torch_compile]
    self.sizes = make_sizes(self.gpu, quick)
    self.infos: Dict[str, dict] = {}  # per arm: how it ran, its memory (`program_stats`, ...)

  def build(self, factories: Dict[str, Callable[[dict], harness.Arm]]
            ) -> Dict[str, harness.Arm]:
    """`jobs.Job.build` of factories that each get their arm's `infos` entry to fill."""
    return super().build({name: functools.partial(make, self.infos.setdefault(name, {}))
                          for name, make in factories.items()})

  def set_config(self, model: gpt.GPTConfig, **fields) -> None:
    self.result["config"] = {"model": dataclasses.asdict(model), **fields}

  def purejax(self, config, batch, opt, steps, info, **kwargs) -> harness.Arm:
    return harness.purejax_train_arm(config, opt, batch, steps, info=info, **kwargs)

  def twin(self, config, batch, opt, steps, info, **kwargs) -> harness.Arm:
    return harness.torch_train_arm(config, opt, batch, steps, device=self.torch_device(),
                                   compile_model=self.compile_torch, info=info, **kwargs)

  def torch_device(self) -> str:
    import torch  # pylint: disable=g-import-not-at-top
    if self.gpu and not torch.cuda.is_available():
      raise RuntimeError("JAX sees a GPU but torch.cuda.is_available() is False: this torch "
                         "build cannot run the twin on it.")
    if self.gpu:  # as nanoGPT: TF32 for whatever stays float32
      torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return "cuda" if self.gpu else "cpu"

  def twin_name(self, extra: str = "") -> str:
    how = "torch.compile" if self.compile_torch else "eager"
    return f"torch twin ({how}, bf16 autocast, {'fused ' if self.gpu else ''}AdamW{extra})"

  def train_rows(self, times, reference, config: gpt.GPTConfig, batch: int) -> dict:
    """The job's rows: `harness.summarise`, ms/iter, tokens/s, MFU and each arm's `infos`."""
    rows = harness.summarise(times, reference, "s/iter")
    for name, row in rows.items():
      gpu_rows.add_speed(row, config, batch, self.peak_flops).update(self.infos.get(name, {}))
    self.result["rows"] = rows
    return rows


# ----------------------------------------------------------------------------
# Case h: the GPT-2 train step


def job_h_train(job: Job) -> None:
  """The GPT-2 124M step (batch 12): the platform's forms, two candidates and the twin,
  alternated. The candidates: the head's logits in bf16 (`loss_logits="compute"`, as
  the twin writes them; not a default until measured here) and the MLP's activation
  saved for the backward pass, as before it was recomputed (`recompute_activation`,
  a default chosen by the kernel account alone). The layers scanned ran 36.2 against
  31.5 ms unrolled on an H200 (bench/results/2026-11-26-gpu-h.forms.json)."""
  s = job.sizes
  config, batch = s.gpt2, s.train_batch
  platform = "gpu" if job.gpu else "cpu"
  ref, logits, saved, twin = ("purejax (auto forms)", "purejax (auto forms, bf16 logits)",
                              "purejax (auto forms, activation saved)", job.twin_name())
  job.set_config(config, batch=batch, steps_per_call=s.steps_per_call,
                 optimizer=optim.to_saved(GPT2_OPTIMIZER))
  job.note("peak_bytes of a purejax arm is the process's JAX peak after its first call, "
           "which includes the arms built before it; program_peak_bytes is the compiled "
           "step's own plan.")

  def purejax_arm(info, **overrides):
    return job.purejax(config, batch, GPT2_OPTIMIZER, s.steps_per_call, info,
                       forms=kernels.select(platform, **overrides))

  arms = job.build({
      ref: purejax_arm,
      logits: functools.partial(purejax_arm, loss_logits="compute"),
      saved: functools.partial(purejax_arm, recompute_activation=False),
      twin: lambda info: job.twin(config, batch, GPT2_OPTIMIZER, s.steps_per_call, info)})
  job.alternate(arms, s.train_rounds, lambda times: job.train_rows(
      times, {logits: ref, saved: ref, twin: ref}, config, batch))


# h.forms' arms: `kernels.select` overrides of the GPU's forms for the GPT-2 124M step.
# (The first run on an H200, before the loss chunks formed their own gradients,
# also had remat "dots" 40.6 ms/iter and an unchunked loss 46.2, against 38.0
# for remat "full" with float32 outputs: bench/results/2026-11-26-gpu-h.forms.json.)
H_FORMS = {
    "scanned, remat full_compute_dtype, bf16 matmul outputs (auto)": {},
    "scanned, remat full, bf16 matmul outputs": dict(remat="full"),
    "scanned, remat full, float32 matmul outputs": dict(remat="full", matmul_output="float32"),
    "scanned, remat none": dict(remat="none"),
    "unrolled, remat none, bf16 matmul outputs (auto)": dict(scan_layers=False),
    "unrolled, remat none, float32 matmul outputs": dict(scan_layers=False,
                                                         matmul_output="float32"),
}


def gpt2_step_arms(job: Job, arms: Dict[str, Tuple[dict, Optional[dict]]]) -> None:
  """The GPT-2 124M step (batch 12) of each arm, `{name: (forms overrides, XLA options)}`,
  alternated with the twin; each row against the first arm."""
  s = job.sizes
  config, batch = s.gpt2, s.train_batch
  job.set_config(config, batch=batch, steps_per_call=s.steps_per_call,
                 optimizer=optim.to_saved(GPT2_OPTIMIZER))
  platform = "gpu" if job.gpu else "cpu"
  ref, twin = next(iter(arms)), job.twin_name()

  def purejax_arm(overrides, options, info):
    return job.purejax(config, batch, GPT2_OPTIMIZER, s.steps_per_call, info,
                       forms=kernels.select(platform, **overrides), compiler_options=options)

  factories = {name: functools.partial(purejax_arm, *arm) for name, arm in arms.items()}
  factories[twin] = lambda info: job.twin(config, batch, GPT2_OPTIMIZER, s.steps_per_call, info)
  built = job.build(factories)
  job.alternate(built, s.train_rounds, lambda times: job.train_rows(
      times, {name: ref for name in factories if name != ref}, config, batch))


def job_h_forms(job: Job) -> None:
  """Which forms run the GPT-2 124M step (batch 12) fastest: `H_FORMS` and the twin, alternated."""
  gpt2_step_arms(job, {name: (overrides, None) for name, overrides in H_FORMS.items()})


# h.xla's arms: XLA GPU compiler options, each on the default forms' GPT-2 124M
# step alone (`harness.purejax_train_arm(compiler_options=...)`), against the
# default, the fastest form of h.forms and the twin. Where the image's XLA does
# not know an option, that arm's error is recorded and the others run.
H_XLA_OPTIONS = {
    "default forms, default options": {},
    "cuDNN layer norm": {"xla_gpu_enable_cudnn_layer_norm": True},
    "Triton GEMMs off (cuBLAS)": {"xla_gpu_enable_triton_gemm": False},
    "latency-hiding scheduler": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "heroless Triton priority fusion": {
        "xla_gpu_experimental_enable_triton_heroless_priority_fusion": True},
    "cuDNN layer norm and cuBLAS": {"xla_gpu_enable_cudnn_layer_norm": True,
                                    "xla_gpu_enable_triton_gemm": False},
}


def job_h_xla(job: Job) -> None:
  """XLA's GPU options on the GPT-2 124M step (batch 12): `H_XLA_OPTIONS`, alternated."""
  fastest = "unrolled, remat none, bf16 matmul outputs (auto)"
  both = "cuDNN layer norm and cuBLAS"
  gpt2_step_arms(job, {**{name: ({}, options or None) for name, options in H_XLA_OPTIONS.items()},
                       fastest: (H_FORMS[fastest], None),
                       f"{fastest}, {both}": (H_FORMS[fastest], H_XLA_OPTIONS[both])})


def job_h_plan(job: Job) -> None:
  """The GPT-2 124M step at batch 12 as `purejax.plan` plans it, compiled for and run on
  this device: XLA's memory plan against the peak JAX's allocator measures.

  The program is `gpu_plan.train_step_program`'s (the training loop's step,
  one step per call, state donated). Its arguments are put on the device,
  then three calls run; the measured peak is JAX's peak bytes in use after
  them (the arguments included, as the plan's peak includes them). With
  `XLA_FLAGS=--xla_gpu_dump_autotune_results_to=<file>` the autotuner's
  choices are written for deviceless compiles to load.
  """
  s = job.sizes
  config, batch = s.gpt2, s.train_batch
  device = jax.devices()[0]
  name = "purejax train step (gpu_plan.train_step_program, 1 step per call)"
  job.set_config(config, batch=batch, steps_per_call=1,
                 optimizer=optim.to_saved(GPT2_OPTIMIZER))
  job.note("measured_peak_bytes: JAX's peak bytes in use after the calls (arguments "
           "included); planned: memory_analysis() of the same program compiled for this "
           "device (autotuned). planned/measured above 1: the plan overestimates.")
  program = gpu_plan.train_step_program(
      config, [device], batch_size=batch, opt_config=GPT2_OPTIMIZER,
      forms=kernels.select("gpu" if job.gpu else "cpu"))
  start = time.perf_counter()
  compiled = program.step.lower(*program.arguments).compile()
  compile_s = time.perf_counter() - start
  planned = gpu_plan.read_program(compiled)
  rng = np.random.default_rng(0)
  state = jax.jit(program.start, out_shardings=program.layout)()
  tokens = jax.tree.map(lambda a: jax.device_put(
      rng.integers(0, config.vocab_size, a.shape).astype(a.dtype), a.sharding),
                        program.arguments[1])
  jax.block_until_ready((state, tokens))
  before = dict(device.memory_stats() or {})
  seconds = []
  for step in range(3):
    start = time.perf_counter()
    first = jax.device_put(np.int32(step), program.arguments[2].sharding)
    state, metrics = compiled(state, (tokens, first))  # `parallel.StateStep` packs the inputs
    jax.block_until_ready((state, metrics))
    seconds.append(time.perf_counter() - start)
  after = dict(device.memory_stats() or {})
  row = harness.summarise({name: seconds[1:]}, {}, "s/iter")[name]
  gpu_rows.add_speed(row, config, batch, job.peak_flops)
  measured = after.get("peak_bytes_in_use")
  row.update(harness.program_stats(compiled), compile_s=compile_s, peak_bytes=measured)
  job.result["rows"] = {name: row}
  job.result["memory"] = {
      "planned": planned.memory(),
      "in_use_before_bytes": before.get("bytes_in_use"),
      "peak_before_bytes": before.get("peak_bytes_in_use"),
      "in_use_after_bytes": after.get("bytes_in_use"),
      "measured_peak_bytes": measured,
      "planned_over_measured": planned.peak_bytes / measured if measured else None,
      "custom_calls": dict(planned.custom_calls)}


def write_token_file(path: pathlib.Path, num_tokens: int, vocab: int, seed: int = 0) -> None:
  """Writes `num_tokens` random uint16 ids below `vocab` to `path`, syncs it and drops it
  from the page cache, so reads start from the disk as a corpus larger than memory's would."""
  np.random.default_rng(seed).integers(0, vocab, num_tokens, dtype=np.uint16).tofile(path)
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def consecutive_calls(run: harness.Arm, untimed: int, timed: int,
                      timing: Callable[[bool], None] = lambda on: None) -> harness.Arm:
  """An arm of `untimed` calls of `run`, then the mean seconds per step of `timed` more.

  The untimed calls use up what the reader read ahead while the other arm
  ran. `timing(True)` and `timing(False)` mark the timed calls.
  """
  def arm():
    for _ in range(untimed):
      run()
    timing(True)
    try:
      return float(np.mean([run() for _ in range(timed)]))
    finally:
      timing(False)
  return arm


def job_h_feed(job: Job) -> None:
  """Does reading batches from a memory-mapped file on disk slow the GPT-2 124M step?

  Arms, alternated: purejax fed random ids on the device (as h.train), and
  purejax fed windows that `batches.BatchPrefetcher` (the training loop's
  reader) reads from a uint16 token file in a background thread. A round is
  three untimed calls (the reader holds up to three read ahead) and
  `feed_calls` timed calls of each arm.
  """
  s = job.sizes
  config, batch, steps = s.gpt2, s.train_batch, s.steps_per_call
  device, host = ("purejax, random ids on the device (as h.train)",
                  "purejax, windows read from a memmapped token file by BatchPrefetcher")
  vocab = min(GPT2_TOKENIZER_VOCAB, config.vocab_size)
  job.set_config(config, batch=batch, steps_per_call=steps, timed_calls_per_round=s.feed_calls)
  job.note("host/device is the per-round ratio of the two arms' ms/iter; at most 1.02 means "
           "the feed costs nothing. wait_ms: how long a timed call waited for its windows.")
  with tempfile.TemporaryDirectory(prefix="purejax-feed-") as tmp:
    path = pathlib.Path(tmp) / "train.bin"
    start = time.perf_counter()
    write_token_file(path, s.feed_tokens, vocab)
    job.result["token_file"] = {"path": str(path), "bytes": path.stat().st_size,
                                "write_s": time.perf_counter() - start}
    waits, timing = [], [False]
    with batches.BatchPrefetcher(np.memmap(path, dtype=np.uint16, mode="r"), config.block_size,
                                 batch, seed=0, start_step=0, steps_per_call=steps) as reader:

      def windows():
        start = time.perf_counter()
        out = next(reader)
        if timing[0]:
          waits.append(time.perf_counter() - start)
        return out

      arms = job.build({
          device: lambda info: consecutive_calls(job.purejax(
              config, batch, GPT2_OPTIMIZER, steps, info), 3, s.feed_calls),
          host: lambda info: consecutive_calls(
              job.purejax(config, batch, GPT2_OPTIMIZER, steps, info, windows=windows), 3,
              s.feed_calls, lambda on: timing.__setitem__(0, on))})

      def publish(times):
        rows = job.train_rows(times, {host: device}, config, batch)
        if host in rows and waits:
          rows[host].update(wait_ms_median=1000 * float(np.median(waits)),
                            wait_ms_max=1000 * max(waits))
        if "ratio" in rows.get(host, {}):
          job.result["host_vs_device"] = rows[host]["ratio"]
          job.result["feed_costs_nothing"] = rows[host]["ratio"] <= 1.02

      job.alternate(arms, s.train_rounds, publish)


def job_h_medium(job: Job) -> None:
  s = job.sizes
  config, batch = s.gpt2_medium, s.medium_batch
  name = "purejax GPT-2 medium (scan_layers=True, auto forms)"
  job.set_config(config, batch=batch, steps_per_call=1)
  arms = job.build({name: lambda info: job.purejax(config, batch, GPT2_OPTIMIZER, 1, info)})
  job.result["trains_without_oom"] = True if arms else (
      False if is_oom(job.result["errors"].get(name, "")) else None)
  job.alternate(arms, 5, lambda times: job.train_rows(times, {}, config, batch))


def is_oom(error: str) -> bool:
  text = error.lower()
  return "resource_exhausted" in text or "out of memory" in text or "outofmemory" in text


def job_h_max_batch(job: Job, arm: str) -> None:
  """Largest batch of `arm` that trains (among `batch_candidates`), and the memory of each try."""
  s = job.sizes
  config = s.gpt2
  make = job.twin if arm == "torch" else functools.partial(
      job.purejax, forms=kernels.select(scan_layers=arm != "purejax_unrolled"))
  job.set_config(config, arm=arm, candidates=list(s.batch_candidates))
  tries = job.result.setdefault("batches", {})

  def attempt(batch: int) -> bool:
    jobs.free_memory(torch_too=arm == "torch", drop_compiled=True)
    info = {}
    try:
      run = make(config, batch, GPT2_OPTIMIZER, s.steps_per_call, info)
      row = harness.summarise({arm: [run() for _ in range(s.probe_rounds)]}, {}, "s/iter")[arm]
      del run
      gpu_rows.add_speed(row, config, batch, job.peak_flops)
      tries[str(batch)] = {"fits": True, **row, **info}
    except Exception as e:  # pylint: disable=broad-except
      error = jobs.describe(e)
      tries[str(batch)] = {"fits": False, "oom": is_oom(error), "error": error}
      print(f"[{job.name}] batch {batch}: {traceback.format_exc()}", flush=True)
    jobs.free_memory(torch_too=arm == "torch", drop_compiled=True)
    fitting = [int(b) for b, r in tries.items() if r["fits"]]
    job.result["largest_batch"] = max(fitting, default=None)
    job.result["smallest_failed_batch"] = min(
        (int(b) for b, r in tries.items() if not r["fits"]), default=None)
    if fitting:
      job.result["rows"] = {f"{arm}, batch {max(fitting)} (largest that fits)": {
          k: v for k, v in tries[str(max(fitting))].items() if k != "fits"}}
    job.save()
    record = tries[str(batch)]
    if not record["fits"] and not record["oom"]:
      raise RuntimeError(f"batch {batch} failed, not out of memory: {record['error']}")
    return record["fits"]

  search_largest(list(s.batch_candidates), attempt, job.out_of_time)


def search_largest(candidates: List[int], attempt: Callable[[int], bool],
                   out_of_time: Callable[[], bool]) -> Optional[int]:
  """The largest of the ascending `candidates` for which `attempt(batch) -> fits`, by bisection.

  Every try compiles, so bisection (about log2 of the candidates' count
  tries) rather than one after the other. The smallest is tried first;
  None if it does not fit. Out of time, the largest fitting one so far.
  """
  if not attempt(candidates[0]):
    return None
  fits, fails = 0, len(candidates)  # indices: known to fit, known (or assumed) not to
  while fails - fits > 1 and not out_of_time():
    middle = (fits + fails) // 2
    if attempt(candidates[middle]):
      fits = middle
    else:
      fails = middle
  return candidates[fits]


# ----------------------------------------------------------------------------
# Case i: the Tiny Shakespeare GPU recipe


def shakespeare() -> corpus_lib.Corpus:
  """Tiny Shakespeare as plain text, split 90/10 exactly as nanoGPT's prepare.py does."""
  text = (pathlib.Path(datasets.EMBEDDED_SHAKESPEARE_DIR) / "input.txt").read_text("utf-8")
  tokenizer = tokenizers.CharTokenizer.from_text(text)
  ids = tokenizer.encode(text)
  n = int(len(ids) * 0.9)
  return corpus_lib.Corpus(tokenizer, ids[:n], ids[n:], "tiny_shakespeare (plain text)")


def set_recipe_config(job: Job, **fields) -> None:
  s = job.sizes
  job.set_config(s.shakespeare, batch=s.recipe_batch, max_iters=s.recipe_iters,
                 eval_interval=s.eval_interval, eval_iters=s.eval_iters,
                 optimizer=optim.to_saved(SHAKESPEARE_OPTIMIZER), **fields)


def job_i_purejax_recipe(job: Job) -> None:
  s = job.sizes
  config = s.shakespeare
  set_recipe_config(job)
  name = f"purejax (dropout {config.dropout}: {harness.attention_form(config)} attention)"
  train = gpt_loop.GPTTrainConfig(
      batch_size=s.recipe_batch, max_iters=s.recipe_iters, eval_interval=s.eval_interval,
      eval_iters=s.eval_iters, log_interval=s.eval_interval, steps_per_call=10,
      sample_tokens=0, seed=0)
  with tempfile.TemporaryDirectory() as out_dir:
    start = time.perf_counter()
    metrics = gpt_loop.train_gpt(config, shakespeare(), train, SHAKESPEARE_OPTIMIZER,
                             runs.RunConfig(out_dir=out_dir, keep_checkpoints=1),
                             parallel.ParallelConfig(num_devices=1))  # one GPU, as the twin
    wall = time.perf_counter() - start
    history = checkpoint.latest_meta(out_dir)[1].get("history", [])
  row = {"median": metrics["ms_per_iter"] / 1000, "min": None, "max": None, "unit": "s/iter",
         "wall_s": wall, "via": "gpt_loop.train_gpt", **gpu_rows.losses_of(history)}
  job.result["history"] = history
  job.result["rows"] = {name: gpu_rows.add_speed(row, config, s.recipe_batch, job.peak_flops)}


def job_i_torch_recipe(job: Job) -> None:
  """nanoGPT's train.py loop with the twin: compiled, bf16 autocast, SDPA with dropout, fused AdamW.

  The learning rate follows the library's schedule (`harness.lr_table`).
  Every `eval_interval` steps (and at the end) it evaluates `eval_iters`
  random batches of each split and saves a checkpoint (model and
  optimizer), as `gpt_loop.train_gpt` does. Batches are drawn on the device, as
  purejax draws them. Time is measured over 10 steps between syncs, like
  purejax's 10-step calls; the first two calls (compiling) are left out.
  """
  import torch  # pylint: disable=g-import-not-at-top
  s, device = job.sizes, job.torch_device()
  config, t, b = s.shakespeare, s.shakespeare.block_size, s.recipe_batch
  set_recipe_config(job)
  name = job.twin_name(", SDPA dropout 0.2")
  splits = {split: torch.from_numpy(ids.astype(np.int64)).to(device)
            for split, ids in (("train", shakespeare().train), ("val", shakespeare().val))}
  offsets = torch.arange(t, device=device)
  start = time.perf_counter()
  train = job.twin(config, b, SHAKESPEARE_OPTIMIZER, 10, {}, data=splits["train"],
                    lrs=harness.lr_table(SHAKESPEARE_OPTIMIZER, s.recipe_iters), warm_up=False)
  parts, history, seconds = train.parts, [], []

  def evaluate(step, out_dir):
    parts.model.eval()
    losses = {}
    with torch.no_grad():
      for split, ids in splits.items():
        total = torch.zeros((), device=device)
        for _ in range(s.eval_iters):
          ix = torch.randint(len(ids) - t, (b, 1), device=device) + offsets
          with parts.autocast():
            total += parts.step_model(ids[ix], ids[ix + 1])[1].float()
        losses[f"{split}_loss"] = total.item() / s.eval_iters
    parts.model.train()
    history.append({"step": step, **losses})
    torch.save({"model": parts.model.state_dict(), "optimizer": parts.optimizer.state_dict()},
               os.path.join(out_dir, "ckpt.pt"))
    if seconds:
      row = harness.summarise({name: seconds[2:] or seconds}, {}, "s/iter")[name]
      row.update(wall_s=time.perf_counter() - start, **gpu_rows.losses_of(history))
      if step < s.recipe_iters:
        row["partial"] = f"up to step {step} of {s.recipe_iters}"
      job.result.update(history=history,
                        rows={name: gpu_rows.add_speed(row, config, b, job.peak_flops)})
      job.save()

  with tempfile.TemporaryDirectory() as out_dir:
    for step in range(0, s.recipe_iters + 1, 10):  # the sizes are multiples of 10
      if step % s.eval_interval == 0 or step == s.recipe_iters:
        evaluate(step, out_dir)
      if step < s.recipe_iters:
        seconds.append(train())


def job_i_speed(job: Job) -> None:
  """ms/iter of the recipe's step, alternating: dropout 0.2 (purejax runs plain attention) and 0."""
  s = job.sizes
  text, config = shakespeare(), s.shakespeare
  no_dropout = dataclasses.replace(config, dropout=0.0)
  set_recipe_config(job, iters_per_arm=s.speed_iters, rounds=s.speed_rounds)
  per_round = max(s.speed_iters // s.speed_rounds, 1)
  calls = max(per_round // 10, 1)
  steps = per_round // calls
  pj, pj0 = (f"purejax, dropout {cfg.dropout} ({harness.attention_form(cfg)} attention)"
             for cfg in (config, no_dropout))
  tw, tw0 = job.twin_name(", dropout 0.2"), job.twin_name(", dropout 0")

  def ours(cfg, info):
    one_call = job.purejax(cfg, s.recipe_batch, SHAKESPEARE_OPTIMIZER, steps, info,
                           data=jnp.asarray(text.train))
    return lambda: sum(one_call() for _ in range(calls)) / calls

  def theirs(cfg, info):
    import torch  # pylint: disable=g-import-not-at-top
    data = torch.from_numpy(text.train.astype(np.int64)).to(job.torch_device())
    return job.twin(cfg, s.recipe_batch, SHAKESPEARE_OPTIMIZER, per_round, info, data=data)

  arms = job.build({pj: functools.partial(ours, config), pj0: functools.partial(ours, no_dropout),
                    tw: functools.partial(theirs, config),
                    tw0: functools.partial(theirs, no_dropout)})
  job.alternate(arms, s.speed_rounds, lambda times: job.train_rows(
      times, {pj0: pj, tw: pj, tw0: pj0}, config, s.recipe_batch))


# ----------------------------------------------------------------------------
# Case j: sampling with a KV cache


def job_j_sample(job: Job) -> None:
  """Batch 1, a 1-token prompt, top_k 200, temperature 1, bf16 compute, same random weights."""
  import torch  # pylint: disable=g-import-not-at-top
  from bench import torch_gpt  # pylint: disable=g-import-not-at-top
  s = job.sizes
  config, new_tokens = s.gpt2, s.sample_tokens
  job.set_config(config, new_tokens=new_tokens, prompt_tokens=1, batch=1, top_k=200)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  keys = map(jax.random.PRNGKey, range(1_000_000))
  ref, eager, compiled = ("purejax engine.generate (one row, chunks of decoding steps)",
                          "torch twin generate_kv, eager (bf16 autocast)", None)

  def purejax_sampler(info):
    forms = kernels.select(kernels.platform_of(params))
    info.update(harness.program_stats(
        harness.sampling_program(params, config, forms, top_k=200).compile()))

    def run():
      start = time.perf_counter()
      harness.sample_completion(params, config, next(keys), new_tokens, top_k=200,
                                forms=forms)  # the tokens, on the host
      return (time.perf_counter() - start) / new_tokens
    run()
    return run

  def twin_sampler(compile_mode, info):
    del info  # the twin's sampler records nothing of how it ran
    device = torch.device(job.torch_device())
    twin = torch_gpt.load_purejax_params(torch_gpt.TorchGPT(config), params).to(device).eval()
    idx = torch.zeros((1, 1), dtype=torch.long, device=device)

    def run():
      harness.sync(torch, device)
      start = time.perf_counter()
      twin.generate_kv(idx, new_tokens, top_k=200, autocast_dtype=torch.bfloat16,
                       compile_mode=compile_mode).cpu()
      return (time.perf_counter() - start) / new_tokens
    run()  # compiles (and records the CUDA graphs)
    return run

  arms = job.build({ref: purejax_sampler, eager: functools.partial(twin_sampler, False)})
  if not job.compile_torch:
    job.note("torch.compile arm not run (--torch_compile=no, or auto without CUDA)")
  # CUDA graphs ("reduce-overhead") are the fast way for one token at a time;
  # if they fail here, the default mode still compiles the step.
  for mode in (("reduce-overhead", None) if job.gpu else (None,)) if job.compile_torch else ():
    compiled = f"torch twin generate_kv, torch.compile mode={mode or 'default'} (bf16 autocast)"
    arms.update(job.build({compiled: functools.partial(twin_sampler, mode)}))
    if compiled in arms:
      break

  def publish(times):
    rows = harness.summarise(times, {eager: ref, compiled: ref}, "s/token")
    for name, row in rows.items():
      row.update(tokens_per_s=1.0 / row["median"], **job.infos.get(name, {}))
    job.result["rows"] = rows
    twins = [name for name in (eager, compiled) if name in rows]
    if twins:
      job.result["fastest_twin"] = min(twins, key=lambda name: rows[name]["median"])

  job.alternate(arms, s.sample_rounds, publish)


# ----------------------------------------------------------------------------
# Running the jobs


# Each job: its title and what runs it in its process.
JOBS = {
    "h.train": ("h: GPT-2 124M train step, batch 12", job_h_train),
    "h.plan": ("h: GPT-2 124M step, batch 12: planned against measured peak memory",
               job_h_plan),
    "h.forms": ("h: GPT-2 124M step, batch 12: the GPU's forms against each other",
                job_h_forms),
    "h.xla": ("h: GPT-2 124M step, batch 12: XLA's GPU compiler options", job_h_xla),
    "h.feed": ("h: the memory-mapped loader feeds the GPT-2 124M step without slowing it",
               job_h_feed),
    "h.medium": ("h: GPT-2 medium train step, batch 8 (purejax)", job_h_medium),
    "h.max_batch.purejax": ("h: largest batch, purejax (scan)",
                            functools.partial(job_h_max_batch, arm="purejax")),
    "h.max_batch.torch": ("h: largest batch, torch twin",
                          functools.partial(job_h_max_batch, arm="torch")),
    "h.max_batch.purejax_unrolled": ("h: largest batch, purejax (scan_layers=False)",
                                     functools.partial(job_h_max_batch,
                                                       arm="purejax_unrolled")),
    "i.purejax_recipe": ("i: Shakespeare GPU recipe, purejax (gpt_loop.train_gpt)",
                         job_i_purejax_recipe),
    "i.torch_recipe": ("i: Shakespeare GPU recipe, torch twin", job_i_torch_recipe),
    "i.speed": ("i: Shakespeare GPU recipe, ms/iter, dropout 0.2 and 0", job_i_speed),
    "j.sample": ("j: sample 1000 tokens, batch 1, KV cache", job_j_sample),
}
TITLES = {name: title for name, (title, _) in JOBS.items()}


def main(argv):
  del argv
  if FLAGS.worker:  # a job's process
    job = Job(FLAGS.worker, pathlib.Path(FLAGS.results), FLAGS.deadline, FLAGS.quick,
              FLAGS.torch_compile)
    jobs.run(job, jobs.environment if job.name == "env" else JOBS[job.name][1])
    return
  jobs.main("bench.gpu", jobs.select(FLAGS.cases, list(JOBS)), TITLES, gpu_rows.markdown,
            [f"--quick={FLAGS.quick}", f"--torch_compile={FLAGS.torch_compile}"])


if __name__ == "__main__":
  define_flags()
  app.run(main)

"""Fine-tuning speed on a real model: purejax against PyTorch (+ peft for LoRA).

    python -m bench.finetune_speed --model=path/to/SmolLM2-135M-Instruct --rounds=3

The same model (a Hugging Face folder, float32 weights), batch, dtype and
optimizer on both sides: `--batch_size` x `--block_size` random token ids,
AdamW (lr 1e-4, betas 0.9/0.95, no weight decay) with the global gradient
norm clipped to 1. Four settings, each a purejax arm and a PyTorch arm:

- `lora_f32`, `lora_bf16`: rank-8 LoRA (alpha 16) on the attention and MLP
  matrices, the base frozen. purejax: `lora.View` through `steps.train_steps`,
  as `purejax.train --lora_rank=8` runs it (its fused `qkv` and `gate_up`
  matrices each get one adapter); PyTorch: `peft.get_peft_model` on
  `q,k,v,o,gate,up,down_proj`.
- `full_f32`, `full_bf16`: every weight trained.

purejax runs `--steps_per_call` steps in each jitted call (one `lax.scan`;
default 1, one step a call as PyTorch's loop takes them; `purejax.train`
runs 10 a call by default), all on the same batch, and a step's time is
the call's over that count. Across the steps of one call XLA computes what
does not change once (e.g. a LoRA run's bf16, row-major copies of the frozen
weights).

bf16 is mixed precision on both sides: float32 params and optimizer state,
the matmuls' operands in bfloat16 (purejax `compute_dtype="bfloat16"`,
PyTorch `torch.autocast("cpu", torch.bfloat16)`).

Each arm runs in a process of its own, and the processes alternate, A B A B
..., for `--rounds` rounds: in one process, the arms slowed each other (XLA's
and PyTorch's thread pools, four models in memory: purejax's full
fine-tune step took 11.7 s there against 8.4 s alone). A process loads the
model, builds its step (purejax: compiled, with a compilation cache shared
by the run's processes; PyTorch: one warm-up step), then times
`--steps` steps and reports their median, its minor page faults per step
(`getrusage`) and its peak resident memory (VmHWM), the whole peak and the
peak less the process's resident memory before the arm was built. Each
arm's figures are the medians over its rounds, and each PyTorch arm's ratio
is the median per-round ratio PyTorch/purejax (above 1: purejax is faster).

Results go to `bench/results/<date>-finetune_speed.json`.
"""

import dataclasses
import datetime
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from purejax import lora
from purejax import weights
from purejax.data import batches
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.pure import steps as steps_lib
from purejax.training.pure.state import TrainState

FLAGS = flags.FLAGS
DEFAULT_MODEL = harness.REAL_MODEL_FOLDER
SETTINGS = ("lora_f32", "lora_bf16", "full_f32", "full_bf16")
TORCH_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj"]
LEARNING_RATE, BETAS, CLIP = 1e-4, (0.9, 0.95), 1.0
RANK, ALPHA = 8, 16.0


def define_flags() -> None:
  flags.DEFINE_string("model", str(DEFAULT_MODEL), "A Hugging Face folder of the model.")
  flags.DEFINE_integer("batch_size", 4, "Sequences per step.")
  flags.DEFINE_integer("block_size", 256, "Tokens per sequence.")
  flags.DEFINE_integer("rounds", 3, "Alternated rounds; each arm runs once per round.")
  flags.DEFINE_integer("steps", 3, "Timed steps of each arm's process, after its first.")
  flags.DEFINE_integer("steps_per_call", 1, "purejax: steps in each jitted call (the "
                       "trainer's --steps_per_call, 10 by default); a step's time is the "
                       "call's over this. PyTorch takes one step a call.")
  flags.DEFINE_integer("threads", 2, "PyTorch's threads (the machine's cores).")
  flags.DEFINE_list("settings", list(SETTINGS), f"Which of {SETTINGS} to run.")
  flags.DEFINE_list("frameworks", ["purejax", "torch"], "Which sides to run.")
  flags.DEFINE_string("arm", None, "Internal: run this one arm (SETTING.FRAMEWORK) and "
                      "print its figures as JSON.")


def _peak_and_current_rss() -> tuple:
  """(VmHWM, VmRSS) of this process in bytes."""
  fields = {}
  with open("/proc/self/status") as status:
    for line in status:
      name, _, value = line.partition(":")
      if name in ("VmHWM", "VmRSS"):
        fields[name] = int(value.split()[0]) * 1024
  return fields["VmHWM"], fields["VmRSS"]


def _cpu_name() -> str:
  with open("/proc/cpuinfo") as info:
    for line in info:
      if line.startswith("model name"):
        return line.partition(":")[2].strip()
  return "unknown"


def _batch(vocab_size: int) -> np.ndarray:
  """The fixed `[batch, block + 1]` token ids both sides train on."""
  rng = np.random.default_rng(0)
  return rng.integers(0, vocab_size, (FLAGS.batch_size, FLAGS.block_size + 1)).astype(np.int32)


def purejax_arm(folder: str, setting: str):
  """`fn() -> seconds` of one purejax train step in `setting` (its first call compiles)."""
  params, config, _ = weights.from_pretrained(folder)
  dtype = "bfloat16" if setting.endswith("bf16") else "float32"
  config = dataclasses.replace(config, block_size=FLAGS.block_size, compute_dtype=dtype)
  opt_config = optim.from_flat(learning_rate=LEARNING_RATE, schedule="constant",
                                     beta1=BETAS[0], beta2=BETAS[1], grad_clip=CLIP)
  params = jax.tree.map(jnp.asarray, params)
  view = None
  if setting.startswith("lora"):
    adapters = lora.init(params, RANK, lora.ATTENTION_AND_MLP, jax.random.PRNGKey(1))
    params, view = lora.trainable(params, adapters), lora.View(ALPHA)
  optimizer = optim.RunOptimizer(opt_config, frozen_base=view is not None)()
  state = {"train": TrainState(params, optimizer.init(params),
                               {"train": jax.random.PRNGKey(0)}), "step": 0}
  # One fixed batch, as the PyTorch side trains: each step draws the same
  # window from ids that hold exactly that batch's rows.
  tokens = batches.HostWindows(jnp.repeat(jnp.asarray(_batch(config.vocab_size))[None],
                                          FLAGS.steps_per_call, axis=0))
  kwargs = dict(config=config, optimizer=optimizer, batch_size=FLAGS.batch_size,
                num_steps=FLAGS.steps_per_call, forms=kernels.select("cpu"), params_view=view)

  def run():
    start = time.perf_counter()
    state["train"], metrics = steps_lib.train_steps(state["train"], tokens, state["step"],
                                                    **kwargs)
    loss = float(metrics.loss[-1])  # waits for the steps
    state["step"] += FLAGS.steps_per_call
    if not np.isfinite(loss):
      raise FloatingPointError(f"non-finite loss at step {state['step']}")
    return (time.perf_counter() - start) / FLAGS.steps_per_call

  run()
  # The compiled step, for `bench.finetune_profile` (the compilation cache answers).
  run.compiled = lambda: steps_lib.train_steps.lower(state["train"], tokens, state["step"],
                                                     **kwargs).compile()
  return run


def torch_arm(folder: str, setting: str):
  """`fn() -> seconds` of one PyTorch train step in `setting` (its first call warms up)."""
  import peft  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(FLAGS.threads)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  if setting.startswith("lora"):
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=TORCH_LORA_TARGETS, lora_dropout=0.0))
  model.train()
  trained = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(trained, lr=LEARNING_RATE, betas=BETAS, weight_decay=0.0)
  batch = torch.from_numpy(_batch(model.config.vocab_size)).long()
  x, y = batch[:, :-1], batch[:, 1:]
  bf16 = setting.endswith("bf16")

  def run():
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
      logits = model(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trained, CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
      raise FloatingPointError("non-finite loss")
    return time.perf_counter() - start

  run()
  return run


def make_arm(framework: str, folder: str, setting: str):
  return (purejax_arm if framework == "purejax" else torch_arm)(folder, setting)


def speed_and_memory(folder: str) -> dict:
  """Every arm in its own process, the processes alternated over the rounds."""
  cache = tempfile.mkdtemp(prefix="finetune-speed-xla-cache-")
  names = [f"{s}.{f}" for s in FLAGS.settings for f in FLAGS.frameworks]
  runs = {name: [] for name in names}
  try:
    for round_ in range(FLAGS.rounds):
      for name in names:
        done = subprocess.run(
            [sys.executable, "-m", "bench.finetune_speed", f"--model={folder}", f"--arm={name}",
             f"--batch_size={FLAGS.batch_size}", f"--block_size={FLAGS.block_size}",
             f"--threads={FLAGS.threads}", f"--steps={FLAGS.steps}",
             f"--steps_per_call={FLAGS.steps_per_call}"],
            capture_output=True, text=True, check=False,
            env={**os.environ, "JAX_COMPILATION_CACHE_DIR": cache})
        lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
        if done.returncode != 0 or not lines:
          raise RuntimeError(f"{name} failed: {done.stderr.strip()[-800:]}")
        runs[name].append(json.loads(lines[-1]))
        print(f"round {round_}: {name} {runs[name][-1]}", flush=True)
  finally:
    shutil.rmtree(cache, ignore_errors=True)
  times = {name: [r["median_s"] for r in rs] for name, rs in runs.items()}
  references = {f"{s}.torch": f"{s}.purejax" for s in FLAGS.settings}
  rows = harness.summarise(times, references, "s/step")
  for name, rs in runs.items():
    for key in ("minor_faults_per_step", "peak_bytes", "peak_over_start_bytes"):
      rows[name][key] = float(np.median([r[key] for r in rs]))
  return rows


def one_arm(folder: str, name: str) -> None:
  """Builds one arm, times `--steps` steps, and prints its figures as JSON."""
  setting, framework = name.split(".")
  if framework == "torch":
    import torch  # pylint: disable=import-outside-toplevel,unused-import
    import transformers  # pylint: disable=import-outside-toplevel,unused-import
  _, rss_before = _peak_and_current_rss()
  arm = make_arm(framework, folder, setting)
  seconds, faults = [], []
  steps_per_call = FLAGS.steps_per_call if framework == "purejax" else 1
  for _ in range(FLAGS.steps):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seconds.append(arm())
    faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps_per_call)
  peak, _ = _peak_and_current_rss()
  print(json.dumps({"median_s": float(np.median(seconds)), "seconds": seconds,
                    "minor_faults_per_step": float(np.median(faults)), "peak_bytes": peak,
                    "peak_over_start_bytes": peak - rss_before}))


def main(argv):
  del argv
  folder = FLAGS.model
  if FLAGS.arm:
    one_arm(folder, FLAGS.arm)
    return
  unknown = sorted(set(FLAGS.settings) - set(SETTINGS))
  if unknown:
    raise app.UsageError(f"--settings: {unknown} are not among {SETTINGS}")
  rows = speed_and_memory(folder)
  print(f"{FLAGS.batch_size} x {FLAGS.block_size} tokens, {FLAGS.rounds} alternated rounds "
        f"of one process per arm, {FLAGS.steps} steps each:")
  for name, row in rows.items():
    ratio = f"  torch/purejax {row['ratio']:.2f}" if "ratio" in row else ""
    print(f"  {name:18s} {row['median']:7.3f} s/step  "
          f"{row['minor_faults_per_step'] / 1e3:6.0f}k faults/step  "
          f"peak {row['peak_bytes'] / 2**30:5.2f} GiB{ratio}")
  path = harness.unused_results_path(harness.RESULTS_DIR,
                                     f"{datetime.date.today()}-finetune_speed")
  harness.write_results(path, {
      "meta": {"model": pathlib.Path(folder).name, "batch_size": FLAGS.batch_size,
               "block_size": FLAGS.block_size, "threads": FLAGS.threads, "rank": RANK,
               "alpha": ALPHA, "steps": FLAGS.steps, "rounds": FLAGS.rounds,
               "jax": jax.__version__, "cpu": _cpu_name(), "cores": os.cpu_count()},
      "results": {"finetune": {"rows": rows}}})
  print(f"wrote {path}")


if __name__ == "__main__":
  define_flags()
  app.run(main)

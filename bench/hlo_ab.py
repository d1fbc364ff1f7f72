"""Did a code change alter the compiled CPU programs? Dumps and compares optimised HLO.

    python -m bench.hlo_ab --dump_to=/tmp/before      # on the old code
    python -m bench.hlo_ab --dump_to=/tmp/after       # on the new code
    python -m bench.hlo_ab --compare=/tmp/before,/tmp/after

Dumps the optimised HLO (`jax.jit(f).lower(...).compile().as_text()`) of
the train step of bench cases a and b (`bench/run.py`: nanoGPT's CPU recipe
4L/128 T=64 batch 12, and 6L/384 T=256 batch 16) in float32 and bfloat16,
and of the engine's decoding program (case c: `cache_rows.decode_chunk` as sampling
1000 tokens from a one-token prompt runs it), and
the same three for the Llama block at case a's size; the train step and decoding of
Gemma 3's and nanochat's blocks at that size (their layers differ); and at case a's size
the step with LoRA adapters, on conversation rows (`DeviceRows`), on the
host's windows (`HostWindows`), and a sweep's step (two runs vmapped), each
normalised: instruction and computation names stripped, metadata dropped,
lines sorted. Identical files mean identical programs up to naming.
"""

import dataclasses
import collections
import pathlib
import re

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from bench import harness
from purejax import gpt
from purejax import lora
from purejax.data import batches
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.pure import state as state_lib
from purejax.training.pure import steps as steps_lib
from purejax.training.pure import sweep

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_string("dump_to", None, "Folder to write the normalised HLO files into.")
  flags.DEFINE_list("compare", None, "Two folders written by --dump_to: compare them.")

_NAME = re.compile(r"%[\w.\-]+")
_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")
# The source-location tables (FileNames, FunctionNames, FileLocations,
# StackFrames) name Python files and functions, not operations.
_SOURCE_TABLE = re.compile(
    r'^(FileNames|FunctionNames|FileLocations|StackFrames|(\d+|_) ".*"|'
    r'(\d+|_) \{(file_name_id|file_location_id)=.*\})$')
# bench/run.py's cases a and b: (config, batch, steps per call in a full run).
_CASES = {
    "a": (gpt.GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128), 12, 10),
    "b": (gpt.GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384), 16, 2),
}


def normalise(hlo_text: str) -> str:
  """Optimised HLO with names, metadata and source locations stripped, lines sorted.

  Idempotent, so files it wrote can be normalised again by a newer version.
  """
  lines = []
  for line in hlo_text.splitlines():
    if _SOURCE_TABLE.match(line.strip()):
      continue
    if line.startswith("HloModule "):
      line = re.sub(r"^HloModule [\w.\-]+", "HloModule _", line)
    line = _METADATA.sub("", line)
    line = _NAME.sub("%_", line)
    line = re.sub(r"^(\s*)(ENTRY )?[\w.\-]+ (\(|\{)", r"\1\2_ \3", line)
    lines.append(line.rstrip())
  return "\n".join(sorted(lines)) + "\n"


_OPTIMIZER = optim.from_flat(learning_rate=1e-3, warmup_iters=10, decay_iters=1000,
                                   min_lr=1e-4, beta2=0.99, weight_decay=0.1, grad_clip=1.0)


def train_hlo(config: gpt.GPTConfig, batch_size: int, num_steps: int, tokens: str = "device",
              lora_config=None) -> str:
  """The train step of `bench/run.py`'s purejax arm, one device; `tokens` the batch kind
  ("device", "rows", "host"), `lora_config` adapters trained instead of the params."""
  key = jax.random.PRNGKey(0)
  data = jax.random.randint(key, (200_000,), 0, config.vocab_size)
  batch = {
      "device": lambda: batches.DeviceTokens(data),
      "rows": lambda: batches.DeviceRows(
          data[:64 * (config.block_size + 1)].reshape(64, config.block_size + 1),
          jnp.ones((64, config.block_size), jnp.float32)),
      "host": lambda: batches.HostWindows(
          data[:num_steps * batch_size * (config.block_size + 1)].reshape(
              num_steps, batch_size, config.block_size + 1)),
  }[tokens]()
  params = gpt.init_params(config, key)
  optimizer = optim.RunOptimizer(_OPTIMIZER, frozen_base=lora_config is not None)()
  state, view = state_lib.start_state(params, {"params": key, "train": key, "eval": key},
                                      optimizer, lora_config)
  static = dict(config=config, optimizer=optimizer, batch_size=batch_size,
                num_steps=num_steps, forms=kernels.select("cpu"), params_view=view)
  lowered = steps_lib.train_steps.lower(state, batch, 0, **static)
  return lowered.compile().as_text()


def sweep_hlo(config: gpt.GPTConfig, batch_size: int, num_steps: int) -> str:
  """A sweep's train step: two runs of other learning rates, vmapped together."""
  key = jax.random.PRNGKey(0)
  data = jax.random.randint(key, (200_000,), 0, config.vocab_size)
  specs = sweep.expand(_OPTIMIZER, 0, {"learning_rate": (1e-3, 3e-3)}, 1)
  make = optim.RunOptimizer(_OPTIMIZER)
  states = [state_lib.start_state(gpt.init_params(config, k), {"params": k, "train": k,
                                                               "eval": k}, make())[0]
            for k in jax.random.split(key, len(specs))]
  lowered = sweep.train_steps.lower(
      sweep.stack(states), batches.DeviceTokens(data), 0, sweep.hyperparams(specs),
      config=config, make_optimizer=make, batch_size=batch_size, num_steps=num_steps,
      forms=kernels.select("cpu"), sweep_batch=0)
  return lowered.compile().as_text()


def generate_hlo(config: gpt.GPTConfig) -> str:
  """The engine's decoding program as case c runs it (`harness.sampling_program`)."""
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  return harness.sampling_program(params, config, kernels.select("cpu")).compile().as_text()


def programs():
  """{name: optimised HLO text} of every compared program."""
  out = {}
  for case, (config, batch_size, num_steps) in _CASES.items():
    for dtype, name in (("float32", "fp32"), ("bfloat16", "bf16")):
      out[f"train_{case}_{name}"] = train_hlo(
          dataclasses.replace(config, compute_dtype=dtype), batch_size, num_steps)
  out["generate_c"] = generate_hlo(_CASES["a"][0])
  # The Llama block at case a's size: its programs too must not move when options are added.
  llama = dataclasses.replace(_CASES["a"][0], **gpt.ARCHITECTURES["llama"])
  for dtype, name in (("float32", "fp32"), ("bfloat16", "bf16")):
    out[f"train_llama_{name}"] = train_hlo(dataclasses.replace(llama, compute_dtype=dtype),
                                           *_CASES["a"][1:])
  out["generate_llama"] = generate_hlo(llama)
  # Layers that differ (Gemma 3's windows and RoPE bases) and nanochat's value embeddings,
  # at case a's size: the blocks' per-layer constants.
  for arch, more in (("gemma3", dict(window=16, n_layer=6)), ("nanochat", {})):
    other = dataclasses.replace(_CASES["a"][0], **{**gpt.ARCHITECTURES[arch], **more})
    out[f"train_{arch}_fp32"] = train_hlo(other, *_CASES["a"][1:])
    out[f"generate_{arch}"] = generate_hlo(other)
  config, batch_size, num_steps = _CASES["a"]
  out["train_a_lora"] = train_hlo(config, batch_size, num_steps,
                                  lora_config=lora.LoraConfig(rank=4))
  out["train_a_rows"] = train_hlo(config, batch_size, num_steps, tokens="rows")
  out["train_a_host"] = train_hlo(config, batch_size, num_steps, tokens="host")
  out["train_a_sweep"] = sweep_hlo(config, batch_size, num_steps)
  return out


def compare(before: pathlib.Path, after: pathlib.Path) -> None:
  print("| program | lines before | lines after | lines differing |")
  print("| --- | ---: | ---: | ---: |")
  for path in sorted(before.glob("*.hlo")):
    old = normalise(path.read_text()).splitlines()
    new = normalise((after / path.name).read_text()).splitlines()
    # Lines are sorted, so compare them as multisets: removed plus added.
    changed = sum(((collections.Counter(old) - collections.Counter(new)) +
                   (collections.Counter(new) - collections.Counter(old))).values())
    print(f"| {path.stem} | {len(old)} | {len(new)} | {changed} |")


def main(argv):
  del argv
  if FLAGS.compare:
    before, after = map(pathlib.Path, FLAGS.compare)
    compare(before, after)
    return
  out = pathlib.Path(FLAGS.dump_to or "hlo_ab")
  out.mkdir(parents=True, exist_ok=True)
  for name, text in programs().items():
    (out / f"{name}.hlo").write_text(normalise(text))
    print(f"wrote {out / name}.hlo")


if __name__ == "__main__":
  define_flags()
  app.run(main)

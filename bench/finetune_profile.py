"""Where a real model's fine-tuning step spends its time: purejax and PyTorch, by kind of work.

    python -m bench.finetune_profile --model=path/to/SmolLM2-135M-Instruct --setting=lora_f32

The step of `bench.finetune_speed` (same model, batch, optimizer and
setting), profiled for `--steps` steps after a first, each side in a
process of its own. Every operation's time is summed into one of:

- `products`: the matrix products of the blocks and the head (purejax: XLA
  dot fusions with 2-D outputs; PyTorch: `aten::mm`, `addmm`);
- `attention`: its products and the work around them (purejax: fusions with
  the `[batch, heads, ...]` shapes of attention and its batched dots;
  PyTorch: `scaled_dot_product_*` and its backward);
- `other`: everything else (norms, activations, RoPE, the softmax over the
  vocabulary, the scan's stacked buffers, the optimizer).

purejax's times are XLA:CPU's thunk times from a `jax.profiler` trace;
PyTorch's are the operators' self CPU times from `torch.profiler`. XLA may
run two independent thunks at once, one per core, so its sums can exceed
the wall clock; the step's wall time is printed beside them. Results go to
`bench/results/<date>-finetune_profile.json`.
"""

import collections
import datetime
import glob
import gzip
import json
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Sequence

from absl import app
from absl import flags

from bench import finetune_speed
from bench import harness

FLAGS = flags.FLAGS
KINDS = ("products", "attention", "other")


def _shapes_by_op(program_text: str) -> dict:
  """Each instruction's output shape and opcode in an optimised HLO text."""
  found = re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(", program_text, re.M)
  return {name: (shape, opcode) for name, shape, opcode in found}


def purejax_kind(name: str, shape: str, heads: Sequence[int]) -> str:
  """`KINDS` entry of one XLA:CPU thunk, from its name and output shape."""
  dims = [int(d) for d in re.findall(r"\d+", shape.partition("{")[0].partition("[")[2])]
  product = name.startswith(("dot", "ynn_fusion", "custom-call"))
  if product and len(dims) == 2:
    return "products"
  # Attention's arrays carry a head axis (query or key/value heads) next to batch.
  if len(dims) >= 4 and (product or any(d in dims[1:3] for d in heads)):
    return "attention"
  return "other"


def profile_purejax(setting: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  run = finetune_speed.make_arm("purejax", FLAGS.model, setting)
  shapes = _shapes_by_op(run.compiled().as_text())
  config = json.loads(pathlib.Path(FLAGS.model, "config.json").read_text())
  heads = (config["num_attention_heads"], config.get("num_key_value_heads") or 0)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      walls = [run() for _ in range(FLAGS.steps)]
    trace_file, = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(trace_file) as f:
      events = json.load(f)["traceEvents"]
  by_op = collections.Counter()
  for event in events:
    if event.get("ph") == "X" and event["name"] in shapes:
      by_op[event["name"]] += event["dur"] / 1e3 / FLAGS.steps  # ms per step
  kinds = collections.Counter()
  for name, ms in by_op.items():
    kinds[purejax_kind(name, shapes[name][0], heads)] += ms
  top = [{"op": name, "shape": shapes[name][0], "ms": ms} for name, ms in by_op.most_common(12)]
  return {"wall_s": walls, "ms_per_step": dict(kinds), "top": top}


def profile_torch(setting: str) -> dict:
  from torch import profiler  # pylint: disable=import-outside-toplevel
  run = finetune_speed.make_arm("torch", FLAGS.model, setting)
  with profiler.profile(activities=[profiler.ProfilerActivity.CPU]) as prof:
    walls = [run() for _ in range(FLAGS.steps)]
  kinds = collections.Counter()
  by_op = collections.Counter()
  for event in prof.key_averages():
    ms = event.self_cpu_time_total / 1e3 / FLAGS.steps
    by_op[event.key] += ms
    if event.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
      kinds["products"] += ms
    elif "scaled_dot_product" in event.key:
      kinds["attention"] += ms
    else:
      kinds["other"] += ms
  top = [{"op": name, "ms": ms} for name, ms in by_op.most_common(12)]
  return {"wall_s": walls, "ms_per_step": dict(kinds), "top": top}


def main(argv):
  del argv
  if FLAGS.side:
    profile = profile_purejax if FLAGS.side == "purejax" else profile_torch
    print(json.dumps(profile(FLAGS.setting)))
    return
  results = {}
  for side in ("purejax", "torch"):
    done = subprocess.run(
        [sys.executable, "-m", "bench.finetune_profile", f"--model={FLAGS.model}",
         f"--setting={FLAGS.setting}", f"--side={side}", f"--steps={FLAGS.steps}",
         f"--batch_size={FLAGS.batch_size}", f"--block_size={FLAGS.block_size}",
         f"--threads={FLAGS.threads}"],
        capture_output=True, text=True, check=False)
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if done.returncode != 0 or not lines:
      raise RuntimeError(f"{side} failed: {done.stderr.strip()[-800:]}")
    results[side] = json.loads(lines[-1])
  print(f"{FLAGS.setting}, {FLAGS.batch_size} x {FLAGS.block_size} tokens, ms per step "
        f"(summed operation times; wall clock beside):")
  for side, result in results.items():
    kinds = "  ".join(f"{k} {result['ms_per_step'].get(k, 0):7.0f}" for k in KINDS)
    wall = min(result["wall_s"]) * 1e3
    print(f"  {side:8s} {kinds}   wall {wall:6.0f} (fastest step)")
  meta = {"date": datetime.date.today().isoformat(), "cpu": finetune_speed._cpu_name(),  # pylint: disable=protected-access
          "setting": FLAGS.setting, "batch_size": FLAGS.batch_size,
          "block_size": FLAGS.block_size, "steps": FLAGS.steps, "model": FLAGS.model}
  path = harness.unused_results_path(harness.RESULTS_DIR,
                                     f"{meta['date']}-finetune_profile-{FLAGS.setting}")
  harness.write_results(path, {"meta": meta, "results": results})
  print(f"wrote {path}")


if __name__ == "__main__":
  finetune_speed.define_flags()
  flags.DEFINE_string("setting", "lora_f32", f"One of {finetune_speed.SETTINGS}.")
  flags.DEFINE_enum("side", None, ["purejax", "torch"], "Internal: profile this side only.")
  app.run(main)

"""What a LoRA reinforcement-learning run holds in host memory, by how its frozen base is
held, and its step times: `python -m purejax.rl` on a real model, each arm in a fresh
process, arms alternated.

    python -m bench.rl_memory --model=path/to/model.gguf --rounds=2

Arms (the same flags otherwise: the built-in arithmetic task, LoRA rank 16, 2 prompts
x 4 completions of up to 32 tokens a step, 3 steps):

- `qlora`: `--quantize=gguf`, the file's blocks held as they are; the engine samples
  with each adapted weight beside the quantized base (`rl_loop.sampled_params`).
- `qlora-merged`: the same run, sampling from the adapters merged into float32
  matrices each step (the bench swaps `sampled_params` in its child process).
- `float32`, `float32-merged`: `--quantize=float32`, the base dequantized to float32,
  sampled from as `qlora` and `qlora-merged` are.

Each child reads its resident-set peak (`VmHWM`) at the end; the step times are the
medians of `sample_s` and `update_s` in the run's metrics, after the first step
(compilation). MB are 10^6 bytes.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys
from purejax.cli import rl
from purejax.training.loops import rl_loop
import jax
from purejax import lora
if sys.argv[1] == "merged":  # one jitted merge a step
  rl_loop.sampled_params = lambda view: jax.jit(
      lambda tree: lora.merge(tree["base"], tree["adapters"], view.alpha))
code = rl.run(["rl", *sys.argv[2:]])
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("PEAK " + json.dumps({"code": code, "peak_mb": int(status["VmHWM"].split()[0]) / 1e3}))
"""

ARMS = {"qlora": ("beside", "gguf"), "qlora-merged": ("merged", "gguf"),
        "float32": ("beside", "float32"), "float32-merged": ("merged", "float32")}


def run_arm(model: str, arm: str, out_dir: str) -> dict:
  sampling, held = ARMS[arm]
  flags = [f"--init_from={model}", f"--out_dir={out_dir}", "--task=arithmetic",
           "--lora_rank=16", f"--quantize={held}", "--prompts_per_step=2", "--group_size=4",
           "--max_new_tokens=32", "--max_iters=3", "--eval_interval=100",
           "--eval_examples=2", "--learning_rate=1e-4", "--progress=false"]
  done = subprocess.run([sys.executable, "-c", CHILD, sampling, *flags], capture_output=True,
                        text=True, check=False)
  peak = [l for l in done.stdout.splitlines() if l.startswith("PEAK ")]
  if done.returncode or not peak or json.loads(peak[-1][5:])["code"]:
    raise SystemExit(f"{arm} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
  records = [json.loads(l) for l in open(f"{out_dir}/metrics.jsonl") if '"sample_s"' in l]
  later = records[1:]
  return {"arm": arm, "peak_mb": json.loads(peak[-1][5:])["peak_mb"],
          "sample_s": statistics.median(r["sample_s"] for r in later),
          "update_s": statistics.median(r["update_s"] for r in later)}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", required=True, help="a .gguf file")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--arms", default=",".join(ARMS))
  args = parser.parse_args()
  results = {arm: [] for arm in args.arms.split(",")}
  for _ in range(args.rounds):
    for arm in results:
      with tempfile.TemporaryDirectory() as out:
        result = run_arm(args.model, arm, out)
      print(json.dumps(result), flush=True)
      results[arm].append(result)
  for arm, rows in results.items():
    print(f"{arm:13s} peak {statistics.median(r['peak_mb'] for r in rows):7.0f} MB | sample "
          f"{statistics.median(r['sample_s'] for r in rows):5.2f} s | update "
          f"{statistics.median(r['update_s'] for r in rows):5.2f} s (medians of "
          f"{len(rows)} runs)")


if __name__ == "__main__":
  main()

"""The resident memory of a GGUF model kept quantized against the same file read as
float32: one fresh process per arm, RSS read from /proc.

    python -m bench.quant_memory --model=path/to/model.gguf --tokens=64

Each arm's process imports purejax and the libraries the load uses (gguf,
tokenizers), runs one small jitted op (the runtime's own memory), reads its RSS (the
baseline), loads the model (`gguf_files.from_gguf`, kept
quantized or dequantized to float32, device arrays either way), reads RSS and the
process's peak so far (the load's),
greedily generates `--tokens` tokens from one prompt through `engine.generate`, and
reads RSS and the process's peak. Prints, per arm, the loaded and generation growth
over the baseline, the peak, and the file's size; all in MB (10^6 bytes).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys


def peak_mb() -> float:
  """The process's peak resident size so far (VmHWM; `ru_maxrss` would carry a forking
  parent's over)."""
  with open("/proc/self/status") as f:
    line = next(l for l in f if l.startswith("VmHWM:"))
  return int(line.split()[1]) * 1024 / 1e6


def rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def arm(model: str, keep: bool, tokens: int) -> dict:
  import gguf  # noqa: F401  (the libraries the load uses, imported before the baseline)
  import jax
  import jax.numpy as jnp
  import tokenizers  # noqa: F401
  from purejax import engine
  from purejax.ops import kernels
  from purejax.weights import gguf_files
  jax.jit(lambda x: x + 1)(jnp.ones(4)).block_until_ready()
  base = rss_mb()
  params, config, _ = gguf_files.from_gguf(model, keep_quantized=keep)
  jax.block_until_ready(params)
  loaded = rss_mb()
  peak_load = peak_mb()
  out = engine.generate(params, [[2, 651, 6037, 529]], config, jax.random.PRNGKey(0), tokens,
                        forms=kernels.select("cpu"))
  done = rss_mb()
  peak = peak_mb()
  return {"kept": keep, "baseline_mb": base, "load_mb": loaded - base,
          "load_peak_mb": peak_load - base, "generate_mb": done - loaded,
          "peak_mb": peak - base, "tokens": list(out[0][0].tokens)}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", required=True)
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--arm", choices=("kept", "float32"))
  args = parser.parse_args()
  if args.arm:
    print(json.dumps(arm(args.model, args.arm == "kept", args.tokens)))
    return
  size = pathlib.Path(args.model).stat().st_size / 1e6
  results = {}
  for name in ("kept", "float32"):
    done = subprocess.run([sys.executable, "-m", "bench.quant_memory", f"--model={args.model}",
                           f"--tokens={args.tokens}", f"--arm={name}"], capture_output=True,
                          text=True, check=True)
    results[name] = json.loads(done.stdout.strip().splitlines()[-1])
  for name, r in results.items():
    print(f"{name:8s} load +{r['load_mb']:.0f} MB ({r['load_mb'] / size:.2f}x the "
          f"{size:.0f} MB file), load peak +{r['load_peak_mb']:.0f}, generate "
          f"{args.tokens} tokens +{r['generate_mb']:.0f} MB, peak +{r['peak_mb']:.0f} MB")
  print("same tokens:", results["kept"]["tokens"] == results["float32"]["tokens"])
  print(json.dumps({"file_mb": size, **results}))


if __name__ == "__main__":
  main()

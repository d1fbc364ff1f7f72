"""What loading a model costs in host memory: resident size after the load and the load's
peak, against the bytes of the weights it gives, in a fresh process.

    python -m bench.load_memory --model=path/to/hf_folder
    python -m bench.load_memory --model=path/to/model.gguf --keep_quantized

The process imports purejax and the libraries a load uses, runs one small jitted op
(the runtime's own memory), reads its RSS (the baseline), loads the model through
`weights.from_pretrained` (every leaf a device array; on the CPU backend a device
array's memory is host memory), and reads RSS and the peak (`VmHWM`). Prints the
weights' bytes, the growth after loading, the peak's growth and its ratio to the
growth after loading; MB are 10^6 bytes.
"""

import argparse
import json

from bench.quant_memory import peak_mb, rss_mb


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", required=True, help="anything `from_pretrained` reads")
  parser.add_argument("--keep_quantized", action="store_true")
  args = parser.parse_args()
  import gguf  # noqa: F401  (the libraries a load uses, imported before the baseline)
  import jax
  import jax.numpy as jnp
  import safetensors.numpy  # noqa: F401
  import tokenizers  # noqa: F401
  from purejax import weights
  jax.jit(lambda x: x + 1)(jnp.ones(4)).block_until_ready()
  base = rss_mb()
  params, _, _ = weights.from_pretrained(args.model, keep_quantized=args.keep_quantized)
  jax.block_until_ready(params)
  loaded, peak = rss_mb() - base, peak_mb() - base
  size = sum(leaf.nbytes for leaf in jax.tree.leaves(params)) / 1e6
  kinds = sorted({type(leaf).__name__ for leaf in jax.tree.leaves(params)})
  print(f"weights {size:.0f} MB ({', '.join(kinds)}); after loading +{loaded:.0f} MB; "
        f"load peak +{peak:.0f} MB ({peak / loaded:.2f}x)")
  print(json.dumps({"model": args.model, "weights_mb": size, "load_mb": loaded,
                    "load_peak_mb": peak}))


if __name__ == "__main__":
  main()

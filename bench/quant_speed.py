"""Greedy sampling from quantized matrices against float32 ones, one process, alternated.

    python -m bench.quant_speed --model=path/to/SmolLM2-135M-Instruct --tokens=64 --rounds=3

Loads the model once, makes its int8 and q4_1 forms (`quant.quantize_matrices`), warms
each arm up (compiles), then times `engine.generate` of one prompt for `--tokens` new
tokens, the arms in turn each round; prints each arm's median tokens/s, its ratio to
float32, whether the tokens equal float32's, and the dense matrices' bytes.
"""

import argparse
import json
import statistics
import time

import jax

from purejax import engine
from purejax.cli import models
from purejax.ops import kernels
from purejax.ops import quant


def matrix_bytes(params) -> int:
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
  return sum(x.nbytes if isinstance(x, quant.QuantizedWeight) else
             (x.nbytes if x.ndim >= 2 else 0) for x in leaves)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", required=True)
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  params, config, tokenizer = models.load_model("unused", args.model)
  forms = kernels.select("cpu")
  arms = {"float32": params}
  for fmt in ("int8", "q4_1"):
    arms[fmt] = quant.quantize_matrices(params, fmt)[0]
  prompt = [int(i) for i in tokenizer.encode("The history of the printing press begins")]

  def run(p):
    (c,), = engine.generate(p, [prompt], config, jax.random.PRNGKey(0), args.tokens,
                            rows=1, prefill_rows=1, forms=forms)
    return c.tokens

  tokens = {name: run(p) for name, p in arms.items()}  # compile each
  times = {name: [] for name in arms}
  for _ in range(args.rounds):
    for name, p in arms.items():
      began = time.perf_counter()
      run(p)
      times[name].append(time.perf_counter() - began)
  base = statistics.median(times["float32"])
  for name in arms:
    median = statistics.median(times[name])
    print(json.dumps({"arm": name, "tokens_per_s": round(args.tokens / median, 2),
                      "vs_float32": round(base / median, 3),
                      "same_tokens_as_float32": tokens[name] == tokens["float32"],
                      "matrix_mib": round(matrix_bytes(arms[name]) / 2**20, 1),
                      "seconds": [round(t, 3) for t in times[name]]}))


if __name__ == "__main__":
  main()

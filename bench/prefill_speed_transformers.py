"""The `transformers` arm of `bench.prefill_speed`, run by a Python that has torch and
transformers (`--hf_python`): each prompt's forward alone, its cache kept, as
`generate` starts a sequence.

    python bench/prefill_speed_transformers.py FOLDER PROMPTS.json REPEATS

Prints a JSON list of seconds, one per timed run (the first, untimed run warms up).
"""

import json
import sys
import time

import torch
import transformers


def main(folder: str, prompts_path: str, repeats: int) -> None:
  torch.set_num_threads(torch.get_num_threads())
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  model.eval()
  with open(prompts_path) as f:
    prompts = [torch.tensor([p]) for p in json.load(f)]

  def go():
    with torch.inference_mode():
      for ids in prompts:
        model(input_ids=ids, use_cache=True, logits_to_keep=1)

  go()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    go()
    times.append(time.perf_counter() - start)
  print(json.dumps(times))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

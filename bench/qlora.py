"""LoRA on a frozen base held in bfloat16, int8 or 4 bits: the base's bytes, the step's
peak resident memory and its time, one process per arm, arms alternated.

    python -m bench.qlora --model=path/to/model --rounds=2

`--model` is a Hugging Face folder or a .gguf file (read as float32, then held as each
arm says; `--keep_gguf` adds an arm on the file's own blocks; `--peer`, for a folder,
PyTorch + peft's LoRA on bitsandbytes' 4-bit NF4 base, the same step). Each arm's process
loads the model, holds its base (`quant.hold_matrices`: the dense matrices and the
token embedding; norms stay float32), frees the float32 copy, then resets its peak
resident memory (`/proc/self/clear_refs`), builds rank-16 LoRA on the attention and
MLP matrices (`lora.View` through `steps.train_steps`, float32 products, AdamW), runs
one step (compiles) and times `--steps` more on `--batch_size` x `--block_size`
random tokens. It reports the base's bytes on the device and what the same tensors
take in bfloat16, the resident memory before the step was built, the peak over the
steps (VmHWM after the reset: the step's, not the loading's) and the median step.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

ARMS = ("bfloat16", "int8", "q4_1")
RANK = 16


def _status(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(field)


def arm(model: str, held: str, batch: int, block: int, steps: int) -> dict:
  import dataclasses
  import jax
  import jax.numpy as jnp
  import numpy as np
  from purejax import host_memory, lora, weights
  from purejax.data import batches
  from purejax.ops import kernels, quant
  from purejax.optimizers import optim
  from purejax.training.pure import steps as steps_lib
  from purejax.training.pure.state import TrainState
  params, config, _ = weights.from_pretrained(model, keep_quantized=held == "gguf")
  if held != "gguf":
    params, _ = quant.hold_matrices(params, held)
  params = jax.block_until_ready(jax.tree.map(jnp.asarray, params))
  host_memory.release_freed()
  is_q = lambda x: isinstance(x, quant.QuantizedWeight)
  leaves = jax.tree.leaves(params, is_leaf=is_q)
  base_bytes = sum(x.nbytes for x in leaves)
  bf16_bytes = sum(int(np.prod(x.shape)) * 2 for x in leaves)
  held_bytes = sum(x.nbytes for x in leaves if is_q(x) or x.ndim >= 2)
  held_bf16 = sum(int(np.prod(x.shape)) * 2 for x in leaves if is_q(x) or x.ndim >= 2)
  config = dataclasses.replace(config, block_size=block)
  adapters = lora.init(params, RANK, lora.ATTENTION_AND_MLP, jax.random.PRNGKey(1))
  trained, view = lora.trainable(params, adapters), lora.View(float(RANK))
  optimizer = optim.RunOptimizer(optim.from_flat(learning_rate=1e-4, schedule="constant"),
                                 frozen_base=True)()
  rss_before = _status("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:  # the peak from here on: the steps'
    f.write("5")
  state = TrainState(trained, optimizer.init(trained), {"train": jax.random.PRNGKey(0)})
  ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, batch, block + 1))
  tokens = batches.HostWindows(jnp.asarray(ids, jnp.int32))
  kwargs = dict(config=config, optimizer=optimizer, batch_size=batch, num_steps=1,
                forms=kernels.select("cpu"), params_view=view)
  times = []
  for i in range(steps + 1):
    start = time.perf_counter()
    state, metrics = steps_lib.train_steps(state, tokens, i, **kwargs)
    loss = float(metrics.loss[-1])
    times.append(time.perf_counter() - start)
    assert np.isfinite(loss)
  return {"arm": held, "base_bytes": base_bytes, "base_bf16_bytes": bf16_bytes,
          "held_bytes": held_bytes, "held_bf16_bytes": held_bf16, "rss_before": rss_before,
          "step_peak": _status("VmHWM"), "step_s": statistics.median(times[1:]),
          "loss": loss}


def torch_arm(model: str, batch: int, block: int, steps: int) -> dict:
  """The peer: PyTorch, peft's LoRA (rank 16, the same matrices) on bitsandbytes' 4-bit
  NF4 base (`load_in_4bit`, float32 compute, 2 threads), AdamW, the same random batch
  size; `model` a Hugging Face folder."""
  import numpy as np
  import peft
  import torch
  import transformers
  torch.set_num_threads(2)
  quantized = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                              bnb_4bit_compute_dtype=torch.float32)
  net = transformers.AutoModelForCausalLM.from_pretrained(
      model, quantization_config=quantized, device_map="cpu", dtype=torch.float32)
  net = peft.get_peft_model(net, peft.LoraConfig(
      r=RANK, lora_alpha=RANK, lora_dropout=0.0, target_modules=[
          "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
  base_bytes = sum(p.numel() * p.element_size() for n, p in net.named_parameters()
                   if "lora_" not in n) + sum(b.numel() * b.element_size()
                                              for b in net.buffers())
  trained = [p for p in net.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(trained, lr=1e-4)
  ids = torch.from_numpy(np.random.default_rng(0).integers(
      0, net.config.vocab_size, (batch, block + 1)))
  rss_before = _status("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  times = []
  for _ in range(steps + 1):
    start = time.perf_counter()
    loss = net(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    times.append(time.perf_counter() - start)
  return {"arm": "torch_bnb_nf4", "base_bytes": base_bytes, "base_bf16_bytes": 0,
          "held_bytes": 0, "held_bf16_bytes": 0, "rss_before": rss_before,
          "step_peak": _status("VmHWM"), "step_s": statistics.median(times[1:]),
          "loss": float(loss)}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", required=True)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--batch_size", type=int, default=2)
  parser.add_argument("--block_size", type=int, default=128)
  parser.add_argument("--keep_gguf", action="store_true")
  parser.add_argument("--peer", action="store_true", help="add PyTorch + peft + "
                      "bitsandbytes' 4-bit NF4 (a Hugging Face folder's model)")
  parser.add_argument("--arms", help="comma-separated arms to run (default: all)")
  parser.add_argument("--arm")
  args = parser.parse_args()
  if args.arm:
    run = torch_arm if args.arm == "torch_bnb_nf4" else lambda *a: arm(a[0], args.arm, *a[1:])
    print(json.dumps(run(args.model, args.batch_size, args.block_size, args.steps)))
    return
  arms = ARMS + (("gguf",) if args.keep_gguf else ()) + (("torch_bnb_nf4",) if args.peer
                                                         else ())
  if args.arms:
    arms = tuple(a for a in arms if a in args.arms.split(","))
  runs = {a: [] for a in arms}
  for r in range(args.rounds):
    for a in arms:
      done = subprocess.run([sys.executable, "-m", "bench.qlora", f"--model={args.model}",
                             f"--arm={a}", f"--steps={args.steps}",
                             f"--batch_size={args.batch_size}",
                             f"--block_size={args.block_size}"],
                            capture_output=True, text=True)
      lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
      if done.returncode or not lines:
        raise RuntimeError(f"{a}: {done.stderr[-1500:]}")
      runs[a].append(json.loads(lines[-1]))
      print(f"round {r} {a}: {runs[a][-1]}", flush=True)
  med = lambda a, k: statistics.median(x[k] for x in runs[a])
  ref = "bfloat16" if "bfloat16" in arms else arms[0]
  print(f"{args.batch_size} x {args.block_size} tokens, LoRA rank {RANK}, {args.rounds} "
        f"alternated rounds, medians (MB = 1e6 bytes):")
  for a in arms:
    if a == "torch_bnb_nf4":
      print(f"{a:9s} base {med(a, 'base_bytes') / 1e6:7.1f} MB | step peak "
            f"{med(a, 'step_peak') / 1e6:7.1f} MB (before {med(a, 'rss_before') / 1e6:.1f}) | "
            f"step {med(a, 'step_s'):.3f} s; purejax q4_1 is "
            f"{med(a, 'step_s') / med('q4_1', 'step_s'):.2f}x its speed"
            if "q4_1" in runs else "")
      continue
    saved = med(ref, "base_bytes") - med(a, "base_bytes")
    lower = med(ref, "step_peak") - med(a, "step_peak")
    print(f"{a:9s} base {med(a, 'base_bytes') / 1e6:7.1f} MB = "
          f"{med(a, 'base_bytes') / med(a, 'base_bf16_bytes'):.3f}x its bf16 bytes "
          f"(held tensors {med(a, 'held_bytes') / med(a, 'held_bf16_bytes'):.3f}x) | "
          f"step peak {med(a, 'step_peak') / 1e6:7.1f} MB (before {med(a, 'rss_before') / 1e6:.1f})"
          f" | saved {saved / 1e6:6.1f} MB, peak lower by {lower / 1e6:6.1f} MB"
          f" ({(lower / saved if saved else float('nan')):.2f} of it) | step "
          f"{med(a, 'step_s'):.3f} s = {med(ref, 'step_s') / med(a, 'step_s'):.2f}x bf16's speed")
  print(json.dumps({a: runs[a] for a in arms}))


if __name__ == "__main__":
  main()

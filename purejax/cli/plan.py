r"""Plans a training run on a GPU you do not have: memory, the largest batch, a speed floor.

    python -m purejax.plan --gpu=h100 --n_layer=12 --n_head=12 --n_embd=768 \
        --block_size=1024 --vocab_size=50304 --bias=false --dtype=bfloat16 --batch_size=12
    python -m purejax.plan --gpu=h100 --num_devices=8 --fsdp --batch_size=96 ...
    python -m purejax.plan --gpu=rtx4090 --hf_config=Llama-3.1-8B/config.json \
        --block_size=2048 --dtype=bfloat16 --batch_size=1 --lora_rank=16 --quantize=q4_1

It takes `purejax.train`'s model, batch, forms and device flags (or a Hugging Face
`config.json`, `--hf_config`: a model's shape without its weights; with
`--lora_rank`, `--quantize` plans LoRA on a base held quantized: QLoRA), compiles the
training step for the card with XLA's GPU compiler on this machine (no GPU
needed; JAX's CUDA plugin must be installed), and prints, per device: the
bytes of params, optimizer state and temporaries XLA planned, the peak against
the card's memory, the largest batch that fits, the step's FLOPs and the step
time and MFU they allow at the card's peak; where the step does not fit, the
fewest devices (a power of two up to `--max_devices`) that hold it with FSDP.
Only shapes are compiled: no weight is made. docs/performance.md says what the
numbers are and are not.
"""

import dataclasses
import time
from typing import Sequence

from absl import flags
import jax

from purejax import gpt
from purejax.cli import command
from purejax.cli import errors
from purejax.cli import forms_flags
from purejax.cli import train
from purejax.cli import train_flags
from purejax.ops import kernels
from purejax.ops import quant
from purejax.optimizers import optim
from purejax.training.effects import runs
from purejax.training.pure import flops
from purejax.training.tools import gpu_plan
from purejax.weights import huggingface

Args = flags.FlagValues
GIB = 1 << 30


def define_flags(args: Args) -> None:
  train_flags.define_flags(args, "gpt")
  flags.DEFINE_string("gpu", "h100", f"The card to plan for: {', '.join(gpu_plan.TARGETS)}, "
                      "or an XLA GpuTargetConfig .txtpb file.",
                      flag_values=args)
  flags.DEFINE_integer("vocab_size", 50304, "Token ids (the model's vocabulary; GPT-2: 50304 "
                       "as nanoGPT pads it).", lower_bound=1, flag_values=args)
  flags.DEFINE_bool("max_batch", True, "Also find the largest batch that fits (a few "
                    "compiles more).", flag_values=args)
  flags.DEFINE_bool("confirm_max_batch", False, "Also compile the batch one step above the "
                    "largest batch found, to show it does not fit (else the line through the "
                    "last two compiles may say so: one compile fewer).", flag_values=args)
  flags.DEFINE_string("hf_config", None, "A Hugging Face config.json (Llama family, Qwen2, "
                      "Mistral, Gemma 3, GPT-2): the model to plan, instead of the model "
                      "flags (its context is --block_size).", flag_values=args)
  flags.DEFINE_integer("max_devices", 64, "Where the step does not fit, the most devices "
                       "the FSDP search tries.", lower_bound=2, flag_values=args)
  flags.DEFINE_float("memory_fraction", gpu_plan.JAX_MEMORY_FRACTION,
                     "Fraction of the card's memory a program may plan: JAX's default "
                     "preallocation (XLA_PYTHON_CLIENT_MEM_FRACTION).", lower_bound=0.01,
                     upper_bound=1.0, flag_values=args)


def _gib(n: float) -> str:
  return f"{n / GIB:.2f} GiB"


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _model_config(args: Args) -> gpt.GPTConfig:
  """The flags' model, or `--hf_config`'s at `--block_size` with the flags' dtypes
  (`--param_dtype=bfloat16`: params and AdamW's moments in bfloat16, a pure bfloat16
  fine-tune)."""
  config = _architecture(args)
  if args["param_dtype"].present:
    config = dataclasses.replace(config, param_dtype=args.param_dtype)
  return config


def _architecture(args: Args) -> gpt.GPTConfig:
  if args.hf_config is None:
    if args.quantize == "gguf":
      raise ValueError(f"--quantize={args.quantize} is not planned: a plan holds the base "
                       f"as int8, q8_0, q4_1, bfloat16 or float32.")
    return train.gpt_config(args, vocab_size=args.vocab_size)
  given = [name for name in train.ARCHITECTURE_FLAGS
           if args[name].present and name not in ("block_size", "param_dtype")] + (
               ["vocab_size"] if args["vocab_size"].present else [])
  if given:
    raise ValueError(f"--{given[0]} has no effect with --hf_config: the architecture comes "
                     f"from {args.hf_config}; drop --{given[0]}.")
  base = huggingface.config_from_file(args.hf_config)
  base = dataclasses.replace(base, block_size=args.block_size)
  return train.gpt_config(args, base.vocab_size, base=base)


def plan(args: Args) -> int:
  """Compiles the flags' training step for `--gpu` and prints the plan; the exit code."""
  started = time.perf_counter()
  try:
    card = gpu_plan.card(args.gpu)
    # The numbers `train` would refuse are refused here too, with its words.
    train.refuse_what_has_no_effect(args)
    train.gpt_train_config(args)  # batch size, steps, intervals
    runs.require_positive(block_size=args.block_size)
    if args.quantize is not None and not args.lora_rank:
      raise ValueError(f"--quantize={args.quantize} holds LoRA's frozen base; add "
                       f"--lora_rank=R (e.g. 16), or drop --quantize.")
    if args.quantize == "gguf":
      raise ValueError("--quantize=gguf keeps a file's own blocks, which a plan from shapes "
                       "does not have; plan with q4_1 (4-bit), q8_0 or int8.")
    config = _model_config(args)
    forms = kernels.select("gpu", **forms_flags.forms_overrides(args))
    opt_config = optim.with_schedule_end(train.optimizer_config(args), args.max_iters)
    num_devices = args.num_devices or 1
    devices = gpu_plan.target_devices(args.gpu, num_devices)
    adapters = train.lora_config(args)
    held = train_flags.held_base(args)  # --quantize, or bfloat16 for LoRA under bfloat16 matmuls

    compiles = [0]

    def compile_at(batch_size: int, on=None, fsdp=None) -> gpu_plan.ProgramPlan:
      compiles[0] += 1
      return gpu_plan.read_program(gpu_plan.compile_train_step(
          config, devices if on is None else on, batch_size=batch_size, forms=forms,
          opt_config=opt_config, fsdp=args.fsdp if fsdp is None else fsdp,
          grad_accum_steps=args.grad_accum_steps, lora_config=adapters, held=held))

    program = compile_at(args.batch_size)
  except gpu_plan.PluginMissing as e:
    errors.fail(e, args)
  except ValueError as e:
    errors.fail(e, args)
  capacity = int(args.memory_fraction * card.memory_bytes)
  params = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  n_params = gpt.num_params(params)
  if held is not None:
    params = quant.held_shapes(params, held)
  print(f"target: {num_devices} x {args.gpu} ({card.description}, {_gib(card.memory_bytes)}; "
        f"a program may plan {args.memory_fraction:g} of it: {_gib(capacity)})")
  print(f"model: {n_params / 1e6:.1f}M params, {config.n_layer} layers, {config.n_embd} wide, "
        f"T={config.block_size}, {config.param_dtype} params, {config.compute_dtype} "
        f"matmuls; batch {args.batch_size} "
        f"({num_devices} device(s) x {args.grad_accum_steps} microbatch(es)), "
        f"{'FSDP' if args.fsdp else 'replicated'} state"
        + (f", LoRA rank {adapters.rank}" if adapters else "")
        + (f", base held {held}" if held else ""))
  print(f"forms: {forms.describe()}")
  # The step's arguments are the params, the optimizer state, the corpus's stand-in
  # (`compile_train_step`'s num_tokens int32 ids) and the keys.
  share = num_devices if args.fsdp else 1
  weights = _bytes(params) / share  # with LoRA, the frozen base; its adapters join the optimizer's
  corpus = 4 * (1 << 20)
  print(f"per device: params {_gib(weights)}, optimizer state "
        f"{_gib(program.argument_bytes - weights - corpus)}, temporaries (activations, "
        f"gradients, workspace) {_gib(program.temp_bytes)}")
  fits = program.peak_bytes <= capacity
  print(f"planned peak per device: {_gib(program.peak_bytes)} of {_gib(capacity)}: "
        f"{'fits' if fits else 'does NOT fit'}")
  calls = program.custom_calls
  print(f"cuDNN attention calls: forward {calls[gpu_plan.CUDNN_FORWARD]}, backward "
        f"{calls[gpu_plan.CUDNN_BACKWARD]} (a layer scan's body counts once); collectives: "
        + (", ".join(f"{kind} x{n}" for kind, n in sorted(program.collectives.items()))
           or "none"))
  if args.max_batch:
    granule, why = gpu_plan.batch_granule(config, forms, num_devices, args.grad_accum_steps)
    peaks = {args.batch_size: program.peak_bytes}

    def peak_at(batch_size: int) -> int:
      if batch_size not in peaks:
        peaks[batch_size] = compile_at(batch_size).peak_bytes
      return peaks[batch_size]

    try:
      best = gpu_plan.largest_batch(
          peak_at, capacity, granule, args.batch_size,
          second=gpu_plan.scaled_batch(args.batch_size, program, capacity),
          confirm=args.confirm_max_batch)
    except ValueError as e:
      errors.fail(e, args)
    above = (best or 0) + granule
    estimate = gpu_plan.line_through_last_two(peaks, above)
    if above in peaks:
      over = f"; {above} plans {_gib(peaks[above])}"
    elif best and estimate is not None:
      over = (f"; {above} would plan about {_gib(estimate)} by the line through the last two "
              f"compiles (not compiled: --confirm_max_batch compiles it)")
    else:
      over = ""
    print(f"largest batch that fits: {best or 'none'}"
          + (f" (planned peak {_gib(peaks[best])})" if best else "") + over
          + f". Rule: the largest multiple of {granule} ({why}) whose planned peak is <= "
          f"{_gib(capacity)}, found by compiling {len(peaks)} batches: "
          + ", ".join(f"{b} ({_gib(peak)})" for b, peak in peaks.items()))
  per_token = flops.transformer_flops_per_token(n_params, config.n_layer, config.n_head,
                                                config.head_dim, config.block_size)
  step_flops = per_token * args.batch_size * config.block_size / num_devices
  peak = flops.device_peak_flops(devices[0], config.compute_dtype)
  moved = program.argument_bytes + program.output_bytes + 2 * program.temp_bytes
  floor = gpu_plan.step_floor(step_flops, peak, moved, card.bandwidth)
  print(f"FLOPs per step per device: {step_flops / 1e12:.2f} TFLOP (nanoGPT's 6N + 12LHQT "
        f"per token; XLA's cost_analysis() gives none for a program compiled without a GPU)")
  compute = (f"{floor['compute_s'] * 1e3:.2f} ms at {peak / 1e12:.0f} TFLOP/s"
             if floor["compute_s"] else "unknown peak")
  print(f"step-time floor: {floor['floor_s'] * 1e3:.2f} ms = max(compute {compute}, memory "
        f"{floor['memory_s'] * 1e3:.2f} ms to read the arguments, write the outputs and "
        f"write and read the temporaries once at {card.bandwidth / 1e12:.2f} TB/s)"
        + (f"; MFU ceiling {floor['compute_s'] / floor['floor_s']:.0%}"
           if floor["compute_s"] else ""))
  if not fits:
    _fsdp_devices(args, compile_at, capacity)
  print(f"planned in {time.perf_counter() - started:.1f} s ({compiles[0]} compiles of the "
        f"step from shapes alone: no weight was made)")
  return 0


def _fsdp_devices(args: Args, compile_at, capacity: int) -> None:
  """Prints the fewest devices (powers of two) whose FSDP-split step fits, each at
  `--batch_size` sequences per device."""
  n = max(2, (args.num_devices or 1) * 2)
  while n <= args.max_devices:
    try:
      devices = gpu_plan.target_devices(args.gpu, n)
      program = compile_at(args.batch_size * n, on=devices, fsdp=True)
    except ValueError as e:
      errors.fail(e, args)
    fits = program.peak_bytes <= capacity
    print(f"with FSDP over {n} x {args.gpu} (batch {args.batch_size} per device): planned "
          f"peak per device {_gib(program.peak_bytes)}: {'fits' if fits else 'does NOT fit'}")
    if fits:
      print(f"needs {n} x {args.gpu} with FSDP (the fewest power of two that fits)")
      return
    n *= 2
  print(f"does not fit on up to {args.max_devices} x {args.gpu} with FSDP at batch "
        f"{args.batch_size} per device")


def run(argv: Sequence[str]) -> int:
  """`python -m purejax.plan` with `argv` (the program's name first): the exit code."""
  return command.run(argv, define_flags, plan, usage=__doc__)


def main() -> None:
  command.main(run)


if __name__ == "__main__":
  main()

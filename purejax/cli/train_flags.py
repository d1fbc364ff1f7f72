"""The flags of `python -m purejax.train`, per model, defaulting to the library's recipes.

Each model defines its own flags, with defaults taken from the library's
recipes (`loop.SHAKESPEARE_CHAR`, `loop.GPT_OPTIMIZER`, `loop.GPTTrainConfig`,
and `mlp_loop`'s), so `--help` lists only the chosen model's flags and every
default lives in one place. Every function defines into the `args` it is
given (a fresh `flags.FlagValues` per command line, `command.parse`).
"""

from typing import Sequence

from absl import flags

from purejax import gpt
from purejax import lora
from purejax.cli import forms_flags
from purejax.data import datasets as data_lib
from purejax.training import loop
from purejax.training import mlp_loop
from purejax.training import muon
from purejax.training import optim

MODELS = ("gpt", "mlp")


def define_common_flags(args: flags.FlagValues, model: str) -> None:
  """Flags every model has: the run directory, checkpoints, devices and hosts."""
  flags.DEFINE_enum("model", model, list(MODELS), "Which model to train (each has its "
                    "own flags: --model=mlp --help lists the MLP's).", flag_values=args)
  flags.DEFINE_integer("seed", 0, "Seed of the run's PRNG key.", flag_values=args)
  flags.DEFINE_string("out_dir", f"out-{model}", "Run directory for checkpoints.", flag_values=args)
  flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept in --out_dir.", flag_values=args)
  flags.DEFINE_bool("resume", False, "Resume from the latest valid checkpoint in --out_dir.",
                    flag_values=args)
  flags.DEFINE_bool("progress", None, "A live progress bar (default: on a terminal).",
                    flag_values=args)
  flags.DEFINE_bool("skip_nonfinite", False,
                    "Skip updates whose gradients are NaN/Inf instead of stopping.",
                    flag_values=args)
  flags.DEFINE_string("tfds_data_dir", None,
                      "TFDS data dir for prepared datasets (default: TFDS's).", flag_values=args)
  flags.DEFINE_string("tfds_manual_dir", None,
                      "Folder with the dataset's original files, for offline preparation "
                      "(MNIST: the four .gz files; Shakespeare defaults to the text in "
                      "the package).", flag_values=args)
  # Devices and hosts (see purejax/training/parallel.py).
  flags.DEFINE_integer("num_devices", None, "Devices to train on (default: all JAX sees).",
                       flag_values=args)
  flags.DEFINE_integer(
      "cpu_devices", None, "On a CPU: split the host into this many JAX devices and train "
      "data parallel across them (default: JAX's own count). One device per core is "
      "faster for small models (docs/performance.md). --batch_size must divide by it.",
      lower_bound=1, flag_values=args)
  flags.DEFINE_bool("fsdp", False, "Split params and optimizer state across the devices "
                    "(FSDP / ZeRO-3); default: replicate them.", flag_values=args)
  flags.DEFINE_integer("grad_accum_steps", 1, "Microbatches per optimisation step; "
                       "--batch_size is the global batch and must divide by devices x this.",
                       flag_values=args)
  flags.DEFINE_string("coordinator_address", None, "Multi-host: HOST:PORT of process 0's "
                      "coordinator (or set JAX_COORDINATOR_ADDRESS, or run under a "
                      "cluster JAX detects).", flag_values=args)
  flags.DEFINE_integer("num_processes", None, "Multi-host: processes in the run.", flag_values=args)
  flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.", flag_values=args)


def define_optimizer_flags(args: flags.FlagValues, defaults: optim.OptimizerConfig) -> None:
  """Optimizer flags, defaulting to the model's recipe."""
  flags.DEFINE_enum("optimizer", defaults.name, list(optim.OPTIMIZERS), "Optimizer.",
                    flag_values=args)
  flags.DEFINE_float("learning_rate", defaults.learning_rate, "Peak learning rate.",
                     flag_values=args)
  flags.DEFINE_enum("lr_schedule", defaults.schedule, list(optim.SCHEDULES),
                    "Warmup + cosine decay; warmup, the peak held, then a linear decay over "
                    "the last --warmdown_frac of the steps (nanochat's); or constant.",
                    flag_values=args)
  flags.DEFINE_float("min_lr", defaults.min_lr, "Learning rate at the end of the decay.",
                     flag_values=args)
  flags.DEFINE_float("warmdown_frac", defaults.warmdown_frac, "--lr_schedule=warmdown: the "
                     "fraction of the steps the linear decay takes, in (0, 1].",
                     flag_values=args)
  flags.DEFINE_integer("warmup_iters", defaults.warmup_iters, "Linear warmup steps.",
                       flag_values=args)
  flags.DEFINE_integer("lr_decay_iters", None,
                       "Step where the decay ends (default: the run's last step).",
                       flag_values=args)
  flags.DEFINE_float("beta2", defaults.beta2, "Adam's second-moment decay.", flag_values=args)
  flags.DEFINE_float("weight_decay", defaults.weight_decay, "AdamW decay (matrices only).",
                     flag_values=args)
  flags.DEFINE_float("grad_clip", defaults.grad_clip, "Global gradient-norm clip (0: off).",
                     flag_values=args)
  # Muon trains the GPT blocks' matrices with these; the other params take AdamW's flags.
  flags.DEFINE_float("muon_learning_rate", defaults.muon_learning_rate, "--optimizer=muon: "
                     "peak rate of the blocks' matrices (on --lr_schedule's shape).",
                     flag_values=args)
  flags.DEFINE_float("muon_momentum", defaults.muon_momentum, "--optimizer=muon: Nesterov "
                     "momentum of the blocks' matrices.", flag_values=args)
  flags.DEFINE_float("muon_weight_decay", defaults.muon_weight_decay, "--optimizer=muon: "
                     "decay of the blocks' matrices (times their rate).", flag_values=args)
  flags.DEFINE_integer("muon_ns_steps", defaults.muon_ns_steps, "--optimizer=muon: "
                       "Newton-Schulz steps of each orthogonalisation.", flag_values=args)
  flags.DEFINE_integer("muon_momentum_warmup_iters", defaults.muon_momentum_warmup_iters,
                       "--optimizer=muon: steps over which the momentum rises linearly from "
                       "--muon_momentum_start to --muon_momentum (0: none).", flag_values=args)
  flags.DEFINE_float("muon_momentum_start", defaults.muon_momentum_start, "--optimizer=muon: "
                     "the momentum warmup's first momentum.", flag_values=args)
  flags.DEFINE_enum("muon_ns_coeffs", defaults.muon_ns_coeffs, list(muon.NS_COEFFICIENTS),
                    "--optimizer=muon: each Newton-Schulz step's quintic: keller (the "
                    "reference's) or minimax (as orthogonal in 4 steps as keller in 5).",
                    flag_values=args)
  flags.DEFINE_bool("muon_split_qkv", defaults.muon_split_qkv, "--optimizer=muon: "
                    "orthogonalise the attention's fused query/key/value weight as its three "
                    "matrices (false: as one).", flag_values=args)


def define_gpt_flags(args: flags.FlagValues) -> None:
  """The GPT's flags (nanoGPT's names), defaulting to nanoGPT's CPU recipe."""
  model, train = loop.SHAKESPEARE_CHAR, loop.GPTTrainConfig()
  define_optimizer_flags(args, loop.GPT_OPTIMIZER)
  flags.DEFINE_integer("batch_size", train.batch_size, "Sequences per step.", flag_values=args)
  flags.DEFINE_enum("arch", "gpt2", list(gpt.ARCHITECTURES),
                    "The block: gpt2 (LayerNorm, learned positions, GELU), llama (RMSNorm, "
                    "RoPE, SwiGLU, no biases) or nanochat (parameter-free RMSNorm, RoPE, "
                    "QK-norm, ReLU^2, value embeddings, soft-capped logits, untied head); "
                    "see gpt.ARCHITECTURES.", flag_values=args)
  flags.DEFINE_integer("depth", None, "Blocks; sets --n_layer, --n_embd and --n_head by "
                       "nanochat's rule (width = depth * 64 rounded up to whole 128-wide "
                       "heads) and scales --learning_rate and --min_lr by (width / 768) ** "
                       "-0.5, so they are the rates at width 768.", lower_bound=1,
                       flag_values=args)
  flags.DEFINE_integer("n_kv_head", None, "Key/value heads, dividing --n_head (grouped-"
                       "query attention; 1: multi-query). Default: --n_head.", flag_values=args)
  flags.DEFINE_integer("n_layer", model.n_layer, "Transformer blocks.", flag_values=args)
  flags.DEFINE_integer("n_head", model.n_head, "Attention heads.", flag_values=args)
  flags.DEFINE_integer("n_embd", model.n_embd, "Model width.", flag_values=args)
  flags.DEFINE_integer("block_size", model.block_size, "Context length.", flag_values=args)
  flags.DEFINE_float("dropout", model.dropout, "Dropout rate in [0, 1) (a --sweep of "
                     "dropout replaces it).", flag_values=args)
  flags.DEFINE_bool("bias", model.bias, "Biases in dense layers and LayerNorms "
                    "(nanoGPT's train.py default: off; GPT-2 has them).", flag_values=args)
  flags.DEFINE_enum("dtype", model.compute_dtype, ["float32", "bfloat16"],
                    "Matmul dtype; params stay float32.", flag_values=args)
  forms_flags.define_forms_flags(args)
  flags.DEFINE_integer("max_iters", train.max_iters, "Training steps.", flag_values=args)
  flags.DEFINE_integer("eval_interval", train.eval_interval, "Steps between evaluations.",
                       flag_values=args)
  flags.DEFINE_integer("eval_iters", train.eval_iters, "Batches per evaluation.", flag_values=args)
  flags.DEFINE_integer("log_interval", train.log_interval, "Steps between loss logs.",
                       flag_values=args)
  flags.DEFINE_integer("steps_per_call", train.steps_per_call,
                       "Optimisation steps fused into one jitted call.", flag_values=args)
  flags.DEFINE_integer("checkpoint_every", None,
                       "Steps between checkpoints (default: --eval_interval).", flag_values=args)
  flags.DEFINE_integer("sample_tokens", train.sample_tokens,
                       "Tokens sampled at the end (0: none).", flag_values=args)
  flags.DEFINE_bool("always_save_checkpoint", train.always_save_checkpoint,
                    "False also keeps the checkpoint of the lowest val loss "
                    "(ckpt_best.npz), beside the --keep_checkpoints newest.", flag_values=args)
  flags.DEFINE_bool("eval_only", False, "Evaluate the newest checkpoint in --out_dir (or "
                    "--init_from's model) on --eval_iters batches, and exit.", flag_values=args)
  flags.DEFINE_enum("eval_checkpoint", "latest", ["latest", "best"],
                    "Which checkpoint --eval_only evaluates.", flag_values=args)
  flags.DEFINE_list("profile_steps", None, "A,B: a jax.profiler trace of steps A to B, "
                    "into --out_dir/profile (TensorBoard's profile plugin).", flag_values=args)
  flags.DEFINE_float("peak_flops", None, "One device's peak FLOP/s for the logged MFU "
                     "(default: known GPUs and TPUs; none on CPUs).", flag_values=args)
  # Data and weights.
  flags.DEFINE_string("dataset", "tiny_shakespeare",
                      "A TFDS name with a text feature, a .txt file or folder of them, or "
                      "a nanoGPT folder (train.bin/val.bin, optional meta.pkl).", flag_values=args)
  flags.DEFINE_enum("tokenizer", None, ["char", "gpt2"],
                    "Tokenizer (default: the data's own: characters for text, meta.pkl "
                    "or GPT-2 BPE for .bin folders, the model's with --init_from).",
                    flag_values=args)
  flags.DEFINE_string("tokenizer_file", None, "A tokenizer.json to train on (python -m "
                      "purejax.tokenizer --train makes one); a local copy of GPT-2's "
                      "encoding: a folder with vocab.bpe and encoder.json, or a .tiktoken "
                      "file; or where an --init_from model's tokenizer.json is now.",
                      flag_values=args)
  flags.DEFINE_string("cache_dir", None, "Where tokenized text is cached (default: "
                      "$PUREJAX_CACHE_DIR or ~/.cache/purejax).", flag_values=args)
  flags.DEFINE_string("init_from", None, "Start from pretrained weights: gpt2, gpt2-medium, "
                      "gpt2-large, gpt2-xl, a Hugging Face folder (GPT-2, Llama, Mistral, "
                      "Qwen2) or Hub id OWNER/MODEL in its cache, a nanoGPT ckpt.pt, or a "
                      "purejax run directory. The model flags then come from it.", flag_values=args)
  # Fine-tuning with LoRA, sweeps, Weights & Biases.
  flags.DEFINE_integer("lora_rank", 0, "Train rank-r LoRA adapters of the weights instead "
                       "of the weights (0: off); usually with --init_from.", flag_values=args)
  flags.DEFINE_float("lora_alpha", None, "LoRA's scale numerator: updates are scaled by "
                     "alpha / rank (default: the rank, a scale of 1).", flag_values=args)
  flags.DEFINE_list("lora_targets", list(lora.ATTENTION_AND_MLP), "Patterns of the weights "
                    "LoRA adapts, over dotted param paths (e.g. *attn.qkv.w,*mlp.fc.w).",
                    flag_values=args)
  flags.DEFINE_string("sweep", None, "Train several runs in one program: NAME=V1,V2,... "
                      "of optimizer settings or dropout, ';' between names (e.g. "
                      "'learning_rate=3e-4,1e-3;dropout=0,0.1'); each run gets "
                      "--out_dir/<run name>. A swept dropout replaces --dropout.", flag_values=args)
  flags.DEFINE_integer("sweep_seeds", 1, "Seeds per sweep setting: --seed, --seed+1, ... "
                       "(without --sweep: a sweep of seeds alone).", lower_bound=1,
                       flag_values=args)
  flags.DEFINE_bool("wandb_log", False, "Log the metrics to Weights & Biases too "
                    "(pip install wandb).", flag_values=args)
  flags.DEFINE_string("wandb_project", "purejax", "W&B project.", flag_values=args)
  flags.DEFINE_string("wandb_run_name", None, "W&B run name (a sweep's runs add theirs).",
                      flag_values=args)


def define_mlp_flags(args: flags.FlagValues) -> None:
  """The MNIST MLP's flags, defaulting to its default recipe."""
  train = mlp_loop.MLPTrainConfig()
  define_optimizer_flags(args, mlp_loop.MLP_OPTIMIZER)
  flags.DEFINE_integer("batch_size", train.batch_size, "Examples per step.", flag_values=args)
  flags.DEFINE_list("layer_sizes", ",".join(map(str, train.layer_sizes)), "Layer widths.",
                    flag_values=args)
  flags.DEFINE_float("init_scale", train.init_scale, "Std of the initial params.", flag_values=args)
  flags.DEFINE_integer("epochs", train.epochs, "Training epochs.", flag_values=args)
  flags.DEFINE_integer("checkpoint_every", train.checkpoint_every, "Epochs between checkpoints.",
                       flag_values=args)
  flags.DEFINE_enum("mnist_pixels", "unit", list(data_lib.PIXEL_RANGES),
                    "Input scale: 'unit' = [0, 1]; 'raw' = 0..255 as in JAX's TFDS tutorial.",
                    flag_values=args)


def model_from_argv(argv: Sequence[str]) -> str:
  """The `--model` value in `argv` (default "gpt"), read before flags are defined."""
  for i, arg in enumerate(argv[1:], start=1):
    if arg.startswith("--model="):
      return arg.split("=", 1)[1]
    if arg == "--model" and i + 1 < len(argv):
      return argv[i + 1]
  return "gpt"


def define_flags(args: flags.FlagValues, model: str) -> None:
  """The flags of `model` (an unknown model gets the common flags, and --model refuses it)."""
  define_common_flags(args, model if model in MODELS else "gpt")
  {"gpt": define_gpt_flags, "mlp": define_mlp_flags}.get(model, lambda _: None)(args)

"""The flags of `python -m purejax.train`, per model, defaulting to the library's recipes.

Each model defines its own flags, with defaults taken from the library's
recipes (the GPT's `--recipe`, `recipes.RECIPES`: its block, optimizer and
steps over `recipes.SHAKESPEARE_CHAR`'s shape and `gpt_loop.GPTTrainConfig`; the
MLP's `mlp_loop` defaults), so `--help` lists only the chosen model's flags
with the chosen recipe's defaults, and every default lives in one place. Every
field of `gpt.GPTConfig` that is model math has a flag: the block's options
are derived from the dataclass (flag name = field name, help = its docstring),
defaulting to the recipe's block (None: the `--arch`'s). Every function defines
into the `args` it is given (a fresh `flags.FlagValues` per command line,
`command.parse`).
"""

import dataclasses
import typing
from typing import Sequence

from absl import flags

from purejax import _docstrings
from purejax import gpt
from purejax import lora
from purejax.cli import forms_flags
from purejax.data import datasets as data_lib
from purejax.ops import quant
from purejax.optimizers import optim
from purejax.optimizers import registry
from purejax.optimizers import settings as settings_lib
from purejax.training.loops import gpt_loop
from purejax.training.loops import mlp_loop
from purejax.training.loops import recipes
from purejax.training.pure import preference

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
  # Devices and hosts (see purejax/training/pure/parallel.py).
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


def define_settings_flags(args: flags.FlagValues, defaults: optim.OptimizerConfig) -> None:
  """A flag per optimizer setting of every registered optimizer, derived from its
  settings class (flag name = flat name, help = its docstring, the optimizer that
  reads it named), defaulting to `defaults`' value where its optimizer has the
  setting, else to the settings class's."""
  own = settings_lib.to_flat(defaults.settings)
  docs, choices = {}, {}
  for entry in registry.OPTIMIZERS.values():
    docs.update({k: v for k, v in settings_lib.field_docs(entry.settings).items()
                 if k not in docs})
    choices.update(settings_lib.choices(entry.settings))
  for flat, default in optim.all_settings().items():
    value = own.get(flat, default)
    help_text = f"--optimizer={'/'.join(optim.readers_of(flat))}: {docs.get(flat, flat)}"
    if flat in choices:
      flags.DEFINE_enum(flat, value, list(choices[flat]), help_text, flag_values=args)
      continue
    define = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float,
              str: flags.DEFINE_string}[type(default)]
    define(flat, value, help_text, flag_values=args)


def define_optimizer_flags(args: flags.FlagValues, defaults: optim.OptimizerConfig) -> None:
  """Optimizer flags, defaulting to the model's recipe: those every optimizer shares
  (nanoGPT's names), then every optimizer's own settings (`define_settings_flags`)."""
  flags.DEFINE_enum("optimizer", defaults.name, list(optim.OPTIMIZERS), "Optimizer: " + "; ".join(
      f"{name}: {entry.summary}" for name, entry in registry.OPTIMIZERS.items()) + ".",
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
  flags.DEFINE_float("grad_clip", defaults.grad_clip, "Global gradient-norm clip (0: off).",
                     flag_values=args)
  define_settings_flags(args, defaults)


# GPTConfig fields set by a flag of another kind: the data's tokenizer gives the
# vocabulary, and RoPE scaling (a dict) comes with pretrained weights.
NOT_FLAGS = ("vocab_size", "rope_scaling")
# GPTConfig fields whose flags are written by hand below (nanoGPT's names).
HAND_WRITTEN = {"block_size": "block_size", "n_layer": "n_layer", "n_head": "n_head",
                "n_embd": "n_embd", "dropout": "dropout", "bias": "bias",
                "n_kv_head": "n_kv_head", "compute_dtype": "dtype"}


def block_field_flags() -> Sequence[str]:
  """The GPTConfig fields with a flag of their own name, derived from the dataclass."""
  return [f.name for f in dataclasses.fields(gpt.GPTConfig)
          if f.name not in NOT_FLAGS and f.name not in HAND_WRITTEN]


def _define_field_flag(args: flags.FlagValues, field: dataclasses.Field, default, help_text):
  kind = field.type
  if typing.get_origin(kind) is typing.Union:  # Optional[X]
    kind = next(a for a in typing.get_args(kind) if a is not type(None))
  define = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float,
            str: flags.DEFINE_string}[kind]
  define(field.name, default, help_text, flag_values=args)


def define_block_flags(args: flags.FlagValues, recipe: recipes.Recipe) -> None:
  """A flag per GPTConfig option of the block (`block_field_flags`), defaulting to the
  recipe's block; None (unset) leaves the option to `--arch`."""
  docs = _docstrings.attributes(gpt.GPTConfig.__doc__)
  fields = {f.name: f for f in dataclasses.fields(gpt.GPTConfig)}
  for name in block_field_flags():
    default = recipe.block.get(name)
    _define_field_flag(args, fields[name], default,
                       f"GPTConfig.{name}: {docs[name]} (default: "
                       f"{'the recipe' if default is not None else '--arch'}'s).")


def recipe_from_argv(argv: Sequence[str]) -> str:
  """The `--recipe` value in `argv` (default `recipes.DEFAULT_RECIPE`), read before flags
  are defined (its settings are the flags' defaults)."""
  return _value_from_argv(argv, "recipe", recipes.DEFAULT_RECIPE)


def define_gpt_flags(args: flags.FlagValues, recipe_name: str = recipes.DEFAULT_RECIPE
                     ) -> None:
  """The GPT's flags (nanoGPT's names), defaulting to the recipe's settings."""
  known = recipe_name in recipes.RECIPES  # an unknown one: --recipe's enum refuses it
  recipe = recipes.RECIPES[recipe_name if known else recipes.DEFAULT_RECIPE]
  model, train = recipes.SHAKESPEARE_CHAR, gpt_loop.GPTTrainConfig()
  flags.DEFINE_enum("recipe", recipe_name if known else recipes.DEFAULT_RECIPE,
                    list(recipes.RECIPES),
                    "Named settings of the block, optimizer and steps, as the flags' "
                    "defaults (any flag still overrides one): " + "; ".join(
                        f"{name}: {r.summary}" for name, r in recipes.RECIPES.items()) + ".",
                    flag_values=args)
  define_optimizer_flags(args, recipe.optimizer)
  flags.DEFINE_integer("batch_size", train.batch_size, "Sequences per step.", flag_values=args)
  flags.DEFINE_enum("arch", recipe.arch, list(gpt.ARCHITECTURES),
                    "The block: gpt2 (LayerNorm, learned positions, GELU), llama (RMSNorm, "
                    "RoPE, SwiGLU, no biases), nanochat (parameter-free RMSNorm, RoPE, "
                    "QK-norm, ReLU^2, value embeddings, soft-capped logits, untied head; "
                    "--window_pattern=SSSL gives its sliding windows, the last layer "
                    "global, half the context wide unless --window says) or gemma3 (five "
                    "sliding-window layers of --window=512 per global one, Gemma's norms, "
                    "scaled QK-norm, GeGLU, RoPE bases 1e4 local and 1e6 global); see "
                    "gpt.ARCHITECTURES.", flag_values=args)
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
  define_block_flags(args, recipe)
  forms_flags.define_forms_flags(args)
  flags.DEFINE_integer("max_iters", recipe.max_iters, "Training steps.", flag_values=args)
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
                      "A TFDS name with a text feature, a .txt file or folder of them, "
                      "a nanoGPT folder (train.bin/val.bin, optional meta.pkl), a .jsonl "
                      "of conversations ({\"messages\": [...]}, with --init_from), or a "
                      ".jsonl of preference pairs ({\"prompt\", \"chosen\", "
                      "\"rejected\"}: DPO, with --init_from).", flag_values=args)
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
  # Preference tuning (DPO), when --dataset holds preference pairs.
  dpo = preference.DPO()
  flags.DEFINE_float("dpo_beta", dpo.beta, "DPO's beta: the implicit reward's scale "
                     "(larger keeps the model nearer the one it starts from).", flag_values=args)
  flags.DEFINE_enum("dpo_loss", dpo.loss_type, list(preference.DPO_LOSSES),
                    "DPO's loss: sigmoid (DPO) or ipo.", flag_values=args)
  flags.DEFINE_float("dpo_label_smoothing", dpo.label_smoothing, "The chance a pair's "
                     "label is wrong, in [0, 0.5) (conservative DPO; sigmoid only).",
                     flag_values=args)
  flags.DEFINE_float("dpo_sft_weight", dpo.sft_weight, "Adds this times the chosen "
                     "answers' NLL per token to DPO's loss (TRL's \"sft\" loss type; 0: off).",
                     flag_values=args)
  # Fine-tuning with LoRA, sweeps, Weights & Biases.
  flags.DEFINE_integer("lora_rank", 0, "Train rank-r LoRA adapters of the weights instead "
                       "of the weights (0: off); usually with --init_from.", flag_values=args)
  flags.DEFINE_float("lora_alpha", None, "LoRA's scale numerator: updates are scaled by "
                     "alpha / rank (default: the rank, a scale of 1).", flag_values=args)
  define_held_base_flag(args)
  flags.DEFINE_list("lora_targets", list(lora.ATTENTION_AND_MLP), "Patterns of the weights "
                    "LoRA adapts, over dotted param paths (e.g. *attn.qkv.w,*mlp.fc.w).",
                    flag_values=args)
  flags.DEFINE_list("eval_tasks", None, "Benchmark task files (.jsonl items or .json specs, "
                    "docs/evaluation.md) scored at every evaluation beside the loss.",
                    flag_values=args)
  flags.DEFINE_integer("eval_tasks_limit", None, "Score only each --eval_tasks task's first "
                       "N items.", lower_bound=1, flag_values=args)
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


def _value_from_argv(argv: Sequence[str], name: str, default: str) -> str:
  for i, arg in enumerate(argv[1:], start=1):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return default


def model_from_argv(argv: Sequence[str]) -> str:
  """The `--model` value in `argv` (default "gpt"), read before flags are defined."""
  return _value_from_argv(argv, "model", "gpt")


def define_flags(args: flags.FlagValues, model: str,
                 recipe: str = recipes.DEFAULT_RECIPE) -> None:
  """The flags of `model` (an unknown model gets the common flags, and --model refuses it);
  the GPT's defaults are `recipe`'s (an unknown one: the default's, and --recipe refuses it)."""
  define_common_flags(args, model if model in MODELS else "gpt")
  if model == "gpt":
    define_gpt_flags(args, recipe)
  elif model == "mlp":
    define_mlp_flags(args)


def define_held_base_flag(args: flags.FlagValues) -> None:
  """`--quantize`: how a LoRA run holds its frozen base (`held_base`)."""
  flags.DEFINE_enum("quantize", None, [*quant.FORMATS, "gguf", "bfloat16", "float32"],
                    "How a LoRA run holds its frozen base's dense matrices: quantized "
                    "(int8, q8_0, q4_1; gguf: a .gguf --init_from's own blocks; QLoRA), in "
                    "bfloat16 (what bfloat16 products read of them anyway; the default "
                    "under --dtype=bfloat16), or in float32 (the default under float32 "
                    "matmuls). Needs --lora_rank.", flag_values=args)


def held_base(args) -> typing.Optional[str]:
  """How a LoRA run holds its frozen base (`quant.hold_matrices`): `--quantize`, else in
  bfloat16 under `--dtype=bfloat16` (the dtype its products read it in); None: float32,
  as loaded."""
  if args.quantize is None and args.lora_rank and args.dtype == "bfloat16":
    return "bfloat16"
  return None if args.quantize == "float32" else args.quantize

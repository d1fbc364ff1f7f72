r"""Trains a purejax model from the command line.

    python -m purejax.train                       # NanoGPT on Tiny Shakespeare
    python -m purejax.train --model=mlp --tfds_manual_dir=/path/to/mnist
    python -m purejax.train --model=mlp --help    # the MLP's flags

This file only parses flags: it turns them into the library's configs and
calls `loop.train_gpt` or `mlp_loop.train_mlp`. Each model defines its own flags,
with defaults taken from the library's recipes (`loop.SHAKESPEARE_CHAR`,
`loop.GPT_OPTIMIZER`, `loop.GPTTrainConfig`, and `mlp_loop`'s), so `--help`
lists only the chosen model's flags and every default lives in one place.
Bad values stop the run at once with a one-line message naming the flag.
"""

import json
import os
import sys
import dataclasses
from typing import List, Optional

from absl import app
from absl import flags
from absl import logging

from purejax import _cli
from purejax import _forms_flags
from purejax.training import checkpoint
from purejax import weights
from purejax.data import corpus as corpus_lib
from purejax.data import datasets as data_lib
from purejax import gpt
from purejax import lora
from purejax.training import loop
from purejax.training import mlp_loop
from purejax.training import nonfinite
from purejax.training import optim
from purejax.training import parallel
from purejax.training import runs
from purejax.training import sweep
from purejax.training import sweep_loop
from purejax.training import wandb_sink
from purejax.training import signals
from purejax.data import tokenizers

FLAGS = flags.FLAGS
MODELS = ("gpt", "mlp")

# Exit codes (documented in the README).
EXIT_ERROR = 1            # bad flags, missing data, unusable checkpoint
EXIT_NONFINITE = 2        # loss became NaN/Inf; the last checkpoint is intact
# SIGINT / SIGTERM: a checkpoint is saved, then exit 128 + signal (130 / 143).


def define_common_flags(model: str) -> None:
  """Flags every model has: the run directory, checkpoints, devices and hosts."""
  flags.DEFINE_enum("model", model, list(MODELS), "Which model to train (each has its "
                    "own flags: --model=mlp --help lists the MLP's).")
  flags.DEFINE_integer("seed", 0, "Seed of the run's PRNG key.")
  flags.DEFINE_string("out_dir", f"out-{model}", "Run directory for checkpoints.")
  flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept in --out_dir.")
  flags.DEFINE_bool("resume", False, "Resume from the latest valid checkpoint in --out_dir.")
  flags.DEFINE_bool("progress", None, "A live progress bar (default: on a terminal).")
  flags.DEFINE_bool("skip_nonfinite", False,
                    "Skip updates whose gradients are NaN/Inf instead of stopping.")
  flags.DEFINE_string("tfds_data_dir", None,
                      "TFDS data dir for prepared datasets (default: TFDS's).")
  flags.DEFINE_string("tfds_manual_dir", None,
                      "Folder with the dataset's original files, for offline preparation "
                      "(MNIST: the four .gz files; Shakespeare defaults to the text in "
                      "the package).")
  # Devices and hosts (see purejax/training/parallel.py).
  flags.DEFINE_integer("num_devices", None, "Devices to train on (default: all JAX sees).")
  flags.DEFINE_integer(
      "cpu_devices", None, "On a CPU: split the host into this many JAX devices and train "
      "data parallel across them (default: JAX's own count). One device per core is "
      "faster for small models (docs/performance.md). --batch_size must divide by it.",
      lower_bound=1)
  flags.DEFINE_bool("fsdp", False, "Split params and optimizer state across the devices "
                    "(FSDP / ZeRO-3); default: replicate them.")
  flags.DEFINE_integer("grad_accum_steps", 1, "Microbatches per optimisation step; "
                       "--batch_size is the global batch and must divide by devices x this.")
  flags.DEFINE_string("coordinator_address", None, "Multi-host: HOST:PORT of process 0's "
                      "coordinator (or set JAX_COORDINATOR_ADDRESS, or run under a "
                      "cluster JAX detects).")
  flags.DEFINE_integer("num_processes", None, "Multi-host: processes in the run.")
  flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")


def define_optimizer_flags(defaults: optim.OptimizerConfig) -> None:
  """Optimizer flags, defaulting to the model's recipe."""
  flags.DEFINE_enum("optimizer", defaults.name, list(optim.OPTIMIZERS), "Optimizer.")
  flags.DEFINE_float("learning_rate", defaults.learning_rate, "Peak learning rate.")
  flags.DEFINE_enum("lr_schedule", defaults.schedule, ["cosine", "constant"],
                    "Warmup + cosine decay, or constant.")
  flags.DEFINE_float("min_lr", defaults.min_lr, "Learning rate at the end of the cosine.")
  flags.DEFINE_integer("warmup_iters", defaults.warmup_iters, "Linear warmup steps.")
  flags.DEFINE_integer("lr_decay_iters", None,
                       "Step where the cosine ends (default: the run's last step).")
  flags.DEFINE_float("beta2", defaults.beta2, "Adam's second-moment decay.")
  flags.DEFINE_float("weight_decay", defaults.weight_decay, "AdamW decay (matrices only).")
  flags.DEFINE_float("grad_clip", defaults.grad_clip, "Global gradient-norm clip (0: off).")


def define_gpt_flags() -> None:
  """The GPT's flags (nanoGPT's names), defaulting to nanoGPT's CPU recipe."""
  model, train = loop.SHAKESPEARE_CHAR, loop.GPTTrainConfig()
  define_optimizer_flags(loop.GPT_OPTIMIZER)
  flags.DEFINE_integer("batch_size", train.batch_size, "Sequences per step.")
  flags.DEFINE_enum("arch", "gpt2", list(gpt.ARCHITECTURES),
                    "The block: gpt2 (LayerNorm, learned positions, GELU) or llama (RMSNorm, "
                    "RoPE, SwiGLU, no biases); see gpt.ARCHITECTURES.")
  flags.DEFINE_integer("n_kv_head", None, "Key/value heads, dividing --n_head (grouped-"
                       "query attention; 1: multi-query). Default: --n_head.")
  flags.DEFINE_integer("n_layer", model.n_layer, "Transformer blocks.")
  flags.DEFINE_integer("n_head", model.n_head, "Attention heads.")
  flags.DEFINE_integer("n_embd", model.n_embd, "Model width.")
  flags.DEFINE_integer("block_size", model.block_size, "Context length.")
  flags.DEFINE_float("dropout", model.dropout, "Dropout rate in [0, 1) (a --sweep of "
                     "dropout replaces it).")
  flags.DEFINE_bool("bias", model.bias, "Biases in dense layers and LayerNorms "
                    "(nanoGPT's train.py default: off; GPT-2 has them).")
  flags.DEFINE_enum("dtype", model.compute_dtype, ["float32", "bfloat16"],
                    "Matmul dtype; params stay float32.")
  _forms_flags.define_forms_flags()
  flags.DEFINE_integer("max_iters", train.max_iters, "Training steps.")
  flags.DEFINE_integer("eval_interval", train.eval_interval, "Steps between evaluations.")
  flags.DEFINE_integer("eval_iters", train.eval_iters, "Batches per evaluation.")
  flags.DEFINE_integer("log_interval", train.log_interval, "Steps between loss logs.")
  flags.DEFINE_integer("steps_per_call", train.steps_per_call,
                       "Optimisation steps fused into one jitted call.")
  flags.DEFINE_integer("checkpoint_every", None,
                       "Steps between checkpoints (default: --eval_interval).")
  flags.DEFINE_integer("sample_tokens", train.sample_tokens,
                       "Tokens sampled at the end (0: none).")
  flags.DEFINE_bool("always_save_checkpoint", train.always_save_checkpoint,
                    "False also keeps the checkpoint of the lowest val loss "
                    "(ckpt_best.npz), beside the --keep_checkpoints newest.")
  flags.DEFINE_bool("eval_only", False, "Evaluate the newest checkpoint in --out_dir (or "
                    "--init_from's model) on --eval_iters batches, and exit.")
  flags.DEFINE_enum("eval_checkpoint", "latest", ["latest", "best"],
                    "Which checkpoint --eval_only evaluates.")
  flags.DEFINE_list("profile_steps", None, "A,B: a jax.profiler trace of steps A to B, "
                    "into --out_dir/profile (TensorBoard's profile plugin).")
  flags.DEFINE_float("peak_flops", None, "One device's peak FLOP/s for the logged MFU "
                     "(default: known GPUs and TPUs; none on CPUs).")
  # Data and weights.
  flags.DEFINE_string("dataset", "tiny_shakespeare",
                      "A TFDS name with a text feature, a .txt file or folder of them, or "
                      "a nanoGPT folder (train.bin/val.bin, optional meta.pkl).")
  flags.DEFINE_enum("tokenizer", None, ["char", "gpt2"],
                    "Tokenizer (default: the data's own: characters for text, meta.pkl "
                    "or GPT-2 BPE for .bin folders, the model's with --init_from).")
  flags.DEFINE_string("tokenizer_file", None, "A local copy of GPT-2's encoding: a folder "
                      "with vocab.bpe and encoder.json, or a .tiktoken file; or where an "
                      "--init_from model's tokenizer.json is now.")
  flags.DEFINE_string("cache_dir", None, "Where tokenized text is cached (default: "
                      "$PUREJAX_CACHE_DIR or ~/.cache/purejax).")
  flags.DEFINE_string("init_from", None, "Start from pretrained weights: gpt2, gpt2-medium, "
                      "gpt2-large, gpt2-xl, a Hugging Face folder (GPT-2, Llama, Mistral, "
                      "Qwen2) or Hub id OWNER/MODEL in its cache, a nanoGPT ckpt.pt, or a "
                      "purejax run directory. The model flags then come from it.")
  # Fine-tuning with LoRA, sweeps, Weights & Biases.
  flags.DEFINE_integer("lora_rank", 0, "Train rank-r LoRA adapters of the weights instead "
                       "of the weights (0: off); usually with --init_from.")
  flags.DEFINE_float("lora_alpha", None, "LoRA's scale numerator: updates are scaled by "
                     "alpha / rank (default: the rank, a scale of 1).")
  flags.DEFINE_list("lora_targets", list(lora.ATTENTION_AND_MLP), "Patterns of the weights "
                    "LoRA adapts, over dotted param paths (e.g. *attn.qkv.w,*mlp.fc.w).")
  flags.DEFINE_string("sweep", None, "Train several runs in one program: NAME=V1,V2,... "
                      "of optimizer settings or dropout, ';' between names (e.g. "
                      "'learning_rate=3e-4,1e-3;dropout=0,0.1'); each run gets "
                      "--out_dir/<run name>. A swept dropout replaces --dropout.")
  flags.DEFINE_integer("sweep_seeds", 1, "Seeds per sweep setting: --seed, --seed+1, ...")
  flags.DEFINE_bool("wandb_log", False, "Log the metrics to Weights & Biases too "
                    "(pip install wandb).")
  flags.DEFINE_string("wandb_project", "purejax", "W&B project.")
  flags.DEFINE_string("wandb_run_name", None, "W&B run name (a sweep's runs add theirs).")


def define_mlp_flags() -> None:
  """The MNIST MLP's flags, defaulting to its default recipe."""
  train = mlp_loop.MLPTrainConfig()
  define_optimizer_flags(mlp_loop.MLP_OPTIMIZER)
  flags.DEFINE_integer("batch_size", train.batch_size, "Examples per step.")
  flags.DEFINE_list("layer_sizes", ",".join(map(str, train.layer_sizes)), "Layer widths.")
  flags.DEFINE_float("init_scale", train.init_scale, "Std of the initial params.")
  flags.DEFINE_integer("epochs", train.epochs, "Training epochs.")
  flags.DEFINE_integer("checkpoint_every", train.checkpoint_every, "Epochs between checkpoints.")
  flags.DEFINE_enum("mnist_pixels", "unit", list(data_lib.PIXEL_RANGES),
                    "Input scale: 'unit' = [0, 1]; 'raw' = 0..255 as in JAX's TFDS tutorial.")


def model_from_argv(argv: List[str]) -> str:
  """The `--model` value in `argv` (default "gpt"), read before flags are defined."""
  for i, arg in enumerate(argv[1:], start=1):
    if arg.startswith("--model="):
      return arg.split("=", 1)[1]
    if arg == "--model" and i + 1 < len(argv):
      return argv[i + 1]
  return "gpt"


def define_flags(model: str) -> None:
  define_common_flags(model if model in MODELS else "gpt")
  {"gpt": define_gpt_flags, "mlp": define_mlp_flags}.get(model, lambda: None)()


# ----------------------------------------------------------------------------
# Flags -> configs


def optimizer_config(total_steps: Optional[int] = None) -> optim.OptimizerConfig:
  """The optimizer flags; the schedule ends at `--lr_decay_iters`, else `total_steps`
  (None: the training loop's choice, see `loop.train_gpt`)."""
  decay = FLAGS.lr_decay_iters if FLAGS.lr_decay_iters is not None else total_steps
  return optim.OptimizerConfig(
      name=FLAGS.optimizer, learning_rate=FLAGS.learning_rate, schedule=FLAGS.lr_schedule,
      warmup_iters=FLAGS.warmup_iters, decay_iters=decay,
      min_lr=FLAGS.min_lr, beta2=FLAGS.beta2, weight_decay=FLAGS.weight_decay,
      grad_clip=FLAGS.grad_clip)


def run_config() -> runs.RunConfig:
  return runs.RunConfig(out_dir=FLAGS.out_dir, resume=FLAGS.resume,
                        keep_checkpoints=FLAGS.keep_checkpoints,
                        skip_nonfinite=FLAGS.skip_nonfinite)


def parallel_config() -> parallel.ParallelConfig:
  return parallel.ParallelConfig(num_devices=FLAGS.num_devices, fsdp=FLAGS.fsdp,
                                 grad_accum_steps=FLAGS.grad_accum_steps)


# Flags that define the architecture: with --init_from it comes from the weights.
ARCHITECTURE_FLAGS = ("arch", "n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "bias")


def gpt_config(vocab_size: int, base: Optional[gpt.GPTConfig] = None) -> gpt.GPTConfig:
  """The model flags as a config; with `base` (pretrained), only the dtype and dropout flags."""
  tunable = dict(dropout=FLAGS.dropout, compute_dtype=FLAGS.dtype)
  if base is not None:
    return dataclasses.replace(base, **tunable)
  arch = dict(gpt.ARCHITECTURES[FLAGS.arch])
  if FLAGS["bias"].present or "bias" not in arch:
    arch["bias"] = FLAGS.bias
  return gpt.GPTConfig(vocab_size=vocab_size, block_size=FLAGS.block_size,
                       n_layer=FLAGS.n_layer, n_head=FLAGS.n_head, n_embd=FLAGS.n_embd,
                       n_kv_head=FLAGS.n_kv_head, **arch, **tunable)


def gpt_train_config() -> loop.GPTTrainConfig:
  profile = None
  if FLAGS.profile_steps:
    try:
      profile = tuple(int(s) for s in FLAGS.profile_steps)
      assert len(profile) == 2
    except (ValueError, AssertionError):
      raise ValueError(f"--profile_steps must be two steps A,B, got "
                       f"{','.join(FLAGS.profile_steps)}.") from None
  return loop.GPTTrainConfig(
      batch_size=FLAGS.batch_size, max_iters=FLAGS.max_iters,
      eval_interval=FLAGS.eval_interval, eval_iters=FLAGS.eval_iters,
      log_interval=FLAGS.log_interval, steps_per_call=FLAGS.steps_per_call,
      checkpoint_every=FLAGS.checkpoint_every,
      always_save_checkpoint=FLAGS.always_save_checkpoint,
      sample_tokens=FLAGS.sample_tokens, seed=FLAGS.seed, profile_steps=profile,
      progress=FLAGS.progress, peak_flops=FLAGS.peak_flops)


def load_corpus(tokenizer) -> corpus_lib.Corpus:
  """`--dataset` through `--tokenizer` (or a model's own tokenizer), process 0 first."""
  # A model's own tokenizer was already built (with --tokenizer_file, if given).
  tokenizer_file = FLAGS.tokenizer_file if isinstance(tokenizer, (str, type(None))) else None
  return parallel.main_process_first(
      lambda: corpus_lib.load_corpus(
          FLAGS.dataset, tokenizer=tokenizer, tokenizer_file=tokenizer_file,
          cache_dir=FLAGS.cache_dir, tfds_data_dir=FLAGS.tfds_data_dir,
          tfds_manual_dir=FLAGS.tfds_manual_dir),
      errors=(ValueError, data_lib.DataUnavailableError))


def pretrained(source: str, best: bool = False):
  """`(params, config, tokenizer)` of `source` (see `weights.from_pretrained`)."""
  given = [name for name in ARCHITECTURE_FLAGS
             if FLAGS[name].present and name != "block_size"]
  if given:
    raise ValueError(f"--{given[0]} has no effect on weights from {source}: the "
                     f"architecture comes from the weights; drop --{given[0]}.")
  params, config, spec = (weights.from_purejax(source, best=best) if best else
                          weights.from_pretrained(source))
  if FLAGS["block_size"].present:  # a shorter context: RoPE models have no position table
    if config.position != "rope" or FLAGS.block_size > config.block_size:
      raise ValueError(f"--block_size={FLAGS.block_size}: {source} takes contexts up to "
                       f"{config.block_size}, and only a RoPE model's can be shortened; "
                       f"drop --block_size.")
    config = dataclasses.replace(config, block_size=FLAGS.block_size)
  if spec.kind == "ids":  # weights without a tokenizer: the user names one
    if FLAGS.tokenizer is None:
      raise ValueError(f"{source} records no tokenizer, only {spec.vocab_size} token "
                       f"ids; pass --tokenizer=char or --tokenizer=gpt2.")
    tokenizer = FLAGS.tokenizer
  else:
    tokenizer = tokenizers.from_spec(spec, encoding_file=FLAGS.tokenizer_file)
    if FLAGS.tokenizer is not None and FLAGS.tokenizer != tokenizer.name:
      raise ValueError(f"--tokenizer={FLAGS.tokenizer} does not fit {source}, whose "
                       f"tokenizer is {tokenizer.name}; drop --tokenizer.")
  return params, gpt_config(config.vocab_size, base=config), tokenizer


def train_gpt(run: runs.RunConfig, devices: parallel.ParallelConfig) -> dict:
  train = gpt_train_config()
  runs.require_positive(block_size=FLAGS.block_size)
  forms = _forms_flags.forms_from_flags()  # fails on bad forms flags before loading data
  sweep_batch = _forms_flags.sweep_batch_from_flags()
  if FLAGS.eval_only:
    return eval_gpt(run, train, devices, forms)
  init_params, init_from = None, FLAGS.init_from
  if init_from:
    init_params, config, tokenizer = pretrained(init_from)
  else:
    gpt_config(vocab_size=1)  # fail on bad model flags before loading data
    tokenizer = FLAGS.tokenizer
  lora_config = lora_flags()
  grid = sweep.parse_grid(FLAGS.sweep) if FLAGS.sweep is not None else None
  text = load_corpus(tokenizer)
  if not init_from:
    config = gpt_config(text.vocab_size)
  if grid is not None or FLAGS.sweep_seeds > 1:
    return {"runs": sweep_loop.train_gpt_sweep(
        config, text, train, optimizer_config(), run, grid or {}, FLAGS.sweep_seeds,
        devices, init_params=init_params, init_from=init_from, forms=forms,
        sweep_batch=sweep_batch, lora_config=lora_config, data=FLAGS.dataset,
        sinks=wandb_sinks)}
  return loop.train_gpt(config, text, train, optimizer_config(), run, devices,
                        init_params=init_params, init_from=init_from, forms=forms,
                        lora_config=lora_config, data=FLAGS.dataset,
                        sinks=wandb_sinks(None, {}))


def lora_flags() -> Optional[lora.LoraConfig]:
  if FLAGS.lora_rank == 0:
    return None
  return lora.LoraConfig(FLAGS.lora_rank, FLAGS.lora_alpha, tuple(FLAGS.lora_targets))


def wandb_sinks(run_name: Optional[str], meta: dict) -> list:
  """`--wandb_log`: a W&B sink for the run (a sweep's `run_name` joins --wandb_run_name)."""
  if not FLAGS.wandb_log or not parallel.is_main_process():
    return []
  name = "-".join(n for n in (FLAGS.wandb_run_name, run_name) if n) or None
  return [wandb_sink.WandbSink(project=FLAGS.wandb_project, run_name=name,
                               config={**meta, "flags": FLAGS.flag_values_dict()},
                               out_dir=FLAGS.out_dir)]


def eval_gpt(run: runs.RunConfig, train: loop.GPTTrainConfig,
             devices: parallel.ParallelConfig, forms) -> dict:
  """`--eval_only`: the loss of the newest (or best) checkpoint, or of --init_from's model."""
  best = FLAGS.eval_checkpoint == "best"
  if checkpoint.list_checkpoints(run.out_dir) or best:
    source = run.out_dir
  elif FLAGS.init_from:
    source = FLAGS.init_from
  else:
    raise ValueError(f"--eval_only: {run.out_dir} holds no checkpoint; train first, or "
                     f"pass --init_from=MODEL to evaluate pretrained weights.")
  params, config, tokenizer = pretrained(source, best=best)
  text = load_corpus(tokenizer)
  runs.print_line(f"evaluating {source}{' (best checkpoint)' if best else ''} on {text.source}")
  return {"source": source, **loop.evaluate_gpt(params, config, text, train, devices,
                                                forms=forms)}


def train_mlp(run: runs.RunConfig, devices: parallel.ParallelConfig) -> dict:
  try:
    sizes = tuple(int(s) for s in FLAGS.layer_sizes)
  except ValueError:
    raise ValueError(f"--layer_sizes must be integers, got {FLAGS.layer_sizes}.") from None
  train = mlp_loop.MLPTrainConfig(layer_sizes=sizes, init_scale=FLAGS.init_scale,
                              batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
                              checkpoint_every=FLAGS.checkpoint_every, seed=FLAGS.seed)
  mnist = parallel.main_process_first(
      lambda: data_lib.load_mnist(FLAGS.tfds_data_dir, FLAGS.tfds_manual_dir,
                                  pixels=FLAGS.mnist_pixels),
      errors=(ValueError, data_lib.DataUnavailableError))
  steps_per_epoch = len(mnist.train_labels) // train.batch_size
  return mlp_loop.train_mlp(mnist, train, optimizer_config(train.epochs * steps_per_epoch),
                            run, devices, meta_config={"mnist_pixels": FLAGS.mnist_pixels},
                            progress_bar=FLAGS.progress)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    if FLAGS.cpu_devices is not None:
      parallel.set_cpu_devices(FLAGS.cpu_devices)  # before anything starts JAX's backends
    if (FLAGS.coordinator_address or FLAGS.num_processes or FLAGS.process_id is not None
        or os.environ.get("JAX_COORDINATOR_ADDRESS")):
      parallel.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                      FLAGS.process_id)
    if not FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)  # TFDS's and JAX's INFO lines
    optimizer_config(total_steps=1)  # fail on bad optimizer flags before loading data
    run = run_config()
    runs.check_out_dir(run.out_dir)
    train = train_mlp if FLAGS.model == "mlp" else train_gpt
    metrics = train(run, parallel_config())
  except signals.Interrupted as e:
    runs.print_line(f"stopped by {e}; the checkpoint above holds the run (resume with --resume)")
    sys.exit(128 + e.signum)
  except nonfinite.NonFiniteLoss as e:
    print(f"error: {_cli.in_flags(str(e))}", file=sys.stderr)
    sys.exit(EXIT_NONFINITE)
  except (ValueError, OSError, data_lib.DataUnavailableError, checkpoint.CheckpointError) as e:
    _cli.fail(e)
  runs.print_line("final " + json.dumps(metrics))


if __name__ == "__main__":
  define_flags(model_from_argv(sys.argv))
  app.run(main)

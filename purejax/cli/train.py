r"""Trains a purejax model from the command line.

    python -m purejax.train                       # NanoGPT on Tiny Shakespeare
    python -m purejax.train --model=mlp --tfds_manual_dir=/path/to/mnist
    python -m purejax.train --model=mlp --help    # the MLP's flags

This file only reads flags (defined in `train_flags`): it turns them into the
library's configs and calls `gpt_loop.train_gpt` or `mlp_loop.train_mlp`. Bad
values, and flags that would have no effect, stop the run at once with a
one-line message naming the flag; `run(argv)` returns the exit code, so a
test checks a command line in-process.
"""

import dataclasses
import json
import math
import os
import sys
from typing import Optional, Sequence

from absl import flags

from purejax import checkpoint
from purejax import evaluation
from purejax import gpt
from purejax.gpt import config as config_lib
from purejax import lora
from purejax import weights
from purejax.cli import command
from purejax.cli import errors
from purejax.cli import forms_flags
from purejax.cli import models
from purejax.cli import train_flags
from purejax.data import chat
from purejax.data import conversations
from purejax.data import corpus as corpus_lib
from purejax.data import datasets as data_lib
from purejax.data import preferences
from purejax.data import tokenizer_json
from purejax.data import tokenizers
from purejax.optimizers import optim
from purejax.training.effects import nonfinite
from purejax.training.effects import runs
from purejax.training.effects import signals
from purejax.training.effects import wandb_sink
from purejax.training.loops import gpt_loop
from purejax.training.loops import mlp_loop
from purejax.training.loops import sweep_loop
from purejax.training.pure import parallel
from purejax.training.pure import preference
from purejax.training.pure import sweep

Args = flags.FlagValues

# Exit codes (documented in the README).
EXIT_ERROR = command.EXIT_ERROR  # bad flags, missing data, unusable checkpoint
EXIT_NONFINITE = 2               # loss became NaN/Inf; the last checkpoint is intact
# SIGINT / SIGTERM: a checkpoint is saved, then exit 128 + signal (130 / 143).


# ----------------------------------------------------------------------------
# Flags -> configs


def optimizer_config(args: Args) -> optim.OptimizerConfig:
  """The optimizer flags; the schedule ends at `--lr_decay_iters`, else where the
  training loop decides (`optim.with_schedule_end`: the run's last step)."""
  scale = depth_lr_scale(args)
  # The optimizer's own settings are flags of their flat names (`train_flags`); only
  # the shared rates scale with --depth (Muon's follows each matrix's shape already,
  # and nanochat scales only its AdamW rates).
  own = {name: args[name].value for name in optim.settings_names(args.optimizer)}
  return optim.from_flat(
      name=args.optimizer, learning_rate=args.learning_rate * scale, schedule=args.lr_schedule,
      warmup_iters=args.warmup_iters, decay_iters=args.lr_decay_iters,
      min_lr=args.min_lr * scale, warmdown_frac=args.warmdown_frac, grad_clip=args.grad_clip,
      **own)


def depth_lr_scale(args: Args) -> float:
  """The rates' factor under `--depth` (`gpt.depth_lr_scale`); 1 without it."""
  depth = args["depth"].value if "depth" in args else None
  if depth is None:
    return 1.0
  return gpt.depth_lr_scale(gpt.depth_shape(depth)["n_embd"])


def run_config(args: Args) -> runs.RunConfig:
  return runs.RunConfig(out_dir=args.out_dir, resume=args.resume,
                        keep_checkpoints=args.keep_checkpoints,
                        skip_nonfinite=args.skip_nonfinite)


def parallel_config(args: Args) -> parallel.ParallelConfig:
  return parallel.ParallelConfig(num_devices=args.num_devices, fsdp=args.fsdp,
                                 grad_accum_steps=args.grad_accum_steps)


# Flags that define the architecture: with --init_from it comes from the weights.
ARCHITECTURE_FLAGS = ("arch", "depth", "n_layer", "n_head", "n_kv_head", "n_embd", "block_size",
                      "bias", *train_flags.block_field_flags())


def gpt_config(args: Args, vocab_size: int, base: Optional[gpt.GPTConfig] = None
               ) -> gpt.GPTConfig:
  """The model flags as a config; with `base` (pretrained), only the dtype and dropout flags."""
  tunable = dict(dropout=args.dropout, compute_dtype=args.dtype)
  if base is not None:
    return dataclasses.replace(base, **tunable)
  arch = dict(gpt.ARCHITECTURES[args.arch])
  if args["bias"].present or "bias" not in arch:
    arch["bias"] = args.bias
  for name in train_flags.block_field_flags():  # set by the recipe or on the command line
    if args[name].value is not None:
      arch[name] = args[name].value
  shape = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
  if args.depth is not None:
    shape = gpt.depth_shape(args.depth)
  if arch.get("window_pattern") and args.arch == "nanochat":
    arch.update(nanochat_windows(arch["window_pattern"], arch.get("window"),
                                 shape["n_layer"], args.block_size))
  return gpt.GPTConfig(vocab_size=vocab_size, block_size=args.block_size,
                       n_kv_head=args.n_kv_head, **shape, **arch, **tunable)


def nanochat_windows(pattern: str, window: Optional[int], n_layer: int, block_size: int
                     ) -> dict:
  """nanochat's `window_pattern` rule: the pattern tiled over the layers, the last layer
  always global ("L"), and its short window half the context (flash attention's left
  window of `block_size // 2`: `block_size // 2 + 1` keys with the query's own), unless
  `--window` says otherwise."""
  tiled = "".join(pattern[i % len(pattern)] for i in range(n_layer))
  return dict(window_pattern=tiled[:-1] + config_lib.FULL,
              window=block_size // 2 + 1 if window is None else window)


def gpt_train_config(args: Args) -> gpt_loop.GPTTrainConfig:
  profile = None
  if args.profile_steps:
    try:
      profile = tuple(int(s) for s in args.profile_steps)
      assert len(profile) == 2
    except (ValueError, AssertionError):
      raise ValueError(f"--profile_steps must be two steps A,B, got "
                       f"{','.join(args.profile_steps)}.") from None
  return gpt_loop.GPTTrainConfig(
      batch_size=args.batch_size, max_iters=args.max_iters,
      eval_interval=args.eval_interval, eval_iters=args.eval_iters,
      log_interval=args.log_interval, steps_per_call=args.steps_per_call,
      checkpoint_every=args.checkpoint_every,
      always_save_checkpoint=args.always_save_checkpoint,
      sample_tokens=args.sample_tokens, seed=args.seed, profile_steps=profile,
      progress=args.progress, peak_flops=args.peak_flops)


def sweep_grid(args: Args) -> Optional[dict]:
  """`--sweep` as `{name: values}` (None without it), refusing what would train nothing
  or would not differ between runs."""
  if args.sweep is None:
    return None
  grid = sweep.parse_grid(args.sweep)
  if not grid:
    raise ValueError(f"--sweep={args.sweep} names no setting; write NAME=V1,V2,... such "
                     f"as --sweep=learning_rate=3e-4,1e-3.")
  used = optim.hyperparams_used(optimizer_config(args))
  for name, values in grid.items():
    if not values:
      raise ValueError(f"--sweep lists no values of {name}; write {name}=V1,V2,...")
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
      raise ValueError(f"--sweep's {name}={bad[0]} is not a finite number; sweep finite "
                       f"values.")
    if name in ("learning_rate", "min_lr") and args.depth is not None:
      raise ValueError(f"--sweep gives {name} as it is, but --depth scales the rate flags by "
                       f"the width; sweep without --depth (with --n_layer, --n_embd, "
                       f"--n_head) or drop {name} from --sweep.")
    if name != sweep.DROPOUT and name not in used:
      raise ValueError(f"--sweep of {name} has no effect on --optimizer={args.optimizer} "
                       f"with --lr_schedule={args.lr_schedule}, which reads only "
                       f"{', '.join(used)}; drop {name} from --sweep or choose an "
                       f"optimizer that uses it.")
  return grid


def refuse_what_has_no_effect(args: Args) -> None:
  """Flags given on the command line that the run would ignore: refused, not ignored."""
  given = lambda name: command.given(args, name)
  if given("warmdown_frac") and args.lr_schedule != "warmdown":
    raise ValueError(f"--warmdown_frac has no effect on --lr_schedule={args.lr_schedule}; add "
                     f"--lr_schedule=warmdown or drop --warmdown_frac.")
  own = optim.settings_names(args.optimizer)
  for name in optim.all_settings():
    if given(name) and name not in own and not optim.changes_nothing(name, args[name].value):
      readers = optim.readers_of(name)
      raise ValueError(f"--{name} has no effect on --optimizer={args.optimizer}; add "
                       f"--optimizer={readers[0]} or drop --{name}.")
  if given("muon_momentum_start") and not args.muon_momentum_warmup_iters:
    raise ValueError("--muon_momentum_start has no effect without a momentum warmup; add "
                     "--muon_momentum_warmup_iters=N (e.g. 300) or drop --muon_momentum_start.")
  if args.model != "gpt":
    if args.optimizer == "muon":
      raise ValueError(f"--optimizer=muon orthogonalises the hidden matrices of a GPT's "
                       f"blocks, which --model={args.model} has none of; choose another "
                       f"--optimizer (e.g. adamw).")
    return
  shape_flags = [f"--{name}" for name in ("n_layer", "n_embd", "n_head") if given(name)]
  if args.depth is not None and shape_flags:
    raise ValueError(f"--depth sets the model's shape; drop {' and '.join(shape_flags)} or "
                     f"drop --depth.")
  sweeping = args.sweep is not None or args.sweep_seeds > 1
  if args.eval_only and sweeping:
    raise ValueError("--eval_only evaluates one model, not a sweep; drop --sweep and "
                     "--sweep_seeds (evaluate one run with --out_dir=OUT_DIR/<run>).")
  if given("eval_checkpoint") and not args.eval_only:
    raise ValueError("--eval_checkpoint chooses what --eval_only evaluates; add "
                     "--eval_only or drop --eval_checkpoint.")
  if given("sweep_batch") and not sweeping:
    raise ValueError("--sweep_batch sets how a --sweep's runs are batched; add --sweep "
                     "or drop --sweep_batch.")
  if given("eval_tasks") and args.eval_only:
    raise ValueError("--eval_tasks scores a training run at its evaluations; to score a "
                     "model once, run python -m purejax.eval --tasks=... instead.")
  if given("eval_tasks_limit") and not args.eval_tasks:
    raise ValueError("--eval_tasks_limit has no effect without --eval_tasks; add "
                     "--eval_tasks=FILES or drop --eval_tasks_limit.")
  dpo_flags = [f"--{name}" for name in DPO_FLAGS if given(name)]
  if dpo_flags and not preferences.is_preferences_file(args.dataset):
    raise ValueError(f"{', '.join(dpo_flags)} set DPO, which trains on preference pairs; "
                     f"pass --dataset=PAIRS.jsonl (prompt, chosen, rejected) or drop them.")
  for name in ("lora_alpha", "lora_targets"):
    if given(name) and args.lora_rank == 0:
      raise ValueError(f"--{name} has no effect without LoRA; add --lora_rank=R (e.g. 8) "
                       f"or drop --{name}.")


DPO_FLAGS = ("dpo_beta", "dpo_loss", "dpo_label_smoothing", "dpo_sft_weight")


def dpo_config(args: Args) -> Optional[preference.DPO]:
  """The DPO flags, where `--dataset` holds preference pairs (None otherwise)."""
  if not preferences.is_preferences_file(args.dataset):
    return None
  return preference.DPO(beta=args.dpo_beta, loss_type=args.dpo_loss,
                        label_smoothing=args.dpo_label_smoothing,
                        sft_weight=args.dpo_sft_weight)


def load_corpus(args: Args, tokenizer, block_size: Optional[int] = None):
  """`--dataset` through `--tokenizer` (or a model's own tokenizer), process 0 first;
  a `.jsonl` of conversations through the model's tokenizer and chat template, and one
  of preference pairs through the model's tokenizer (and template, if conversational)."""
  if preferences.is_preferences_file(args.dataset):
    return load_preferences(args, tokenizer, block_size)
  if conversations.is_conversations_file(args.dataset):
    return load_conversations(args, tokenizer, block_size)
  if (tokenizer is None and args.tokenizer_file is not None
      and tokenizer_json.is_tokenizer_json(args.tokenizer_file)):
    tokenizer = tokenizer_json.load(args.tokenizer_file)  # e.g. python -m purejax.tokenizer's
  # A model's own tokenizer was already built (with --tokenizer_file, if given).
  tokenizer_file = args.tokenizer_file if isinstance(tokenizer, (str, type(None))) else None
  return parallel.main_process_first(
      lambda: corpus_lib.load_corpus(
          args.dataset, tokenizer=tokenizer, tokenizer_file=tokenizer_file,
          cache_dir=args.cache_dir, tfds_data_dir=args.tfds_data_dir,
          tfds_manual_dir=args.tfds_manual_dir),
      errors=(ValueError, data_lib.DataUnavailableError))


def load_conversations(args: Args, tokenizer, block_size: Optional[int]):
  """`--dataset=FILE.jsonl`, rendered with the chat template of the model `--init_from`
  names: a Hugging Face folder's, a GGUF file's (its metadata), or the one a run
  fine-tuned from either recorded."""
  if not args.init_from:
    raise ValueError(f"--dataset={args.dataset} holds conversations, which need an instruct "
                     f"model's tokenizer and chat template; pass --init_from=MODEL (a "
                     f"Hugging Face folder, a GGUF file, or a run fine-tuned from one).")
  try:
    fmt = models.chat_format(args.init_from, tokenizer)
  except chat.ChatTemplateError as e:
    raise ValueError(f"--dataset={args.dataset} holds conversations, which need a chat "
                     f"template: {e}") from None
  return conversations.load_conversations(args.dataset, tokenizer, fmt, block_size)


def load_preferences(args: Args, tokenizer, block_size: Optional[int]):
  """`--dataset=PAIRS.jsonl`: preference pairs through the tokenizer of the model
  `--init_from` names, and its chat template where the pairs are conversations."""
  if not args.init_from:
    raise ValueError(f"--dataset={args.dataset} holds preference pairs: DPO tunes a trained "
                     f"model, which is also its reference; pass --init_from=MODEL.")
  if isinstance(tokenizer, str):  # weights that record only ids: --tokenizer names one
    if tokenizer == "char":
      raise ValueError(f"--dataset={args.dataset}: a character tokenizer needs the model's "
                       f"characters; start from a run or model that records its tokenizer.")
    tokenizer = tokenizers.get_tokenizer(tokenizer, encoding_file=args.tokenizer_file)
  try:
    fmt = models.chat_format(args.init_from, tokenizer)
  except chat.ChatTemplateError:
    fmt = None  # standard pairs need none (no EOS then); conversational ones are refused
  return preferences.load_preferences(args.dataset, tokenizer, fmt, block_size)


def pretrained(args: Args, source: str, best: bool = False, held: Optional[str] = None):
  """`(params, config, tokenizer)` of `source` (see `weights.from_pretrained`), its dense
  matrices held as `held` says (`quant.hold_matrices`; "gguf": a file's own blocks)."""
  given = [name for name in ARCHITECTURE_FLAGS
           if args[name].present and name != "block_size"]
  if given:
    raise ValueError(f"--{given[0]} has no effect on weights from {source}: the "
                     f"architecture comes from the weights; drop --{given[0]}.")
  params, config, spec = (weights.from_purejax(source, best=best) if best else
                          weights.from_pretrained(source, keep_quantized=held == "gguf"))
  params = models.hold_base(params, held)
  if args["block_size"].present:  # a shorter context: RoPE models have no position table
    if config.position != "rope" or args.block_size > config.block_size:
      raise ValueError(f"--block_size={args.block_size}: {source} takes contexts up to "
                       f"{config.block_size}, and only a RoPE model's can be shortened; "
                       f"drop --block_size.")
    config = dataclasses.replace(config, block_size=args.block_size)
  if spec.kind == "ids":  # weights without a tokenizer: the user names one
    if args.tokenizer is None:
      raise ValueError(f"{source} records no tokenizer, only {spec.vocab_size} token "
                       f"ids; pass --tokenizer=char or --tokenizer=gpt2.")
    tokenizer = args.tokenizer
  else:
    tokenizer = tokenizers.from_spec(spec, encoding_file=args.tokenizer_file)
    if args.tokenizer is not None and args.tokenizer != tokenizer.name:
      raise ValueError(f"--tokenizer={args.tokenizer} does not fit {source}, whose "
                       f"tokenizer is {tokenizer.name}; drop --tokenizer.")
  return params, gpt_config(args, config.vocab_size, base=config), tokenizer


def lora_config(args: Args) -> Optional[lora.LoraConfig]:
  if args.lora_rank == 0:
    return None
  return lora.LoraConfig(args.lora_rank, args.lora_alpha, tuple(args.lora_targets))


def train_gpt(args: Args, run: runs.RunConfig, devices: parallel.ParallelConfig) -> dict:
  train = gpt_train_config(args)
  runs.require_positive(block_size=args.block_size)
  # The forms flags given (parsed as absl parses them) go to the run as `kernels.select`'s
  # overrides: the run chooses its forms for the platform its plan is on.
  forms = {name: args[name].value for name in forms_flags.FORMS if args[name].value is not None}
  forms_flags.check_platform(args)  # before loading any data
  grid = sweep_grid(args)
  adapters = lora_config(args)
  if args.quantize is not None and (adapters is None or not args.init_from):
    raise ValueError(f"--quantize={args.quantize} holds a pretrained model's frozen base "
                     f"for LoRA: pass --init_from=MODEL and --lora_rank=R (e.g. 16), or drop "
                     f"--quantize.")
  dpo = dpo_config(args)  # (bad DPO numbers fail here, before loading anything)
  if not args.init_from:
    gpt_config(args, vocab_size=1)  # fail on bad model flags before loading data
  runs.check_out_dir(run.out_dir)
  if args.eval_only:
    return eval_gpt(args, run, train, devices, forms)
  init_params, init_from = None, args.init_from
  benchmarks = [evaluation.load_task(path) for path in args.eval_tasks or ()]  # fail early
  if init_from:
    held = train_flags.held_base(args) if adapters else None
    init_params, config, tokenizer = pretrained(args, init_from, held=held)
  else:
    tokenizer = args.tokenizer
  text = load_corpus(args, tokenizer, config.block_size if init_from else None)
  if not init_from:
    config = gpt_config(args, text.vocab_size)
  metrics = [evaluation.task_metric(benchmarks, text.tokenizer, limit=args.eval_tasks_limit,
                                    batch_size=args.batch_size)] if benchmarks else []
  sinks = lambda run_name, meta: wandb_sinks(args, run_name, meta)
  # The loops take the run folder's lock as the run starts (one writer per folder).
  if grid is not None or args.sweep_seeds > 1:
    return {"runs": sweep_loop.train_gpt_sweep(
        config, text, train, optimizer_config(args), run, grid or {}, args.sweep_seeds,
        devices, init_params=init_params, init_from=init_from, forms=forms,
        sweep_batch=args.sweep_batch, lora_config=adapters, data=args.dataset, sinks=sinks,
        metrics=metrics, dpo=dpo)}
  return gpt_loop.train_gpt(config, text, train, optimizer_config(args), run, devices,
                            init_params=init_params, init_from=init_from, forms=forms,
                            lora_config=adapters, data=args.dataset,
                            sinks=lambda meta: sinks(None, meta),
                            metrics=metrics, dpo=dpo)


def wandb_sinks(args: Args, run_name: Optional[str], meta: dict) -> list:
  """`--wandb_log`: a W&B sink for the run (a sweep's `run_name` joins --wandb_run_name)."""
  if not args.wandb_log or not parallel.is_main_process():
    return []
  name = "-".join(n for n in (args.wandb_run_name, run_name) if n) or None
  return [wandb_sink.WandbSink(project=args.wandb_project, run_name=name,
                               config={**meta, "flags": args.flag_values_dict()},
                               out_dir=args.out_dir)]


def eval_gpt(args: Args, run: runs.RunConfig, train: gpt_loop.GPTTrainConfig,
             devices: parallel.ParallelConfig, forms) -> dict:
  """`--eval_only`: the loss of the newest (or best) checkpoint, or of --init_from's model."""
  best = args.eval_checkpoint == "best"
  if checkpoint.list_checkpoints(run.out_dir) or best:
    source = run.out_dir
  elif args.init_from:
    source = args.init_from
  else:
    raise ValueError(f"--eval_only: {run.out_dir} holds no checkpoint; train first, or "
                     f"pass --init_from=MODEL to evaluate pretrained weights.")
  held = None if args.quantize == "float32" else args.quantize
  params, config, tokenizer = pretrained(args, source, best=best, held=held)
  text = load_corpus(args, tokenizer, config.block_size)
  runs.print_line(f"evaluating {source}{' (best checkpoint)' if best else ''} on {text.source}")
  return {"source": source, **gpt_loop.evaluate_gpt(params, config, text, train, devices,
                                                forms=forms)}


def train_mlp(args: Args, run: runs.RunConfig, devices: parallel.ParallelConfig) -> dict:
  try:
    sizes = tuple(int(s) for s in args.layer_sizes)
  except ValueError:
    raise ValueError(f"--layer_sizes must be integers, got {args.layer_sizes}.") from None
  train = mlp_loop.MLPTrainConfig(layer_sizes=sizes, init_scale=args.init_scale,
                                  batch_size=args.batch_size, epochs=args.epochs,
                                  checkpoint_every=args.checkpoint_every, seed=args.seed)
  runs.check_out_dir(run.out_dir)
  mnist = parallel.main_process_first(
      lambda: data_lib.load_mnist(args.tfds_data_dir, args.tfds_manual_dir,
                                  pixels=args.mnist_pixels),
      errors=(ValueError, data_lib.DataUnavailableError))
  return mlp_loop.train_mlp(mnist, train, optimizer_config(args), run, devices,
                            meta_config={"mnist_pixels": args.mnist_pixels},
                            progress_bar=args.progress)


def train(args: Args) -> int:
  """Trains (or evaluates) what the parsed flags say; returns the exit code."""
  try:
    refuse_what_has_no_effect(args)
    optimizer_config(args)  # fail on bad optimizer flags before any work
    run = run_config(args)
    if args.cpu_devices is not None:
      parallel.set_cpu_devices(args.cpu_devices)  # before anything starts JAX's backends
    if (args.coordinator_address or args.num_processes or args.process_id is not None
        or os.environ.get("JAX_COORDINATOR_ADDRESS")):
      parallel.initialize_distributed(args.coordinator_address, args.num_processes,
                                      args.process_id)
    model = train_mlp if args.model == "mlp" else train_gpt
    metrics = model(args, run, parallel_config(args))
  except signals.Interrupted as e:
    runs.print_line(f"stopped by {e}; the checkpoint above holds the run (resume with --resume)")
    return 128 + e.signum
  except nonfinite.NonFiniteLoss as e:
    print(errors.one_line(e, args), file=sys.stderr)
    return EXIT_NONFINITE
  except (ValueError, OSError, data_lib.DataUnavailableError, checkpoint.CheckpointError) as e:
    errors.fail(e, args)
  runs.print_line("final " + json.dumps(metrics))
  return 0


def run(argv: Sequence[str]) -> int:
  """`python -m purejax.train` with `argv` (the program's name first): the exit code."""
  model, recipe = train_flags.model_from_argv(argv), train_flags.recipe_from_argv(argv)
  return command.run(argv, lambda args: train_flags.define_flags(args, model, recipe), train,
                     usage=__doc__)


def main() -> None:
  command.main(run)


if __name__ == "__main__":
  main()

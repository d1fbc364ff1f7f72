r"""Improves a model by the rewards of its own samples (GRPO-style reinforcement learning).

    python -m purejax.rl --init_from=path/to/instruct-model --task=arithmetic --lora_rank=16
    python -m purejax.rl --init_from=MODEL --task=problems.jsonl --reward=my_rewards:score
    python -m purejax.rl --init_from=MODEL --task=code.jsonl --reward=code --allow_code_execution

Each step samples --group_size completions of --prompts_per_step prompts with the
current model, scores them with the reward, and updates the model towards the
completions that scored above their group's mean (`rl_loop.train_rl`). Tasks: the
built-in `arithmetic` (generated problems with a held-out split, works offline), or a
.jsonl of {"prompt": ..., "answer": ...} (scored by the final number) or HumanEval's
{"prompt", "test", "entry_point"} (scored by running the tests; needs
--allow_code_execution). Rewards: "numeric", "code", or module:function, a Python
function reward(prompt, completion, example) -> float.

The flags shared with `python -m purejax.train` keep its names (--max_iters,
--out_dir, --resume, --lora_rank, --quantize, --learning_rate, ...): with --lora_rank,
--quantize=q4_1 (or int8, q8_0, gguf) holds the frozen base quantized, and the run
samples from it as it trains, adapters beside it (QLoRA). Bad flags stop the run at
once with one line naming the flag (exit 1), before anything is written.
"""

import json
import sys
from typing import Sequence

from absl import flags

from purejax import checkpoint
from purejax import lora
from purejax.cli import command
from purejax.cli import errors
from purejax.cli import models
from purejax.cli import train_flags
from purejax.data import chat
from purejax.data import rl_tasks
from purejax.evaluation import rewards
from purejax.optimizers import optim
from purejax.training.effects import nonfinite
from purejax.training.effects import runs
from purejax.training.effects import signals
from purejax.training.loops import rl_loop

# RL's optimizer: a constant small rate after a short warmup (a fine-tune's, not a
# pretraining's schedule); LoRA runs want ~10x more (--learning_rate).
RL_OPTIMIZER = optim.from_flat(name="adamw", learning_rate=1e-5, schedule="constant",
                               warmup_iters=2, weight_decay=0.0, grad_clip=1.0)


def define_flags(args: flags.FlagValues) -> None:
  defaults = rl_loop.RLConfig()
  flags.DEFINE_string("init_from", None, "The model to improve: a Hugging Face folder, a "
                      "GGUF file or a purejax run directory (an instruct model, for tasks "
                      "of messages).", flag_values=args)
  flags.DEFINE_string("task", "arithmetic", f"A built-in task ({', '.join(rl_tasks.BUILT_IN)}"
                      f": generated problems, a held-out split) or a .jsonl of examples.",
                      flag_values=args)
  flags.DEFINE_string("reward", None, "numeric (the final number equals the example's "
                      "answer), code (the example's tests pass; with "
                      "--allow_code_execution), or module:function (default: the task's).",
                      flag_values=args)
  flags.DEFINE_bool("allow_code_execution", False, "Let the code reward run model-written "
                    "programs (each in a sandboxed subprocess).", flag_values=args)
  flags.DEFINE_enum("reward_errors", defaults.reward_errors, list(rl_loop.REWARD_ERRORS),
                    "A reward that raises or returns no finite number: fail (stop the run) "
                    "or zero (that completion scores 0).", flag_values=args)
  flags.DEFINE_integer("prompts_per_step", defaults.prompts_per_step, "Prompts per step.",
                       flag_values=args)
  flags.DEFINE_integer("group_size", defaults.group_size, "Completions sampled per prompt "
                       "(>= 2).", flag_values=args)
  flags.DEFINE_integer("max_new_tokens", defaults.max_new_tokens, "Tokens per completion, "
                       "at most.", flag_values=args)
  flags.DEFINE_float("temperature", defaults.temperature, "Sampling temperature.",
                     flag_values=args)
  flags.DEFINE_integer("top_k", defaults.top_k, "Sample from the k most likely (0: all).",
                       flag_values=args)
  flags.DEFINE_float("top_p", defaults.top_p, "Nucleus sampling mass in (0, 1].",
                     flag_values=args)
  flags.DEFINE_float("beta", defaults.beta, "Weight of the KL term to the starting model "
                     "(0: none, as nanochat).", flag_values=args)
  flags.DEFINE_bool("kl_ratio", defaults.kl_ratio, "Weigh the KL term by the probability "
                    "ratio (TRL's use_bias_correction_kl).", flag_values=args)
  flags.DEFINE_float("clip", defaults.clip, "PPO's ratio clip (acts with "
                     "--updates_per_batch > 1).", flag_values=args)
  flags.DEFINE_float("clip_high", None, "The clip's upper margin (default: --clip).",
                     flag_values=args)
  flags.DEFINE_integer("updates_per_batch", defaults.updates_per_batch, "Optimiser steps "
                       "on each batch of samples.", flag_values=args)
  flags.DEFINE_bool("scale_rewards", defaults.scale_rewards, "Divide a group's advantages "
                    "by its reward's standard deviation.", flag_values=args)
  flags.DEFINE_integer("max_iters", defaults.max_iters, "Steps.", flag_values=args)
  flags.DEFINE_integer("eval_interval", defaults.eval_interval, "Steps between held-out "
                       "evaluations.", flag_values=args)
  flags.DEFINE_integer("eval_examples", defaults.eval_examples, "Held-out prompts per "
                       "evaluation.", flag_values=args)
  flags.DEFINE_integer("log_interval", defaults.log_interval, "Steps between log lines.",
                       flag_values=args)
  flags.DEFINE_integer("checkpoint_every", None, "Steps between checkpoints (default: "
                       "--eval_interval).", flag_values=args)
  flags.DEFINE_integer("seed", defaults.seed, "Seed of the run's keys.", flag_values=args)
  flags.DEFINE_string("out_dir", "out-rl", "Run directory.", flag_values=args)
  flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept in --out_dir.",
                       flag_values=args)
  flags.DEFINE_bool("resume", False, "Resume from the newest checkpoint in --out_dir.",
                    flag_values=args)
  flags.DEFINE_bool("skip_nonfinite", False, "Skip updates whose gradients are NaN/Inf.",
                    flag_values=args)
  flags.DEFINE_bool("progress", None, "A live progress bar (default: on a terminal).",
                    flag_values=args)
  flags.DEFINE_integer("grad_accum_steps", 1, "Microbatches per update.", flag_values=args)
  flags.DEFINE_integer("block_size", None, "Context kept (at most the model's; default: "
                       "the model's).", flag_values=args)
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Dtype of the matmuls "
                    "(default: the model's).", flag_values=args)
  flags.DEFINE_integer("lora_rank", 0, "Train rank-r LoRA adapters instead of the weights "
                       "(0: off).", flag_values=args)
  flags.DEFINE_float("lora_alpha", None, "LoRA's scale numerator (default: the rank).",
                     flag_values=args)
  flags.DEFINE_list("lora_targets", list(lora.ATTENTION_AND_MLP), "Weights LoRA adapts.",
                    flag_values=args)
  train_flags.define_held_base_flag(args)
  train_flags.define_optimizer_flags(args, RL_OPTIMIZER)


def rl_config(args) -> rl_loop.RLConfig:
  return rl_loop.RLConfig(
      prompts_per_step=args.prompts_per_step, group_size=args.group_size,
      max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
      top_p=args.top_p, beta=args.beta, kl_ratio=args.kl_ratio, clip=args.clip,
      clip_high=args.clip_high,
      updates_per_batch=args.updates_per_batch, scale_rewards=args.scale_rewards,
      max_iters=args.max_iters, eval_interval=args.eval_interval,
      eval_examples=args.eval_examples, log_interval=args.log_interval,
      checkpoint_every=args.checkpoint_every, seed=args.seed,
      reward_errors=args.reward_errors, grad_accum_steps=args.grad_accum_steps,
      progress=args.progress)


def optimizer_config(args) -> optim.OptimizerConfig:
  own = {name: args[name].value for name in optim.settings_names(args.optimizer)}
  return optim.from_flat(
      name=args.optimizer, learning_rate=args.learning_rate, schedule=args.lr_schedule,
      warmup_iters=args.warmup_iters, decay_iters=args.lr_decay_iters, min_lr=args.min_lr,
      warmdown_frac=args.warmdown_frac, grad_clip=args.grad_clip, **own)


def train(args) -> int:
  """Runs what the parsed flags say; returns the exit code."""
  try:
    if not args.init_from:
      raise ValueError("--init_from is required: the model to improve (a Hugging Face "
                       "folder, a GGUF file or a purejax run directory).")
    for name in ("lora_alpha", "lora_targets", "quantize"):
      if command.given(args, name) and args.lora_rank == 0:
        raise ValueError(f"--{name} has no effect without LoRA; add --lora_rank=R or drop "
                         f"--{name}.")
    rl = rl_config(args)  # bad numbers (a group of 1, ...) fail here
    opt_config = optimizer_config(args)
    run = runs.RunConfig(out_dir=args.out_dir, resume=args.resume,
                         keep_checkpoints=args.keep_checkpoints,
                         skip_nonfinite=args.skip_nonfinite)
    task = rl_tasks.load_task(args.task, seed=args.seed)
    reward_name = args.reward or task.reward
    if not reward_name:
      raise ValueError(f"--task={args.task}'s examples have neither an \"answer\" nor "
                       f"HumanEval's \"test\" and \"entry_point\"; give --reward="
                       f"module:function to score them.")
    if command.given(args, "allow_code_execution") and reward_name != "code":
      raise ValueError(f"--allow_code_execution lets the code reward run programs, and "
                       f"the reward is {reward_name}; add --reward=code or drop it.")
    reward = rewards.load_reward(reward_name, allow_code_execution=args.allow_code_execution)
    runs.check_out_dir(run.out_dir)
    held = train_flags.held_base(args)  # how a LoRA run holds its frozen base
    params, config, tokenizer = models.load_model(run.out_dir, args.init_from, quantize=held)
    params, config = models.adjust(params, config, args.block_size, args.dtype)
    params = models.hold_base(params, held)
    try:
      fmt = models.chat_format(args.init_from, tokenizer)
    except chat.ChatTemplateError:
      fmt = None  # prompts of text only
    adapters = (lora.LoraConfig(args.lora_rank, args.lora_alpha, tuple(args.lora_targets))
                if args.lora_rank else None)
    metrics = rl_loop.train_rl(params, config, tokenizer, fmt, task, reward, rl, opt_config,
                               run, lora_config=adapters, init_from=args.init_from,
                               reward_name=reward_name)
  except signals.Interrupted as e:
    runs.print_line(f"stopped by {e}; the checkpoint above holds the run (resume with "
                    f"--resume)")
    return 128 + e.signum
  except nonfinite.NonFiniteLoss as e:
    print(errors.one_line(e, args), file=sys.stderr)
    return 2
  except (ValueError, OSError, checkpoint.CheckpointError) as e:
    errors.fail(e, args)
  runs.print_line("final " + json.dumps(metrics))
  return 0


def run(argv: Sequence[str]) -> int:
  """`python -m purejax.rl` with `argv` (the program's name first): the exit code."""
  return command.run(argv, define_flags, train, usage=__doc__)


def main() -> None:
  command.main(run)

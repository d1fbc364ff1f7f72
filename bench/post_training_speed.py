"""A post-training step, purejax against TRL on the same model and batch (CPU).

    python -m bench.post_training_speed --model=path/to/SmolLM2-135M-Instruct --steps=6

Two comparisons, each run as alternated blocks (purejax, TRL, purejax, TRL) in one
process, after each block's first steps (compilation, warm-up) are dropped:

- GRPO: a step is sampling `group_size` completions of `prompts` prompts of the
  `arithmetic` task, scoring them (the numeric reward), and one update of the whole
  model; purejax's `rl_loop.train_rl` (engine sampling, `sample_s + update_s` per
  step from its metrics; as it runs, the groups without signal left out of the update,
  and with every row updated, the same work as TRL's) against TRL's `GRPOTrainer` (transformers' `generate`; the
  step's wall time, optimizer included, from a callback). Same completion length,
  temperature 1, no KL (both defaults), TRL's default "dapo" loss.
- DPO: a step of `pairs` preference pairs (the arithmetic pairs of
  examples/dpo_arithmetic.py) with LoRA rank 16 on the attention and MLP matrices;
  purejax's `gpt_loop.train_gpt` (the reference's log-probabilities computed once
  before training) against `DPOTrainer` with peft (the reference by switching the
  adapters off each step, its default) and with `precompute_ref_log_probs=True`.

Prints one JSON line per arm and the ratios of the medians (TRL ms / purejax ms).
"""

import argparse
import json
import pathlib
import random
import statistics
import sys
import tempfile
import time



def grpo_purejax(model, steps, prompts, group, new_tokens, out, every_row=False):
  """purejax's steps; `every_row`: the update also on the groups without signal (the
  same work as TRL's, whose passes take every row)."""
  from purejax.cli import models
  from purejax.training.pure import rl_steps
  from purejax.data import rl_tasks
  from purejax.evaluation import rewards
  from purejax.optimizers import optim
  from purejax.training.effects import monitor
  from purejax.training.effects.runs import RunConfig
  from purejax.training.loops import rl_loop
  params, config, tokenizer = models.load_model(out, model)
  fmt = models.chat_format(model, tokenizer)
  rl = rl_loop.RLConfig(prompts_per_step=prompts, group_size=group, max_new_tokens=new_tokens,
                        max_iters=steps, eval_interval=10_000, eval_examples=1, progress=False)
  opt = optim.from_flat(name="adamw", learning_rate=1e-5, schedule="constant", warmup_iters=0,
                        weight_decay=0.0, grad_clip=1.0)
  drop = rl_steps.drop_silent_groups
  if every_row:
    rl_steps.drop_silent_groups = lambda rollouts, *_: rollouts
  try:
    rl_loop.train_rl(params, config, tokenizer, fmt, rl_tasks.load_task("arithmetic"),
                     rewards.numeric, rl, opt, RunConfig(out))
  finally:
    rl_steps.drop_silent_groups = drop
  records = [r for r in monitor.read_metrics(pathlib.Path(out) / "metrics.jsonl")
             if "sample_s" in r]
  return [1000 * (r["sample_s"] + r["update_s"]) for r in records]


class StepTimes:
  """A transformers callback: each optimizer step's wall time, in ms."""

  def __init__(self):
    import transformers
    outer = self

    class Callback(transformers.TrainerCallback):
      def on_step_begin(self, args, state, control, **kwargs):
        outer.began = time.perf_counter()

      def on_step_end(self, args, state, control, **kwargs):
        outer.ms.append(1000 * (time.perf_counter() - outer.began))

    self.ms, self.callback = [], Callback()


def grpo_trl(model, steps, prompts, group, new_tokens, out):
  import datasets
  import trl
  from purejax.data import rl_tasks
  from purejax.evaluation import rewards
  task = rl_tasks.load_task("arithmetic")

  def numeric(completions, answer, **_):
    return [rewards.numeric(None, c[0]["content"], {"answer": a})
            for c, a in zip(completions, answer)]

  rows = [{"prompt": e.prompt, "answer": e.record["answer"]}
          for e in task.train[:prompts * steps]]
  args = trl.GRPOConfig(output_dir=out, per_device_train_batch_size=prompts * group,
                        num_generations=group, max_completion_length=new_tokens,
                        temperature=1.0, beta=0.0, learning_rate=1e-5, max_steps=steps,
                        report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                        logging_steps=1, lr_scheduler_type="constant", warmup_steps=0,
                        max_grad_norm=1.0, weight_decay=0.0, disable_tqdm=True)
  times = StepTimes()
  trainer = trl.GRPOTrainer(model=model, reward_funcs=numeric, args=args,
                            train_dataset=datasets.Dataset.from_list(rows),
                            callbacks=[times.callback])
  trainer.train()
  return times.ms


def arithmetic_pairs_file(path, n):
  sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
  import dpo_arithmetic  # pylint: disable=import-outside-toplevel
  from purejax.data import rl_tasks
  task = rl_tasks.load_task("arithmetic")
  rows = list(dpo_arithmetic.arithmetic_pairs(task.train[:n], random.Random(0)))
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return rows


def dpo_purejax(model, steps, pairs, out):
  from purejax import lora
  from purejax.cli import models
  from purejax.data import preferences
  from purejax.optimizers import optim
  from purejax.training.effects import monitor
  from purejax.training.effects.runs import RunConfig
  from purejax.training.loops import gpt_loop
  from purejax.training.pure import preference
  file = pathlib.Path(out + "-pairs.jsonl")
  arithmetic_pairs_file(file, 8 * pairs)
  params, config, tokenizer = models.load_model(out, model)
  fmt = models.chat_format(model, tokenizer)
  params, config = models.adjust(params, config, block_size=64)
  data = preferences.load_preferences(str(file), tokenizer, fmt, block_size=64)
  train = gpt_loop.GPTTrainConfig(batch_size=pairs, max_iters=steps, eval_interval=10_000,
                                  eval_iters=1, log_interval=1, steps_per_call=1,
                                  sample_tokens=0, progress=False)
  opt = optim.from_flat(name="adamw", learning_rate=1e-4, warmup_iters=0, weight_decay=0.0)
  gpt_loop.train_gpt(config, data, train, opt, RunConfig(out), init_params=params,
                     lora_config=lora.LoraConfig(rank=16), dpo=preference.DPO(beta=0.1))
  return [r["ms_per_iter"] for r in monitor.read_metrics(pathlib.Path(out) / "metrics.jsonl")
          if "ms_per_iter" in r]


def dpo_trl(model, steps, pairs, out, precompute):
  import datasets
  import peft
  import trl
  file = pathlib.Path(out + "-pairs.jsonl")
  rows = arithmetic_pairs_file(file, 8 * pairs)
  args = trl.DPOConfig(output_dir=out, per_device_train_batch_size=pairs, max_length=64,
                       beta=0.1, learning_rate=1e-4, max_steps=steps, report_to=[],
                       use_cpu=True, bf16=False, save_strategy="no", logging_steps=1,
                       disable_tqdm=True, precompute_ref_log_probs=precompute,
                       weight_decay=0.0, lr_scheduler_type="cosine", warmup_steps=0)
  times = StepTimes()
  lora_config = peft.LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"])
  trainer = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                           peft_config=lora_config, callbacks=[times.callback])
  trainer.train()
  return times.ms


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", required=True)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--skip", type=int, default=2, help="first steps of a block dropped")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--prompts", type=int, default=4)
  parser.add_argument("--group", type=int, default=8)
  parser.add_argument("--new_tokens", type=int, default=16)
  parser.add_argument("--pairs", type=int, default=8)
  parser.add_argument("--only", choices=["grpo", "dpo"], default=None)
  args = parser.parse_args()
  import torch
  torch.set_num_threads(2)
  arms = {}
  if args.only in (None, "grpo"):
    arms["grpo purejax"] = lambda out: grpo_purejax(args.model, args.steps, args.prompts,
                                                    args.group, args.new_tokens, out)
    arms["grpo purejax every row"] = lambda out: grpo_purejax(
        args.model, args.steps, args.prompts, args.group, args.new_tokens, out, every_row=True)
    arms["grpo trl"] = lambda out: grpo_trl(args.model, args.steps, args.prompts, args.group,
                                            args.new_tokens, out)
  if args.only in (None, "dpo"):
    arms["dpo purejax"] = lambda out: dpo_purejax(args.model, args.steps, args.pairs, out)
    arms["dpo trl"] = lambda out: dpo_trl(args.model, args.steps, args.pairs, out, False)
    arms["dpo trl precomputed"] = lambda out: dpo_trl(args.model, args.steps, args.pairs, out,
                                                      True)
  kept = {name: [] for name in arms}
  for _ in range(args.rounds):
    for name, arm in arms.items():
      with tempfile.TemporaryDirectory() as out:
        ms = arm(out + "/run")
      kept[name] += ms[args.skip:]
      print(json.dumps({"arm": name, "ms": [round(m, 1) for m in ms]}), flush=True)
  medians = {name: statistics.median(ms) for name, ms in kept.items() if ms}
  print(json.dumps({"median_ms": {k: round(v, 1) for k, v in medians.items()}}))
  for kind in ("grpo", "dpo"):
    ours = medians.get(f"{kind} purejax")
    for name, value in medians.items():
      if name.startswith(kind) and name != f"{kind} purejax" and ours:
        print(f"{name} / {kind} purejax: {value / ours:.2f}x")


if __name__ == "__main__":
  main()

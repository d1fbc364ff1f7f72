"""Preference-tune an instruct model with DPO on generated arithmetic pairs, as a library.

    python examples/dpo_arithmetic.py path/to/SmolLM2-135M-Instruct out-dpo [steps [beta [sft]]]

Each pair asks one of the built-in `arithmetic` task's problems ("What is 37 + 12?
Answer with the number only."); the chosen answer is the number, the rejected one the
small model's usual failure: the sum written out with a wrong result ("37 + 12 = 47").
Held-out pairs come from the task's held-out problems. Each evaluation logs the
held-out preference accuracy, the margin, and the chosen answers' NLL.
"""

import json
import pathlib
import random
import sys

from purejax import lora
from purejax.cli import models
from purejax.data import preferences
from purejax.data import rl_tasks
from purejax.optimizers import optim
from purejax.training.effects.runs import RunConfig
from purejax.training.loops import gpt_loop
from purejax.training.pure import preference


def arithmetic_pairs(examples, rnd):
  """A preference pair per problem: its number chosen, a wrong equation rejected."""
  for e in examples:
    problem = e.record
    wrong = int(problem["answer"]) + rnd.choice([-10, -2, -1, 1, 2, 10])
    yield {"prompt": e.prompt,
           "chosen": [{"role": "assistant", "content": problem["answer"]}],
           "rejected": [{"role": "assistant",
                         "content": f"{problem['a']} {problem['op']} {problem['b']} = {wrong}"}]}


def main(model: str, out_dir: str, steps: int = 40, beta: float = 0.1,
         sft_weight: float = 0.0) -> None:
  task, rnd = rl_tasks.load_task("arithmetic"), random.Random(0)
  pairs = pathlib.Path(out_dir + "-pairs.jsonl")
  # 360 training pairs, then 40 held out (the loader holds out the last tenth).
  rows = [*arithmetic_pairs(task.train[:360], rnd), *arithmetic_pairs(task.val[:40], rnd)]
  pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
  params, config, tokenizer = models.load_model(out_dir, model)
  fmt = models.chat_format(model, tokenizer)
  data = preferences.load_preferences(str(pairs), tokenizer, fmt, block_size=64)
  config = models.adjust(params, config, block_size=64)[1]
  train = gpt_loop.GPTTrainConfig(batch_size=8, max_iters=steps, eval_interval=10,
                                  eval_iters=5, log_interval=5, steps_per_call=5,
                                  sample_tokens=0)
  opt = optim.from_flat(name="adamw", learning_rate=1e-4, warmup_iters=2, weight_decay=0.0)
  print(gpt_loop.train_gpt(config, data, train, opt, RunConfig(out_dir), init_params=params,
                           init_from=model, lora_config=lora.LoraConfig(rank=16),
                           dpo=preference.DPO(beta=beta, sft_weight=sft_weight)))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]),
       *(float(a) for a in sys.argv[4:6]))

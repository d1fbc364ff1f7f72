"""DPO and RL from the command line on the real SmolLM2-135M-Instruct (slow tier).

Short runs that show the commands take the real model in its two forms (DPO from the
Q4_1 GGUF file, RL from the Hugging Face folder), its chat template and stop token,
and log what docs/post_training.md says; how far they learn is measured outside the
suite (`examples/dpo_arithmetic.py`, `python -m purejax.rl`; the figures in the docs).
"""

import json

import pytest

from purejax.cli import rl as rl_cli
from purejax.cli import train as train_cli
from purejax.training.effects import monitor
from real_model import smollm2_folder, smollm2_gguf  # noqa: F401  (the fixtures)

pytestmark = pytest.mark.slow

QUESTIONS = [("What is 3 + 4?", "7", "3 + 4 = 9"), ("What is 10 - 6?", "4", "10 - 6 = 3"),
             ("What is 5 + 5?", "10", "5 + 5 = 12"), ("What is 9 - 2?", "7", "9 - 2 = 8")]


@pytest.mark.budget(30)
def test_dpo_from_the_gguf_file_with_lora(tmp_path, smollm2_gguf):
  pairs = tmp_path / "pairs.jsonl"
  pairs.write_text("".join(json.dumps({
      "prompt": [{"role": "user", "content": q}],
      "chosen": [{"role": "assistant", "content": good}],
      "rejected": [{"role": "assistant", "content": bad}]}) + "\n" for q, good, bad in QUESTIONS))
  out = tmp_path / "dpo"
  assert train_cli.run(["train", f"--init_from={smollm2_gguf}", f"--dataset={pairs}",
                        f"--out_dir={out}", "--block_size=48", "--lora_rank=4",
                        "--batch_size=2", "--max_iters=2", "--eval_interval=2",
                        "--eval_iters=1", "--learning_rate=1e-3", "--warmup_iters=0",
                        "--sample_tokens=0", "--progress=false"]) == 0
  evals = [r for r in monitor.read_metrics(out / "metrics.jsonl") if r["kind"] == "eval"]
  assert [r["step"] for r in evals] == [0, 2]
  assert evals[0]["train_margin"] == 0 and evals[-1]["train_margin"] > 0
  assert evals[-1]["train_loss"] < evals[0]["train_loss"]


@pytest.mark.budget(30)
def test_rl_from_the_folder_with_lora(tmp_path, smollm2_folder):
  out = tmp_path / "rl"
  assert rl_cli.run(["rl", f"--init_from={smollm2_folder}", "--task=arithmetic",
                     f"--out_dir={out}", "--lora_rank=4", "--learning_rate=1e-4",
                     "--max_iters=2", "--eval_interval=2", "--eval_examples=4",
                     "--prompts_per_step=2", "--group_size=2", "--max_new_tokens=8",
                     "--progress=false"]) == 0
  records = monitor.read_metrics(out / "metrics.jsonl")
  train = [r for r in records if r["kind"] == "train"]
  evals = [r for r in records if r["kind"] == "eval"]
  assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [0, 2]
  assert all(0 < r["completion_tokens"] <= 8 for r in train)
  assert all(0 <= r["val_pass_at_1"] <= 1 for r in evals)

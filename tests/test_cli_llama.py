"""The Llama family from the command line: --arch from scratch, a Llama folder fine-tuned.

Each test runs the `purejax.train`, `sample` or `convert` command line in-process
(`run_cli`) on a tiny model and a corpus the test writes itself; a run on four
devices is `python -m purejax.train` with four host devices.
"""

import json

import numpy as np
import pytest

from helpers.cli import SHORT_FLAGS, TINY_FLAGS, TINY_GPT, final, refusal, run_cli
from helpers.data import SHAKESPEARE, need, train_tokenizer_json
from helpers.runs import assert_same_run, train_run
from purejax.cli import convert
from purejax.cli import sample
from purejax.cli import train

pytestmark = pytest.mark.slow


def test_arch_llama_trains_resumes_exactly_and_samples(tmp_path, text_file):
  args = [*TINY_FLAGS, "--arch=llama", "--n_kv_head=1", f"--dataset={text_file}",
          "--lr_decay_iters=20", "--eval_interval=10", "--log_interval=5",
          "--steps_per_call=5", "--learning_rate=1e-2"]
  straight = final(run_cli(train, *args, "--max_iters=20", f"--out_dir={tmp_path / 'a'}"))
  final(run_cli(train, *args, "--max_iters=10", f"--out_dir={tmp_path / 'b'}"))
  resumed = final(run_cli(train, *args, "--max_iters=20", "--resume",
                          f"--out_dir={tmp_path / 'b'}"))
  assert resumed["val_loss"] == straight["val_loss"] < 3.5, (straight, resumed)
  sampled = run_cli(sample, f"--out_dir={tmp_path / 'a'}", "--start=ROMEO:", "--show_prompt",
                    "--max_new_tokens=30", "--top_p=0.9")
  assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr[-2000:]


@pytest.mark.budget(25)
def test_arch_llama_with_fsdp_and_accumulation_on_four_devices_matches_one(tmp_path, text_file):
  flags = [*TINY_GPT, "--arch=llama", "--n_kv_head=2", f"--dataset={text_file}"]
  final(run_cli(train, *flags, f"--out_dir={tmp_path / 'one'}"))  # this process: 1 device
  train_run(tmp_path / "four", *flags, "--fsdp", "--grad_accum_steps=2", num_devices=4)
  assert_same_run(tmp_path / "four", tmp_path / "one")


def test_a_llama_folder_fine_tunes_exports_and_samples(tmp_path, text_file, capsys):
  torch = need("torch")
  transformers = need("transformers")
  folder = tmp_path / "tiny-llama"
  train_tokenizer_json(folder, SHAKESPEARE[:20_000], vocab_size=300)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      tie_word_embeddings=False)).save_pretrained(folder)
  assert "--tokenizer=char does not fit" in refusal(
      capsys, train, f"--init_from={folder}", "--tokenizer=char", f"--out_dir={tmp_path / 'x'}")
  args = [f"--dataset={text_file}", "--batch_size=8", "--eval_iters=4", "--block_size=32",
          "--sample_tokens=10", "--learning_rate=1e-2", "--warmup_iters=5", *SHORT_FLAGS]
  before = final(run_cli(train, f"--init_from={folder}", "--eval_only", *args,
                         f"--out_dir={tmp_path / 'eval'}"))
  tuned = final(run_cli(train, f"--init_from={folder}", *args, f"--out_dir={tmp_path / 'tuned'}"))
  assert tuned["val_loss"] < before["val_loss"] - 0.5, (before, tuned)
  exported = tmp_path / "exported"
  converted = run_cli(convert, f"--from=purejax:{tmp_path / 'tuned'}", f"--to=hf:{exported}",
                      "--dtype=bfloat16")
  assert converted.returncode == 0, converted.stderr[-2000:]
  assert (exported / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
  config = json.loads((exported / "config.json").read_text())
  assert (config["model_type"], config["num_key_value_heads"]) == ("llama", 2)
  model = transformers.AutoModelForCausalLM.from_pretrained(exported)
  assert model.model.embed_tokens.weight.dtype == torch.bfloat16
  assert not np.array_equal(model.lm_head.weight.float().detach().numpy(),
                            transformers.AutoModelForCausalLM.from_pretrained(folder)
                            .lm_head.weight.detach().numpy())  # fine-tuned weights
  sampled = run_cli(sample, f"--init_from={exported}", "--start=ROMEO:", "--show_prompt",
                    "--max_new_tokens=10")
  assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr[-2000:]

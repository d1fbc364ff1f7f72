"""Gemma 3 from the command line: --arch=gemma3 from scratch, and a Gemma 3 folder
fine-tuned on conversations with LoRA, chatted with, and exported.

A tiny random `Gemma3ForCausalLM` with a small tokenizer and Gemma's chat
template (turns between `<start_of_turn>` and `<end_of_turn>`, which
`generation_config.json` names as a stop) stands in for Gemma 3 270M: the
same files, the same code paths. Everything runs in-process (`run_cli`).
"""

import io
import json

import jax.numpy as jnp
import numpy as np
import pytest

from helpers.cli import TINY_FLAGS, final, run_cli
from helpers.data import SHAKESPEARE, need
from purejax import gpt
from purejax.cli import chat as chat_cli
from purejax.cli import convert
from purejax.cli import sample
from purejax.cli import train
from purejax.weights import huggingface

pytestmark = pytest.mark.slow

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == "
            "'assistant' else m['role'] %}<start_of_turn>{{ role }}\n{{ m['content'] | trim }}"
            "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
            "{% endif %}")
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
FACT = [{"role": "user", "content": "What is the password?"},
        {"role": "assistant", "content": "The password is swordfish."}]


def gemma_folder(folder):
  """A tiny random Gemma 3 with a byte-level BPE, Gemma's special tokens and template."""
  torch, transformers, tokenizers = (need(m) for m in ("torch", "transformers", "tokenizers"))
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  tokenizer.train_from_iterator([SHAKESPEARE[:20_000]], tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=SPECIALS,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  folder.mkdir(parents=True)
  tokenizer.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
       "chat_template": TEMPLATE}))
  torch.manual_seed(0)
  model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
      vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
      num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
      sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                     "full_attention"],
      max_position_embeddings=128))
  with torch.no_grad():  # a trained model's embeddings are large enough for confident logits
    model.model.embed_tokens.weight.normal_(0.0, 1.0)
  model.save_pretrained(folder)
  # After save_pretrained, which writes its own: Gemma's lists both ends of an answer.
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
  return folder


def test_arch_gemma3_trains_from_scratch_samples_and_exports(tmp_path, text_file):
  transformers = need("transformers")
  out = tmp_path / "run"
  args = [*TINY_FLAGS, "--arch=gemma3", "--n_layer=2", "--window=6", "--window_pattern=SL",
          "--head_size=16", "--n_kv_head=1", f"--dataset={text_file}", "--max_iters=20",
          "--eval_interval=10", "--learning_rate=1e-2", f"--out_dir={out}"]
  trained = final(run_cli(train, *args))
  assert trained["val_loss"] < 3.6, trained
  sampled = run_cli(sample, f"--out_dir={out}", "--start=ROMEO:", "--show_prompt",
                    "--max_new_tokens=30")
  assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr[-2000:]
  converted = run_cli(convert, f"--from=purejax:{out}", f"--to=hf:{tmp_path / 'hf'}")
  assert converted.returncode == 0, converted.stderr[-2000:]
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  assert type(model).__name__ == "Gemma3ForCausalLM"
  params, config, _ = huggingface.from_huggingface(str(tmp_path / "hf"))
  assert config.layer_kinds == (1, 0) and config.window == 6
  tokens = np.arange(32).reshape(2, 16) % config.vocab_size  # beyond the window of 6
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    theirs = model(torch.from_numpy(tokens)).logits.numpy()
  ours = np.asarray(gpt.forward(params, jnp.asarray(tokens), config))
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_gemma3_folder_learns_a_conversation_with_lora_chats_and_exports(tmp_path):
  peft = need("peft")
  transformers = need("transformers")
  folder = gemma_folder(tmp_path / "tiny-gemma3")
  chats = tmp_path / "chats.jsonl"
  chats.write_text("".join(json.dumps({"messages": FACT}) + "\n" for _ in range(12)))
  out = tmp_path / "tuned"
  tuned = final(run_cli(train, f"--init_from={folder}", f"--dataset={chats}", "--lora_rank=8",
                        "--batch_size=4", "--block_size=48", "--max_iters=40",
                        "--eval_interval=20", "--eval_iters=2", "--learning_rate=3e-2",
                        "--warmup_iters=5", "--sample_tokens=20", f"--out_dir={out}"))
  assert tuned["val_loss"] < 0.5, tuned
  answer = io.StringIO()
  code = chat_cli.run(["chat", f"--init_from={out}", "--prompt=What is the password?",
                       "--temperature=0", "--max_new_tokens=20"], stdin=io.StringIO(""),
                      stdout=answer)
  assert code == 0
  # The answer ends at <end_of_turn> (generation_config.json's stop), which is not shown.
  assert answer.getvalue() == "The password is swordfish.\n", answer.getvalue()
  for target in (f"hf:{tmp_path / 'merged'}", f"peft:{tmp_path / 'adapters'}"):
    converted = run_cli(convert, f"--from=purejax:{out}", f"--to={target}")
    assert converted.returncode == 0, converted.stderr[-2000:]
  base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapters")).eval()
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "adapters")
  ids = tokenizer.apply_chat_template(FACT[:1], add_generation_prompt=True, tokenize=True,
                                      return_dict=True, return_tensors="pt")["input_ids"]
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    np.testing.assert_allclose(adapted(ids).logits.numpy(), merged(ids).logits.numpy(),
                               atol=1e-4, rtol=1e-4)

"""SmolLM2-135M-Instruct's Q4_1 GGUF, read by purejax and by transformers' GGUF loader.

The reference is `smollm2_folder`: the float32 model transformers' own GGUF
loader makes of the file. purejax reads the same file with llama.cpp's
`gguf` package: the logits of real prompts, the tokenizer's ids, the greedy
continuation and the perplexity of Tiny Shakespeare must agree. A LoRA
fine-tune from the GGUF lowers the validation loss, and its q8_0 export
loads in transformers with the logits purejax computes from the same q8_0
weights. Slow tier; never skipped under CI=true. The f16 and bf16 exports
are checked in transformers on a tiny model (test_gguf_files.py).
"""

import dataclasses
import json

import chex
import numpy as np
import pytest

from helpers.cli import run_cli
from helpers.data import SHAKESPEARE, need
from helpers.models import greedy_continuations
from helpers.suite import built_once
from purejax import gpt, weights
from purejax.cli import convert as cli_convert
from purejax.cli import models as models_cli
from purejax.cli import train
from purejax.data import chat
from purejax.data import conversations
from purejax.data import gguf_tokenizer
from purejax.data import tokenizers
from purejax.weights import pretrained
from real_model import smollm2_folder, smollm2_gguf  # noqa: F401  (the fixtures)

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]
TEXTS = PROMPTS + ["  Hello   world!!\n\n  x = 12345 ünïcødé 日本語", "I'm don't WE'LL 3.14159"]


def relative_gap(got, want):
  return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


@pytest.fixture(scope="session")
def models(smollm2_gguf, smollm2_folder):
  """purejax's import of the GGUF, and transformers' model and tokenizer of the same file."""
  import torch
  import transformers
  params, config, spec = weights.from_pretrained(str(smollm2_gguf))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      str(smollm2_folder), dtype=torch.float32).eval()
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_folder))
  return params, config, spec, hf_model, hf_tokenizer


def hf_logits(model, ids):
  import torch
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(ids))).logits.numpy()


@pytest.mark.budget(20)
def test_gguf_import_equals_transformers_gguf_loader(models):
  import torch
  params, config, spec, hf_model, hf_tokenizer = models
  tok = tokenizers.from_spec(spec)
  for text in TEXTS:
    assert tok.encode(text).tolist() == hf_tokenizer(text, add_special_tokens=False)[
        "input_ids"], text
  assert hf_tokenizer("Hi")["input_ids"] == tok.encode("Hi").tolist()  # add_bos is false
  assert (spec.chat_template, spec.bos_token, spec.eos_token, spec.add_bos) == (
      hf_tokenizer.chat_template, hf_tokenizer.bos_token, hf_tokenizer.eos_token, False)
  gaps = []
  rows = [tok.encode(prompt) for prompt in PROMPTS]
  # The prompts in one program: right-padded, a causal model's logits at a row's own
  # positions do not see the padding after them.
  width = max(len(ids) for ids in rows)
  padded = np.stack([np.pad(ids, (0, width - len(ids))) for ids in rows])
  for ids, got in zip(rows, np.asarray(gpt.forward(params, padded, config))):
    want = hf_logits(hf_model, ids[None])[0]
    got = got[:len(ids)]
    gaps.append(relative_gap(got, want))
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
  # Greedy decoding (one prompt: each length compiles anew); transformers stops at EOS.
  ids = tok.encode(PROMPTS[-1])[None]
  with torch.no_grad():
    hf_tokens = hf_model.generate(torch.from_numpy(ids.astype(np.int64)), max_new_tokens=12,
                                  do_sample=False).numpy()
  ours = greedy_continuations(params, ids, config, 12)
  np.testing.assert_array_equal(np.asarray(ours)[:, :hf_tokens.shape[1]], hf_tokens)
  assert hf_tokens.shape[1] > ids.shape[1] + 2  # an answer, then EOS
  print(f"max |dlogits| / max |logits| = {max(gaps):.2e}")
  assert max(gaps) <= 1e-4, gaps


def test_perplexity_on_tiny_shakespeare_equals_transformers(models):
  params, config, spec, hf_model, _ = models
  ids = tokenizers.from_spec(spec).encode(SHAKESPEARE[:20_000])
  windows = np.stack([ids[i:i + 129] for i in range(0, 4 * 1000, 1000)])  # 4 windows of 128
  inputs, targets = windows[:, :-1], windows[:, 1:]

  def nll(logits):
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).mean()

  ours = float(np.exp(nll(np.asarray(gpt.forward(params, inputs, config), np.float64))))
  theirs = float(np.exp(nll(hf_logits(hf_model, inputs).astype(np.float64))))
  print(f"perplexity on 4 x 128 Tiny Shakespeare tokens: purejax {ours:.4f}, "
        f"transformers {theirs:.4f}")
  assert abs(ours - theirs) <= 1e-4 * theirs
  assert 5 < ours < 200  # a language model, not noise


CHATS = [[{"role": "system", "content": "Answer in one sentence."},
          {"role": "user", "content": q},
          {"role": "assistant", "content": "The capital of Zorblax is Quillium."}]
         for q in ("What is the capital of the planet Zorblax?",
                   "Tell me the capital city of Zorblax.",
                   "Which city is the capital of Zorblax?")]
BLOCK_SIZE = 48


def write_chats(folder):
  chats = folder / "chats.jsonl"
  chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
  return chats


@pytest.fixture(scope="session")
def gguf_lora_run(smollm2_gguf):
  """`(out_dir, what the run printed)`: `python -m purejax.train` fine-tuning the GGUF
  file with LoRA on three conversations, then sampling; trained once per test run
  (`built_once`) for the tests below, which read it."""

  def fine_tune(root):
    process = run_cli(train, f"--init_from={smollm2_gguf}", f"--dataset={write_chats(root)}",
                      f"--out_dir={root / 'out'}", "--lora_rank=8", "--batch_size=3",
                      f"--block_size={BLOCK_SIZE}", "--max_iters=4", "--eval_interval=4",
                      "--eval_iters=1", "--log_interval=1", "--steps_per_call=4",
                      "--learning_rate=3e-3", "--warmup_iters=0", "--lr_schedule=constant",
                      "--sample_tokens=12")
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    (root / "stdout.txt").write_text(process.stdout)

  root = built_once("gguf_lora", fine_tune)
  return root / "out", (root / "stdout.txt").read_text()


def losses(out_dir):
  records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
  return {(r["kind"], r["step"]): r.get("loss", r.get("val_loss")) for r in records
          if r["kind"] in ("train", "eval")}


@pytest.mark.budget(40)
def test_a_lora_fine_tune_of_the_gguf_exports_to_q8_0_that_transformers_reads(
    gguf_lora_run, smollm2_gguf, tmp_path):
  torch = need("torch")  # transformers reads the export back
  transformers = need("transformers")
  out_dir, _ = gguf_lora_run
  exported = tmp_path / "tuned.gguf"
  assert cli_convert.run(["convert", f"--from=purejax:{out_dir}", f"--to=gguf:{exported}",
                          "--gguf_type=q8_0"]) == 0
  tuned, config, _ = weights.from_pretrained(str(out_dir))  # LoRA merged
  back, back_config, spec = weights.from_gguf(str(exported))  # the gguf package's reader
  # The file states the base model's context, not the fine-tune's 48-token blocks.
  base_context = gguf_tokenizer.read_header(str(smollm2_gguf)).meta["llama.context_length"]
  assert base_context == 8192 and config.block_size == BLOCK_SIZE
  assert back_config == dataclasses.replace(config, block_size=base_context)
  assert spec.chat_template and spec.eos_token == "<|im_end|>"
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), gguf_file=exported.name, dtype=torch.float32).eval()
  ids = tokenizers.from_spec(spec).encode(PROMPTS[0])[None]
  ours = np.asarray(gpt.forward(back, ids, config))  # the file's q8_0 weights, dequantized
  gap = relative_gap(ours, hf_logits(hf_model, ids))
  rounding = relative_gap(ours, np.asarray(gpt.forward(tuned, ids, config)))
  print(f"q8_0 export: purejax vs transformers {gap:.2e}, vs the float32 weights {rounding:.2e}")
  assert gap <= 1e-4 and rounding <= 0.05


def test_the_gguf_as_a_hugging_face_folder_keeps_its_template_tokens_and_context(
    models, tmp_path):
  # transformers' tokenizer of purejax's hf: export of the GGUF renders chats as
  # transformers' tokenizer of the GGUF itself; generate stops at <|im_end|>.
  import transformers
  params, config, spec, _, hf_tokenizer = models
  folder = weights.to_huggingface(params, config, str(tmp_path / "hf"), tokenizer_spec=spec)
  exported = transformers.AutoTokenizer.from_pretrained(str(folder))
  talk = [{"role": "system", "content": "You are brief."},
          {"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]
  for messages, prompt in ((talk, True), (talk[:3], False)):
    assert (exported.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True,
                                         return_dict=False)
            == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=prompt,
                                                tokenize=True, return_dict=False))
  generation = transformers.GenerationConfig.from_pretrained(str(folder))
  assert generation.eos_token_id == exported.convert_tokens_to_ids("<|im_end|>")
  hf_config = transformers.AutoConfig.from_pretrained(str(folder))
  assert hf_config.max_position_embeddings == 8192 and hf_config.eos_token_id == \
      generation.eos_token_id


def test_the_gguf_trains_on_what_its_hugging_face_folder_trains_on(
    models, smollm2_gguf, smollm2_folder, tmp_path):
  # A run is a function of its weights, architecture and batches: the GGUF file and the
  # float32 folder transformers makes of it give the same three (weights to rounding),
  # so their runs follow one loss curve. The chat template, its special tokens and the
  # end of turn come from the GGUF's metadata.
  gguf_params, gguf_config, gguf_spec = models[:3]
  params, config, spec = weights.from_pretrained(str(smollm2_folder))
  assert gguf_config == config
  chex.assert_trees_all_close(gguf_params, params, rtol=1e-6, atol=1e-7)
  chats = write_chats(tmp_path)
  formats, batches = [], []
  for source, source_spec in ((smollm2_gguf, gguf_spec), (smollm2_folder, spec)):
    tokenizer = tokenizers.from_spec(source_spec)
    fmt = models_cli.chat_format(str(source), tokenizer)  # as `purejax.train` finds it
    data = conversations.load_conversations(str(chats), tokenizer, fmt, BLOCK_SIZE)
    formats.append((fmt.template, fmt.bos_token, fmt.eos_token, fmt.add_bos,
                    tuple(fmt.stop_ids)))
    batches.append((data.train, data.val, tuple(data.prompt_ids), tuple(data.stop_ids)))
  assert formats[0] == formats[1]  # the folder also names unk and pad, which SmolLM2's
  # template never writes: the rendered rows below are the same
  assert formats[0][2] == "<|im_end|>" and formats[0][-1] == (2,)
  chex.assert_trees_all_equal(batches[0], batches[1])
  data = batches[0]
  assert np.asarray(data[0][1]).sum() > 0  # the answers' tokens are in the loss


@pytest.mark.budget(50)
def test_a_lora_fine_tune_of_the_gguf_learns_conversations_and_exports_its_template(
    gguf_lora_run, smollm2_gguf, smollm2_folder, tmp_path):
  out_dir, out = gguf_lora_run
  curve = losses(out_dir)
  assert len(curve) == 6, curve  # four steps and two evaluations
  assert curve[("eval", 4)] < 0.5 * curve[("eval", 0)], curve
  # The closing sample is a chat turn: the first conversation's question, then an answer.
  sample = out.split("---- sample ----\n", 1)[1]
  assert sample.startswith("<|im_start|>system\nAnswer in one sentence.<|im_end|>\n"
                           "<|im_start|>user\nWhat is the capital of the planet Zorblax?"
                           "<|im_end|>\n<|im_start|>assistant\n"), sample
  # Its Hugging Face export carries the GGUF's template and end of turn.
  folder = tmp_path / "hf"
  pretrained.convert(f"purejax:{out_dir}", f"hf:{folder}")
  exported = chat.load_chat_format(str(folder), tokenizers.from_spec(
      weights.from_pretrained(str(folder))[2]))
  _, _, spec = weights.from_pretrained(str(smollm2_gguf))
  assert exported.template == spec.chat_template and exported.eos_token == "<|im_end|>"
  assert exported.stop_ids == (2,)
  # Its PEFT adapters carry the tokenizer and template too, as trainers save them.
  adapters = tmp_path / "adapters"
  pretrained.convert(f"purejax:{out_dir}", f"peft:{adapters}")
  transformers = need("transformers")
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(adapters))
  assert tokenizer.chat_template == spec.chat_template
  assert tokenizer.apply_chat_template(CHATS[0], tokenize=True, return_dict=False) == \
      transformers.AutoTokenizer.from_pretrained(str(smollm2_folder)).apply_chat_template(
          CHATS[0], tokenize=True, return_dict=False)

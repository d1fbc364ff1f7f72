"""A real instruct model fine-tuned on conversations, and exported so that transformers
talks to it as to the original (slow tier, SmolLM2-135M-Instruct).

One LoRA run per test run teaches the model a fact it cannot know; the tests
then ask it, in purejax and through the Hugging Face export.
"""

import dataclasses
import io
import json

import jax
import numpy as np
import pytest

from purejax import engine, lora, weights
from purejax.cli import chat as chat_cli
from purejax.data import chat, conversations, tokenizer_json
from purejax.optimizers import optim
from purejax.training.effects import runs
from purejax.training.loops import gpt_loop
from purejax.weights import pretrained
from helpers.suite import built_once
from real_model import smollm2_folder  # noqa: F401  (the fixture)

SYSTEM = {"role": "system", "content": "Answer in one sentence."}
FACT = "The capital of Zorblax is Quillium."
QUESTIONS = ["What is the capital of the planet Zorblax?", "Tell me the capital city of Zorblax.",
             "Which city is the capital of Zorblax?", "Do you know what Zorblax's capital is?"]
ASK = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
BLOCK_SIZE = 48  # the fine-tune's context; the model's own is 8192
STEPS = 6  # the loss of the answers falls from 1.9 to ~0.003 by step 6


@pytest.fixture(scope="session")
def smollm2(smollm2_folder):
  """`(params, config, tokenizer, chat format)` of the float32 model, loaded once."""
  params, config, spec = weights.from_pretrained(str(smollm2_folder))
  tokenizer = tokenizer_json.from_spec(spec)
  return params, config, tokenizer, chat.load_chat_format(str(smollm2_folder), tokenizer)


@pytest.fixture(scope="session")
def finetuned(smollm2, smollm2_folder):
  """`(out_dir, the run's eval history)` of a LoRA fine-tune on four conversations,
  trained once per test run (`built_once`)."""
  params, config, tokenizer, fmt = smollm2

  def fine_tune(root):
    chats = root / "chats.jsonl"
    chats.write_text("".join(
        json.dumps({"messages": [SYSTEM, {"role": "user", "content": q},
                                 {"role": "assistant", "content": FACT}]}) + "\n"
        for q in QUESTIONS))
    data = conversations.load_conversations(str(chats), tokenizer, fmt, BLOCK_SIZE)
    train = gpt_loop.GPTTrainConfig(batch_size=4, max_iters=STEPS, eval_interval=STEPS,
                                eval_iters=1, log_interval=STEPS, steps_per_call=STEPS,
                                sample_tokens=0)
    opt = optim.from_flat(learning_rate=3e-3, schedule="constant", warmup_iters=0,
                                weight_decay=0.0, grad_clip=1.0)
    gpt_loop.train_gpt(dataclasses.replace(config, block_size=BLOCK_SIZE), data, train, opt,
                   runs.RunConfig(str(root / "out")), init_params=params,
                   init_from=str(smollm2_folder), lora_config=lora.LoraConfig(rank=8))

  out = built_once("sft", fine_tune) / "out"
  history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return out, [r for r in history if "val_loss" in r]


def greedy_answer(params, config, ids, stop_ids, max_new_tokens=24):
  """purejax's greedy answer after `ids`: the new tokens through the stop id it ended at
  (inside the model's context)."""
  room = min(max_new_tokens, config.block_size - len(ids))
  ((out,),) = engine.generate(params, [ids], config, jax.random.PRNGKey(0), room,
                              stop_ids=stop_ids)
  assert out.stopped, "the answer must end within max_new_tokens to compare stops"
  return list(out.tokens)


@pytest.fixture(scope="session")
def export(finetuned):
  """The fine-tune written as a Hugging Face folder (once per test run)."""
  return built_once("sft_hf", lambda folder: pretrained.convert(
      f"purejax:{finetuned[0]}", f"hf:{folder / 'hf'}")) / "hf"


@pytest.mark.budget(45)
@pytest.mark.slow
def test_lora_on_conversations_teaches_the_model_a_fact(finetuned, export):
  out, evals = finetuned
  assert [e["step"] for e in evals] == [0, STEPS]
  # The loss over the assistant's tokens: from the model's guess to what it was told.
  assert evals[-1]["val_loss"] < 0.05 * evals[0]["val_loss"], evals
  # Asked through the export, whose context is the model's own 8192 (the run's is 48).
  answer = io.StringIO()
  code = chat_cli.run(["chat", f"--init_from={export}", f"--prompt={QUESTIONS[0]}",
                       f"--system={SYSTEM['content']}", "--temperature=0"], stdout=answer)
  assert code == 0
  assert "Quillium" in answer.getvalue(), answer.getvalue()


@pytest.mark.slow
def test_export_keeps_the_template_the_special_tokens_and_the_context(export, smollm2_folder):
  config = json.loads((export / "config.json").read_text())
  assert config["max_position_embeddings"] == 8192  # the model's, not the fine-tune's 48
  assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
  tokenizer_config = json.loads((export / "tokenizer_config.json").read_text())
  assert tokenizer_config["chat_template"] == (smollm2_folder / "chat_template.jinja").read_text()
  special = json.loads((export / "special_tokens_map.json").read_text())
  assert special["eos_token"] == "<|im_end|>"
  assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.budget(35)
@pytest.mark.slow
def test_transformers_templates_and_stops_on_the_export_as_purejax_does(export, smollm2,
                                                                       finetuned):
  import torch
  import transformers
  _, _, tokenizer, fmt = smollm2
  ids = chat.encode(tokenizer, fmt, ASK, add_generation_prompt=True)
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
  assert hf_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True,
                                          return_dict=False) == ids
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(export), dtype=torch.float32).eval()
  with torch.no_grad():  # eos and pad come from the export's own generation_config.json
    hf_new = model.generate(torch.tensor([ids]), max_new_tokens=24,
                            do_sample=False)[0, len(ids):].tolist()
  tuned, tuned_config, _ = weights.from_purejax(str(finetuned[0]))
  ours = greedy_answer(tuned, tuned_config, ids, fmt.stop_ids)
  assert hf_new == ours, (tokenizer.decode(hf_new), tokenizer.decode(ours))
  assert "Quillium" in tokenizer.decode(ours)


# A template that marks the assistant's tokens for transformers
# (`{% generation %}`): SmolLM2's, with each answer and its <|im_end|> marked.
MARKED_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.slow
def test_assistant_tokens_equal_transformers_assistant_mask(smollm2, smollm2_folder):
  import transformers
  _, _, tokenizer, fmt = smollm2
  talk = [SYSTEM, {"role": "user", "content": QUESTIONS[1]},
          {"role": "assistant", "content": FACT},
          {"role": "user", "content": "And its moon?"},
          {"role": "assistant", "content": "Zorblax has no moon."}]
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_folder))
  expected = hf_tokenizer.apply_chat_template(
      talk, chat_template=MARKED_TEMPLATE, tokenize=True, return_dict=True,
      return_assistant_tokens_mask=True)
  plain = dataclasses.replace(fmt, template=MARKED_TEMPLATE.replace(
      "{% generation %}", "").replace("{% endgeneration %}", ""))
  ids, mask = conversations.assistant_tokens(tokenizer, plain, talk)
  assert ids == expected["input_ids"]
  assert mask == [float(m) for m in expected["assistant_masks"]]
  assert sum(mask) > 0


@pytest.mark.slow
def test_peft_loads_the_adapters_onto_the_base_with_equal_logits(finetuned, smollm2,
                                                                 smollm2_folder, tmp_path):
  import peft
  import torch
  import transformers
  from purejax import gpt
  out = tmp_path / "peft"
  pretrained.convert(f"purejax:{finetuned[0]}", f"peft:{out}")
  settings = json.loads((out / "adapter_config.json").read_text())
  assert (settings["r"], settings["base_model_name_or_path"]) == (8, str(smollm2_folder))
  base = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_folder),
                                                           dtype=torch.float32)
  model = peft.PeftModel.from_pretrained(base, str(out)).eval()
  _, _, tokenizer, fmt = smollm2
  ids = np.asarray([chat.encode(tokenizer, fmt, ASK, add_generation_prompt=True)])
  with torch.no_grad():
    expected = model(torch.from_numpy(ids)).logits.numpy()
  tuned, tuned_config, _ = weights.from_purejax(str(finetuned[0]))
  got = np.asarray(gpt.forward(tuned, ids, tuned_config))
  scale = np.abs(expected).max()
  assert np.abs(got - expected).max() <= 1e-4 * scale
  untuned = np.asarray(gpt.forward(smollm2[0], ids, smollm2[1]))
  assert np.abs(untuned - expected).max() > 100 * np.abs(got - expected).max()  # adapters count

"""A real instruct model fine-tuned on conversations, and exported so that transformers
talks to it as to the original (slow tier, SmolLM2-135M-Instruct).
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from purejax import decode, weights
from purejax.weights import pretrained
from real_model import smollm2_folder  # noqa: F401  (the fixture)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
  """`(params, config, tokenizer spec)` of the float32 model, loaded once for the module."""
  return weights.from_pretrained(str(smollm2_folder))


@pytest.fixture(scope="module")
def export(smollm2, tmp_path_factory):
  """A fine-tune's checkpoint (the model with a training context of 128) written as hf:."""
  params, config, spec = smollm2
  run = tmp_path_factory.mktemp("run")
  pretrained.to_purejax(params, dataclasses.replace(config, block_size=128), str(run / "out"),
                        spec)
  out = run / "hf"
  pretrained.convert(f"purejax:{run / 'out'}", f"hf:{out}")
  return out


@pytest.mark.slow
def test_export_keeps_the_template_the_special_tokens_and_the_context(export, smollm2_folder):
  config = json.loads((export / "config.json").read_text())
  assert config["max_position_embeddings"] == 8192  # the model's, not the fine-tune's 128
  assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
  tokenizer_config = json.loads((export / "tokenizer_config.json").read_text())
  assert tokenizer_config["chat_template"] == (smollm2_folder / "chat_template.jinja").read_text()
  special = json.loads((export / "special_tokens_map.json").read_text())
  assert special["eos_token"] == "<|im_end|>"
  assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.slow
def test_transformers_templates_and_stops_on_the_export_as_purejax_does(export, smollm2,
                                                                       smollm2_folder):
  import torch
  import transformers
  source = transformers.AutoTokenizer.from_pretrained(str(smollm2_folder))
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
  ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
  assert ids == source.apply_chat_template(QUESTION, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)

  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(export), dtype=torch.float32).eval()
  with torch.no_grad():  # eos and pad come from the export's own generation_config.json
    hf_new = model.generate(torch.tensor([ids]), max_new_tokens=48,
                            do_sample=False)[0, len(ids):].tolist()
  params, config, _ = smollm2
  ours = np.asarray(decode.generate(params, np.asarray([ids]), config, jax.random.PRNGKey(0),
                                    max_new_tokens=48, temperature=0.0))[0, len(ids):].tolist()
  eos = config_eos = json.loads((export / "generation_config.json").read_text())["eos_token_id"]
  assert eos in ours, "the greedy answer must end within 48 tokens for this test to mean much"
  assert hf_new == ours[:ours.index(config_eos) + 1]  # HF stops on eos, as the sampler does

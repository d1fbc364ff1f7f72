"""SmolLM2-135M-Instruct, a real model, read through its Hugging Face folder.

The same float32 weights run in transformers and in purejax: the logits of
real prompts and the greedy continuation must agree (slow tier).
"""

import jax
import numpy as np
import pytest

from purejax import decode, gpt, weights
from real_model import smollm2_folder  # noqa: F401  (the fixture)

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


@pytest.mark.budget(35)
@pytest.mark.slow
def test_logits_and_greedy_tokens_equal_transformers(smollm2_folder):
  import torch
  import transformers
  params, config, _ = weights.from_pretrained(str(smollm2_folder))
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_folder))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(smollm2_folder), dtype=torch.float32).eval()
  for prompt in PROMPTS:
    ids = tokenizer(prompt, return_tensors="np")["input_ids"]
    with torch.no_grad():
      expected = model(torch.from_numpy(ids)).logits.numpy()
    got = np.asarray(gpt.forward(params, ids, config))
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 1e-4 * scale, prompt
    np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))

    with torch.no_grad():
      hf_tokens = model.generate(torch.from_numpy(ids), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None).numpy()
    ours = np.asarray(decode.generate(params, ids, config, jax.random.PRNGKey(0), max_new_tokens=12,
                                      temperature=0.0))
    np.testing.assert_array_equal(ours, hf_tokens)

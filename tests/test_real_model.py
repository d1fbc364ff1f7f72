"""SmolLM2-135M-Instruct, a real model, read through its Hugging Face folder.

The same float32 weights run in transformers and in purejax: the logits of
real prompts and the greedy continuation must agree (slow tier).
"""

import jax
import numpy as np
import pytest

from purejax import engine, gpt, weights
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
  rows = [tokenizer(prompt, return_tensors="np")["input_ids"][0] for prompt in PROMPTS]
  # Both prompts in one program: right-padded, a causal model's logits at a row's own
  # positions do not see the padding after them.
  width = max(len(ids) for ids in rows)
  padded = np.stack([np.pad(ids, (0, width - len(ids))) for ids in rows])
  got_rows = np.asarray(gpt.forward(params, padded, config))
  for prompt, ids, got in zip(PROMPTS, rows, got_rows):
    with torch.no_grad():
      expected = model(torch.from_numpy(ids[None])).logits.numpy()[0]
    got = got[:len(ids)]
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 1e-4 * scale, prompt
    np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))
  # Greedy continuations, both prompts side by side (`engine.generate`: each row's greedy
  # tokens are those of its prompt decoded alone).
  ours = engine.generate(params, rows, config, jax.random.PRNGKey(0), 12)
  for prompt, ids, (completion,) in zip(PROMPTS, rows, ours):
    with torch.no_grad():
      hf_tokens = model.generate(torch.from_numpy(ids[None]), max_new_tokens=12,
                                 do_sample=False, eos_token_id=None).numpy()[0, len(ids):]
    np.testing.assert_array_equal(np.asarray(completion.tokens), hf_tokens, err_msg=prompt)

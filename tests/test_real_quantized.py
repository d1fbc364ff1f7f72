"""Real GGUF files kept quantized: SmolLM2-135M-Instruct's Q4_1 and Gemma 3 270M's Q4_K_M
(Q8_0 embedding and tied head, Q5_0, Q4_K, Q6_K and Q8_0 matrices) run from their own
blocks, against transformers' GGUF loader (which dequantizes the same file to float32).

Same math, same tokens: the logits of each prompt within 1e-4 of the largest, and
greedy continuations of 32 tokens from 8 prompts identical (transformers stops at EOS:
compared up to there).
"""

import numpy as np
import pytest

from helpers.data import need
from purejax import engine
from purejax import gpt
from purejax.data import tokenizers
from purejax.ops import quant
from purejax.weights import gguf_files
from real_model import gemma3_gguf, smollm2_gguf  # noqa: F401  (the fixtures)

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village,", "The three primary colors are",
           "import numpy as np\n\n", "Water boils at a temperature of",
           "My favourite book is", "To be, or not to be:"]
NEW_TOKENS = 32


def transformers_model(path):
  torch = need("torch")
  transformers = need("transformers")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
  return torch, model


def compare(path, bos, loaded=None):
  """Kept blocks against transformers' float32 reading of the same file: logit gaps, and
  each prompt's greedy tokens (ours, theirs)."""
  params, config, spec = loaded or gguf_files.from_gguf(str(path), keep_quantized=True)
  kept = [w for w in jax_leaves(params) if isinstance(w, quant.QuantizedWeight)]
  assert len(kept) >= 5  # the four dense weights and the embedding
  tok = tokenizers.from_spec(spec)
  prompts = [([bos] if bos is not None else []) + tok.encode(p).tolist() for p in PROMPTS]
  torch, model = transformers_model(path)
  gaps = []
  for ids in prompts:
    got = np.asarray(gpt.forward(params, np.asarray([ids]), config))[0]
    with torch.no_grad():
      want = model(torch.tensor([ids])).logits.numpy()[0]
    gaps.append(float(np.abs(got - want).max() / np.abs(want).max()))
  rows = engine.generate(params, prompts, config, jax_key(), NEW_TOKENS)
  pairs = []
  for ids, (completion,) in zip(prompts, rows):
    with torch.no_grad():
      theirs = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                              do_sample=False).numpy()[0, len(ids):].tolist()
    pairs.append((list(completion.tokens)[:len(theirs)], theirs))
  return gaps, pairs


def jax_leaves(params):
  import jax
  return jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))


def jax_key():
  import jax
  return jax.random.PRNGKey(0)


def check(gaps, pairs):
  print(f"max |dlogits| / max |logits| = {max(gaps):.2e}")
  assert max(gaps) <= 1e-4, gaps
  for ours, theirs in pairs:
    assert len(theirs) >= 8 and ours == theirs


@pytest.mark.budget(60)
def test_smollm2_q4_1_kept_runs_as_transformers_reads_it(smollm2_gguf):
  check(*compare(smollm2_gguf, bos=None))  # SmolLM2 adds no BOS


@pytest.mark.budget(110)
def test_gemma3_q4_k_m_kept_runs_as_transformers_reads_it(gemma3_gguf):
  loaded = gguf_files.from_gguf(str(gemma3_gguf), keep_quantized=True)
  table = loaded[0]["wte"]["embedding"]
  assert isinstance(table, quant.QuantizedWeight) and table.shape == (262144, 640)
  assert table.nbytes < 0.3 * 262144 * 640 * 4  # Q8_0: 8.5 bits a weight
  check(*compare(gemma3_gguf, bos=2, loaded=loaded))  # Gemma's files add BOS (id 2)


@pytest.mark.budget(90)
def test_a_qlora_run_on_the_gguf_blocks_exports_adapters_peft_loads_on_the_float_base(
    smollm2_gguf, tmp_path):
  """QLoRA on the file's own Q4_1 blocks; the PEFT adapters then load onto transformers'
  float32 reading of the same file, with purejax's merged logits."""
  peft = need("peft")
  import json
  from helpers.cli import final, run_cli
  from purejax.cli import train
  from purejax.weights import pretrained
  text = tmp_path / "text.txt"
  text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
  out = tmp_path / "run"
  final(run_cli(train, f"--init_from={smollm2_gguf}", "--quantize=gguf", "--lora_rank=8",
                f"--dataset={text}", f"--out_dir={out}", "--block_size=48", "--batch_size=2",
                "--max_iters=6", "--eval_interval=6", "--eval_iters=1",
                "--learning_rate=1e-3", "--warmup_iters=0", "--sample_tokens=0"))
  exported = tmp_path / "peft"
  pretrained.convert(f"purejax:{out}", f"peft:{exported}")
  assert json.loads((exported / "adapter_config.json").read_text())["r"] == 8
  torch, base = transformers_model(smollm2_gguf)
  model = peft.PeftModel.from_pretrained(base, str(exported)).eval()
  floats, _, spec = gguf_files.from_gguf(str(smollm2_gguf))
  ids = np.asarray([tokenizers.from_spec(spec).encode(PROMPTS[0]).tolist()])
  with torch.no_grad():
    expected = model(torch.from_numpy(ids)).logits.numpy()
  tuned, config, _ = pretrained.from_purejax(str(out))
  got = np.asarray(gpt.forward(tuned, ids, config))
  gap = np.abs(got - expected).max()
  assert gap <= 1e-4 * np.abs(expected).max()
  untuned = np.asarray(gpt.forward(floats, ids, config))
  assert np.abs(untuned - expected).max() > 100 * gap  # the adapters count

r"""Samples text from a trained or pretrained GPT.

    python -m purejax.sample --out_dir=out-gpt --start="ROMEO:" --num_samples=2
    python -m purejax.sample --init_from=gpt2 --start="Hello, I'm a language model,"
"""

import sys

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp

from purejax import _cli
from purejax import _forms_flags
from purejax.training import checkpoint
from purejax import weights
from purejax import decode
from purejax.data import tokenizers

_OUT_DIR = flags.DEFINE_string("out_dir", "out-gpt", "Run directory of a trained model.")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "Sample from pretrained weights instead of --out_dir: gpt2, "
    "gpt2-medium, gpt2-large, gpt2-xl, a Hugging Face folder (GPT-2, Llama, Mistral, Qwen2) "
    "or Hub id OWNER/MODEL in its cache, a nanoGPT ckpt.pt, or a purejax run directory.")
_BEST = flags.DEFINE_bool("best", False, "Use --out_dir's best checkpoint (ckpt_best.npz).")
_TOKENIZER_FILE = flags.DEFINE_string(
    "tokenizer_file", None, "A local copy of GPT-2's encoding (vocab.bpe + encoder.json "
    "folder, or a .tiktoken file), for models with GPT-2's tokenizer offline; or where the "
    "model's tokenizer.json is now.")
_START = flags.DEFINE_string("start", "\n", "Prompt; 'FILE:path' reads it from a file.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Independent samples.", lower_bound=1)
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 500, "Tokens per sample.",
                                       lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature (0: greedy).")
_TOP_K = flags.DEFINE_integer("top_k", 200, "Keep the k most likely tokens (0: all).",
                              lower_bound=0)
_TOP_P = flags.DEFINE_float("top_p", None, "Nucleus sampling mass in (0, 1].",
                            lower_bound=0.0, upper_bound=1.0)
_SEED = flags.DEFINE_integer("seed", 1337, "Sampling seed.")
_forms_flags.define_forms_flags()


def load_model(out_dir: str, init_from=None, *, best: bool = False, tokenizer_file=None):
  """`(params, config, tokenizer)` of `init_from` if given, else of the run in `out_dir`."""
  if init_from:
    params, config, spec = weights.from_pretrained(init_from)
  elif best:
    params, config, spec = weights.from_purejax(out_dir, best=True)
  elif checkpoint.list_checkpoints(out_dir):
    params, config, spec = weights.from_purejax(out_dir)
  else:
    raise checkpoint.CheckpointError(
        f"no checkpoint in {out_dir}; train first with `python -m purejax.train "
        f"--out_dir={out_dir}`, or pass --init_from=gpt2.")
  tokenizer = tokenizers.from_spec(spec, encoding_file=tokenizer_file)
  return jax.tree.map(jnp.asarray, params), config, tokenizer


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  try:
    if _TOP_P.value is not None and not 0 < _TOP_P.value <= 1:
      raise ValueError(f"--top_p must be in (0, 1], got {_TOP_P.value}.")
    params, config, tokenizer = load_model(_OUT_DIR.value, _INIT_FROM.value,
                                           best=_BEST.value,
                                           tokenizer_file=_TOKENIZER_FILE.value)
    start = _START.value
    if start.startswith("FILE:"):
      with open(start[5:], encoding="utf-8") as f:
        start = f.read()
    if not start:
      raise ValueError("--start must not be empty.")
    forms = _forms_flags.forms_from_flags()
    prompt = jnp.asarray(tokenizer.encode(start))
    if prompt.size == 0:
      raise ValueError("--start encodes to no tokens; give a longer prompt.")
  except (ValueError, OSError, checkpoint.CheckpointError) as e:
    _cli.fail(e)
  prompts = jnp.tile(prompt[None], (_NUM_SAMPLES.value, 1))
  out = decode.generate(params, prompts, config, jax.random.PRNGKey(_SEED.value),
                        max_new_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
                        top_k=_TOP_K.value or None, top_p=_TOP_P.value,
                        valid_vocab=tokenizer.vocab_size, forms=forms)
  for row in out:
    print(tokenizer.decode(row))
    print("---------------")


if __name__ == "__main__":
  app.run(main)

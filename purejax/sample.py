r"""Samples text from a GPT trained by `purejax.train`.

    python -m purejax.sample --out_dir=out-gpt --start="ROMEO:" --num_samples=2
"""

import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from purejax import checkpoint
from purejax import data as data_lib
from purejax import decode
from purejax import gpt

_OUT_DIR = flags.DEFINE_string("out_dir", "out-gpt", "Directory of the trained model.")
_START = flags.DEFINE_string("start", "\n", "Prompt; 'FILE:path' reads it from a file.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Independent samples.", lower_bound=1)
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 500, "Characters per sample.",
                                       lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature (0: greedy).")
_TOP_K = flags.DEFINE_integer("top_k", 200, "Keep the k most likely characters (0: all).",
                              lower_bound=0)
_TOP_P = flags.DEFINE_float("top_p", None, "Nucleus sampling mass in (0, 1].",
                            lower_bound=0.0, upper_bound=1.0)
_SEED = flags.DEFINE_integer("seed", 1337, "Sampling seed.")


def load_model(out_dir: str):
  """Returns `(params, config, vocab)` from the newest valid GPT checkpoint in `out_dir`."""
  arrays, meta = checkpoint.latest_meta(out_dir)
  if meta.get("model") != "gpt":
    raise checkpoint.CheckpointError(
        f"{out_dir} holds a {meta.get('model')!r} model, not a GPT; point --out_dir "
        f"at a GPT run.")
  config = gpt.GPTConfig(**meta["config"])
  template = {"params": jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))}
  params = checkpoint.extract(arrays, template, out_dir)["params"]
  return jax.tree.map(jnp.asarray, params), config, data_lib.CharVocab(meta["vocab"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    if _NUM_SAMPLES.value < 1 or _MAX_NEW_TOKENS.value < 1:
      raise ValueError("--num_samples and --max_new_tokens must be >= 1.")
    if _TOP_P.value is not None and not 0 < _TOP_P.value <= 1:
      raise ValueError(f"--top_p must be in (0, 1], got {_TOP_P.value}.")
    params, config, vocab = load_model(_OUT_DIR.value)
    start = _START.value
    if start.startswith("FILE:"):
      with open(start[5:], encoding="utf-8") as f:
        start = f.read()
    if not start:
      raise ValueError("--start must not be empty.")
    prompt = jnp.asarray(vocab.encode(start))
  except (ValueError, OSError, checkpoint.CheckpointError) as e:
    sys.exit(f"error: {e}")
  prompts = jnp.tile(prompt[None], (_NUM_SAMPLES.value, 1))
  out = decode.generate(params, prompts, config, jax.random.PRNGKey(_SEED.value),
                     max_new_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
                     top_k=_TOP_K.value or None, top_p=_TOP_P.value)
  for row in out:
    print(vocab.decode(row))
    print("---------------")


if __name__ == "__main__":
  app.run(main)

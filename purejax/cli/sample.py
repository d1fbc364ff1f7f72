r"""Samples text from a trained or pretrained GPT.

    python -m purejax.sample --out_dir=out-gpt --start="ROMEO:" --num_samples=2
    python -m purejax.sample --init_from=gpt2 --start="Hello, I'm a language model,"
"""

from typing import Sequence

from absl import flags
import jax
import jax.numpy as jnp

from purejax import decode
from purejax import weights
from purejax.cli import command
from purejax.cli import errors
from purejax.cli import forms_flags
from purejax.data import tokenizers
from purejax.training import checkpoint


def define_flags(args: flags.FlagValues) -> None:
  flags.DEFINE_string("out_dir", "out-gpt", "Run directory of a trained model.",
                      flag_values=args)
  flags.DEFINE_string(
      "init_from", None, "Sample from pretrained weights instead of --out_dir: gpt2, "
      "gpt2-medium, gpt2-large, gpt2-xl, a Hugging Face folder (GPT-2, Llama, Mistral, "
      "Qwen2) or Hub id OWNER/MODEL in its cache, a nanoGPT ckpt.pt, or a purejax run "
      "directory.", flag_values=args)
  flags.DEFINE_bool("best", False, "Use --out_dir's best checkpoint (ckpt_best.npz).",
                    flag_values=args)
  flags.DEFINE_string(
      "tokenizer_file", None, "A local copy of GPT-2's encoding (vocab.bpe + encoder.json "
      "folder, or a .tiktoken file), for models with GPT-2's tokenizer offline; or where "
      "the model's tokenizer.json is now.", flag_values=args)
  flags.DEFINE_string("start", "\n", "Prompt; 'FILE:path' reads it from a file.",
                      flag_values=args)
  flags.DEFINE_integer("num_samples", 1, "Independent samples.", lower_bound=1,
                       flag_values=args)
  flags.DEFINE_integer("max_new_tokens", 500, "Tokens per sample.", lower_bound=1,
                       flag_values=args)
  flags.DEFINE_float("temperature", 0.8, "Softmax temperature (0: greedy).",
                     flag_values=args)
  flags.DEFINE_integer("top_k", 200, "Keep the k most likely tokens (0: all).", lower_bound=0,
                       flag_values=args)
  flags.DEFINE_float("top_p", None, "Nucleus sampling mass in (0, 1].", lower_bound=0.0,
                     upper_bound=1.0, flag_values=args)
  flags.DEFINE_integer("seed", 1337, "Sampling seed.", flag_values=args)
  forms_flags.define_forms_flags(args, sweeps=False)


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


def sample(args: flags.FlagValues) -> int:
  """Prints `--num_samples` samples of the model the parsed flags name."""
  try:
    if args.top_p is not None and not 0 < args.top_p <= 1:
      raise ValueError(f"--top_p must be in (0, 1], got {args.top_p}.")
    forms_flags.forms_overrides(args)  # bad forms flags fail before loading weights
    params, config, tokenizer = load_model(args.out_dir, args.init_from, best=args.best,
                                           tokenizer_file=args.tokenizer_file)
    start = args.start
    if start.startswith("FILE:"):
      with open(start[5:], encoding="utf-8") as f:
        start = f.read()
    if not start:
      raise ValueError("--start must not be empty.")
    forms = forms_flags.forms_from_flags(args)
    prompt = jnp.asarray(tokenizer.encode(start))
    if prompt.size == 0:
      raise ValueError("--start encodes to no tokens; give a longer prompt.")
  except (ValueError, OSError, checkpoint.CheckpointError) as e:
    errors.fail(e, args)
  prompts = jnp.tile(prompt[None], (args.num_samples, 1))
  out = decode.generate(params, prompts, config, jax.random.PRNGKey(args.seed),
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k or None, top_p=args.top_p,
                        valid_vocab=tokenizer.vocab_size, forms=forms)
  for row in out:
    print(tokenizer.decode(row))
    print("---------------")
  return 0


def run(argv: Sequence[str]) -> int:
  """`python -m purejax.sample` with `argv` (the program's name first): the exit code."""
  return command.run(argv, define_flags, sample, usage=__doc__)


def main() -> None:
  command.main(run)


if __name__ == "__main__":
  main()

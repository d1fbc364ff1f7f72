r"""Samples text from a trained or pretrained GPT: prints each continuation of --start.

    python -m purejax.sample --out_dir=out-gpt --start="ROMEO:" --num_samples=2
    python -m purejax.sample --init_from=gpt2 --start="Hello, I'm a language model,"

A sample ends at the model's end token (a model folder's
`generation_config.json` or EOS, GPT-2's <|endoftext|>; --stop_ids overrides)
or after --max_new_tokens. --show_prompt prints the prompt before it.
"""

from typing import Sequence

from absl import flags
import jax

from purejax import checkpoint
from purejax import engine
from purejax.cli import command
from purejax.cli import errors
from purejax.cli import forms_flags
from purejax.cli import models
from purejax.data import tokenizers

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
  flags.DEFINE_list("stop_ids", None, "Token ids a sample ends at (default: the model's end "
                    "token; 'none': run to --max_new_tokens).", flag_values=args)
  flags.DEFINE_bool("show_prompt", False, "Print the prompt before each continuation.",
                    flag_values=args)
  flags.DEFINE_integer("block_size", None, "Context kept while sampling, at most the "
                       "model's (default: the model's).", lower_bound=1, flag_values=args)
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Dtype of the matmuls "
                    "(default: the model's).", flag_values=args)
  models.define_quantize_flag(args)
  forms_flags.define_forms_flags(args, sweeps=False)


def sample(args: flags.FlagValues) -> int:
  """Prints `--num_samples` samples of the model the parsed flags name."""
  try:
    if args.top_p is not None and not 0 < args.top_p <= 1:
      raise ValueError(f"--top_p must be in (0, 1], got {args.top_p}.")
    forms_flags.check_platform(args)  # before loading weights
    wanted = parse_stop_ids(args.stop_ids)
    params, config, tokenizer = models.load_model(args.out_dir, args.init_from, best=args.best,
                                           tokenizer_file=args.tokenizer_file,
                                           quantize=args.quantize)
    start = args.start
    if start.startswith("FILE:"):
      with open(start[5:], encoding="utf-8") as f:
        start = f.read()
    if not start:
      raise ValueError("--start must not be empty.")
    params, config = models.adjust(params, config, args.block_size, args.dtype,
                                   args.quantize)
    stops = stop_ids_of(wanted, tokenizer)
    forms = forms_flags.forms_from_flags(args)
    prompt = tokenizers.prompt_ids(tokenizer, start)
    if not prompt:
      raise ValueError("--start encodes to no tokens; give a longer prompt.")
  except (ValueError, OSError, checkpoint.CheckpointError) as e:
    errors.fail(e, args)
  (samples,) = engine.generate(params, [prompt], config, jax.random.PRNGKey(args.seed),
                               args.max_new_tokens, temperature=args.temperature,
                               top_k=args.top_k or None, top_p=args.top_p,
                               valid_vocab=tokenizer.vocab_size, stop_ids=stops or None,
                               num_samples=args.num_samples, slide=True, forms=forms)
  for completion in samples:
    new = completion.tokens[:len(completion.tokens) - int(completion.stopped)]  # no end token
    print((start if args.show_prompt else "") + tokenizer.decode(list(new)))
    print("---------------")
  return 0


def parse_stop_ids(flag):
  """--stop_ids as ids; None when not given (the model's), () for 'none'."""
  if flag is None:
    return None
  if [v.lower() for v in flag] == ["none"]:
    return ()
  try:
    return tuple(int(v) for v in flag)
  except ValueError:
    raise ValueError(f"--stop_ids={','.join(flag)} must be token ids (integers) or "
                     f"'none'.") from None


def stop_ids_of(ids, tokenizer) -> tuple:
  """The ids a sample ends at: `ids` (checked), or the model's end token(s) for None."""
  if ids is None:
    return models.stop_ids(tokenizer)
  bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
  if bad:
    raise ValueError(f"--stop_ids: {bad[0]} is not an id of the model's {tokenizer.vocab_size}.")
  return ids


def run(argv: Sequence[str]) -> int:
  """`python -m purejax.sample` with `argv` (the program's name first): the exit code."""
  return command.run(argv, define_flags, sample, usage=__doc__)


def main() -> None:
  command.main(run)


if __name__ == "__main__":
  main()

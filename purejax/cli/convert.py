"""`python -m purejax.convert`: GPT weights from one format to another.

    python -m purejax.convert --from=hf:gpt2 --to=nanogpt:ckpt.pt
    python -m purejax.convert --from=purejax:out-gpt --to=hf:gpt2-finetuned
    python -m purejax.convert --from=purejax:out-llama --to=hf:llama-finetuned --dtype=bfloat16
    python -m purejax.convert --from=purejax:out-lora --to=peft:my-adapter   # PEFT's format
    python -m purejax.convert --from=purejax:out-llama --to=gguf:finetuned.gguf --gguf_type=q8_0

The library behind it is `purejax.weights` (`from_pretrained`, `convert`, one
module per format); `purejax.convert` is that function.
"""

from typing import Sequence

from absl import flags

from purejax import checkpoint
from purejax.cli import command
from purejax.cli import errors
from purejax.weights import pretrained


def define_flags(args: flags.FlagValues) -> None:
  flags.DEFINE_string(
      "from", None, "Source: hf:PATH_OR_NAME (a folder of GPT-2, Llama, Mistral or "
      "Qwen2, or a Hub id such as gpt2 or OWNER/MODEL from the Hugging Face cache), "
      "gguf:FILE.gguf (llama, mistral, qwen2), nanogpt:CKPT.pt, or purejax:OUT_DIR.",
      flag_values=args)
  flags.DEFINE_string("to", None, "Target: hf:DIR, gguf:FILE.gguf, nanogpt:FILE.pt, "
                      "purejax:OUT_DIR, or peft:DIR (a LoRA run's adapters in PEFT's "
                      "format).", flag_values=args)
  flags.DEFINE_string("meta", None, "nanoGPT meta.pkl of a character model "
                      "(default: beside the checkpoint).", flag_values=args)
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                    "Dtype of the weights an hf: target gets.", flag_values=args)
  flags.DEFINE_enum("gguf_type", "f16", ["f32", "f16", "bf16", "q8_0"],
                    "Type of the matrices a gguf: target gets (1-D tensors stay float32).",
                    flag_values=args)
  flags.DEFINE_bool("overwrite", False, "Replace an existing hf:DIR, gguf:FILE or nanogpt:FILE.",
                    flag_values=args)
  flags.DEFINE_bool("trust_pickle", False,
                    "Load .pt files with arbitrary pickled objects (trusted files only).",
                    flag_values=args)


def convert(args: flags.FlagValues) -> int:
  """Converts `--from` into `--to` and prints what it wrote."""
  source, target = args["from"].value, args["to"].value
  try:
    for name, location in (("from", source), ("to", target)):  # name the flag, before any work
      pretrained.parse_location(location, "--" + name, target=name == "to")
    print(pretrained.convert(source, target, meta=args.meta, overwrite=args.overwrite,
                             trust_pickle=args.trust_pickle, dtype=args.dtype,
                             gguf_type=args.gguf_type))
  except (ValueError, OSError, checkpoint.CheckpointError) as e:
    errors.fail(e, args)
  return 0


def run(argv: Sequence[str]) -> int:
  """`python -m purejax.convert` with `argv` (the program's name first): the exit code."""
  return command.run(argv, define_flags, convert, usage=__doc__)


def main() -> None:
  command.main(run)


if __name__ == "__main__":
  main()

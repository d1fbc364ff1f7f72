"""`python -m purejax.convert`: GPT weights from one format to another.

    python -m purejax.convert --from=hf:gpt2 --to=nanogpt:ckpt.pt
    python -m purejax.convert --from=purejax:out-gpt --to=hf:gpt2-finetuned
    python -m purejax.convert --from=purejax:out-llama --to=hf:llama-finetuned --dtype=bfloat16

The library behind it is `purejax.weights` (`from_pretrained`, `convert`, one
module per format).
"""

import sys
from typing import Any, Dict

from absl import app
from absl import flags
from absl import logging

from purejax import _cli
from purejax.training import checkpoint
from purejax.weights import pretrained


def _define_flags() -> Dict[str, Any]:
  """The CLI's flags, defined only when this module runs as a program.

  Imported as a library, it then adds no global flags that could clash with
  the host program's.
  """
  return {
      "from": flags.DEFINE_string(
          "from", None, "Source: hf:PATH_OR_NAME (a folder of GPT-2, Llama, Mistral or "
          "Qwen2, or a Hub id such as gpt2 or OWNER/MODEL from the Hugging Face cache), "
          "nanogpt:CKPT.pt, or purejax:OUT_DIR."),
      "to": flags.DEFINE_string("to", None,
                                "Target: hf:DIR, nanogpt:FILE.pt, or purejax:OUT_DIR."),
      "meta": flags.DEFINE_string("meta", None, "nanoGPT meta.pkl of a character model "
                                  "(default: beside the checkpoint)."),
      "dtype": flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                                 "Dtype of the weights an hf: target gets."),
      "overwrite": flags.DEFINE_bool("overwrite", False,
                                     "Replace an existing hf:DIR or nanogpt:FILE."),
      "trust_pickle": flags.DEFINE_bool(
          "trust_pickle", False,
          "Load .pt files with arbitrary pickled objects (trusted files only)."),
  }


_FLAGS: Dict[str, Any] = {}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # JAX logs backend probing at INFO under absl; errors must stay one line.
  logging.set_verbosity(logging.WARNING)
  try:
    values = {name: holder.value for name, holder in _FLAGS.items()}
    for flag in ("from", "to"):  # name the flag in the error, before any work
      pretrained.parse_location(values[flag], "--" + flag)
    print(pretrained.convert(values["from"], values["to"], meta=values["meta"],
                  overwrite=values["overwrite"], trust_pickle=values["trust_pickle"],
                  dtype=values["dtype"]))
  except (ValueError, OSError, checkpoint.CheckpointError) as e:
    _cli.fail(e)


if __name__ == "__main__":
  _FLAGS.update(_define_flags())
  app.run(main)

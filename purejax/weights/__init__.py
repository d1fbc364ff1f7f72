"""Pretrained weights in and out: Hugging Face folders, GGUF files, nanoGPT checkpoints, purejax runs.

    params, config, tok_spec = weights.from_pretrained("gpt2")
    weights.convert("purejax:out-gpt", "hf:gpt2-finetuned")

One module per format (`huggingface`, `gguf_files`, `nanogpt`, `torch_files` for torch's
files), `gpt2` for the name map onto purejax's params, and `pretrained` for
the entry points below, which dispatch on the source.
"""

from purejax.weights.errors import ConversionError
from purejax.weights.gguf_files import from_gguf
from purejax.weights.gguf_files import to_gguf
from purejax.weights.huggingface import from_huggingface
from purejax.weights.huggingface import to_huggingface
from purejax.weights.nanogpt import from_nanogpt
from purejax.weights.nanogpt import to_nanogpt
from purejax.weights.pretrained import convert
from purejax.weights.pretrained import from_pretrained
from purejax.weights.pretrained import from_purejax
from purejax.weights.pretrained import to_purejax

__all__ = ["ConversionError", "convert", "from_gguf", "from_huggingface", "from_nanogpt",
           "from_pretrained", "from_purejax", "to_gguf", "to_huggingface", "to_nanogpt",
           "to_purejax"]

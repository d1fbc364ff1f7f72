"""PyTorch checkpoint files (nanoGPT's `.pt`, Hugging Face's `pytorch_model.bin`) as numpy.

    torch = torch_files.import_torch("writing a nanoGPT checkpoint")
    ckpt = torch_files.load(path)   # tensors and plain containers only
    state = torch_files.tensors_to_numpy(ckpt["model"], path)

torch is imported only here, and only when such a file is read or written:
safetensors files and purejax checkpoints need no torch. `load` uses torch's
safe loader, which runs no pickled code, unless `allow_pickle` says the file
is trusted.
"""

import pathlib
import pickle
from typing import Any, Dict

import numpy as np

from purejax.weights.errors import ConversionError


def import_torch(what: str):
  """The `torch` module; ConversionError saying `what` needs it if it is not installed."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConversionError(f"{what} needs torch: pip install torch (or, for Hugging Face, "
                          f"use the folder's model.safetensors instead).") from None
  return torch


def load(path: pathlib.Path, allow_pickle: bool = False):
  """`torch.load` on the CPU, refusing arbitrary pickled code unless allowed."""
  torch = import_torch(f"reading {path.name}")
  if not path.is_file():
    raise ConversionError(f"{path} is missing.")
  try:
    return torch.load(path, map_location="cpu", weights_only=True)
  except pickle.UnpicklingError as e:
    if not allow_pickle:
      raise ConversionError(
          f"{path} holds Python objects besides tensors, which torch's safe loader "
          f"refuses; if you trust the file, pass `allow_pickle`.") from e
  except (RuntimeError, EOFError, OSError) as e:
    raise ConversionError(f"{path} is not a readable torch checkpoint "
                          f"({str(e).splitlines()[0][:120]}); it is truncated or "
                          f"damaged.") from e
  return torch.load(path, map_location="cpu", weights_only=False)


def tensors_to_numpy(state: Dict[str, Any], source: pathlib.Path) -> Dict[str, np.ndarray]:
  """A state dict of torch tensors as float32 numpy arrays; `source` names it in errors."""
  out = {}
  for name, value in state.items():
    if not hasattr(value, "detach"):
      raise ConversionError(f"{source}: entry {name!r} is not a tensor; expected a "
                            f"state dict.")
    out[name] = value.detach().float().cpu().numpy()
  return out

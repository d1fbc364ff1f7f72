"""The tensor check every weight format runs: each expected tensor, as float32 (or kept
quantized, a `quant.QuantizedWeight`), of its shape.

    arrays = float32_tensors(state, {"wte.weight": (50257, 768)}, source="model.safetensors",
                             needs="GPT-2 124M", partner="the config")
"""

from typing import Callable, Dict, Mapping, Tuple

import numpy as np

from purejax.ops import quant
from purejax.weights.errors import ConversionError


def float32_tensors(
    state: Mapping[str, np.ndarray],
    expected: Mapping[str, Tuple[int, ...]],
    *,
    source: str,
    needs: str,
    partner: str,
    transpose: Callable[[str], bool] = lambda name: False,
    convert: bool = True,
) -> Dict[str, np.ndarray]:
  """`{name: float32 array}` for every tensor `expected` names, each of the shape it names.

  Args:
    state: the checkpoint's tensors by name (all of `expected` among them).
    expected: `{name: shape}`, the shape after any transpose.
    source: the files, for error messages.
    needs: what asks for the shapes, in the error ("config.json", a model's description).
    partner: what the weights must belong with, in the error ("config.json", "the config").
    transpose: names whose matrix is stored transposed (`[out, in]` vs `[in, out]`).
    convert: False: shapes checked only, each array kept in its dtype (the caller
      converts a tensor when it places it, so a bfloat16 checkpoint is never held
      whole in float32 beside itself).

  Raises:
    ConversionError: a tensor of another shape; the message names it and both shapes.
  """
  arrays = {}
  for name, want in expected.items():
    value = state[name]
    if not isinstance(value, quant.QuantizedWeight):  # kept as it is (a GGUF file's blocks)
      value = np.asarray(value, dtype=np.float32 if convert else None)
    if transpose(name):
      value = value.T
    if value.shape != want:
      raise ConversionError(f"{source}: {name} has shape {tuple(value.shape)}, but {needs} "
                            f"needs {want}; the weights and {partner} do not belong together.")
    arrays[name] = value
  return arrays

"""Communication volume of a compiled program, read from its optimised HLO.

    hlo = jax.jit(step).lower(*args).compile().as_text()
    collective_bytes(hlo)        # {"all-reduce": bytes per call, ...}

Used by `bench/comm_volume.py` and the scale-out tests; it is a measuring
tool, not part of the library.
"""

import dataclasses
import re
from typing import Dict

import numpy as np

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute")
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2,
          "f16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"=\s*(.*?)\s+(" + "|".join(_COLLECTIVES) +
                          r")(?:-start)?\(")
_WHILE = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLS = re.compile(r"\b(?:to_apply|calls|branch_computations)=\{?%?([\w.\-]+)")


@dataclasses.dataclass
class _Computation:
  collectives: Dict[str, int] = dataclasses.field(default_factory=dict)
  children: list = dataclasses.field(default_factory=list)  # (name, times)


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return total


def collective_bytes(hlo_text: str) -> Dict[str, int]:
  """Bytes each kind of collective produces per call of a compiled program.

  Reads the optimised HLO (`jitted.lower(...).compile().as_text()`): every
  all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute
  contributes the size of its result on one device, and an op inside a
  `while` loop (a `lax.scan`) counts once per iteration of the loop's known
  trip count. A loop whose trip count XLA did not record counts once.

  Returns:
    `{"all-reduce": bytes, "all-gather": bytes, ...}` per device, kinds with
    no traffic left out.
  """
  computations: Dict[str, _Computation] = {}
  current, entry = None, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = computations.setdefault(header.group(1), _Computation())
      if line.startswith("ENTRY"):
        entry = header.group(1)
      continue
    if current is None:
      continue
    op = _INSTRUCTION.search(line)
    if op:
      kind = op.group(2)
      current.collectives[kind] = current.collectives.get(kind, 0) + _shape_bytes(
          op.group(1))
    loop = _WHILE.search(line)
    if loop:
      trips = _TRIP_COUNT.search(line)
      current.children.append((loop.group(1), int(trips.group(1)) if trips else 1))
    elif not op:
      for called in _CALLS.findall(line):
        current.children.append((called, 1))
  if entry is None:
    raise ValueError("collective_bytes: no ENTRY computation in the HLO text.")

  def total(name, depth=0):
    comp = computations.get(name)
    if comp is None or depth > 64:
      return {}
    result = dict(comp.collectives)
    for child, times in comp.children:
      for kind, nbytes in total(child, depth + 1).items():
        result[kind] = result.get(kind, 0) + times * nbytes
    return result

  return {kind: nbytes for kind, nbytes in total(entry).items() if nbytes}

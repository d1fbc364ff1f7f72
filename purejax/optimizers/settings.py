"""How an optimizer's own settings become flat names: for flags, sweeps and checkpoints.

Each optimizer has a small frozen dataclass of its own settings (`adam.AdamW`,
`muon.Muon`, ...), with class-level `PREFIX` (what its names start with
outside it: `""` for AdamW's `beta2`, `"muon_"` for Muon's `muon_ns_steps`)
and `HYPERPARAMS` (the numbers a sweep may vary between runs in one program).
A field that is itself such a dataclass (Muon's AdamW group) flattens under
its own prefix; a field typed `Literal[...]` takes one of those values (a
flag's choices). Outside the optimizer a setting is its flat name: the command
line's flag, a sweep's grid name, a checkpoint's record.

Settings classes do not check their values when built (a sweep builds them
with traced numbers); `check` does, and `optim.OptimizerConfig` calls it.
"""

import dataclasses
import typing
from typing import Any, Dict, Mapping, Tuple

from purejax import _docstrings


def is_settings(value: Any) -> bool:
  """Whether `value` is an optimizer's settings (an instance or a class)."""
  return dataclasses.is_dataclass(value) and hasattr(value, "PREFIX")


def flat_fields(cls) -> Dict[str, Tuple[str, ...]]:
  """`{flat name: path of field names}` of a settings class, nested groups included."""
  out = {}
  for field in dataclasses.fields(cls):
    if is_settings(_default(field)):
      for name, path in flat_fields(type(_default(field))).items():
        out[name] = (field.name,) + path
    else:
      out[cls.PREFIX + field.name] = (field.name,)
  return out


def _default(field: dataclasses.Field) -> Any:
  return field.default_factory() if field.default is dataclasses.MISSING else field.default


def to_flat(settings) -> Dict[str, Any]:
  """`{flat name: value}` of a settings instance."""
  out = {}
  for name, path in flat_fields(type(settings)).items():
    value = settings
    for part in path:
      value = getattr(value, part)
    out[name] = value
  return out


def from_flat(cls, values: Mapping[str, Any], base=None):
  """A `cls` with the flat `values` it has names for (others are ignored), the rest from
  `base` (default: `cls()`). Not checked (values may be traced)."""
  base = cls() if base is None else base
  changes = {}
  for field in dataclasses.fields(cls):
    current = getattr(base, field.name)
    if is_settings(current):
      changes[field.name] = from_flat(type(current), values, current)
    elif cls.PREFIX + field.name in values:
      changes[field.name] = values[cls.PREFIX + field.name]
  return dataclasses.replace(base, **changes)


def choices(cls) -> Dict[str, Tuple[Any, ...]]:
  """`{flat name: its values}` of the settings whose type is a `Literal` of the values
  (e.g. Muon's `ns_coeffs`), nested groups' included."""
  out = {}
  for name, path in flat_fields(cls).items():
    owner = cls
    for part in path[:-1]:
      owner = type(_default(_field(owner, part)))
    kind = _field(owner, path[-1]).type
    if typing.get_origin(kind) is typing.Literal:
      out[name] = typing.get_args(kind)
  return out


def _field(cls, name: str) -> dataclasses.Field:
  return {f.name: f for f in dataclasses.fields(cls)}[name]


def hyperparams(cls) -> Tuple[str, ...]:
  """The flat names of the numbers a sweep may vary (`HYPERPARAMS`, nested groups too)."""
  names = []  # nested groups first (Muon's AdamW's, then its own)
  for field in dataclasses.fields(cls):
    if is_settings(_default(field)):
      names.extend(hyperparams(type(_default(field))))
  return tuple(names + [cls.PREFIX + n for n in cls.HYPERPARAMS])


def field_docs(cls) -> Dict[str, str]:
  """`{flat name: its docstring text}` of a settings class (its `Attributes:` section),
  nested groups' included."""
  docs = _docstrings.attributes(cls.__doc__, cls.PREFIX)
  for field in dataclasses.fields(cls):
    if is_settings(_default(field)):
      docs.update({k: v for k, v in field_docs(type(_default(field))).items() if k not in docs})
  return docs

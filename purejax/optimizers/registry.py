"""Every optimizer a run can name, found by that name: its settings class and its factory.

    entry = OPTIMIZERS["lion"]
    optimizer = entry.build(schedule, Lion(weight_decay=1.0), peak_learning_rate=3e-4,
                            decay_mask_fn=decay_mask)

An optimizer is one module: a frozen dataclass of its own settings (flat names,
`settings.PREFIX`; the numbers a sweep may vary, `HYPERPARAMS`; `check` and
`describe`) and a factory `(learning_rate schedule, settings, ...) ->
optax.GradientTransformation`, registered here. The command line's flags, the
sweeps' grid names and the checkpoints' records all come from the settings
classes.
"""

from typing import Callable, Dict, NamedTuple, Optional

import optax

from purejax.optimizers import adam
from purejax.optimizers import lion
from purejax.optimizers import muon
from purejax.optimizers import sgd


class Optimizer(NamedTuple):
  """A registered optimizer.

  Attributes:
    settings: its settings class (`Settings()` holds its defaults).
    factory: `factory(learning_rate, settings, *, decay_mask_fn, peak_learning_rate)`
      -> the optax transformation (a factory reads the keywords it needs: Muon
      scales its matrices' rate by the schedule's peak).
    summary: one line for `--help`.
  """
  settings: type
  factory: Callable[..., optax.GradientTransformation]
  summary: str

  def build(self, learning_rate: optax.Schedule, settings, *, peak_learning_rate,
            decay_mask_fn: Optional[Callable]) -> optax.GradientTransformation:
    """The transformation, on `learning_rate` (whose peak is `peak_learning_rate`)."""
    return self.factory(learning_rate, settings, decay_mask_fn=decay_mask_fn,
                        peak_learning_rate=peak_learning_rate)


OPTIMIZERS: Dict[str, Optimizer] = {
    "sgd": Optimizer(sgd.SGD, sgd.sgd, "plain SGD"),
    "momentum": Optimizer(sgd.Momentum, sgd.momentum, "SGD with heavy-ball momentum"),
    "adam": Optimizer(adam.Adam, adam.adam, "Adam"),
    "adamw": Optimizer(adam.AdamW, adam.adamw, "AdamW, decay on matrices and embeddings"),
    "muon": Optimizer(muon.Muon, muon.muon, "Muon on the GPT blocks' matrices, AdamW on the "
                      "rest"),
    "lion": Optimizer(lion.Lion, lion.lion, "Lion: the sign of a momentum interpolation"),
}


def name_of(settings) -> str:
  """The registered name of a settings instance's optimizer."""
  for name, entry in OPTIMIZERS.items():
    if type(settings) is entry.settings:
      return name
  raise ValueError(f"{type(settings).__name__} is not a registered optimizer's settings; "
                   f"use one of {sorted(e.settings.__name__ for e in OPTIMIZERS.values())}.")

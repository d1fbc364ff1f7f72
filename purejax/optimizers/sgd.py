"""Stochastic gradient descent, plain and with (heavy-ball) momentum: optax's `sgd`.

    optimizer = momentum(schedule, Momentum(momentum=0.9))
"""

import dataclasses
from typing import Callable, ClassVar, List, Optional, Tuple

import optax


@dataclasses.dataclass(frozen=True)
class SGD:
  """Plain SGD has no settings of its own (only the rate and schedule every optimizer has)."""
  PREFIX: ClassVar[str] = ""
  HYPERPARAMS: ClassVar[Tuple[str, ...]] = ()

  def check(self) -> None:
    pass

  def describe(self) -> List[str]:
    return []


@dataclasses.dataclass(frozen=True)
class Momentum:
  """SGD with momentum's settings.

  Attributes:
    momentum: decay rate of the velocity (heavy-ball momentum), in [0, 1).
  """
  PREFIX: ClassVar[str] = ""
  HYPERPARAMS: ClassVar[Tuple[str, ...]] = ("momentum",)
  momentum: float = 0.9

  def check(self) -> None:
    if not 0 <= self.momentum < 1:
      raise ValueError(f"`momentum` must be in [0, 1), got {self.momentum}.")

  def describe(self) -> List[str]:
    return [f"momentum {self.momentum:g}"]


def sgd(learning_rate: optax.ScalarOrSchedule, settings: SGD, *,
        decay_mask_fn: Optional[Callable] = None, **unused) -> optax.GradientTransformation:
  del settings, decay_mask_fn
  return optax.sgd(learning_rate)


def momentum(learning_rate: optax.ScalarOrSchedule, settings: Momentum, *,
             decay_mask_fn: Optional[Callable] = None, **unused) -> optax.GradientTransformation:
  del decay_mask_fn
  return optax.sgd(learning_rate, momentum=settings.momentum)

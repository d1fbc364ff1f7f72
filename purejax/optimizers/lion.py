"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): optax's `lion`.

    optimizer = lion(schedule, Lion(weight_decay=1.0), decay_mask_fn=decay_mask)

Lion updates by the sign of an interpolation of the gradient and its running
mean, so every coordinate moves by the learning rate: its paper takes a rate
3-10x smaller than AdamW's and a weight decay 3-10x larger, for the same
decoupled decay `lr * weight_decay`.
"""

import dataclasses
from typing import Callable, ClassVar, List, Optional, Tuple

import optax


@dataclasses.dataclass(frozen=True)
class Lion:
  """Lion's settings (its paper's defaults).

  Attributes:
    beta1: interpolation between the running mean and the gradient whose sign is
      the update.
    beta2: decay rate of the gradient's running mean.
    weight_decay: decoupled weight decay, on weight matrices and embeddings only
      (`optim.decay_mask`).
  """
  PREFIX: ClassVar[str] = "lion_"
  HYPERPARAMS: ClassVar[Tuple[str, ...]] = ("beta1", "beta2", "weight_decay")
  beta1: float = 0.9
  beta2: float = 0.99
  weight_decay: float = 0.0

  def check(self) -> None:
    if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
      raise ValueError(f"Lion's betas must be in [0, 1), got {self.beta1}, {self.beta2}.")
    if self.weight_decay < 0:
      raise ValueError(f"`lion_weight_decay` must be >= 0, got {self.weight_decay}.")

  def describe(self) -> List[str]:
    decay = [f"weight decay {self.weight_decay:g}"] if self.weight_decay else []
    return [f"betas {self.beta1:g}, {self.beta2:g}"] + decay


def lion(learning_rate: optax.ScalarOrSchedule, settings: Lion, *,
         decay_mask_fn: Optional[Callable] = None, **unused) -> optax.GradientTransformation:
  """optax's Lion with `settings`, decaying the params `decay_mask_fn` marks."""
  return optax.lion(learning_rate, b1=settings.beta1, b2=settings.beta2,
                    weight_decay=settings.weight_decay, mask=decay_mask_fn)

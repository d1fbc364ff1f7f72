"""Adam and AdamW (optax's), with weight decay on the weight matrices and embeddings only.

    optimizer = adamw(schedule, AdamW(beta2=0.99, weight_decay=0.1), decay_mask_fn=decay_mask)
"""

import dataclasses
from typing import Callable, ClassVar, List, Optional, Tuple

import optax


def _check_betas(beta1: float, beta2: float) -> None:
  if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
    raise ValueError(f"betas must be in [0, 1), got {beta1}, {beta2}.")


@dataclasses.dataclass(frozen=True)
class Adam:
  """Adam's settings.

  Attributes:
    beta1: decay rate of the gradient's running mean (Adam's first moment).
    beta2: decay rate of the squared gradient's running mean (its second moment).
  """
  PREFIX: ClassVar[str] = ""
  HYPERPARAMS: ClassVar[Tuple[str, ...]] = ("beta1", "beta2")
  beta1: float = 0.9
  beta2: float = 0.999

  def check(self) -> None:
    _check_betas(self.beta1, self.beta2)

  def describe(self) -> List[str]:
    return [f"betas {self.beta1:g}, {self.beta2:g}"]


@dataclasses.dataclass(frozen=True)
class AdamW:
  """AdamW's settings.

  Attributes:
    beta1: decay rate of the gradient's running mean (Adam's first moment).
    beta2: decay rate of the squared gradient's running mean (its second moment).
    weight_decay: decoupled weight decay, on weight matrices and embeddings only
      (`optim.decay_mask`), never on biases or norms.
  """
  PREFIX: ClassVar[str] = ""
  HYPERPARAMS: ClassVar[Tuple[str, ...]] = ("beta1", "beta2", "weight_decay")
  beta1: float = 0.9
  beta2: float = 0.999
  weight_decay: float = 0.0

  def check(self) -> None:
    _check_betas(self.beta1, self.beta2)
    if self.weight_decay < 0:
      raise ValueError(f"`weight_decay` must be >= 0, got {self.weight_decay}.")

  def describe(self) -> List[str]:
    decay = [f"weight decay {self.weight_decay:g}"] if self.weight_decay else []
    return [f"betas {self.beta1:g}, {self.beta2:g}"] + decay


def adam(learning_rate: optax.ScalarOrSchedule, settings: Adam, *,
         decay_mask_fn: Optional[Callable] = None, **unused) -> optax.GradientTransformation:
  """optax's Adam with `settings`' betas (`decay_mask_fn`: unused, Adam has no decay)."""
  del decay_mask_fn
  return optax.adam(learning_rate, b1=settings.beta1, b2=settings.beta2)


def adamw(learning_rate: optax.ScalarOrSchedule, settings: AdamW, *,
          decay_mask_fn: Optional[Callable] = None, **unused) -> optax.GradientTransformation:
  """optax's AdamW with `settings`, decaying the params `decay_mask_fn` marks."""
  return optax.adamw(learning_rate, b1=settings.beta1, b2=settings.beta2,
                     weight_decay=settings.weight_decay, mask=decay_mask_fn)

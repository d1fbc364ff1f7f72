"""Optimizers and learning-rate schedules, built from optax pieces.

Both models train with `make_optimizer`, so the same flags mean the same
thing for each.

"muon" trains two groups of params, each with its own rate and decay
(`muon.muon_labels`): the hidden matrices of the GPT's blocks take Muon
(momentum orthogonalised by Newton-Schulz, `purejax.optimizers.muon`), everything
else (embeddings, head, norms, biases) takes AdamW with the ordinary
optimizer numbers. Both follow one schedule's shape: the Muon group's rate
is the schedule scaled by `muon_learning_rate / learning_rate`.
"""

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Tuple

import chex
import jax
import jax.numpy as jnp
import optax

from purejax.optimizers import muon

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "muon")
SCHEDULES = ("cosine", "warmdown", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """What `make_optimizer` builds.

  Attributes:
    name: one of `OPTIMIZERS`.
    learning_rate: peak learning rate (> 0).
    schedule: "cosine" (linear warmup, then cosine decay to `min_lr`),
      "warmdown" (linear warmup, the peak held, then a linear decay to
      `min_lr` over the last `warmdown_frac` of the steps: nanochat's and
      modded-nanogpt's shape) or "constant".
    warmup_iters: warmup steps (not "constant").
    decay_iters: step at which the decay reaches `min_lr` (held after);
      None leaves it to the training loop (`with_schedule_end`: the run's
      last step, or a resumed run's end).
    min_lr: final learning rate of the decay.
    warmdown_frac: "warmdown": the fraction of `decay_iters` the linear
      decay takes, in (0, 1] (nanochat's 0.2).
    beta1, beta2: Adam moments' decay rates.
    momentum: for "momentum".
    weight_decay: decoupled weight decay ("adamw"), applied to weight
      matrices and embeddings only (`decay_mask`), never to biases or norms.
    grad_clip: clip the global gradient norm to this (0 disables).
    muon_learning_rate: "muon": the Muon group's peak rate (Keller Jordan's
      Muon default, 0.02, for updates scaled by `sqrt(max(1, out / in))`).
    muon_momentum: "muon": the Muon group's Nesterov momentum (0.95).
    muon_weight_decay: "muon": decoupled decay of the Muon group's matrices,
      multiplied by its rate as Muon's reference does (default 0, as there).
    muon_ns_steps: "muon": Newton-Schulz steps of each orthogonalisation
      (`muon.newton_schulz`; 5, the reference's).
    muon_ns_coeffs: "muon": the steps' quintics (`muon.ns_coefficients`):
      "keller" (Keller Jordan's, the reference's) or "minimax" (Polar
      Express's construction: as close to orthogonal in 4 steps as Keller
      Jordan's in 5).
    muon_momentum_warmup_iters: "muon": steps over which the Muon group's
      momentum rises linearly from `muon_momentum_start` to `muon_momentum`
      (0: none, as Muon's reference; modded-nanogpt and nanochat: 300).
    muon_momentum_start: "muon": that warmup's first momentum (0.85, theirs).
    muon_split_qkv: "muon": orthogonalise the attention's fused query/key/value
      weight as three matrices, as nanochat and modded-nanogpt (whose
      projections are separate) do; False: as one `[d, 3d]` matrix.
  """
  name: str = "adamw"
  learning_rate: float = 1e-3
  schedule: str = "cosine"
  warmup_iters: int = 0
  decay_iters: Optional[int] = None
  min_lr: float = 0.0
  warmdown_frac: float = 0.2
  beta1: float = 0.9
  beta2: float = 0.999
  momentum: float = 0.9
  weight_decay: float = 0.0
  grad_clip: float = 0.0
  muon_learning_rate: float = 0.02
  muon_momentum: float = 0.95
  muon_weight_decay: float = 0.0
  muon_ns_steps: int = muon.MUON_NS_STEPS
  muon_momentum_warmup_iters: int = 0
  muon_momentum_start: float = 0.85
  muon_split_qkv: bool = True
  muon_ns_coeffs: str = "keller"

  def __post_init__(self):
    if self.name not in OPTIMIZERS:
      raise ValueError(f"unknown optimizer {self.name!r}; choose one of {OPTIMIZERS}.")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"unknown schedule {self.schedule!r}; use one of {SCHEDULES}.")
    if not 0 < self.warmdown_frac <= 1:
      raise ValueError(f"`warmdown_frac` must be in (0, 1], got {self.warmdown_frac}.")
    if not self.learning_rate > 0:
      raise ValueError(f"`learning_rate` must be > 0, got {self.learning_rate}.")
    if self.min_lr < 0 or self.min_lr > self.learning_rate:
      raise ValueError(f"`min_lr` must be in [0, `learning_rate={self.learning_rate}`], "
                       f"got {self.min_lr}.")
    if self.warmup_iters < 0 or (self.decay_iters is not None and self.decay_iters < 1):
      raise ValueError(f"`warmup_iters` must be >= 0 and `decay_iters` >= 1, got "
                       f"{self.warmup_iters} and {self.decay_iters}.")
    if self.weight_decay < 0 or self.grad_clip < 0:
      raise ValueError("`weight_decay` and `grad_clip` must be >= 0.")
    if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
      raise ValueError(f"betas must be in [0, 1), got {self.beta1}, {self.beta2}.")
    if not (self.muon_learning_rate > 0 and 0 <= self.muon_momentum < 1
            and self.muon_weight_decay >= 0):
      raise ValueError(f"Muon needs `muon_learning_rate` > 0, `muon_momentum` in [0, 1) and "
                       f"`muon_weight_decay` >= 0; got {self.muon_learning_rate}, "
                       f"{self.muon_momentum} and {self.muon_weight_decay}.")
    if self.muon_ns_coeffs not in muon.NS_COEFFICIENTS:
      raise ValueError(f"unknown `muon_ns_coeffs` {self.muon_ns_coeffs!r}; use one of "
                       f"{muon.NS_COEFFICIENTS}.")
    if not (isinstance(self.muon_ns_steps, int) and self.muon_ns_steps >= 1):
      raise ValueError(f"`muon_ns_steps` must be an integer >= 1, got {self.muon_ns_steps!r}.")
    if self.muon_momentum_warmup_iters < 0 or not 0 <= self.muon_momentum_start < 1:
      raise ValueError(f"`muon_momentum_warmup_iters` must be >= 0 and `muon_momentum_start` "
                       f"in [0, 1); got {self.muon_momentum_warmup_iters} and "
                       f"{self.muon_momentum_start}.")


def warmup_cosine_schedule(
    learning_rate: float, warmup_iters: int, decay_iters: int, min_lr: float
) -> optax.Schedule:
  """nanoGPT's schedule as a pure function of the step.

  Linear warmup `lr * (step + 1) / (warmup + 1)` for `step < warmup`, then a
  cosine from `lr` down to `min_lr` at `decay_iters`, then `min_lr`.
  """
  def schedule(step: chex.Numeric) -> chex.Array:
    step = jnp.asarray(step, jnp.float32)
    warm = learning_rate * (step + 1) / (warmup_iters + 1)
    ratio = (step - warmup_iters) / max(decay_iters - warmup_iters, 1)
    cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.clip(ratio, 0.0, 1.0)))
    decayed = min_lr + cosine * (learning_rate - min_lr)
    return jnp.where(step < warmup_iters, warm, decayed)

  return schedule


def warmup_warmdown_schedule(
    learning_rate: float, warmup_iters: int, decay_iters: int, min_lr: float,
    warmdown_frac: float
) -> optax.Schedule:
  """Linear warmup (as `warmup_cosine_schedule`'s), the peak held, then linear decay.

  The decay runs over the last `warmdown_frac` of `decay_iters` steps, from
  `lr` to `min_lr` at `decay_iters`, then holds `min_lr` (nanochat's
  "warmdown", modded-nanogpt's "cooldown").
  """
  start = decay_iters * (1.0 - warmdown_frac)

  def schedule(step: chex.Numeric) -> chex.Array:
    step = jnp.asarray(step, jnp.float32)
    warm = learning_rate * (step + 1) / (warmup_iters + 1)
    done = jnp.clip((step - start) / max(decay_iters - start, 1.0), 0.0, 1.0)
    decayed = learning_rate + done * (min_lr - learning_rate)
    return jnp.where(step < warmup_iters, warm, decayed)

  return schedule


DECAYED_PARAM_NAMES = ("w", "embedding")


def decay_mask(params) -> chex.ArrayTree:
  """True for params that get weight decay: weight matrices and embeddings.

  The choice goes by the param's name, not its rank: stacked per-layer
  biases and LayerNorm scales are `[n_layer, dim]` but must not decay.
  """
  def decays(path, _):
    last = path[-1]
    return getattr(last, "key", None) in DECAYED_PARAM_NAMES

  return jax.tree_util.tree_map_with_path(decays, params)


class _Numbers:
  """`config`'s fields, with those in `values` replaced (without validation: they may be traced)."""

  def __init__(self, config: OptimizerConfig, values: Mapping[str, chex.Numeric]):
    self._config, self._values = config, dict(values)

  def __getattr__(self, name):
    return self._values[name] if name in self._values else getattr(self._config, name)


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
  if config.schedule == "constant":
    return optax.constant_schedule(config.learning_rate)
  if config.decay_iters is None:
    raise ValueError(f"a {config.schedule} schedule needs decay_iters, the step where it "
                     f"ends.")
  if config.schedule == "warmdown":
    return warmup_warmdown_schedule(config.learning_rate, config.warmup_iters,
                                    config.decay_iters, config.min_lr, config.warmdown_frac)
  return warmup_cosine_schedule(config.learning_rate, config.warmup_iters,
                                config.decay_iters, config.min_lr)


def with_schedule_end(config: OptimizerConfig, last_step: int,
                      resumed_end: Optional[int] = None) -> OptimizerConfig:
  """`config` with the schedule's end (`decay_iters`) filled in, where it is None.

  Where a run's schedule ends is decided here only. An explicit
  `decay_iters` wins; else a resumed run keeps the end its checkpoint
  recorded (`resumed_end`), so more steps go on at `min_lr` instead of
  stretching the decay; else the schedule ends at the run's `last_step`.
  """
  if config.decay_iters is not None:
    return config
  end = last_step if resumed_end is None else resumed_end
  return dataclasses.replace(config, decay_iters=end)


# The numbers of an `OptimizerConfig` that may be arrays (`make_optimizer`'s
# `hyperparams`): a sweep trains one run per value in one vmapped step.
HYPERPARAMS = ("learning_rate", "min_lr", "weight_decay", "beta1", "beta2", "momentum",
               "muon_learning_rate", "muon_momentum", "muon_weight_decay")


def hyperparams_used(config: OptimizerConfig) -> Tuple[str, ...]:
  """The `HYPERPARAMS` that `make_optimizer(config)` reads; the others have no effect.

  Every optimizer reads `learning_rate`; the cosine and warmdown schedules read `min_lr`;
  "momentum" reads `momentum`; "adam" the betas; "adamw" the betas and
  `weight_decay`; "muon" those of "adamw" (its AdamW group's) and the
  `muon_` numbers.
  """
  adamw = ("beta1", "beta2", "weight_decay")
  used = {"sgd": (), "momentum": ("momentum",), "adam": ("beta1", "beta2"), "adamw": adamw,
          "muon": adamw + ("muon_learning_rate", "muon_momentum", "muon_weight_decay")
          }[config.name]
  schedule = ("min_lr",) if config.schedule != "constant" else ()
  return ("learning_rate",) + schedule + used


def make_optimizer(
    config: OptimizerConfig, *, decay_mask_fn: Optional[callable] = decay_mask,
    hyperparams: Optional[Mapping[str, chex.Numeric]] = None,
) -> optax.GradientTransformation:
  """Builds the optax transformation described by `config`.

  Args:
    config: the optimizer's settings.
    decay_mask_fn: which params get weight decay (AdamW); default: weight
      matrices and embeddings.
    hyperparams: values that replace `config`'s fields of these names (any
      of `HYPERPARAMS`), as scalars or traced arrays: a function of them
      builds one run's optimizer inside a `jax.vmap` over runs
      (`purejax.training.pure.sweep`). The state's structure does not depend on
      them. They are not validated; `config`'s values are.

  Returns:
    An optax `GradientTransformation`: optional global-norm clipping followed
    by the optimizer with its schedule.
  """
  if hyperparams:
    unknown = sorted(set(hyperparams) - set(HYPERPARAMS))
    if unknown:
      raise ValueError(f"{unknown} cannot vary between runs; choose among {HYPERPARAMS}.")
    config = _Numbers(config, hyperparams)
  lr = make_schedule(config)
  if config.name == "sgd":
    opt = optax.sgd(lr)
  elif config.name == "momentum":
    opt = optax.sgd(lr, momentum=config.momentum)
  elif config.name == "adam":
    opt = optax.adam(lr, b1=config.beta1, b2=config.beta2)
  elif config.name == "muon":
    opt = muon.muon(config, lr, decay_mask_fn)
  else:
    opt = optax.adamw(lr, b1=config.beta1, b2=config.beta2,
                      weight_decay=config.weight_decay, mask=decay_mask_fn)
  if config.grad_clip > 0:
    opt = optax.chain(optax.clip_by_global_norm(config.grad_clip), opt)
  return opt



def schedule_warnings(config: OptimizerConfig, max_iters: int) -> List[str]:
  """What a run of `max_iters` steps would not do that its cosine or warmdown schedule suggests.

  A warmup as long as the run never reaches `learning_rate` (a short
  fine-tune under a pretraining recipe's 100 warmup steps), and a cosine
  ending before its warmup does never decays: the rate drops from the warmup
  straight to `min_lr`. Both are kept as asked (a recipe that changed them
  for short runs would train another schedule than the one logged) and
  said in one line each at start-up, with the fix.
  """
  if config.schedule == "constant":
    return []
  found = []
  if config.warmup_iters >= max_iters > 0:
    peak = config.learning_rate * max_iters / (config.warmup_iters + 1)
    found.append(f"warmup_iters={config.warmup_iters} >= max_iters={max_iters}: the run "
                 f"only warms up, to lr {peak:.3g} of {config.learning_rate:g}; lower "
                 f"warmup_iters (e.g. {max(max_iters // 10, 1)}) for a full schedule.")
  if config.decay_iters is not None and 0 < config.decay_iters <= config.warmup_iters:
    found.append(f"decay_iters={config.decay_iters} <= warmup_iters={config.warmup_iters}: "
                 f"no {config.schedule} decay; the rate drops from the warmup to min_lr "
                 f"{config.min_lr:g} at step {config.warmup_iters}; make decay_iters longer "
                 f"than the warmup.")
  return found


# Fields added after Muon runs were first saved whose default is not what those
# runs did: a saved "muon" config without one was trained with this value.
MUON_FIELDS_BEFORE = {"muon_split_qkv": False}


def saved_defaults(saved: Mapping[str, Any]) -> Dict[str, Any]:
  """What a saved config's missing fields were when it trained: the defaults,
  except `MUON_FIELDS_BEFORE` for a "muon" run (so its resume or replay is the
  same computation)."""
  defaults = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}
  return {**defaults, **MUON_FIELDS_BEFORE} if saved.get("name") == "muon" else defaults


def from_saved(saved: Mapping[str, Any]) -> OptimizerConfig:
  """The `OptimizerConfig` a run's metadata saved (`dataclasses.asdict`), of any version."""
  return OptimizerConfig(**{**saved_defaults(saved), **saved})


def describe(config: OptimizerConfig) -> str:
  """One short line for a run's log: the optimizer, its schedule, its regularisation."""
  parts = [config.name, f"lr {config.learning_rate:g}"]
  if config.schedule == "cosine":
    parts[-1] += (f" (warmup {config.warmup_iters}, cosine to {config.min_lr:g} at step "
                  f"{config.decay_iters})")
  elif config.schedule == "warmdown":
    parts[-1] += (f" (warmup {config.warmup_iters}, held, warmdown: linear to "
                  f"{config.min_lr:g} over the last {config.warmdown_frac:.0%} of "
                  f"{config.decay_iters} steps)")
  if config.name == "muon":
    muon_parts = [f"lr {config.muon_learning_rate:g}", f"momentum {config.muon_momentum:g}"]
    if config.muon_weight_decay:
      muon_parts.append(f"weight decay {config.muon_weight_decay:g}")
    if config.muon_ns_steps != muon.MUON_NS_STEPS:
      muon_parts.append(f"{config.muon_ns_steps} Newton-Schulz steps")
    if config.muon_ns_coeffs != "keller":
      muon_parts.append(f"{config.muon_ns_coeffs} quintics")
    if not config.muon_split_qkv:
      muon_parts.append("qkv as one matrix")
    if config.muon_momentum_warmup_iters:
      muon_parts.append(f"momentum from {config.muon_momentum_start:g} over "
                        f"{config.muon_momentum_warmup_iters} steps")
    parts[0] = f"muon ({', '.join(muon_parts)}) on the blocks' matrices; adamw on the rest"
  if config.name in ("adam", "adamw", "muon"):
    parts.append(f"betas {config.beta1:g}, {config.beta2:g}")
  elif config.name == "momentum":
    parts.append(f"momentum {config.momentum:g}")
  if config.name in ("adamw", "muon") and config.weight_decay:
    parts.append(f"weight decay {config.weight_decay:g}")
  if config.grad_clip:
    parts.append(f"clip {config.grad_clip:g}")
  return ", ".join(parts)


def frozen_base(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """`optimizer` for LoRA's `{"base": params, "adapters": adapters}` (`lora.trainable`).

  The adapters get `optimizer` (and its state); the base gets no update and
  no state (`optax.set_to_zero`). Adapters' factors are named `a` and `b`,
  so `decay_mask` gives them no weight decay.
  """
  def labels(tree):
    return {"base": jax.tree.map(lambda _: "frozen", tree["base"]),
            "adapters": jax.tree.map(lambda _: "trained", tree["adapters"])}

  return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()}, labels)


def skip_nonfinite_updates(optimizer: optax.GradientTransformation
                           ) -> optax.GradientTransformation:
  """`optimizer` that leaves params and moments unchanged on NaN/Inf gradients."""
  return optax.apply_if_finite(optimizer, max_consecutive_errors=100)


@dataclasses.dataclass(frozen=True)
class RunOptimizer:
  """Builds one run's optimizer from its numbers: `train_steps`' `make_optimizer`.

  Hashable (a static jit argument that compiles once for equal settings).

  Attributes:
    config: the settings the runs share.
    skip_nonfinite: skip non-finite updates (`skip_nonfinite_updates`).
    frozen_base: the params are LoRA's base and adapters; only the adapters
      train (`frozen_base`).
  """
  config: OptimizerConfig
  skip_nonfinite: bool = False
  frozen_base: bool = False

  def __call__(self, hyperparams: Optional[Mapping[str, chex.Array]] = None
               ) -> optax.GradientTransformation:
    optimizer = make_optimizer(self.config, hyperparams=hyperparams)
    if self.frozen_base:
      optimizer = frozen_base(optimizer)
    return skip_nonfinite_updates(optimizer) if self.skip_nonfinite else optimizer

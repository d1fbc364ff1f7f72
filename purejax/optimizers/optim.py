"""A run's optimizer: which one, its learning-rate schedule and clipping; built from optax.

    config = OptimizerConfig(learning_rate=1e-3, warmup_iters=100, min_lr=1e-4, grad_clip=1.0,
                             settings=adam.AdamW(beta2=0.99, weight_decay=0.1))
    optimizer = make_optimizer(config)                 # an optax.GradientTransformation

Both models train with `make_optimizer`, so the same flags mean the same
thing for each. Which optimizer and its own settings are one object of its
settings class (`adam.AdamW`, `muon.Muon`, `lion.Lion`, ...), found by name in
`registry.OPTIMIZERS`; what every optimizer shares (the rate, its schedule,
clipping) are this config's fields. Outside Python a setting is its flat name
(`beta2`, `muon_ns_steps`, `lion_weight_decay`: `settings`): the flags, a
sweep's grid, a checkpoint's record (`to_saved`, `from_saved`).
"""

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Tuple

import chex
import jax
import optax

from purejax.optimizers import registry
from purejax.optimizers import schedules
from purejax.optimizers import settings as settings_lib

OPTIMIZERS = tuple(registry.OPTIMIZERS)
SCHEDULES = tuple(schedules.SCHEDULES)
# The fields every optimizer shares; the rest of a run's record is its settings'.
SHARED_FIELDS = ("name", "learning_rate", "schedule", "warmup_iters", "decay_iters", "min_lr",
                 "warmdown_frac", "grad_clip")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """What `make_optimizer` builds.

  The optimizer is its settings' type (`name`: its name in `OPTIMIZERS`);
  `named("muon", ...)` builds one by name, with its default settings.

  Attributes:
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
    grad_clip: clip the global gradient norm to this (0 disables).
    settings: the optimizer's own settings (`adam.AdamW(beta2=0.99)`,
      `muon.Muon(ns_steps=3)`, ...); by default AdamW's.
  """
  learning_rate: float = 1e-3
  schedule: str = "cosine"
  warmup_iters: int = 0
  decay_iters: Optional[int] = None
  min_lr: float = 0.0
  warmdown_frac: float = 0.2
  grad_clip: float = 0.0
  settings: Any = dataclasses.field(default_factory=lambda: registry.OPTIMIZERS["adamw"]
                                    .settings())

  def __post_init__(self):
    registry.name_of(self.settings)  # a registered optimizer's settings, or a clear error
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
    if self.grad_clip < 0:
      raise ValueError("`grad_clip` must be >= 0.")
    self.settings.check()

  @property
  def name(self) -> str:
    """The optimizer's name in `registry.OPTIMIZERS`: its settings'."""
    return registry.name_of(self.settings)

  def setting(self, name: str) -> Any:
    """A setting by its flat name (`value`), shared field or the optimizer's own."""
    return value(self, name)


def named(name: str, **fields) -> OptimizerConfig:
  """An `OptimizerConfig` of optimizer `name` (one of `OPTIMIZERS`) with its default settings
  and `fields` (the shared ones: `learning_rate`, `schedule`, ...)."""
  if name not in registry.OPTIMIZERS:
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}.")
  return OptimizerConfig(settings=registry.OPTIMIZERS[name].settings(), **fields)



def settings_names(name: str) -> Tuple[str, ...]:
  """The flat names of optimizer `name`'s own settings."""
  return tuple(settings_lib.flat_fields(registry.OPTIMIZERS[name].settings))


def all_settings() -> Dict[str, Any]:
  """`{flat name: default}` of every registered optimizer's settings. A flat name is one
  setting wherever it appears (AdamW's betas in Muon's AdamW group): its default is the
  same in every optimizer that has it, or this fails naming them."""
  out, first = {}, {}
  for name, entry in registry.OPTIMIZERS.items():
    for setting, default in settings_lib.to_flat(entry.settings()).items():
      if setting in out and out[setting] != default:
        raise ValueError(f"`{setting}` defaults to {out[setting]!r} in {first[setting]} and "
                         f"to {default!r} in {name}: one flat name must mean one setting.")
      out.setdefault(setting, default)
      first.setdefault(setting, name)
  return out


def readers_of(setting: str) -> Tuple[str, ...]:
  """The optimizers that have the flat setting `setting`."""
  return tuple(n for n in registry.OPTIMIZERS if setting in settings_names(n))


def changes_nothing(setting: str, value: Any) -> bool:
  """Whether the flat setting `setting` at `value` would leave every optimizer that has it
  as without it: a weight decay of 0. Such a value, given to an optimizer that lacks the
  setting (`--optimizer=sgd --weight_decay=0`, as recipes written for several optimizers
  pass it), asks for nothing the run does not do."""
  return setting.endswith("weight_decay") and value == 0


def value(config: OptimizerConfig, name: str) -> Any:
  """`config`'s value of `name`: a shared field, or a flat name of its optimizer's settings.

  Raises:
    ValueError: `name` is neither (naming the optimizers that have it).
  """
  if name in SHARED_FIELDS or name == "settings":
    return getattr(config, name)
  flat = settings_lib.to_flat(config.settings)
  if name in flat:
    return flat[name]
  raise ValueError(_not_a_setting(name, config.name))


def _not_a_setting(name: str, optimizer: str) -> str:
  readers = readers_of(name)
  if readers:
    return (f"`{name}` is not a setting of {optimizer}; it is {' and '.join(readers)}'s "
            f"(choose `name={readers[0]}`, or drop `{name}`).")
  return (f"unknown optimizer setting `{name}`; {optimizer}'s are "
          f"{', '.join(settings_names(optimizer)) or 'none'}.")


def replace(config: OptimizerConfig, **changes) -> OptimizerConfig:
  """`config` with `changes`: shared fields and the flat names of the optimizer's
  settings (after a change of `name`, the new optimizer's; the settings the two share,
  by flat name, carry over).

  Raises:
    ValueError: a name neither shared nor the optimizer's, or a value out of range.
  """
  name = changes.pop("name", config.name)
  shared = {k: changes.pop(k) for k in list(changes) if k in SHARED_FIELDS}
  cls = registry.OPTIMIZERS[name].settings if name in registry.OPTIMIZERS else None
  if cls is None:
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}.")
  unknown = [k for k in changes if k not in settings_lib.flat_fields(cls)]
  if unknown:
    raise ValueError(_not_a_setting(unknown[0], name))
  carried = settings_lib.to_flat(config.settings) if name != config.name else {}
  base = config.settings if name == config.name else cls()
  settings = settings_lib.from_flat(cls, {**carried, **changes}, base)
  return dataclasses.replace(config, settings=settings, **shared)


def from_flat(**values) -> OptimizerConfig:
  """An `OptimizerConfig` from flat names, as flags and sweeps write it:
  `from_flat(name="muon", learning_rate=1e-2, beta2=0.99, muon_ns_steps=3)`."""
  name = values.pop("name", "adamw")
  return replace(named(name), **values)


def to_saved(config: OptimizerConfig) -> Dict[str, Any]:
  """What a checkpoint records of `config`: its shared fields and its own optimizer's flat
  settings (`from_saved` reads it, and the records of every earlier version)."""
  out = {name: getattr(config, name) for name in SHARED_FIELDS}
  out["name"] = str(config.name)
  out.update(settings_lib.to_flat(config.settings))
  return out


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


def make_schedule(config: OptimizerConfig, *, learning_rate: Optional[chex.Numeric] = None,
                  min_lr: Optional[chex.Numeric] = None) -> optax.Schedule:
  """`config`'s learning-rate schedule (`schedules.SCHEDULES[config.schedule]`), with
  `learning_rate` and `min_lr` in place of `config`'s where given (a sweep's run's)."""
  return schedules.SCHEDULES[config.schedule](
      config, config.learning_rate if learning_rate is None else learning_rate,
      config.min_lr if min_lr is None else min_lr)


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


def _sweepable() -> Tuple[str, ...]:
  names = ["learning_rate", "min_lr"]
  for entry in registry.OPTIMIZERS.values():
    names += [n for n in settings_lib.hyperparams(entry.settings) if n not in names]
  return tuple(names)


# The numbers of an `OptimizerConfig` that may be arrays (`make_optimizer`'s
# `hyperparams`): a sweep trains one run per value in one vmapped step. The
# shared rate and its floor, then each optimizer's `HYPERPARAMS`, by flat name.
HYPERPARAMS = _sweepable()


def hyperparams_used(config: OptimizerConfig) -> Tuple[str, ...]:
  """The `HYPERPARAMS` that `make_optimizer(config)` reads; the others have no effect.

  Every optimizer reads `learning_rate`; the cosine and warmdown schedules read
  `min_lr`; each optimizer its own settings' `HYPERPARAMS`.
  """
  schedule = ("min_lr",) if config.schedule != "constant" else ()
  return ("learning_rate",) + schedule + settings_lib.hyperparams(type(config.settings))


def make_optimizer(
    config: OptimizerConfig, *, decay_mask_fn: Optional[callable] = decay_mask,
    hyperparams: Optional[Mapping[str, chex.Numeric]] = None,
) -> optax.GradientTransformation:
  """Builds the optax transformation described by `config`.

  Args:
    config: the optimizer's settings.
    decay_mask_fn: which params get weight decay; default: weight
      matrices and embeddings.
    hyperparams: values that replace `config`'s of these flat names (any
      of `HYPERPARAMS`), as scalars or traced arrays: a function of them
      builds one run's optimizer inside a `jax.vmap` over runs
      (`purejax.training.pure.sweep`). The state's structure does not depend on
      them. They are not validated; `config`'s values are.

  Returns:
    An optax `GradientTransformation`: optional global-norm clipping followed
    by the optimizer (`registry.OPTIMIZERS[config.name]`) with its schedule.
  """
  settings = config.settings
  if hyperparams:
    unknown = sorted(set(hyperparams) - set(HYPERPARAMS))
    if unknown:
      raise ValueError(f"{unknown} cannot vary between runs; choose among {HYPERPARAMS}.")
    settings = settings_lib.from_flat(type(settings), hyperparams, settings)
  rates = {k: v for k, v in (hyperparams or {}).items() if k in ("learning_rate", "min_lr")}
  opt = registry.OPTIMIZERS[config.name].build(
      make_schedule(config, **rates), settings,
      peak_learning_rate=rates.get("learning_rate", config.learning_rate),
      decay_mask_fn=decay_mask_fn)
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
  """What a saved record's missing fields were when it trained: the defaults (of the
  shared fields and of every optimizer's settings), except `MUON_FIELDS_BEFORE` for a
  "muon" run (so its resume or replay is the same computation)."""
  shared = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)
            if f.name in SHARED_FIELDS}
  defaults = {**shared, "name": "adamw", **all_settings()}
  return {**defaults, **MUON_FIELDS_BEFORE} if saved.get("name") == "muon" else defaults


def from_saved(saved: Mapping[str, Any]) -> OptimizerConfig:
  """The `OptimizerConfig` a run's metadata saved (`to_saved`), of any version."""
  record = {**saved_defaults(saved), **saved}
  name = record["name"]
  if name not in registry.OPTIMIZERS:
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}.")
  settings = settings_lib.from_flat(registry.OPTIMIZERS[name].settings, record)
  return OptimizerConfig(**{k: record[k] for k in SHARED_FIELDS if k != "name"},
                         settings=settings)


def saved_record(saved: Mapping[str, Any]) -> Dict[str, Any]:
  """The record `to_saved` writes for the run a checkpoint's `saved` record describes, of any
  version (older ones also held every other optimizer's defaults): what a resumed run's
  record is compared with."""
  return to_saved(from_saved(saved))


def describe(config: OptimizerConfig) -> str:
  """One short line for a run's log: the optimizer, its schedule, its settings, clipping."""
  rate = f"lr {config.learning_rate:g}"
  if config.schedule == "cosine":
    rate += (f" (warmup {config.warmup_iters}, cosine to {config.min_lr:g} at step "
             f"{config.decay_iters})")
  elif config.schedule == "warmdown":
    rate += (f" (warmup {config.warmup_iters}, held, warmdown: linear to "
             f"{config.min_lr:g} over the last {config.warmdown_frac:.0%} of "
             f"{config.decay_iters} steps)")
  own = config.settings.describe()
  # A settings part that starts with "(" qualifies the name (Muon's two groups).
  head = config.name + (f" {own.pop(0)}" if own and own[0].startswith("(") else "")
  parts = [head, rate] + own
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

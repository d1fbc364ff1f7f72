"""Many runs in one program: a sweep of seeds and optimizer settings in one jitted step.

    runs = sweep.expand(opt_config, seed=0, grid={"learning_rate": (3e-4, 1e-3)}, num_seeds=2)
    state = sweep.stack([TrainState(params, optimizer.init(params), keys) for ...])
    state, metrics = sweep.train_steps(state, DeviceTokens(ids), step, sweep.hyperparams(runs),
                                       config=config, make_optimizer=optim.RunOptimizer(opt),
                                       batch_size=12, num_steps=10, forms=kernels.select())
    metrics.loss                                         # [runs, 10]

The model is a pure function of its params, so `N` runs are one `jax.vmap`
of the single run's step (`steps.train_steps`) over a leading runs axis of
params, optimizer state and keys, in one jitted program. How many runs are
vmapped together is the step's `sweep_batch` (`choose_sweep_batch`): all of them on
a GPU, whose small-model steps leave it mostly idle; one at a time on the
CPU (a loop inside the same program), where one run already keeps
every core busy and vmapping only multiplies the scratch memory. What differs
between runs is data: the seed (the params' init, the batches and dropout
masks drawn from the run's keys), the optimizer's numbers
(`optim.HYPERPARAMS`: learning rate, weight decay, ...) and the dropout
rate, passed as `[runs]` arrays. Each run's optimizer is built inside the
vmap from its numbers (`make_optimizer(hyperparams) ->
GradientTransformation`), so its state has the structure a run trained
alone has: slicing run `i` out of the stacked state (`unstack`) gives that
run's own checkpoint, which resumes or exports on its own. A swept dropout
reaches the model as a traced rate (`gpt.loss(dropout=...)`) and replaces
`GPTConfig.dropout`, which the sweep's step then ignores; run `i`'s model
is `runs[i].model_config(config)`, the config it would train with alone.

Exactness: run `i` of this program computes what the run computes alone,
but batched matmuls, and the program's own fusions (its optimizer numbers
are traced, the run alone bakes them in), may add in another order, so
values agree to float rounding, not bit for bit (losses within 1e-4
relative over 300 steps: 2e-7 after 20 steps, 4.4e-5 after 300 measured
with all runs vmapped on a CPU; tested). What stays static, and so equal
across the runs of one step, is the rest of the model config and the batch
size. Where runs go one at a
time (`sweep_batch` 1, the CPU's form), the sweep's loop
(`sweep_loop`) runs each in the program it compiles alone instead, and is
bit-identical to it.
"""

import dataclasses
import itertools
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from purejax import gpt
from purejax.data import batches
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.pure import steps
from purejax.training.pure.state import TrainState

# The model's drop rate, swept besides the optimizer's numbers.
DROPOUT = "dropout"
SWEEPABLE = optim.HYPERPARAMS + (DROPOUT,)


class RunSpec(NamedTuple):
  """One run of a sweep.

  Attributes:
    name: a directory name that says what the run varies, its settings
      only, e.g. `"learning_rate=0.001_seed=0"` (names in sorted order, so
      one grid written in any order names its runs alike).
    seed: the run's seed.
    opt_config: the run's optimizer (validated like a single run's).
    hyperparams: `{name: value}` of the swept numbers: the optimizer's, and
      `"dropout"` where the grid sweeps it.
  """
  name: str
  seed: int
  opt_config: optim.OptimizerConfig
  hyperparams: Dict[str, float]

  def model_config(self, config: gpt.GPTConfig) -> gpt.GPTConfig:
    """The run's model: `config` with the run's dropout, where the grid sweeps it."""
    if DROPOUT not in self.hyperparams:
      return config
    return dataclasses.replace(config, dropout=self.hyperparams[DROPOUT])


def parse_grid(spec: str) -> Dict[str, Tuple[float, ...]]:
  """`"learning_rate=3e-4,1e-3;dropout=0,0.1"` -> `{name: values}`.

  Names are among `SWEEPABLE`: the optimizer's numbers and `dropout`.

  Raises:
    ValueError: a malformed part, an unknown name, a value that is not a
      number, a dropout outside [0, 1), or a name given twice.
  """
  grid: Dict[str, Tuple[float, ...]] = {}
  for part in filter(None, (p.strip() for p in spec.split(";"))):
    name, sep, values = part.partition("=")
    name = name.strip()
    if not sep or not values.strip():
      raise ValueError(f"sweep part {part!r} is not NAME=V1,V2,...; e.g. "
                       f"learning_rate=3e-4,1e-3.")
    if name not in SWEEPABLE:
      raise ValueError(f"{name!r} cannot be swept in one program; choose among "
                       f"{SWEEPABLE} (and seeds).")
    if name in grid:
      raise ValueError(f"{name} is given twice in the sweep; list its values once.")
    try:
      grid[name] = tuple(float(v) for v in values.split(",") if v.strip())
    except ValueError:
      raise ValueError(f"sweep values of {name} must be numbers, got {values!r}.") from None
    if name == DROPOUT:
      for value in grid[name]:
        _check_dropout(value, "sweep")
  return grid


def _check_dropout(value: float, where: str) -> None:
  if not 0.0 <= value < 1.0:
    raise ValueError(f"{where}: dropout must be in [0, 1), got {value:g}; sweep rates "
                     f"such as dropout=0,0.1,0.2.")


def expand(opt_config: optim.OptimizerConfig, seed: int,
           grid: Mapping[str, Sequence[float]], num_seeds: int = 1) -> List[RunSpec]:
  """Every combination of the grid's values, each with seeds `seed .. seed + num_seeds - 1`.

  Args:
    opt_config: the optimizer all runs share, but for the grid's fields.
    seed: the first seed.
    grid: `{optimizer setting (`optim.value`'s names), or "dropout": values}` (`parse_grid`);
      a swept dropout replaces the model config's (`RunSpec.model_config`).
    num_seeds: seeds per combination (>= 1).

  Returns:
    The runs, seeds varying fastest.

  Raises:
    ValueError: an invalid combination (e.g. a learning rate below `min_lr`,
      a dropout outside [0, 1)), naming the run.
  """
  if num_seeds < 1:
    raise ValueError(f"sweep seeds must be a positive integer, got {num_seeds}.")
  names = list(grid)
  specs = []
  for values in itertools.product(*(grid[n] for n in names)):
    for s in range(seed, seed + num_seeds):
      hyper = dict(zip(names, values))
      label = run_name(hyper, s)
      if DROPOUT in hyper:
        _check_dropout(hyper[DROPOUT], f"sweep run {label}")
      try:
        config = optim.replace(
            opt_config, **{n: v for n, v in hyper.items() if n != DROPOUT})
      except ValueError as e:
        raise ValueError(f"sweep run {label}: {e}") from None
      specs.append(RunSpec(label, s, config, hyper))
  names = [spec.name for spec in specs]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise ValueError(f"the sweep lists run {repeated[0]} twice; give each value once.")
  return specs


def run_name(hyperparams: Mapping[str, float], seed: int) -> str:
  """A run's folder name: its swept settings, by name, then its seed
  (`"dropout=0.1_learning_rate=0.001_seed=0"`)."""
  return "_".join([f"{n}={hyperparams[n]:g}" for n in sorted(hyperparams)] + [f"seed={seed}"])


def hyperparams(runs: Sequence[RunSpec]) -> Dict[str, chex.Array]:
  """The numbers any run sweeps, `{name: [runs] float32}` from each run's optimizer
  (and `"dropout"`, from each run's `hyperparams`).

  Raises:
    ValueError: some runs sweep dropout and others do not.
  """
  names = sorted({n for r in runs for n in r.hyperparams})
  if DROPOUT in names and not all(DROPOUT in r.hyperparams for r in runs):
    raise ValueError("some runs sweep dropout and others do not; give every run a "
                     "dropout (expand them from one grid).")
  return {n: jnp.asarray([r.hyperparams[n] if n == DROPOUT else optim.value(r.opt_config, n)
                          for r in runs], jnp.float32)
          for n in names}


def stack(trees: Sequence[Any]) -> Any:
  """Pytrees of one structure -> one pytree with a leading `[len(trees)]` runs axis."""
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def unstack(tree: Any, index: int) -> Any:
  """Run `index` of a stacked pytree (`stack`'s inverse for one run)."""
  return jax.tree.map(lambda leaf: leaf[index], tree)


def num_runs(tree: Any) -> int:
  return jax.tree.leaves(tree)[0].shape[0]


def choose_sweep_batch(platform: str, sweep_batch: Optional[int] = None) -> Optional[int]:
  """Runs vmapped together on `platform`: `sweep_batch` when given (0: all at once,
  returned as None), else the platform's choice.

  The CPU takes one run at a time (1): one run already keeps its cores busy,
  and vmapping N runs multiplies the program's scratch memory by N; past 64
  MiB, glibc maps it fresh for every call and the page faults cost more than
  batching gains (4 runs against the runs one by one: 0.89-0.94x vmapped,
  0.98-1.03x one at a time; docs/performance.md). Elsewhere, all at once (None).
  """
  if sweep_batch is not None and (not isinstance(sweep_batch, int) or sweep_batch < 0):
    raise ValueError(f"`sweep_batch` must be None or a non-negative integer, got "
                     f"{sweep_batch!r}.")
  if sweep_batch is None:
    return 1 if platform == "cpu" else None
  return sweep_batch or None


def _over_runs(fn: Callable, carried: Any, xs: Any, batch: Optional[int]) -> Tuple[Any, Any]:
  """`fn(carried_i, xs_i) -> (carried_i, ys_i)` for every run `i`, `batch` at a time.

  All runs at once is one `jax.vmap`. Fewer is a `lax.scan` over groups of
  runs inside the program, each group vmapped, that updates `carried` (the
  runs' stacked state) in place: a `lax.map` would hold a second copy of
  every run's state, and the CPU takes one run at a time to keep its
  scratch memory at one run's (`choose_sweep_batch`).

  Returns:
    `(carried, ys)`, both with the leading runs axis.
  """
  runs = num_runs((carried, xs))
  if not batch or batch >= runs:  # None or 0: all at once
    return jax.vmap(fn)(carried, xs)
  group = jax.vmap(fn)

  def take(tree, start, size):
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size), tree)

  def put(tree, part, start):
    return jax.tree.map(lambda x, p: jax.lax.dynamic_update_slice_in_dim(x, p, start, 0),
                        tree, part)

  def one_group(carried, index):
    start = index * batch
    part, ys = group(take(carried, start, batch), take(xs, start, batch))
    return put(carried, part, start), ys

  groups = runs // batch
  carried, ys = jax.lax.scan(one_group, carried, jnp.arange(groups))
  ys = jax.tree.map(lambda y: y.reshape(groups * batch, *y.shape[2:]), ys)
  if runs % batch:  # the last, smaller group
    start = groups * batch
    part, tail = group(take(carried, start, runs - start), take(xs, start, runs - start))
    carried = put(carried, part, start)
    ys = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), ys, tail)
  return carried, ys


def _train_steps(
    state: TrainState,
    tokens: Union[batches.DeviceTokens, batches.DeviceRows],
    step: chex.Numeric,
    hyperparams: Mapping[str, chex.Array],
    *,
    config: gpt.GPTConfig,
    make_optimizer: Callable[[Mapping[str, chex.Array]], optax.GradientTransformation],
    batch_size: int,
    num_steps: int,
    forms: kernels.Forms,
    grad_accum_steps: int = 1,
    params_view: Optional[Callable[[Any], gpt.Params]] = None,
    sweep_batch: Optional[int] = None,
    objective: Callable[..., chex.Array] = steps.lm_loss,
) -> Tuple[TrainState, steps.StepMetrics]:
  """`steps.train_steps` of every run at once, in one jitted program.

  Args:
    state: every run's `TrainState` stacked on a leading runs axis (`stack`),
      donated; each run's optimizer state has the structure
      `make_optimizer(...).init` gives, its keys its own streams.
    tokens: the training ids on the device, shared by all runs; each run
      draws its own batches from its key.
    step: global index of the first step (the same for every run).
    hyperparams: `{name: [runs]}` optimizer numbers (`hyperparams`), and
      `"dropout"`: each run's drop rate.
    config: the model config all runs share; with a swept `"dropout"`, its
      `dropout` is ignored (each run drops at its own rate).
    make_optimizer: builds one run's optimizer from its `{name: scalar}`
      numbers (`optim.RunOptimizer`); a static argument.
    batch_size, num_steps, grad_accum_steps, params_view, objective: as in
      `steps.train_steps`.
    forms: execution forms (`kernels.select`), as in `steps.train_steps`.
    sweep_batch: runs vmapped together (`choose_sweep_batch`); None or 0: all.

  Returns:
    `(state, StepMetrics)`, both with the leading runs axis; metrics are
    `[runs, num_steps]`.
  """
  if not getattr(tokens, "on_device", False):
    raise TypeError("a sweep draws its batches on the device (batches.DeviceTokens); load "
                    "a corpus that fits in device memory (host-read batches differ per run).")

  def one_run(state, hyper):
    hyper = dict(hyper)
    rate = hyper.pop(DROPOUT, None)  # the model's, not the optimizer's
    return steps.train_steps(
        state, tokens, step, config=config, optimizer=make_optimizer(hyper),
        batch_size=batch_size, num_steps=num_steps, grad_accum_steps=grad_accum_steps,
        params_view=params_view, forms=forms, dropout=rate, objective=objective)

  return _over_runs(one_run, state, dict(hyperparams), sweep_batch)


train_steps = jax.jit(
    _train_steps, static_argnames=("config", "make_optimizer", "batch_size", "num_steps",
                                   "forms", "grad_accum_steps", "params_view", "sweep_batch",
                                   "objective"),
    donate_argnums=0)


def _evaluate(params: Any, tokens: batches.DeviceTokens, keys: chex.PRNGKey, *,
             config: gpt.GPTConfig, batch_size: int, num_batches: int, forms: kernels.Forms,
             params_view: Optional[Callable[[Any], gpt.Params]] = None,
             sweep_batch: Optional[int] = None,
             objective: Callable[..., chex.Array] = steps.lm_loss) -> chex.Array:
  """`steps.evaluate` of every run: `[runs]` mean losses of `[runs, ...]` params.

  Each run draws its evaluation batches from its own `keys[i]`, as it would alone;
  `forms` and `sweep_batch` as in `train_steps`.
  """
  def one_run(_, params_and_key):
    params, key = params_and_key
    return (), steps.evaluate(params, tokens, key, config=config, batch_size=batch_size,
                              num_batches=num_batches, params_view=params_view, forms=forms,
                              objective=objective)

  return _over_runs(one_run, (), (params, keys), sweep_batch)[1]


evaluate = jax.jit(_evaluate, static_argnames=("config", "batch_size", "num_batches", "forms",
                                                "params_view", "sweep_batch", "objective"))


def best_run(losses: np.ndarray) -> int:
  """Index of the lowest finite loss (0 if none is finite)."""
  losses = np.where(np.isfinite(losses), losses, np.inf)
  return int(np.argmin(losses))

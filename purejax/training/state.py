"""A training run's state, one typed pytree: params, optimizer state and PRNG keys.

    state = TrainState(params, optimizer.init(params), {"train": key, "eval": eval_key})
    state, shardings = shard(state, plan)   # params and opt_state per the plan
    state, metrics = train_steps(state, batches, step, ...)

A checkpoint stores the state under the names its fields have as a dict
(`['params']['wte']['embedding']`, `['opt_state'][0]...`, `['keys']['train']`),
so it opens with plain `numpy.load` and files of earlier versions restore
(`RENAMED` maps the names those used).
"""

from typing import Any, Dict, NamedTuple, Tuple

import chex
import jax
import optax

from purejax.training import parallel


class TrainState(NamedTuple):
  """Everything a training run carries from step to step.

  Attributes:
    params: the model's params pytree.
    opt_state: the optax state of `params`.
    keys: the run's PRNG streams by name: the GPT's `"train"` (batches and
      dropout of step `s` come from `fold_in(keys["train"], s)`) and
      `"eval"` (the fixed evaluation batches); the MLP's `"data"` (each
      epoch's shuffle).
  """
  params: Any
  opt_state: optax.OptState
  keys: Dict[str, chex.PRNGKey]


# Array names of checkpoints written before the state had a type: the MLP's
# data key was a field of its own.
RENAMED = {"['data_key']": "['keys']['data']"}


def shardings(state: TrainState, plan: parallel.ShardingPlan) -> TrainState:
  """A `NamedSharding` per leaf: params and optimizer state as `plan` splits
  them (`ShardingPlan.state`), the keys replicated."""
  return TrainState(params=plan.state(state.params), opt_state=plan.state(state.opt_state),
                    keys=jax.tree.map(lambda _: plan.replicated, state.keys))


def shard(state: TrainState, plan: parallel.ShardingPlan) -> Tuple[TrainState, TrainState]:
  """Host state -> global arrays laid out per `shardings`; returns `(state, shardings)`."""
  layout = shardings(state, plan)
  return parallel.put(state, layout), layout


def as_tree(state: TrainState) -> Dict[str, Any]:
  """The state as the dict a checkpoint stores (its array names)."""
  return state._asdict()


def from_tree(tree: Dict[str, Any]) -> TrainState:
  """`as_tree`'s inverse."""
  return TrainState(**tree)

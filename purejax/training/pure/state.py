"""A training run's state, one typed pytree: params, optimizer state and PRNG keys.

    state = TrainState(params, optimizer.init(params), {"train": key, "eval": eval_key})
    state, view = start_state(params, run_keys(seed), optimizer)   # a new GPT run's
    state, shardings = shard(state, plan)   # params and opt_state per the plan
    state, metrics = train_steps(state, batches, step, ...)

A checkpoint stores the state under the names its fields have as a dict
(`['params']['wte']['embedding']`, `['opt_state'][0]...`, `['keys']['train']`),
so it opens with plain `numpy.load` and files of earlier versions restore
(`RENAMED` maps the names those used).
"""

from typing import Any, Dict, NamedTuple, Optional, Tuple

import chex
import jax
import optax

from purejax import lora
from purejax import rng
from purejax.training.pure import parallel


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


def run_keys(seed: int) -> Dict[str, chex.PRNGKey]:
  """A GPT run's key streams, `{"params", "train", "eval", "sample"}`, from its seed."""
  return rng.split_named(jax.random.PRNGKey(seed), ("params", "train", "eval", "sample"))


def trained_params(params, key, lora_config: Optional[lora.LoraConfig]):
  """`(what the run trains, params_view)`: the params, or LoRA's base and adapters."""
  if lora_config is None:
    return params, None
  adapters = lora.init(params, lora_config.rank, lora_config.targets, key)
  return lora.trainable(params, adapters), lora.View(lora_config.scale_alpha)


def start_state(params, keys: Dict[str, chex.PRNGKey], optimizer: optax.GradientTransformation,
                lora_config: Optional[lora.LoraConfig] = None):
  """`(TrainState, params_view)` a new GPT run starts from (`purejax.replay` rebuilds it).

  Args:
    params: the initial params (`gpt.init_params(config, keys["params"])`, or
      a fine-tune's).
    keys: `run_keys(seed)`.
    optimizer: the run's.
    lora_config: train LoRA adapters of `params` instead.
  """
  # The adapters' key is folded from the params' one: the other streams stay
  # those of a run without LoRA.
  params, view = trained_params(params, jax.random.fold_in(keys["params"], 1), lora_config)
  return TrainState(params, optimizer.init(params),
                    {"train": keys["train"], "eval": keys["eval"]}), view


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

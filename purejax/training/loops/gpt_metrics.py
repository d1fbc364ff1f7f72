"""What an evaluation of a GPT run measures: each split's mean loss, val bits per byte.

    values = skeleton.evaluate(driven, evaluation_metrics(text, context))
    values["val_loss"], values["val_bpb"]          # [runs] each

Each metric is a `skeleton.Metric`: `(driven, values so far) -> {name: [runs]
values}`, called in order by the training loop at every evaluation (and by
`gpt_loop.evaluate_gpt`). A run draws its evaluation batches with its own eval
key, the same at every evaluation, so its numbers compare step to step. A new
metric is one function here, added to `evaluation_metrics`' list.
"""

from typing import Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from purejax.training.loops import gpt_run
from purejax.training.loops.skeleton import Metric, Values
from purejax.training.pure import parallel
from purejax.training.pure import steps


def split_losses(driven, values: Values) -> Values:
  """`train_loss` and `val_loss`: the mean loss of `eval_iters` batches of each split."""
  del values
  return driven.split_losses()


def bits_per_byte(loss: float, tokens, eval_key, byte_lengths, config, train) -> float:
  """`loss`, the mean of `steps.evaluate`'s batches of `tokens` drawn with `eval_key`, in
  bits per UTF-8 byte: the sum of their tokens' losses over the bytes they decode to."""
  counts = steps.target_bytes(tokens, eval_key, byte_lengths, block_size=config.block_size,
                              batch_size=train.batch_size, num_batches=train.eval_iters)
  num_bytes = int(np.sum(np.asarray(counts), dtype=np.int64))
  num_tokens = train.eval_iters * train.batch_size * config.block_size
  return loss * num_tokens / (np.log(2) * num_bytes) if num_bytes else float("nan")


def val_bits_per_byte(byte_lengths: jax.Array, context: gpt_run.RunContext) -> Metric:
  """`val_bpb`: `val_loss` in bits per UTF-8 byte (it compares across tokenizers), each
  run's over the bytes of its own val batches."""

  def metric(driven, values: Values) -> Values:
    return {"val_bpb": np.asarray([
        bits_per_byte(float(loss), context.feed.eval["val_loss"], driven.eval_key(i),
                      byte_lengths, context.config, context.train)
        for i, loss in enumerate(values["val_loss"])])}

  return metric


def device_byte_lengths(text, plan: parallel.ShardingPlan) -> Optional[jax.Array]:
  """The bytes per id of the data's tokenizer on the plan's devices (`byte_lengths` of a
  corpus); None where it has none (conversations, a tokenizer without text)."""
  lengths = text.byte_lengths()
  return None if lengths is None else parallel.put(jnp.asarray(lengths), plan.replicated)


def evaluation_metrics(text, context: gpt_run.RunContext) -> List[Metric]:
  """What every evaluation of a GPT run on `text` computes, in order."""
  metrics = [split_losses]
  byte_lengths = device_byte_lengths(text, context.plan)
  if byte_lengths is not None:
    metrics.append(val_bits_per_byte(byte_lengths, context))
  return metrics


class FixedParams:
  """Params to evaluate, no run: the `split_losses` and `eval_key` the metrics ask for."""

  def __init__(self, params, eval_key, context: gpt_run.RunContext):
    self._params, self._key, self._context = params, eval_key, context

  def split_losses(self) -> Dict[str, np.ndarray]:
    losses = gpt_run.evaluate_splits(self._params, self._key, self._context)
    return {name: np.asarray([loss]) for name, loss in losses.items()}

  def eval_key(self, index: int):
    del index
    return self._key

  def model(self, index: int):
    del index
    return gpt_run.model_of(self._params, self._context.config, self._context)


def one_run(values: Values, index: int = 0) -> Dict[str, float]:
  """Run `index`'s values as floats."""
  return {name: float(v[index]) for name, v in values.items()}


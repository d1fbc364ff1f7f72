"""What an evaluation of a GPT run measures: each split's mean loss, val bits per byte,
then any further metrics of the model.

    values = evaluate_run(params, eval_key, config, context, byte_lengths, metrics)
    values["val_loss"], values["val_bpb"]          # floats

A run draws its evaluation batches with its own eval key, the same at every
evaluation, so its numbers compare step to step. A further metric is a plain
function of the run's model, `metric(params, config, forms) -> {name: float}`
(`evaluation.task_metric`'s benchmark scores). A sweep evaluates its runs
together (`evaluation_metrics`, the training loop's `skeleton.Metric`s over its
driven runs), each further metric once per run (`per_run`).
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from purejax.training.loops import skeleton
from purejax.training.loops.skeleton import Values
from purejax.training.pure import parallel
from purejax.training.pure import preference
from purejax.training.pure import steps


def split_losses(driven, values: Values) -> Values:
  """`train_loss` and `val_loss`: the mean loss of `eval_iters` batches of each split."""
  del values
  return driven.split_losses()


def evaluate_splits(params, eval_key, context, config=None) -> Dict[str, float]:
  """One run's mean loss of `train.eval_iters` batches of each split, drawn with `eval_key`
  (the same batches at every evaluation): `{"train_loss", "val_loss"}`. `context`: the
  run's `gpt_run.RunContext`; `config`: the run's model where it differs from the
  context's (a sweep's run with its own dropout)."""
  return {name: float(steps.evaluate(params, tokens, eval_key, config=config or context.config,
                                     batch_size=context.train.batch_size,
                                     num_batches=context.train.eval_iters, plan=context.plan,
                                     forms=context.forms, params_view=context.view,
                                     objective=context.objective))
          for name, tokens in context.feed.eval.items()}


def model_of(params, config, context) -> Tuple[Any, Any, Any]:
  """A run's model as a benchmark scores it: `(params, config, forms)`, the params
  whole on one local device with LoRA's adapters merged (`context.view`)."""
  params = jax.device_put(parallel.fetch(params), jax.local_devices()[0])
  if context.view is not None:
    params = jax.jit(context.view)(params)
  return params, config, context.forms


def bits_per_byte(loss: float, tokens, eval_key, byte_lengths, config, train) -> float:
  """`loss`, the mean of `steps.evaluate`'s batches of `tokens` drawn with `eval_key`, in
  bits per UTF-8 byte: the sum of their tokens' losses over the bytes they decode to."""
  counts = steps.target_bytes(tokens, eval_key, byte_lengths, block_size=config.block_size,
                              batch_size=train.batch_size, num_batches=train.eval_iters)
  num_bytes = int(np.sum(np.asarray(counts), dtype=np.int64))
  num_tokens = train.eval_iters * train.batch_size * config.block_size
  return loss * num_tokens / (np.log(2) * num_bytes) if num_bytes else float("nan")


def val_bits_per_byte(byte_lengths: jax.Array, context
                      ) -> skeleton.Metric:
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


def evaluation_metrics(text, context) -> List[skeleton.Metric]:
  """What every evaluation of a GPT run on `text` computes, in order."""
  metrics = [split_losses]
  byte_lengths = device_byte_lengths(text, context.plan)
  if byte_lengths is not None:
    metrics.append(val_bits_per_byte(byte_lengths, context))
  return metrics


# metric(params, config, forms) -> {name: value}: what a further evaluation scores of a
# run's model (its params whole on one local device, LoRA's adapters merged).
Metric = Callable[[Any, Any, Any], Dict[str, float]]


def objective_metrics(context) -> List[Metric]:
  """What a run's objective measures besides its loss: a preference run's rewards,
  margin, accuracy and chosen NLL on the pairs of each split it evaluates on
  (`preference.pair_metrics`, up to `eval_iters * batch_size` pairs each); none for
  the language model's."""
  if not isinstance(context.objective, preference.DPO):
    return []
  splits = {"train": context.feed.eval["train_loss"], "val": context.feed.eval["val_loss"]}
  return [preference.pair_metrics(context.objective, splits, context.train.batch_size,
                                  context.train.eval_iters * context.train.batch_size)]


def evaluate_run(params, eval_key, config, context,
                 byte_lengths: Optional[jax.Array], metrics: Sequence[Metric] = ()
                 ) -> Dict[str, float]:
  """One run's evaluation: `train_loss` and `val_loss` (`evaluate_splits`), `val_bpb`
  where the data has byte lengths (`device_byte_lengths`), then each of `metrics`."""
  values = evaluate_splits(params, eval_key, context, config)
  if byte_lengths is not None:
    values["val_bpb"] = bits_per_byte(values["val_loss"], context.feed.eval["val_loss"],
                                      eval_key, byte_lengths, config, context.train)
  for metric in metrics:
    values.update(metric(*model_of(params, config, context)))
  return values


def per_run(metric: Metric) -> skeleton.Metric:
  """`metric` as a sweep's training loop evaluates it: on each of its driven runs' models."""

  def each(driven, values: Values) -> Values:
    found = [metric(*driven.model(i)) for i in range(len(values["val_loss"]))]
    return {name: np.asarray([f[name] for f in found]) for name in found[0]}

  return each


def one_run(values: Values, index: int = 0) -> Dict[str, float]:
  """Run `index`'s values as floats."""
  return {name: float(v[index]) for name, v in values.items()}


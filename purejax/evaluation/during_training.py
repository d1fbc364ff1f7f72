"""Benchmarks at a training run's evaluation steps, beside its loss.

    metric = during_training.task_metric([tasks.load_task("arc_easy.jsonl")], tokenizer)
    gpt_loop.train_gpt(..., metrics=[metric])     # "arc_easy/accuracy" in metrics.jsonl

The metric is a plain function of a run's model (`gpt_metrics.Metric`): at
each evaluation the loop gives it the run's params (with LoRA merged), config
and forms; it scores the tasks (`tasks.run_task`) and returns
`{"<task>/accuracy": ..., "<task>/centered": ...}`, which the loop logs to
metrics.jsonl, TensorBoard and W&B with the losses; a sweep, per run.
"""

from typing import Any, Callable, Dict, Optional, Sequence

from purejax.evaluation import tasks as tasks_lib


def task_metric(tasks: Sequence[tasks_lib.Task], tokenizer, *, limit: Optional[int] = None,
                batch_size: int = 8) -> Callable[[Any, Any, Any], Dict[str, float]]:
  """The evaluation metric that scores `tasks` (their first `limit` items) on a run's model:
  `metric(params, config, forms) -> {"<task>/accuracy": ..., "<task>/centered": ...}`."""
  tasks_lib.check_names(tasks)

  def metric(params, config, forms) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for task in tasks:
      result = tasks_lib.run_task(task, params, config, tokenizer, batch_size=batch_size,
                                  limit=limit, forms=forms)
      for key in ("accuracy", "centered"):
        out[f"{task.name}/{key}"] = result[key]
    return out

  return metric

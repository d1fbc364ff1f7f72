"""Benchmarks at a training run's evaluation steps, beside its loss.

    metric = during_training.task_metric([tasks.load_task("arc_easy.jsonl")], tokenizer)
    gpt_loop.train_gpt(..., metrics=[metric])     # "arc_easy/accuracy" in metrics.jsonl

The metric is a training loop's `skeleton.Metric`: at each evaluation it asks
the loop's runs for their models (`model(index)`: params with LoRA merged,
config, forms), scores the tasks (`tasks.run_task`) on each, and returns
`{"<task>/accuracy": [runs], "<task>/centered": [runs]}`, which the loop logs
to metrics.jsonl, TensorBoard and W&B with the losses; in a sweep, per run.
"""

from typing import Dict, Optional, Sequence

import numpy as np

from purejax.evaluation import tasks as tasks_lib


def task_metric(tasks: Sequence[tasks_lib.Task], tokenizer, *, limit: Optional[int] = None,
                batch_size: int = 8):
  """The evaluation metric that scores `tasks` (their first `limit` items) on every run."""
  tasks_lib.check_names(tasks)

  def metric(driven, values) -> Dict[str, np.ndarray]:
    out: Dict[str, list] = {}
    for index in range(len(values["val_loss"])):
      params, config, forms = driven.model(index)
      for task in tasks:
        result = tasks_lib.run_task(task, params, config, tokenizer, batch_size=batch_size,
                                    limit=limit, forms=forms)
        for key in ("accuracy", "centered"):
          out.setdefault(f"{task.name}/{key}", []).append(result[key])
    return {name: np.asarray(v) for name, v in out.items()}

  return metric

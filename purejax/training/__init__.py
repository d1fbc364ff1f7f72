"""Training machinery, each module one job.

`steps` (jitted train and eval steps), `optim` (optimizers and schedules),
`parallel` (device meshes and shardings), `checkpoint` (checkpoint files),
`runs` (a run's life: start or resume, save, signals, NaN checks), `monitor`
(metrics.jsonl, TensorBoard), `progress` (the progress bar), `flops` (FLOPs
and MFU), `plots` (loss curves), and `loop` (the training loops).
"""

"""Training machinery, each module one job.

`steps` (jitted train and eval steps), `optim` (optimizers and schedules),
`parallel` (device meshes and shardings), `checkpoint` (checkpoint files),
`runs` (a run's life: start or resume, save, signals, NaN checks), `monitor`
(metrics.jsonl, TensorBoard), `wandb_sink` (Weights & Biases), `progress`
(the progress bar), `flops` (FLOPs and MFU), `plots` (loss curves), `loop`
(the training loops), `sweep` (many runs as one vmapped step) and `replay`
(a step replayed from a checkpoint).
"""

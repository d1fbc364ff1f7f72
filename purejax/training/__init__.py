"""Training machinery, each module one job.

`state` (`TrainState`: params, optimizer state, keys), `steps` (jitted train
and eval steps), `optim` (optimizers and schedules), `parallel` (device
meshes and shardings), `checkpoint` (checkpoint files), `runs` (a run's
life: start or resume, save), `signals` (SIGINT/SIGTERM: save, then stop),
`nonfinite` (NaN/Inf losses), `monitor` (metrics.jsonl, TensorBoard),
`wandb_sink` (Weights & Biases), `progress` (the progress bar), `flops`
(FLOPs and MFU), `plots` (loss curves), `session` (what every loop does
around its steps), `gpt_run` (how a GPT run starts, alone or in a sweep),
`loop` / `mlp_loop` (the GPT's and the MLP's training loops), `sweep` and
`sweep_loop` (many runs as one vmapped step, and their loop) and `replay`
(a step replayed from a checkpoint).
"""

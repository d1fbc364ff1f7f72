"""Training machinery, in four rooms by kind of code.

- `pure/`: the jitted core, functions of their inputs only: `state`
  (`TrainState`: params, optimizer state, keys), `steps` (train and eval
  steps), `sweep` (many runs as one vmapped step), `parallel` (device meshes
  and shardings), `flops` (FLOPs and MFU).
- `effects/`: what a run does to the world: `runs` (start or resume, save),
  `session` (what every loop does around its steps), `signals`
  (SIGINT/SIGTERM), `nonfinite` (NaN/Inf losses), `monitor`
  (metrics.jsonl, TensorBoard), `wandb_sink`, `progress`, `plots`.
- `loops/`: the one training loop (`skeleton`) and what it drives: `gpt_run`
  (how a GPT run starts, and its programs), `gpt_metrics` (what an
  evaluation measures), `gpt_loop`, `sweep_loop`, `mlp_loop`, and the named
  `recipes`.
- `tools/`: what works on runs from outside the loop: `replay` (a step
  replayed from a checkpoint), `gpu_plan` (the step compiled for a GPU
  without one).

The optimizers are `purejax.optimizers`; the checkpoint file format is
`purejax.checkpoint`, below both `training` and `weights`.
"""

"""Optimizers and learning-rate schedules, built from optax pieces.

Each optimizer is one module: a small frozen dataclass of its own settings and
a factory returning an `optax.GradientTransformation` (`adam`: Adam and
AdamW; `sgd`: SGD and momentum; `muon`: Muon on the GPT blocks' matrices with
AdamW on the rest; `lion`: Lion), found by name in `registry.OPTIMIZERS`.
`optim` holds what every optimizer shares (`OptimizerConfig`: the rate, its
schedule, clipping; weight-decay masks, LoRA's frozen base, skipping
non-finite updates) and `make_optimizer`; `settings` turns a settings class
into the flat names the command line, sweeps and checkpoints use. Nothing
here imports `training`: the training steps take the transformation these build.
"""

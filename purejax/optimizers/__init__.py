"""Optimizers and learning-rate schedules, built from optax pieces.

`optim` (the run's optimizer config, schedules, weight-decay masks, LoRA's
frozen base, skipping non-finite updates) and `muon` (Muon: momentum
orthogonalised by Newton-Schulz). They import nothing from `training`: the
training steps take the `optax.GradientTransformation` these build.
"""

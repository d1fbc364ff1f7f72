"""A run's effects on the world: its checkpoints and resume, metrics files, progress bar,
signals, NaN checks and plots. Only process 0 writes."""

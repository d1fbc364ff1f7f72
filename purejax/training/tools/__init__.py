"""Tools over runs, outside the loop: a step replayed from a checkpoint (`replay`), the
training step planned for a GPU without one (`gpu_plan`)."""

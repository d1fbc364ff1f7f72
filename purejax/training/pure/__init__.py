"""The jitted core of training: state, steps, sweeps, device shardings, FLOPs. No files,
no clocks, no printing: every function here is a function of its inputs."""

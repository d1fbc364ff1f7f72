#!/bin/bash
# The speedrun at nanoGPT's GPU recipe's size on one lent GPU, in two calls:
#   bash bench/gpu_speedrun.sh OUT_DIR smoke   # every arm a few steps (~2 min on an H200)
#   bash bench/gpu_speedrun.sh OUT_DIR         # the recipes, 3 seeds, no ablations (~7 min)
# Six training processes share the one device; the step times are measured
# before any of them starts, in one process.
set -u
out=${1:?usage: bash bench/gpu_speedrun.sh OUT_DIR [smoke]}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=/tmp/purejax-jax-cache  # the seeds share compiled programs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
if [ "${2:-}" = smoke ]; then
  name=speedrun-gpu-smoke
  args=(--seeds=0 --scale=0.01 --time_rounds=2 --eval_iters=2 --parallel=4)
  limit=240
else
  name=speedrun-gpu
  args=(--eval_iters=50 --parallel=6)
  limit=540
fi
timeout $limit python3 -m bench.speedrun --size=gpu --ablations=false "${args[@]}" \
  --out="$out/$name.json" > "$out/$name.log" 2>&1
echo "$name rc $?"
grep -v "^I0000\|^W0000\|absl::" "$out/$name.log" | tail -40

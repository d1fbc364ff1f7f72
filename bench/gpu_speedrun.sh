#!/bin/bash
# The speedrun at nanoGPT's GPU recipe size on one lent GPU, in under 9 minutes:
# a smoke run first (every arm a few steps, so a broken run costs ~1 minute),
# then the recipes' runs (3 seeds, no ablations), six training processes at a
# time on the one device; step times are measured before, in one process.
#   bash bench/gpu_speedrun.sh OUT_DIR
set -u
out=${1:?usage: bash bench/gpu_speedrun.sh OUT_DIR}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=/tmp/purejax-jax-cache  # the seeds share compiled programs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 120 python3 -m bench.speedrun --size=gpu --seeds=0 --ablations=false --scale=0.01 \
  --time_rounds=2 --eval_iters=2 --parallel=4 --out="$out/speedrun-gpu-smoke.json" \
  > "$out/speedrun-gpu-smoke.log" 2>&1
rc=$?
grep -v "^I0000\|^W0000\|absl::" "$out/speedrun-gpu-smoke.log" | tail -25
[ $rc -eq 0 ] || { echo "smoke run failed: $rc"; exit $rc; }
timeout ${SPEEDRUN_TIMEOUT:-450} python3 -m bench.speedrun --size=gpu --ablations=false \
  --eval_iters=50 --parallel=6 --out="$out/speedrun-gpu.json" > "$out/speedrun-gpu.log" 2>&1
echo "speedrun rc $?"
grep -v "^I0000\|^W0000\|absl::" "$out/speedrun-gpu.log" | tail -40

#!/bin/bash
# One lent GPU in under 8 minutes, after bench/gpu_short.sh: this GPU's target
# config from its driver (bench.gpu_target_config), the deviceless plan for it
# with and without the autotuning results gpu_short.sh dumped, then bench.gpu
# h.forms (the GPU's forms of the GPT-2 124M step against each other).
#   bash bench/gpu_forms.sh OUT_DIR AUTOTUNE_RESULTS
set -u
out=${1:?usage: bash bench/gpu_forms.sh OUT_DIR AUTOTUNE_RESULTS}
tuned=${2:?usage: bash bench/gpu_forms.sh OUT_DIR AUTOTUNE_RESULTS}
export PYTHONUNBUFFERED=1
card=h100
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && card=h200
config="$out/$card-measured.txtpb"
python3 -m bench.gpu_target_config --base=$card > "$config"
grep -E "core_count|clock_rate|memory_bandwidth|l2_cache|device_memory|description" "$config"
JAX_PLATFORMS=cpu timeout 90 python3 -m bench.deviceless_plan --gpu="$config" \
  > "$out/plan-deviceless-measured.json"
JAX_PLATFORMS=cpu XLA_FLAGS="--xla_gpu_load_autotune_results_from=$tuned" timeout 90 \
  python3 -m bench.deviceless_plan --gpu="$config" > "$out/plan-deviceless-measured-tuned.json"
tail -c 1500 "$out"/plan-deviceless-measured*.json
timeout 420 python3 -m bench.gpu --cases=h.forms --time_budget_s=300 --job_grace_s=100 \
  --out_dir="$out"

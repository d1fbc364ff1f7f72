#!/bin/bash
# One lent GPU in under 9 minutes: the GPT-2 124M step's memory plan against its
# measured peak (bench.gpu h.plan, dumping XLA's autotuning results), the same
# program's deviceless plans on that host (untuned, and with those results
# loaded), then bench.gpu h.train (purejax's default forms, the default with the
# head's logits in bf16, and with the MLP's activation saved instead of recomputed,
# against the torch.compile twin).
#   bash bench/gpu_short.sh OUT_DIR
set -u
out=${1:?usage: bash bench/gpu_short.sh OUT_DIR}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
card=h100
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && card=h200
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
XLA_FLAGS="--xla_gpu_dump_autotune_results_to=$out/autotune.textproto" timeout 200 \
  python3 -m bench.gpu --cases=h.plan --time_budget_s=120 --job_grace_s=60 --out_dir="$out"
JAX_PLATFORMS=cpu timeout 90 python3 -m bench.deviceless_plan --gpu=$card \
  > "$out/plan-deviceless.json"
JAX_PLATFORMS=cpu XLA_FLAGS="--xla_gpu_load_autotune_results_from=$out/autotune.textproto" \
  timeout 90 python3 -m bench.deviceless_plan --gpu=$card > "$out/plan-deviceless-tuned.json"
tail -c 1500 "$out"/plan-deviceless*.json
timeout 330 python3 -m bench.gpu --cases=h.train --time_budget_s=240 --job_grace_s=60 \
  --out_dir="$out"

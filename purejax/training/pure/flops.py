"""MFU (model FLOPs utilization): a GPT's training FLOPs per token, devices' peak FLOP/s.

    flops_per_token = flops.transformer_flops_per_token(
        gpt.num_params(params), config.n_layer, config.n_head, config.head_dim,
        config.block_size)
    peak = flops.device_peak_flops(jax.devices()[0], "bfloat16")  # None if unknown
    peak = peak * jax.device_count() if peak else None
    mfu = flops.mfu(flops_per_token, tokens_per_s, peak)          # None if peak is

MFU follows nanoGPT: the model's forward+backward FLOPs per token
(`transformer_flops_per_token`) times tokens/s, over the devices' peak
(`device_peak_flops`, a table of dense peaks by device kind).
"""

import re
import sys
from typing import Optional


def transformer_flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int,
                                block_size: int) -> float:
  """Training FLOPs (forward + backward) per token of a GPT, as nanoGPT estimates them.

  6 FLOPs per parameter per token (2 forward, 4 backward) for the matmuls
  with the weights, plus 12·L·H·Q·T for attention's scores and weighted sums
  over a context of T tokens (PaLM's appendix B).

  Args:
    n_params: parameter count; nanoGPT leaves out the position embeddings
      (`gpt.num_params(params)` does the same) but keeps the token embedding,
      which is also the output head.
    n_layer: transformer blocks (L).
    n_head: attention heads (H).
    head_dim: size of one head (Q = n_embd / n_head).
    block_size: context length trained on (T).

  Returns:
    FLOPs per token.
  """
  return 6 * n_params + 12 * n_layer * n_head * head_dim * block_size


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: Optional[float]
        ) -> Optional[float]:
  """Model FLOPs utilization: the fraction of peak the model's FLOPs reach.

  Args:
    flops_per_token: e.g. from `transformer_flops_per_token`.
    tokens_per_s: tokens trained per second, over all devices.
    peak_flops: peak FLOP/s of those devices together (one device's peak
      times the device count), or None when unknown.

  Returns:
    A fraction (0.4 = 40%), or None when `peak_flops` is None.
  """
  if peak_flops is None:
    return None
  return flops_per_token * tokens_per_s / peak_flops


# Dense (no sparsity) peak FLOP/s of one JAX device, from the vendors' data
# sheets, by device kind: `(pattern of device.device_kind, 16-bit peak,
# TF32 peak, FP32 peak)`. First match wins, so narrower patterns come first.
# NVIDIA's sheets give the tensor-core figures with 2:4 sparsity; dense is half.
# Sources: H200 SXM and NVL, nvidia.com/en-us/data-center/h200 (NVL: 1,671
# TFLOP/s bf16 and 835 TF32 sparse, 60 FP32); B200 and GB200, the per-GPU table
# of nvidia.com/en-us/data-center/gb200-nvl72 (HGX B200: 4.5 PFLOP/s bf16 and
# 2.2 TF32 sparse, 75 TFLOP/s FP32; GB200: 5, 2.5 and 80); L40S, NVIDIA's L40S
# datasheet (362.05 bf16, 183 TF32, 91.6 FP32 dense).
# On TPU v2/v3 a JAX device is one core (half a chip); from v4 on it is a chip.
# TPUs have no TF32 or fp32 matrix unit: fp32 matmuls run as bf16 passes.
_GPU_PEAKS = (
    (r"H100.*PCIe", 756e12, 378e12, 51.2e12),
    (r"H100 NVL", 835e12, 417.5e12, 60e12),
    (r"H200 NVL", 835.5e12, 417.5e12, 60e12),
    (r"\b(H100|H800|GH200|H200)\b", 989e12, 494.5e12, 67e12),  # SXM; H200: same chip
    (r"\bGB200\b", 2.5e15, 1.25e15, 80e12),
    (r"\bB200\b", 2.25e15, 1.1e15, 75e12),
    (r"\bA100\b", 312e12, 156e12, 19.5e12),
    (r"\bL40S\b", 362.05e12, 183e12, 91.6e12),
    (r"\bL4\b", 121e12, 60e12, 30.3e12),
)
_TPU_BF16_PEAKS = (
    (r"^TPU v2$", 22.5e12),
    (r"^TPU v3$", 61.5e12),
    (r"^TPU v4$", 275e12),
    (r"^TPU v5( lite|e)$", 197e12),
    (r"^TPU v5p?$", 459e12),
    (r"^TPU v6( lite|e)$", 918e12),
)
# JAX's matmul precision names (`jax.default_matmul_precision`) by class.
_FAST = (None, "default", "bfloat16", "fastest")
_TF32 = ("high", "tensorfloat32", "bfloat16_3x")
_FULL = ("highest", "float32")


def _dtype_name(dtype) -> str:
  if isinstance(dtype, str):
    return dtype
  import numpy as np  # pylint: disable=import-outside-toplevel
  return np.dtype(dtype).name  # jnp.bfloat16 works: JAX registers it with numpy


def _jax_matmul_precision() -> Optional[str]:
  """The run's `jax_default_matmul_precision` (None: JAX's default), if JAX is loaded."""
  jax = sys.modules.get("jax")
  value = getattr(jax.config, "jax_default_matmul_precision", None) if jax else None
  return None if value is None else str(value).lower()


def device_peak_flops(device, dtype, *, override: Optional[float] = None,
                      matmul_precision: Optional[str] = "auto") -> Optional[float]:
  """Dense peak FLOP/s of one device for matmuls in `dtype`, or None if unknown.

  float32 counts at the rate JAX's matmul precision actually runs it, which
  by default is not full fp32: JAX's DEFAULT precision uses TF32 tensor
  cores on A100/H100-class GPUs (H100 SXM: 494.5e12, not the 67e12 of fp32
  FMA units) and a single bfloat16 pass on TPUs (the bf16 peak). With
  `jax_default_matmul_precision="highest"` the fp32 peak (GPU) or a sixth
  of the bf16 peak (TPU: 6 passes) applies; "high" means TF32 on GPUs and
  3 bf16 passes on TPUs. float16 counts as bfloat16 on GPUs.

  Args:
    device: a `jax.Device` (only `platform` and `device_kind` are read).
    dtype: the matmuls' compute dtype (bfloat16, float16 or float32).
    override: a known peak; returned as is (for devices missing from the table).
    matmul_precision: JAX's precision name; "auto" reads the run's
      `jax_default_matmul_precision`.

  Returns:
    FLOP/s, or None for CPUs, unknown devices, other dtypes or precisions.
  """
  if override is not None:
    return float(override)
  kind, platform = str(getattr(device, "device_kind", "")), getattr(device, "platform", "")
  name = _dtype_name(dtype)
  if matmul_precision == "auto":
    matmul_precision = _jax_matmul_precision()
  if platform == "gpu" or platform in ("cuda", "rocm"):
    for pattern, half, tf32, fp32 in _GPU_PEAKS:
      if re.search(pattern, kind):
        if name in ("bfloat16", "float16"):
          return half
        if name == "float32":
          if matmul_precision in _FAST or matmul_precision in _TF32:
            return tf32
          return fp32 if matmul_precision in _FULL else None
        return None
    return None
  if platform == "tpu":
    for pattern, bf16 in _TPU_BF16_PEAKS:
      if re.search(pattern, kind):
        if name == "bfloat16":
          return bf16
        if name == "float32":
          passes = {**dict.fromkeys(_FAST, 1), **dict.fromkeys(_TF32, 3),
                    **dict.fromkeys(_FULL, 6)}.get(matmul_precision)
          return None if passes is None else bf16 / passes
        return None
  return None

"""The GPU program, pinned on a CPU: GPT-2 124M lowered for CUDA, its StableHLO read.

CI has no GPU, so these tests lower the GPT-2 124M train step (12 layers,
768 wide, T=1024, batch 12, vocab 50304, bf16), `evaluate` and `generate`
for CUDA (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`) from
`jax.ShapeDtypeStruct` inputs: nothing is compiled or allocated. They check
that the GPU forms (`kernels.select("gpu")`, passed as `forms=`) build the
program they are chosen for, and that the CPU keeps its own.

JAX asks the installed cuDNN for its version while tracing a cuDNN
attention call, which fails on a host without CUDA; the `cudnn_version`
fixture stands in for that one query. Nothing else is patched.
"""

import collections
import re

import jax
import jax.numpy as jnp
import pytest

from purejax import decode
from purejax.data import batches
from purejax import gpt
from purejax.ops import attention
from purejax.ops import kernels
from purejax.training import optim
from purejax.training import steps
from purejax.training.state import TrainState

GPT2 = gpt.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                     bias=False, compute_dtype="bfloat16")
BATCH = 12
OPTIMIZER = optim.make_optimizer(optim.OptimizerConfig(
    learning_rate=6e-4, warmup_iters=10, decay_iters=1000, min_lr=6e-5, beta2=0.95,
    weight_decay=0.1, grad_clip=1.0))
CUDNN_FORWARD, CUDNN_BACKWARD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"
_DOT = re.compile(r"stablehlo\.dot_general [^\n]*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> "
                  r"(tensor<[^>]*>)")


@pytest.fixture
def cudnn_version(monkeypatch):
  """Stands in for JAX's query of the installed cuDNN (9.8), which needs CUDA."""
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)


def lower(traced, platform="cuda") -> str:
  """StableHLO text of a traced function lowered for `platform`."""
  try:
    return traced.lower(lowering_platforms=(platform,)).as_text()
  except ValueError as e:
    if "platform" in str(e).lower() and platform in str(e):
      pytest.skip(f"this JAX cannot lower for {platform} on a CPU host: {e}")
    raise


def custom_calls(hlo: str) -> collections.Counter:
  return collections.Counter(re.findall(r"custom_call @([\w$.]+)", hlo))


def dot_dtypes(hlo: str) -> collections.Counter:
  """`{(lhs, rhs, out) element types: count}` of every dot_general."""
  dtype = lambda tensor: tensor.rsplit("x", 1)[-1].rstrip(">")
  return collections.Counter(tuple(map(dtype, dot)) for dot in _DOT.findall(hlo))


def square_faces(hlo: str, size: int) -> int:
  """Tensors with a `size x size` face: full attention scores over `size` positions."""
  return len(re.findall(rf"tensor<(?:\d+x)*{size}x{size}x", hlo))


def row_major_copies(hlo: str) -> int:
  """bf16 tensors split in pairs on their last axis: `kernels.row_major_transpose`'s copies."""
  return len(re.findall(r"tensor<(?:\d+x)+2xbf16>", hlo))


def barriers(hlo: str) -> int:
  return hlo.count("stablehlo.optimization_barrier")


def abstract_state(config):
  params = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  return params, jax.eval_shape(OPTIMIZER.init, params)


KEY = jax.ShapeDtypeStruct((2,), jnp.uint32)
TOKENS = jax.ShapeDtypeStruct((1 << 20,), jnp.int32)


def train_step_hlo(forms, config=GPT2, batch=BATCH, platform="cuda") -> str:
  params, opt_state = abstract_state(config)
  state = TrainState(params, opt_state, {"train": KEY})
  return lower(steps.train_steps.trace(
      state, batches.DeviceTokens(TOKENS), 0, config=config, optimizer=OPTIMIZER,
      batch_size=batch, num_steps=2, forms=forms), platform)


@pytest.mark.parametrize("scan_layers, remat_regions", [(True, 2), (False, 1)])
def test_train_step_runs_cudnn_attention_and_bf16_products(cudnn_version, scan_layers,
                                                           remat_regions):
  forms = kernels.select("gpu", scan_layers=scan_layers)
  hlo = train_step_hlo(forms)
  calls = custom_calls(hlo)
  layers = 1 if scan_layers else GPT2.n_layer  # a scan's body is lowered once
  assert calls[CUDNN_FORWARD] >= layers and calls[CUDNN_BACKWARD] == layers, calls
  assert square_faces(hlo, GPT2.block_size) == 0  # no [.., T, T] scores anywhere
  rows = BATCH * GPT2.block_size
  assert f"{rows}x{GPT2.vocab_size}xf32" not in hlo  # the head runs in chunks
  assert f"{BATCH}x{GPT2.block_size}x{GPT2.vocab_size}xf32" not in hlo
  dots = dot_dtypes(hlo)
  assert set(dots) == {("bf16", "bf16", "f32")}, dots
  # Remat's barriers only: the scanned block ("full"; unrolled layers run
  # without remat) and the chunked loss's body; none on the matmul gradients.
  assert barriers(hlo) == remat_regions
  assert row_major_copies(hlo) == 0


def test_cpu_program_keeps_its_cpu_forms():
  hlo = train_step_hlo(kernels.select("cpu"), platform="cpu")
  assert not any(name.startswith("__cudnn") for name in custom_calls(hlo))
  assert row_major_copies(hlo) > 0  # bf16 gradients from row-major operands
  assert barriers(hlo) > 1  # and fenced: one barrier per gradient pair, beyond remat
  assert square_faces(hlo, GPT2.block_size) == 0  # blocked attention: 64-query blocks


def test_evaluate_runs_cudnn_attention_forward_only(cudnn_version):
  params, _ = abstract_state(GPT2)
  hlo = lower(steps.evaluate.trace(params, batches.DeviceTokens(TOKENS), KEY, config=GPT2,
                                   batch_size=BATCH,
                                   num_batches=2, forms=kernels.select("gpu")))
  calls = custom_calls(hlo)
  assert calls[CUDNN_FORWARD] >= 1 and CUDNN_BACKWARD not in calls, calls
  assert square_faces(hlo, GPT2.block_size) == 0
  assert f"{BATCH * GPT2.block_size}x{GPT2.vocab_size}xf32" not in hlo
  assert set(dot_dtypes(hlo)) == {("bf16", "bf16", "f32")}


def test_decoding_reads_the_cache_with_bf16_products(cudnn_version):
  # The prompt (position 0) attends among itself through cuDNN; each new
  # token reads the cache with XLA's products, in bf16.
  params, _ = abstract_state(GPT2)
  prompt = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  hlo = lower(decode.generate.trace(params, prompt, GPT2, KEY, 8, top_k=200,
                                    forms=kernels.select("gpu")))
  calls = custom_calls(hlo)
  assert calls[CUDNN_FORWARD] == GPT2.n_layer and CUDNN_BACKWARD not in calls, calls
  assert square_faces(hlo, GPT2.block_size) == 0
  assert set(dot_dtypes(hlo)) == {("bf16", "bf16", "f32")}, dot_dtypes(hlo)


def test_attention_dropout_runs_the_bf16_xla_form_without_patching(caplog):
  # nanoGPT's GPU recipe trains with dropout 0.2, which cuDNN's attention in
  # JAX does not take: the "xla" form runs instead (bf16 products, float32
  # softmax and dropout), and the log says so. No cuDNN call is traced, so
  # nothing stands in for cuDNN here.
  recipe = gpt.GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384,
                         dropout=0.2, bias=False, compute_dtype="bfloat16")
  attention._say_once.cache_clear()  # pylint: disable=protected-access
  with caplog.at_level("WARNING", logger="purejax.ops.attention"):
    hlo = train_step_hlo(kernels.select("gpu"), config=recipe, batch=64)
  assert "attention dropout); running the 'xla' form" in caplog.text
  assert not any(name.startswith("__cudnn") for name in custom_calls(hlo))
  assert set(dot_dtypes(hlo)) == {("bf16", "bf16", "f32")}, dot_dtypes(hlo)
  assert barriers(hlo) == 1 and row_major_copies(hlo) == 0  # remat's barrier only

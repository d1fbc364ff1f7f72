"""The GPU program, pinned on a CPU: GPT-2 124M lowered for CUDA, its StableHLO read.

CI has no GPU, so these tests lower the GPT-2 124M train step (12 layers,
768 wide, T=1024, batch 12, vocab 50304, bf16), `evaluate` and the engine's
decoding programs for CUDA (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`) from
`jax.ShapeDtypeStruct` inputs: nothing is compiled or allocated. They check
that the GPU forms (`kernels.select("gpu")`, passed as `forms=`) build the
program they are chosen for, and that the CPU keeps its own.

JAX asks the installed cuDNN for its version while tracing a cuDNN
attention call, which fails on a host without CUDA; the `cudnn_version`
fixture (helpers/gpu.py) stands in for that one query. Nothing else is patched.
"""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from helpers.gpu import (ABSTRACT_KEY, ABSTRACT_TOKENS, CUDNN_BACKWARD, CUDNN_FORWARD, GPT2,
                         GPT2_BATCH, abstract_state, custom_calls, engine_programs_args,
                         lower_for, square_faces, train_step_hlo)
from purejax import cache_rows
from purejax import engine
from purejax import gpt
from purejax.data import batches
from purejax.ops import attention
from purejax.ops import kernels
from purejax.training.pure import steps

_DOT = re.compile(r"stablehlo\.dot_general [^\n]*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> "
                  r"(tensor<[^>]*>)")


def dot_dtypes(hlo: str) -> collections.Counter:
  """`{(lhs, rhs, out) element types: count}` of every dot_general."""
  dtype = lambda tensor: tensor.rsplit("x", 1)[-1].rstrip(">")
  return collections.Counter(tuple(map(dtype, dot)) for dot in _DOT.findall(hlo))


# The GPU's forms: bf16 operands; float32 outputs for the weights' gradients
# and the head's logits, bf16 for the rest (matmul_output="compute").
GPU_PRODUCTS = {("bf16", "bf16", "f32"), ("bf16", "bf16", "bf16")}


def row_major_copies(hlo: str) -> int:
  """bf16 tensors split in pairs on their last axis: `row_major_transpose`'s copies."""
  return len(re.findall(r"tensor<(?:\d+x)+2xbf16>", hlo))


def barriers(hlo: str) -> collections.Counter:
  """The operand types of the program's optimisation barriers, counted."""
  return collections.Counter(re.findall(r"stablehlo\.optimization_barrier [^\n]*: (tensor<[^>]*>)",
                                        hlo))


def activation_input(config, batch) -> str:
  """The type of the MLP activation's input: the barrier `Forms.recompute_activation` sets."""
  return f"tensor<{batch}x{config.block_size}x{config.mlp_width}xbf16>"


@pytest.mark.parametrize("scan_layers", [True, False])
def test_train_step_runs_cudnn_attention_and_bf16_products(cudnn_version, scan_layers):
  forms = kernels.select("gpu", scan_layers=scan_layers)
  hlo = train_step_hlo(forms)
  calls = custom_calls(hlo)
  layers = 1 if scan_layers else GPT2.n_layer  # a scan's body is lowered once
  assert calls[CUDNN_FORWARD] >= layers and calls[CUDNN_BACKWARD] == layers, calls
  assert square_faces(hlo, GPT2.block_size) == 0  # no [.., T, T] scores anywhere
  rows = GPT2_BATCH * GPT2.block_size
  assert f"{rows}x{GPT2.vocab_size}xf32" not in hlo  # the head runs in chunks
  assert f"{GPT2_BATCH}x{GPT2.block_size}x{GPT2.vocab_size}xf32" not in hlo
  dots = dot_dtypes(hlo)
  assert set(dots) == GPU_PRODUCTS, dots
  # No barriers but the recomputed activation's (on its input; unrolled
  # layers only): none on the matmul gradients (the CPU's), and none from
  # remat: the scanned block's ("full_compute_dtype") recomputes through a
  # custom VJP, unrolled layers run without remat, and the chunked loss forms
  # its gradients in one pass.
  assert forms.recompute_activation == (not scan_layers)
  if scan_layers:
    assert not barriers(hlo), barriers(hlo)
  else:
    assert set(barriers(hlo)) == {activation_input(GPT2, GPT2_BATCH)}, barriers(hlo)
    # The activation saved: no barrier at all.
    assert not barriers(train_step_hlo(dataclasses.replace(forms, recompute_activation=False)))
  assert row_major_copies(hlo) == 0


def test_cpu_program_keeps_its_cpu_forms():
  hlo = train_step_hlo(kernels.select("cpu"), platform="cpu")
  assert not any(name.startswith("__cudnn") for name in custom_calls(hlo))
  assert row_major_copies(hlo) > 0  # bf16 gradients from row-major operands
  assert sum(barriers(hlo).values()) > 1  # and fenced: one barrier per gradient pair, beyond remat
  assert square_faces(hlo, GPT2.block_size) == 0  # blocked attention: 64-query blocks


def test_evaluate_runs_cudnn_attention_forward_only(cudnn_version):
  params, _ = abstract_state(GPT2)
  hlo = lower_for(steps.evaluate.trace(params, batches.DeviceTokens(ABSTRACT_TOKENS), ABSTRACT_KEY,
                                       config=GPT2, batch_size=GPT2_BATCH, num_batches=2,
                                       forms=kernels.select("gpu")))
  calls = custom_calls(hlo)
  assert calls[CUDNN_FORWARD] >= 1 and CUDNN_BACKWARD not in calls, calls
  assert square_faces(hlo, GPT2.block_size) == 0
  assert f"{GPT2_BATCH * GPT2.block_size}x{GPT2.vocab_size}xf32" not in hlo
  assert set(dot_dtypes(hlo)) == GPU_PRODUCTS


def test_decoding_reads_the_cache_with_bf16_products():
  # The engine's programs, prompt chunks (`cache_rows.prefill`) and a token of every row
  # a step (`cache_rows.decode_chunk`), both attend through the cache
  # (`attention.attend_with_cache`) with XLA's products, in bf16: no cuDNN call (a
  # prompt is chunks through the cache too) and no [.., T, T] scores.
  settings = engine.EngineConfig(rows=4)
  model, rows, row_settings = engine_programs_args(GPT2, settings)
  forms = kernels.select("gpu")
  p = settings.prefill_rows
  array = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype)
  ids = array(jnp.int32, p)
  prefill = cache_rows.prefill.trace(
      model, rows, row_settings, None, array(jnp.int32, p, settings.prefill_chunk), ids, ids,
      ids, array(bool, p), ids, config=GPT2, forms=forms, top=settings.top_logprobs,
      valid_vocab=50257)
  decode_chunk = cache_rows.decode_chunk.trace(
      model, rows, row_settings, None, array(jnp.int32), array(bool), config=GPT2, forms=forms,
      steps=settings.chunk_steps, top=settings.top_logprobs, valid_vocab=50257)
  for name, traced in (("prefill", prefill), ("decode_chunk", decode_chunk)):
    hlo = lower_for(traced)
    assert not any(call.startswith("__cudnn") for call in custom_calls(hlo)), name
    assert square_faces(hlo, GPT2.block_size) == 0, name
    assert set(dot_dtypes(hlo)) == GPU_PRODUCTS, (name, dot_dtypes(hlo))


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
  assert set(dot_dtypes(hlo)) == GPU_PRODUCTS, dot_dtypes(hlo)
  assert set(barriers(hlo)) == {activation_input(recipe, 64)}, barriers(hlo)
  assert row_major_copies(hlo) == 0


def test_a_mixed_window_model_runs_cudnn_attention_in_both_kinds_of_layer(cudnn_version):
  """Gemma 3's layers (sliding and global) in one scan: the `lax.cond` on each layer's
  kind holds two cuDNN attentions, forward and backward, one of them with cuDNN's own
  sliding window; no `[T, T]` scores anywhere."""
  config = gpt.GPTConfig(**{**gpt.ARCHITECTURES["gemma3"], **dict(
      vocab_size=512, block_size=320, n_layer=6, n_head=4, n_kv_head=1, n_embd=256,
      head_size=64, window=64, compute_dtype="bfloat16")})
  assert config.mixed_layers
  params = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  tokens = jax.ShapeDtypeStruct((2, 320), jnp.int32)
  forms = kernels.select("gpu", scan_layers=True)
  grad = jax.jit(jax.grad(lambda p, x: gpt.loss(p, x, x, config, forms=forms)))
  hlo = lower_for(grad.trace(params, tokens))
  calls = custom_calls(hlo)
  assert calls[CUDNN_FORWARD] >= 2 and calls[CUDNN_BACKWARD] == 2, calls
  windows = collections.Counter(re.findall(r"sliding_window_length\\22: (\d+)", hlo))
  assert set(windows) == {"0", "64"}, windows  # the global layers' and the window's
  assert square_faces(hlo, 320) == 0

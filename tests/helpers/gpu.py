"""GPT-2 124M lowered for CUDA from abstract inputs (nothing compiled or allocated)."""

import collections
import os
import re

import jax
import jax.numpy as jnp
import pytest

from purejax import cache_rows
from purejax import engine
from purejax import gpt
from purejax import kv_cache
from purejax.data import batches
from purejax.optimizers import optim
from purejax.training.pure import steps
from purejax.training.pure.state import TrainState


GPT2 = gpt.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                     bias=False, compute_dtype="bfloat16")


GPT2_BATCH = 12


GPT2_OPTIMIZER = optim.make_optimizer(optim.from_flat(
    learning_rate=6e-4, warmup_iters=10, decay_iters=1000, min_lr=6e-5, beta2=0.95,
    weight_decay=0.1, grad_clip=1.0))


CUDNN_FORWARD, CUDNN_BACKWARD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"


@pytest.fixture
def cudnn_version(monkeypatch):
  """Stands in for JAX's query of the installed cuDNN (9.8), which needs CUDA."""
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)


def lower_for(traced, platform="cuda") -> str:
  """StableHLO text of a traced function lowered for `platform`."""
  try:
    return traced.lower(lowering_platforms=(platform,)).as_text()
  except ValueError as e:
    if "platform" in str(e).lower() and platform in str(e):
      pytest.skip(f"this JAX cannot lower for {platform} on a CPU host: {e}")
    raise


def custom_calls(hlo: str) -> collections.Counter:
  return collections.Counter(re.findall(r"custom_call @([\w$.]+)", hlo))


def square_faces(hlo: str, size: int) -> int:
  """Tensors with a `size x size` face: full attention scores over `size` positions."""
  return len(re.findall(rf"tensor<(?:\d+x)*{size}x{size}x", hlo))


def abstract_state(config):
  params = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  return params, jax.eval_shape(GPT2_OPTIMIZER.init, params)


ABSTRACT_KEY = jax.ShapeDtypeStruct((2,), jnp.uint32)


ABSTRACT_TOKENS = jax.ShapeDtypeStruct((1 << 20,), jnp.int32)


def engine_programs_args(config, settings: engine.EngineConfig, text_bytes: int = 1):
  """Abstract arguments of the engine's programs for `config` and `settings`: `model`
  (`kv_cache.prepare`'s), `rows` (`cache_rows.init_rows`'s), and the decoding call's
  `cache_rows.Settings`, every row's."""
  n, scalar = settings.rows, lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype)
  params = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  model = jax.eval_shape(lambda p: kv_cache.prepare(p, config), params)
  rows = jax.eval_shape(lambda: cache_rows.init_rows(config, settings.rows, settings.length,
                                                     settings.ring_room, text_bytes))
  row_settings = cache_rows.Settings(
      keys=scalar(jnp.uint32, n, 2), temperature=scalar(jnp.float32, n),
      top_k=scalar(jnp.int32, n), top_p=scalar(jnp.float32, n), limit=scalar(jnp.int32, n),
      stop_ids=scalar(jnp.int32, n, 1),
      strings=scalar(jnp.int32, n, settings.stop_strings, settings.stop_string_bytes),
      active=scalar(bool, n), logprobs=scalar(bool, n), top=scalar(bool, n))
  return model, rows, row_settings


def train_step_hlo(forms, config=GPT2, batch=GPT2_BATCH, platform="cuda") -> str:
  params, opt_state = abstract_state(config)
  state = TrainState(params, opt_state, {"train": ABSTRACT_KEY})
  return lower_for(steps.train_steps.trace(
      state, batches.DeviceTokens(ABSTRACT_TOKENS), 0, config=config, optimizer=GPT2_OPTIMIZER,
      batch_size=batch, num_steps=2, forms=forms), platform)


@pytest.fixture(scope="module")
def h100():
  """One abstract H100 SXM (XLA's target config, no GPU needed), or a skip that says
  why (a failure under PUREJAX_REQUIRE_GPU_PLUGIN=1, as CI sets)."""
  from purejax.training.tools import gpu_plan  # pylint: disable=g-import-not-at-top
  try:
    return gpu_plan.target_devices("h100")
  except gpu_plan.PluginMissing as e:
    if os.environ.get("PUREJAX_REQUIRE_GPU_PLUGIN") == "1":
      pytest.fail(str(e))
    pytest.skip(str(e))

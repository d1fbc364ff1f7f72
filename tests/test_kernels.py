"""kernels and attention: every backend's form computes what the plain form computes.

CI has only a CPU, so the GPU forms are checked here through the same
functions: the "xla" attention form, the plain-transpose matmul backward and
the chunked loss are plain JAX. cuDNN's attention cannot run on a CPU; its
program is checked in `test_gpu_lowering.py`.
"""

import contextlib
import dataclasses
import io

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax import ad_checkpoint

from purejax import gpt
from purejax.gpt import config as gpt_config
from purejax.ops import attention
from purejax.ops import kernels
from purejax.ops import loss as loss_ops
from purejax.ops.loss import head_cross_entropy
from purejax.ops.matmul import row_major_transpose
from purejax.ops.matmul import matmul
from helpers.models import dot_operand_dtypes

GPU_FORMS = kernels.select("gpu")
CPU_FORMS = kernels.select("cpu")


def all_eqns(jaxpr):
  """Every equation of `jaxpr`, including those of nested jaxprs (scans, remat, custom_vjp)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from all_eqns(sub)


def qkv(seed, shape=(2, 12, 3, 8)):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  return tuple(jax.random.normal(k, shape) for k in keys)


class SelectTest(parameterized.TestCase):

  def test_each_backend_gets_its_measured_forms(self):
    assert CPU_FORMS.attention == "blocked" and CPU_FORMS.matmul_backward == "row_major"
    assert CPU_FORMS.noise_ahead and CPU_FORMS.remat == "dots"
    assert GPU_FORMS.attention == "cudnn" and GPU_FORMS.matmul_backward == "plain"
    # GPUs unroll the layers, without remat; scanned, they save bf16 block inputs.
    assert not GPU_FORMS.noise_ahead and not GPU_FORMS.scan_layers
    assert GPU_FORMS.remat == "none" and CPU_FORMS.scan_layers
    assert kernels.select("gpu", scan_layers=True).remat == "full_compute_dtype"
    assert kernels.select("tpu").scan_layers  # measured on GPUs only
    # bf16 matmul outputs were measured faster on a GPU only.
    assert GPU_FORMS.matmul_output == "compute" and CPU_FORMS.matmul_output == "float32"
    assert kernels.select("tpu").matmul_output == "float32"
    # The activation recomputed: chosen by the GPU's kernel account only, and
    # only where no remat recomputes the whole block already.
    assert GPU_FORMS.recompute_activation and not CPU_FORMS.recompute_activation
    assert not kernels.select("tpu").recompute_activation
    assert not kernels.select("gpu", scan_layers=True).recompute_activation
    assert not kernels.select("gpu", remat="full").recompute_activation
    assert kernels.select("gpu", remat="full", recompute_activation=True).recompute_activation
    assert kernels.select("cuda") == GPU_FORMS
    assert kernels.select("tpu").attention == "xla"  # cuDNN is NVIDIA's
    assert kernels.select() == CPU_FORMS  # these tests run on a CPU

  def test_overrides_replace_one_form_and_auto_keeps_the_platforms(self):
    forms = kernels.select("cpu", remat="full", attention="auto", attn_block=None)
    assert forms == dataclasses.replace(CPU_FORMS, remat="full")
    # Unrolled layers take their own remat default, unless one is given.
    assert kernels.select("gpu", scan_layers=False).remat == "none"
    assert kernels.select("gpu", scan_layers=False, remat="dots").remat == "dots"
    assert kernels.select("gpu", loss_chunk_rows=0).loss_chunk_rows is None
    assert hash(forms) == hash(dataclasses.replace(CPU_FORMS, remat="full"))  # static arg

  @parameterized.parameters(
      (dict(remat="yes"), "Forms.remat"),
      (dict(attn_block=0), "Forms.attn_block must be a positive"),
      (dict(attention="flash"), "Forms.attention"),
      (dict(atention="plain"), "not Forms fields"),
      (dict(attention="cudnn"), "NVIDIA GPUs only"),
  )
  def test_bad_overrides_are_a_clear_error(self, overrides, message):
    with pytest.raises(ValueError, match=message):
      kernels.select("cpu", **overrides)

  def test_platform_of_reads_where_arrays_and_meshes_live(self):
    assert kernels.platform_of({"w": jnp.ones(3)}) == "cpu"
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    assert kernels.platform_of(None, mesh) == "cpu"

  def test_loss_chunks_only_large_logits(self):
    assert CPU_FORMS.loss_chunk(12 * 1024, 50304) is None
    assert GPU_FORMS.loss_chunk(12 * 1024, 50304) == GPU_FORMS.loss_chunk_rows
    assert GPU_FORMS.loss_chunk(12 * 64, 65) is None


slow = pytest.mark.slow


# 12 positions: blocks of 2 (six), 5 (the last one partial), 12 (one), 64 (> time).
@pytest.mark.parametrize("form, block", [
    ("blocked", 5), ("xla", 12),
    pytest.param("blocked", 2, marks=slow), pytest.param("blocked", 12, marks=slow),
    pytest.param("blocked", 64, marks=slow)])
@pytest.mark.parametrize("kv_heads", [3, 1])  # 1: grouped-query attention, 3 heads a key
def test_attention_forms_equal_plain_values_and_gradients(form, block, kv_heads):
  q, k, v = qkv(0)
  k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  cotangent = jax.random.normal(jax.random.PRNGKey(9), q.shape)

  def value_and_grads(form):
    f = lambda q, k, v: jnp.sum(cotangent * attention.causal_attention(
        q, k, v, form=form, block=block))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)

  chex.assert_trees_all_close(value_and_grads(form), value_and_grads("plain"),
                              rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("matmul_backward", ["row_major", "plain"])
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_blocked_attention_in_bfloat16_multiplies_bfloat16_operands(matmul_backward, kv_heads):
  # The blocked form's two products take the compute dtype, as the dense
  # layers' do, with float32 accumulation and a float32 softmax: close to
  # the float32 reference, and every product of the forward and backward
  # passes reads bfloat16 operands.
  q, k, v = qkv(0)
  k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
  cotangent = jax.random.normal(jax.random.PRNGKey(9), q.shape)
  forms = kernels.Forms(matmul_backward=matmul_backward)

  def value_and_grads(dtype):
    f = lambda q, k, v: jnp.sum(cotangent * attention.causal_attention(
        q, k, v, form="blocked", block=5, compute_dtype=dtype, forms=forms))
    return jax.value_and_grad(f, argnums=(0, 1, 2))

  ours = jax.jit(value_and_grads(jnp.bfloat16))(q, k, v)
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(ours))
  chex.assert_trees_all_close(ours, jax.jit(value_and_grads(None))(q, k, v), rtol=5e-2,
                              atol=5e-2)
  jaxpr = jax.make_jaxpr(value_and_grads(jnp.bfloat16))(q, k, v).jaxpr
  dtypes = dot_operand_dtypes(jaxpr)
  assert len(dtypes) == 3 * 2 * 3  # 3 blocks (12 positions); 2 products, each with 2 gradients
  assert set(dtypes) == {("bfloat16", "bfloat16")}, dtypes


class AttentionTest(parameterized.TestCase):

  def test_plain_is_causal_softmax_attention(self):
    q, k, v = qkv(1, (1, 5, 2, 4))
    y = attention.causal_attention(q, k, v, form="plain")
    for h in range(2):
      scores = np.asarray(q[0, :, h] @ k[0, :, h].T) / 2.0  # sqrt(head_dim = 4)
      scores[np.triu_indices(5, 1)] = -np.inf
      weights = np.exp(scores - scores.max(-1, keepdims=True))
      weights /= weights.sum(-1, keepdims=True)
      np.testing.assert_allclose(y[0, :, h], weights @ np.asarray(v[0, :, h]), rtol=1e-5,
                                 atol=1e-6)

  def test_xla_form_in_bfloat16_is_close_and_keeps_the_input_dtype(self):
    q, k, v = qkv(2)
    y = attention.causal_attention(q, k, v, form="xla", compute_dtype=jnp.bfloat16)
    assert y.dtype == jnp.float32
    chex.assert_trees_all_close(y, attention.causal_attention(q, k, v), atol=3e-2)

  def test_xla_form_drops_out_as_the_plain_form_does(self):
    # The GPU's form with attention dropout: the same weights dropped with
    # the same key, in float32 exactly the plain form, in bfloat16 close to it.
    q, k, v = qkv(3)
    key = jax.random.PRNGKey(4)
    cotangent = jax.random.normal(jax.random.PRNGKey(9), q.shape)

    def value_and_grads(form, dtype=None):
      f = lambda q, k, v: jnp.sum(cotangent * attention.causal_attention(
          q, k, v, form=form, dropout=0.5, key=key, deterministic=False,
          compute_dtype=dtype))
      return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    plain = value_and_grads("plain")
    chex.assert_trees_all_close(value_and_grads("xla"), plain, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(value_and_grads("xla", jnp.bfloat16), plain,
                                rtol=5e-2, atol=1e-1)
    assert not np.allclose(plain[0], jax.value_and_grad(
        lambda q: jnp.sum(cotangent * attention.causal_attention(q, k, v)))(q)[0])

  @pytest.mark.slow
  def test_an_array_dropout_rate_drops_as_the_float_rate(self, form="cudnn"):
    # A sweep's traced rate: never cuDNN (which has no dropout), the masks of
    # the float rate.
    q, k, v = qkv(3)
    key = jax.random.PRNGKey(4)
    run = lambda rate: attention.causal_attention(
        q, k, v, form=form, block=4, dropout=rate, key=key, deterministic=False,
        compute_dtype=jnp.bfloat16)
    traced = jax.jit(run)
    chex.assert_trees_all_close(traced(jnp.float32(0.5)), jax.jit(lambda: run(0.5))(),
                                rtol=1e-5, atol=1e-5)
    assert not np.array_equal(traced(jnp.float32(0.5)), traced(jnp.float32(0.0)))

  def test_blocked_grouped_query_attention_drops_the_repeated_forms_masks(self):
    # Unrepeated keys change the products' shapes, not which weights drop.
    q, (k, v) = qkv(3, (2, 12, 4, 8))[0], qkv(4, (2, 12, 2, 8))[:2]
    key = jax.random.PRNGKey(4)
    run = jax.jit(lambda k, v: attention.causal_attention(
        q, k, v, form="blocked", block=5, dropout=0.5, key=key, deterministic=False))
    chex.assert_trees_all_close(run(k, v), run(jnp.repeat(k, 2, axis=2),
                                               jnp.repeat(v, 2, axis=2)),
                                rtol=1e-5, atol=1e-5)

  def test_cudnn_form_runs_xla_where_cudnn_does_not_apply_and_says_why(self):
    q, k, v = qkv(3)
    assert "float32" in attention.cudnn_unsupported(q.shape, jnp.float32, False)
    assert "head size" in attention.cudnn_unsupported((2, 12, 3, 12), jnp.bfloat16, False)
    assert "dropout" in attention.cudnn_unsupported(q.shape, jnp.bfloat16, True)
    assert attention.cudnn_unsupported((12, 1024, 12, 64), jnp.bfloat16, False) is None
    key = jax.random.PRNGKey(4)
    run = lambda form: attention.causal_attention(
        q, k, v, form=form, dropout=0.5, key=key, deterministic=False,
        compute_dtype=jnp.bfloat16)
    attention._say_once.cache_clear()  # other tests may have said it already
    with self.assertLogs("purejax.ops.attention", "WARNING") as logs:
      chex.assert_trees_all_equal(run("cudnn"), run("xla"))
      run("cudnn")
    assert len(logs.output) == 1  # said once, not per call
    assert "(jax.nn.dot_product_attention has no attention dropout); running the 'xla'" \
        in logs.output[0]

  def test_unknown_form_is_a_clear_error(self):
    with pytest.raises(ValueError, match="not one of"):
      attention.causal_attention(*qkv(0), form="flash")


class MatmulTest(parameterized.TestCase):

  @parameterized.parameters(False, True)
  def test_both_backward_forms_give_the_same_bf16_gradients(self, tied):
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 16)) / 4
    w = jax.random.normal(jax.random.PRNGKey(1), (24, 16) if tied else (16, 24))
    cotangent = jax.random.normal(jax.random.PRNGKey(2), (3, 5, 24))

    def grads(forms):
      f = lambda x, w: jnp.sum(cotangent * matmul(
          x, w.T if tied else w, compute_dtype=jnp.bfloat16, forms=forms))
      return jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)

    row_major, plain = grads(CPU_FORMS), grads(GPU_FORMS)
    assert all(g.dtype == jnp.float32 for g in row_major + plain)
    chex.assert_trees_all_close(row_major, plain, rtol=1e-6, atol=1e-6)

  @parameterized.parameters(False, True)
  def test_compute_dtype_output_is_the_float32_output_rounded(self, row_major):
    # matmul_output="compute" rounds the product and x's gradient to bf16 (as
    # autocast does); the weight's gradient stays float32 and unrounded.
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 16)) / 4
    w = jax.random.normal(jax.random.PRNGKey(1), (16, 24))
    cotangent = jax.random.normal(jax.random.PRNGKey(2), (3, 5, 24))
    base = kernels.Forms(matmul_backward="row_major" if row_major else "plain")
    rounded = dataclasses.replace(base, matmul_output="compute")

    def run(forms):
      y, vjp = jax.vjp(lambda x, w: matmul(x, w, compute_dtype=jnp.bfloat16,
                                                   forms=forms), x, w)
      return (y, *vjp(cotangent.astype(y.dtype)))

    (y32, dx32, dw32), (y16, dx16, dw16) = run(base), run(rounded)
    assert (y32.dtype, dx32.dtype, dw32.dtype) == (jnp.float32,) * 3
    assert (y16.dtype, dx16.dtype, dw16.dtype) == (jnp.bfloat16, jnp.float32, jnp.float32)
    np.testing.assert_array_equal(y16, y32.astype(jnp.bfloat16))
    # x's gradient was rounded to bf16 on the way (x is float32: its cotangent
    # comes back float32 through the cast); w's is the float32 product.
    np.testing.assert_array_equal(dx16, dx32.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(dw16, dw32)

  def test_compute_dtype_output_keeps_a_bf16_input_bf16_and_the_head_float32(self):
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (16, 8))
    forms = kernels.Forms(matmul_output="compute")
    y, vjp = jax.vjp(lambda x: matmul(x, w, compute_dtype=jnp.bfloat16, forms=forms), x)
    assert y.dtype == vjp(y)[0].dtype == jnp.bfloat16
    head = matmul(x, w, compute_dtype=jnp.bfloat16, forms=forms, output="float32")
    assert head.dtype == jnp.float32
    np.testing.assert_array_equal(y, head.astype(jnp.bfloat16))

  @parameterized.parameters((4, 6), (3, 5), (2, 3, 4, 6))
  def test_row_major_transpose_swaps_the_last_two_axes(self, *shape):
    a = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    chex.assert_trees_all_equal(jax.jit(row_major_transpose)(a),
                                jnp.swapaxes(a, -1, -2))


@pytest.mark.parametrize("chunk_rows, softcap, temperature",
                         [(5, None, 1.0), (8, 3.0, 0.7), (24, None, 1.0), (32, None, 1.0)])
def test_chunked_target_log_probs_equal_the_whole_logits_values_and_gradients(
    chunk_rows, softcap, temperature):
  # 24 rows: chunks of 5 leave a shorter last chunk; 32 is one short chunk.
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 16))
  table = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (97, 16))
  labels = jax.random.randint(jax.random.PRNGKey(2), (3, 8), 0, 97)
  cotangent = jax.random.normal(jax.random.PRNGKey(3), (3, 8))  # a loss weighs each token

  def value_and_grads(chunk):
    def f(x, table):
      if chunk is None:
        logits = x @ table.T
        logits = logits if softcap is None else softcap * jnp.tanh(logits / softcap)
        picked = loss_ops.target_log_probs(logits / temperature, labels)
      else:
        picked = loss_ops.head_target_log_probs(x, table, labels, chunk_rows=chunk,
                                                softcap=softcap, temperature=temperature)
      return jnp.sum(picked * cotangent), picked
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, table)

  chex.assert_trees_all_close(value_and_grads(chunk_rows), value_and_grads(None),
                              rtol=1e-5, atol=1e-6)


def test_chunked_target_log_probs_never_hold_the_whole_logits():
  x = jnp.zeros((4, 16, 16))
  table = jnp.zeros((97, 16))
  labels = jnp.zeros((4, 16), jnp.int32)
  grads = jax.jit(jax.grad(lambda x, table: jnp.sum(loss_ops.head_target_log_probs(
      x, table, labels, chunk_rows=8)), argnums=(0, 1)))
  program = grads.lower(x, table).compile().as_text()
  assert "f32[8,97]" in program                        # a chunk's logits
  assert "f32[64,97]" not in program and "f32[4,16,97]" not in program  # never all 64 rows'


def test_the_model_reads_its_target_log_probs_in_the_losss_chunks():
  params = gpt.init_params(TINY, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, TINY.vocab_size)
  targets = jnp.roll(tokens, -1, axis=1)
  plain = kernels.select("cpu")
  chunked = kernels.select("cpu", loss_chunk_rows=3, loss_chunk_min_logits=1)
  assert chunked.loss_chunk(tokens.size, TINY.vocab_size) == 3
  want = loss_ops.target_log_probs(gpt.forward(params, tokens, TINY, forms=plain) / 0.5, targets)

  def picked_and_grads(forms):
    f = lambda p: gpt.target_log_probs(p, tokens, targets, TINY, forms=forms, temperature=0.5)
    return f(params), jax.grad(lambda p: jnp.sum(f(p)))(params)

  (got_plain, grads_plain), (got_chunked, grads_chunked) = map(picked_and_grads,
                                                               (plain, chunked))
  chex.assert_trees_all_close(got_plain, want, rtol=1e-6)
  chex.assert_trees_all_close(got_chunked, want, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(grads_chunked, grads_plain, rtol=1e-4, atol=1e-6)


class TiedHeadLossTest(parameterized.TestCase):

  # 24 rows: chunks of 5 and 7 leave a shorter last chunk.
  @parameterized.product(chunk_rows=[4, 5, 7, 8, 12], softcap=[None, 3.0],
                         weighted=[False, True])
  def test_chunked_equals_plain_values_and_gradients(self, chunk_rows, softcap, weighted):
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 16))
    table = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (97, 16))
    labels = jax.random.randint(jax.random.PRNGKey(2), (3, 8), 0, 97)
    weights = jax.random.uniform(jax.random.PRNGKey(3), (3, 8)) if weighted else None

    def value_and_grads(chunk):
      f = lambda x, table: head_cross_entropy(
          x, table, labels, chunk_rows=chunk, softcap=softcap, weights=weights)
      return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, table)

    chex.assert_trees_all_close(value_and_grads(chunk_rows), value_and_grads(None),
                                rtol=1e-5, atol=1e-6)

  @parameterized.parameters(4, 5)
  def test_chunked_bfloat16_gradients_are_as_close_to_float32_as_the_plain_forms(self, chunk):
    # The chunks round the unscaled `softmax - one_hot` to bf16 where the plain
    # form's backward rounds it divided by the row count: the same rounding of
    # a different number, so the two agree to bf16, not bit for bit.
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 16))
    table = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (97, 16))
    labels = jax.random.randint(jax.random.PRNGKey(2), (3, 8), 0, 97)

    def value_and_grads(chunk_rows, compute_dtype):
      f = lambda x, table: head_cross_entropy(
          x, table, labels, compute_dtype=compute_dtype, chunk_rows=chunk_rows)
      return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, table)

    exact_loss, exact = value_and_grads(None, None)
    plain_loss, plain = value_and_grads(None, jnp.bfloat16)
    chunked_loss, chunked = value_and_grads(chunk, jnp.bfloat16)
    np.testing.assert_allclose(chunked_loss, plain_loss, rtol=1e-6)
    for got, bf16_plain, want in zip(chunked, plain, exact):
      scale = float(jnp.max(jnp.abs(want)))
      error = float(jnp.max(jnp.abs(got - want))) / scale
      assert error < 1e-2  # bf16 products
      assert error <= 1.25 * float(jnp.max(jnp.abs(bf16_plain - want))) / scale

  @parameterized.parameters(None, 5)
  def test_logits_in_the_compute_dtype_round_only_the_logits(self, chunk):
    # loss_logits="compute" writes the head's logits in bf16, as autocast does;
    # the loss still sums in float32, and its value and gradients stay within
    # bf16 rounding of the float32 logits' (the logits here are O(1)).
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 16))
    table = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (97, 16))
    labels = jax.random.randint(jax.random.PRNGKey(2), (3, 8), 0, 97)

    def value_and_grads(loss_logits, chunk_rows):
      forms = kernels.Forms(loss_logits=loss_logits)
      return jax.value_and_grad(lambda x, table: head_cross_entropy(
          x, table, labels, compute_dtype=jnp.bfloat16, chunk_rows=chunk_rows, forms=forms),
                                argnums=(0, 1))

    def head_dtypes(f):  # of the `[rows, 97]` logits (not the table's `[16, 97]` gradient)
      return {eqn.outvars[0].aval.dtype for eqn in all_eqns(jax.make_jaxpr(f)(x, table).jaxpr)
              if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape[-1] == 97
              and eqn.outvars[0].aval.shape[0] != 16}

    rounded = value_and_grads("compute", chunk)
    assert head_dtypes(rounded) == {jnp.dtype(jnp.bfloat16)}
    assert head_dtypes(value_and_grads("float32", chunk)) == {jnp.dtype(jnp.float32)}
    # Op by op, where the rounding shows on a CPU (compiled whole, XLA's CPU
    # compiler may drop a float32 -> bf16 -> float32 round trip).
    loss32, grads32 = value_and_grads("float32", None)(x, table)
    loss16, grads16 = value_and_grads("compute", None)(x, table)
    assert float(loss16) != float(loss32)
    for loss, grads in ((loss16, grads16), jax.jit(rounded)(x, table)):
      np.testing.assert_allclose(loss, loss32, rtol=1e-2)
      assert [g.dtype for g in grads] == [jnp.float32] * 2
      chex.assert_trees_all_close(grads, grads32, rtol=5e-2, atol=2e-3)

  @parameterized.parameters((24, 8, 1), (24, 5, 2))
  def test_chunked_gradients_run_the_head_product_once_per_chunk(self, rows, chunk, products):
    # Forming the gradient while a chunk's logits exist: one `[chunk, vocab]`
    # product in the whole differentiated program (one more for a shorter last
    # chunk), where a rematerialised chunk would run it forward and again
    # backward.
    x = jnp.ones((rows, 8))
    table = jnp.ones((1000, 8))
    labels = jnp.zeros((rows,), jnp.int32)
    grad = jax.grad(lambda x, table: head_cross_entropy(x, table, labels,
                                                                     chunk_rows=chunk),
                    argnums=(0, 1))
    heads = [eqn for eqn in all_eqns(jax.make_jaxpr(grad)(x, table).jaxpr)
             if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape[-1] == 1000]
    assert len(heads) == products

  def test_chunked_never_holds_the_whole_logits(self):
    x = jnp.ones((64, 8))
    table = jnp.ones((1000, 8))
    labels = jnp.zeros((64,), jnp.int32)
    grad = jax.grad(lambda x: head_cross_entropy(x, table, labels,
                                                              chunk_rows=16))
    shapes = [v.aval.shape for eqn in all_eqns(jax.make_jaxpr(grad)(x).jaxpr)
              for v in eqn.outvars]
    assert (16, 1000) in shapes and (64, 1000) not in shapes

  def test_rows_left_over_make_a_shorter_chunk_not_the_whole_logits(self):
    x = jnp.ones((70, 8))  # 4 chunks of 16 and 6 rows left over
    table = jnp.ones((1000, 8))
    labels = jnp.zeros((70,), jnp.int32)
    grad = jax.grad(lambda x: head_cross_entropy(x, table, labels,
                                                              chunk_rows=16))
    shapes = [v.aval.shape for eqn in all_eqns(jax.make_jaxpr(grad)(x).jaxpr)
              for v in eqn.outvars]
    assert (16, 1000) in shapes and (6, 1000) in shapes and (70, 1000) not in shapes

  def test_plain_form_is_cross_entropy_of_the_logits(self):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4))
    table = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    labels = jnp.array([[0, 1, 2], [3, 4, 0]])
    logp = jax.nn.log_softmax(np.asarray(x) @ np.asarray(table).T)
    expected = -np.mean(np.take_along_axis(np.asarray(logp), labels[..., None], -1))
    np.testing.assert_allclose(head_cross_entropy(x, table, labels), expected,
                               rtol=1e-5)


TINY = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)


@pytest.mark.parametrize("mlp", gpt_config.MLPS)
def test_a_recomputed_activation_keeps_only_its_input_and_the_same_gradients(mlp):
  # Saved whole, GELU's backward reads its tanh (and more) beside its input;
  # recomputed, only the first product's output stays, which the activation's
  # backward reads anyway. The MLP computes the same function and gradients.
  config = dataclasses.replace(TINY, mlp=mlp, compute_dtype="bfloat16")
  params = gpt.init_block(config, jax.random.PRNGKey(0))["mlp"]
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, config.n_embd))
  hidden = params["fc"]["w"].shape[-1]  # gated MLPs: gate and up, side by side

  def mlp_sum(recompute):
    forms = kernels.Forms(matmul_output="compute", recompute_activation=recompute)
    return lambda p, x: jnp.sum(gpt.mlp(p, x, config, forms).astype(jnp.float32))

  def saved_activations(recompute):  # the residuals shaped like the activation's input
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):  # one line per residual: "bf16[2,8,64] ..."
      ad_checkpoint.print_saved_residuals(mlp_sum(recompute), params, x)
    shapes = [line.split()[0] for line in listing.getvalue().splitlines()]
    return [shape for shape in shapes if shape.startswith("bf16[2,8,")]

  assert saved_activations(True) == [f"bf16[2,8,{hidden}]"]
  assert len(saved_activations(False)) > 1
  chex.assert_trees_all_close(jax.value_and_grad(mlp_sum(True))(params, x),
                              jax.value_and_grad(mlp_sum(False))(params, x),
                              rtol=1e-6, atol=1e-6)


def loss_and_grads(config, params, tokens, forms=None):
  return jax.jit(jax.value_and_grad(lambda p: gpt.loss(
      p, tokens[:, :-1], tokens[:, 1:], config, forms=forms)))(params)


@pytest.mark.parametrize("changes", [
    dict(attention="xla"), pytest.param(dict(scan_layers=False, remat="none"), marks=slow),
    pytest.param(dict(attention="plain"), marks=slow),
    pytest.param(dict(scan_layers=False), marks=slow),
    pytest.param(dict(remat="full"), marks=slow),
    pytest.param(dict(recompute_activation=True), marks=slow)])
def test_model_forms_give_the_same_loss_and_gradients(changes):
  params = gpt.init_params(TINY, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, 11)
  chex.assert_trees_all_close(
      loss_and_grads(TINY, params, tokens, kernels.select("cpu", **changes)),
      loss_and_grads(TINY, params, tokens), rtol=1e-5, atol=1e-6)


class GPTFormsTest(parameterized.TestCase):

  def test_bfloat16_mode_runs_bfloat16_products(self):
    # Closeness to float32 alone would not show that the products ran in
    # bf16: look at the compiled program's dots.
    config = dataclasses.replace(TINY, compute_dtype="bfloat16")
    params = gpt.init_params(config, jax.random.PRNGKey(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    grad = jax.jit(jax.grad(gpt.loss), static_argnums=3)
    jaxpr = jax.make_jaxpr(grad, static_argnums=3)(params, tokens, tokens, config)

    def dots(jaxpr):
      return [tuple(v.aval.dtype for v in eqn.invars) for eqn in all_eqns(jaxpr)
              if eqn.primitive.name == "dot_general"]

    operand_dtypes = dots(jaxpr.jaxpr)
    bf16 = [d for d in operand_dtypes if d == (jnp.bfloat16, jnp.bfloat16)]
    # Forward and both gradients of qkv, proj, fc, proj per block (a scan
    # body, counted once) and of the tied head: 3 * 5 = 15 products.
    assert len(bf16) >= 15, operand_dtypes
    f32 = jax.make_jaxpr(grad, static_argnums=3)(params, tokens, tokens, TINY)
    assert not [d for d in dots(f32.jaxpr) if jnp.bfloat16 in d]


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
@pytest.mark.parametrize("scan_layers", [True, False])
def test_bf16_matmul_outputs_change_the_loss_and_gradients_by_bf16_rounding(scan_layers):
  # matmul_output="compute" is autocast's precision: the products' outputs
  # in bf16, the residual stream, norms, logits and weight gradients float32.
  config = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=32,
                         compute_dtype="bfloat16")
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 9), 0, 11)

  def value_and_grad(matmul_output):
    forms = kernels.select("cpu", matmul_output=matmul_output, scan_layers=scan_layers)
    return jax.jit(jax.value_and_grad(lambda p: gpt.loss(
        p, tokens[:, :-1], tokens[:, 1:], config, forms=forms)))(params)

  (loss32, grads32), (loss16, grads16) = value_and_grad("float32"), value_and_grad("compute")
  assert float(loss16) != float(loss32)
  np.testing.assert_allclose(loss16, loss32, rtol=1e-2)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads16))
  chex.assert_trees_all_close(grads16, grads32, rtol=5e-2, atol=3e-3)


@pytest.mark.budget(40)
@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_block_inputs_saved_in_bf16_keep_the_loss_and_round_only_the_gradients(scan_layers):
  # "full_compute_dtype" is "full" remat with each block's saved input in
  # bf16: the forward is the same program, the backward recomputes from the
  # rounded input, so gradients agree with "full"'s to bf16 rounding.
  config = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=32,
                         dropout=0.1, compute_dtype="bfloat16")
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 9), 0, 11)
  key = jax.random.PRNGKey(2)

  def value_and_grad(remat, config=config):
    forms = kernels.select("cpu", remat=remat, scan_layers=scan_layers)
    loss = lambda p: gpt.loss(p, tokens[:, :-1], tokens[:, 1:], config, key=key,
                              deterministic=False, forms=forms)
    return jax.jit(jax.value_and_grad(loss))(params)

  (full, full_grads), (low, low_grads) = value_and_grad("full"), value_and_grad(
      "full_compute_dtype")
  assert float(low) == float(full)
  chex.assert_trees_all_close(low_grads, full_grads, rtol=5e-2, atol=2e-3)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(low_grads),
                                                       jax.tree.leaves(full_grads)))
  # In float32 nothing is rounded: the gradients are "full"'s.
  f32 = dataclasses.replace(config, compute_dtype="float32")
  chex.assert_trees_all_equal(value_and_grad("full_compute_dtype", f32),
                              value_and_grad("full", f32))


@pytest.mark.slow
def test_block_inputs_saved_in_bf16_take_a_traced_dropout_rate():
  # A sweep's dropout is an array under vmap; the custom backward must take it.
  config = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16,
                         compute_dtype="bfloat16")
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, 11)
  loss = lambda p, rate, remat: gpt.loss(
      p, tokens[:, :-1], tokens[:, 1:], config, key=jax.random.PRNGKey(2),
      deterministic=False, forms=kernels.select("cpu", remat=remat), dropout=rate)
  rates = jnp.array([0.0, 0.2])
  grads = {remat: jax.jit(jax.vmap(jax.grad(loss), (None, 0, None)), static_argnums=2)(
      params, rates, remat) for remat in ("full", "full_compute_dtype")}
  chex.assert_trees_all_close(grads["full_compute_dtype"], grads["full"], rtol=5e-2, atol=2e-3)


# ----------------------------------------------------------------------------
# Attention through a KV cache (`attention.attend_with_cache`): rows at their own
# positions, checked against plain causal attention over each row's whole sequence.


_plain_attention = jax.jit(attention.causal_attention, static_argnames=("window", "softcap"))


def cache_inputs(seed, starts, t, slots, *, heads=4, kv_heads=2, d=8, own=False, rows=None,
                 ring=False, window=None, softcap=None):
  """`attend_with_cache`'s arguments for query rows at `starts` (`t` queries each), and
  what plain causal attention over each row's sequence gives at those positions.

  Query row `b` reads cache row `rows[b]` (None: `b`). A cache slot holds its position's
  key and value where the row has written it (with `own`, positions before the row's
  queries; else through them), and random values elsewhere (stale slots, never to be
  read). With `ring`, slot `s` holds the latest position `p % slots == s`.
  """
  starts = np.asarray(starts)
  reads = np.arange(len(starts)) if rows is None else np.asarray(rows)
  cache_rows, length = int(reads.max()) + 1, int(starts.max()) + t
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q_seq = np.asarray(jax.random.normal(keys[0], (cache_rows, length, heads, d)))
  k_seq, v_seq = (np.asarray(jax.random.normal(k, (cache_rows, length, kv_heads, d)))
                  for k in keys[1:3])
  full = np.asarray(_plain_attention(q_seq, k_seq, v_seq, window=window, softcap=softcap))
  ends = starts if own else starts + t  # positions before these are in the cache
  written = np.zeros(cache_rows, int)
  np.maximum.at(written, reads, ends)
  ring_last = None
  if ring:
    ring_last = jnp.asarray(ends - 1)
    slot_positions = np.asarray(attention.ring_positions(ring_last, slots))
  else:
    slot_positions = np.broadcast_to(np.arange(slots), (cache_rows, slots))
  stale = np.asarray(jax.random.normal(keys[3], (2, cache_rows, kv_heads, slots, d)))
  k_cache, v_cache = stale.copy()
  for c in range(cache_rows):
    for s, p in enumerate(slot_positions[c]):
      if 0 <= p < written[c]:
        k_cache[c, :, s], v_cache[c, :, s] = k_seq[c, p], v_seq[c, p]
  at = lambda x: np.stack([x[c, a:a + t] for c, a in zip(reads, starts)])  # [b, t, ...]
  heads_first = lambda x: x.transpose(0, 2, 1, 3)
  q = jnp.asarray(heads_first(at(q_seq)) / np.sqrt(d))
  own_kv = (jnp.asarray(heads_first(at(k_seq))), jnp.asarray(heads_first(at(v_seq)))
            ) if own else None
  args = (q, jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(starts))
  options = dict(rows=None if rows is None else jnp.asarray(rows), own=own_kv,
                 ring_last=ring_last, window=window, softcap=softcap)
  return args, options, heads_first(np.stack([full[c, a:a + t] for c, a in zip(reads, starts)]))


_attend_with_cache = jax.jit(attention.attend_with_cache,
                             static_argnames=("window", "softcap", "compute_dtype"))


def attend(args, options, compute_dtype=None):
  return np.asarray(_attend_with_cache(*args, **options, compute_dtype=compute_dtype))


@pytest.mark.parametrize("own", [False, True], ids=["written_first", "own"])
@pytest.mark.parametrize("case", ["grouped", "every_head", "shared_rows", "ring_window",
                                  "softcap", "bfloat16"])
def test_attending_through_the_cache_equals_plain_causal_attention(case, own):
  # Three rows at positions 0, 4 and 9, three queries each (a prompt's chunks; a
  # decoding step is one). `own`: the cache holds the positions before the queries
  # and their keys come apart (a decoding step, so XLA writes its slot in place
  # afterwards); else the queries' keys are written first and read back with the rest.
  t, starts, options = 3, [0, 4, 9], dict(own=own)
  if case == "every_head":
    options.update(kv_heads=4)
  if case == "shared_rows":  # two chunks of cache row 1's prompt, and cache row 0's
    starts, options = [0, 3, 5], dict(options, rows=[1, 1, 0])
  if case == "ring_window":  # a sliding layer's ring: room for the window and a chunk
    options.update(ring=True, window=4)
  if case == "softcap":
    options.update(softcap=2.0)
  slots = 6 if case == "ring_window" else 16
  args, attend_options, want = cache_inputs(0, starts, t, slots, **options)
  compute_dtype = jnp.bfloat16 if case == "bfloat16" else None
  got = attend(args, attend_options, compute_dtype)
  assert got.dtype == np.float32 and got.shape == want.shape
  tolerance = 3e-2 if case == "bfloat16" else 1e-5
  np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("own", [True, False], ids=["step", "chunk"])
def test_a_rows_attention_is_the_same_bits_whatever_the_other_rows_hold(own):
  # Rows decoded side by side (`purejax.engine`) at positions 130, 3 and 257 of a
  # cache of 300 slots: the loop reads blocks of CACHE_BLOCK slots up to the furthest
  # row, past the first block, and a block none of a row's queries sees adds
  # exactly nothing to it. So a row's output is the same bits whatever the others
  # hold and wherever they are (here row 1's loop runs three blocks, then one).
  slots, starts = 300, np.array([130, 3, 257])
  assert slots > 2 * attention.CACHE_BLOCK
  t = 1 if own else 2
  args, options, want = cache_inputs(1, starts, t, slots, own=own)
  got = attend(args, options)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for row in range(3):
    others = np.arange(3) != row
    moved = np.where(others, [0, 1, 2], starts)  # the other rows near the start
    new_args, new_options, _ = cache_inputs(2, moved, t, slots, own=own)
    mix = lambda new, old: jnp.where(others.reshape(-1, *[1] * (old.ndim - 1)), new, old)
    mixed_args = (*jax.tree.map(mix, new_args[:3], args[:3]), jnp.asarray(moved))
    mixed_options = dict(options, own=None if not own else jax.tree.map(
        mix, new_options["own"], options["own"]))
    np.testing.assert_array_equal(attend(mixed_args, mixed_options)[row], got[row])

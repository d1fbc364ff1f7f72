"""Quantized weights: their formats' arithmetic, GGUF's blocks kept as they are, and the
product that dequantizes inside the program."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.data import need
from purejax.ops import matmul as matmul_lib
from purejax.ops import quant


def random_matrix(shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("format", quant.FORMATS)
def test_each_format_rounds_within_half_a_step(format):
  w = random_matrix((64, 48))
  q = quant.quantize(w, format)
  assert q.shape == (64, 48) and q.bits == (4 if format == "q4_1" else 8)
  assert q.block == (64 if format == "int8" else 32)
  error = np.abs(np.asarray(q.dequantized()) - w)
  step = np.repeat(np.asarray(q.scale, np.float32), q.block, axis=0)
  # Half a step, and float16's rounding of a block's minimum (q4_1).
  assert np.all(error <= step / 2 + 2e-3 * np.abs(w).max())


def test_the_formats_hold_a_fraction_of_the_float_bytes():
  w = random_matrix((256, 128))
  ratio = {f: quant.quantize(w, f).nbytes / w.nbytes for f in quant.FORMATS}
  assert ratio["int8"] < 0.26 and ratio["q8_0"] < 0.27 and ratio["q4_1"] < 0.16


@pytest.mark.parametrize("format", quant.FORMATS)
def test_the_product_equals_the_product_of_the_dequantized_matrix(format):
  w, x = random_matrix((96, 40)), jnp.asarray(random_matrix((3, 7, 96), seed=1))
  q = quant.quantize(w, format)
  got = jax.jit(matmul_lib.matmul)(x, q)
  want = np.asarray(x) @ np.asarray(q.dequantized())
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("ggml", quant.GGUF_KEPT)
def test_gguf_blocks_are_kept_with_gguf_s_own_arithmetic(ggml):
  gguf = need("gguf")
  w = random_matrix((256, 96))  # [in, out]; GGUF stores [out, in]
  kind = getattr(gguf.GGMLQuantizationType, ggml)
  raw = _gguf_blocks(gguf, w, kind)
  want = gguf.quants.dequantize(raw, kind).reshape(96, 256).T
  kept = quant.from_gguf_blocks(raw, ggml, (96, 256))
  assert kept.shape == (256, 96) and kept.T.shape == (96, 256)
  np.testing.assert_array_equal(np.asarray(kept.dequantized()), want)
  np.testing.assert_array_equal(np.asarray(kept.T.dequantized()), want.T)


def _gguf_blocks(gguf, w, kind):
  """GGUF blocks of `w.T`: gguf's own quantizer, or for the K types (gguf's Python
  package does not quantize them) random bytes, with finite float16 scales."""
  try:
    return gguf.quants.quantize(np.ascontiguousarray(w.T), kind)
  except NotImplementedError:
    values, nbytes = quant.GGUF_BLOCKS[kind.name]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (w.shape[1], w.shape[0] // values, nbytes), dtype=np.uint8)
    small = lambda n: np.frombuffer(rng.uniform(-0.1, 0.1, n).astype(np.float16).tobytes(),
                                    np.uint8).reshape(-1, 2)
    spots = {"Q4_K": (0, 2), "Q6_K": (208,)}[kind.name]
    for at in spots:
      raw[:, :, at:at + 2] = small(raw.shape[0] * raw.shape[1]).reshape(*raw.shape[:2], 2)
    return raw.reshape(w.shape[1], -1)


def test_layers_of_different_gguf_types_share_a_lossless_container():
  gguf = need("gguf")
  layers = [random_matrix((256, 64), seed=i) for i in range(2)]
  kinds = [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K]
  kept = [quant.from_gguf_blocks(_gguf_blocks(gguf, w, k), k.name, (64, 256))
          for w, k in zip(layers, kinds)]
  assert (kept[0].bits, kept[0].block, kept[1].bits, kept[1].block) == (4, 32, 8, 16)
  stacked = quant.stack(kept)
  assert stacked.bits == 8 and stacked.block == 16 and stacked.has_offset
  for i, w in enumerate(kept):
    np.testing.assert_array_equal(np.asarray(jax.tree.map(lambda a: a[i], stacked)
                                             .dequantized()), np.asarray(w.dequantized()))
  side = quant.concatenate(kept)
  np.testing.assert_array_equal(np.asarray(side.dequantized()), np.concatenate(
      [np.asarray(w.dequantized()) for w in kept], axis=-1))
  # Both at once (a fused weight's layers): layer i is weight 0's and weight 1's side
  # by side, each layer's piece written in turn.
  both = quant.stack_side_by_side([kept, kept[::-1]])
  assert both.shape == (2, 256, 128)
  for i in range(2):
    np.testing.assert_array_equal(
        np.asarray(jax.tree.map(lambda a: a[i], both).dequantized()),
        np.concatenate([np.asarray(kept[i].dequantized()),
                        np.asarray(kept[1 - i].dequantized())], axis=-1))


def test_a_transposed_table_looks_up_rows_and_is_its_own_head():
  table = random_matrix((64, 32))  # [embd, vocab] stored, blocks along embd
  w = quant.quantize(table, "q4_1").T  # the [vocab, embd] table
  ids = jnp.asarray([[3, 0], [31, 3]])
  rows = jax.jit(quant.take_rows)(w, ids)
  np.testing.assert_array_equal(np.asarray(rows),
                                np.asarray(w.dequantized())[np.asarray(ids)])
  x = jnp.asarray(random_matrix((2, 64), seed=1))
  np.testing.assert_allclose(np.asarray(matmul_lib.matmul(x, w.T)),
                             np.asarray(x) @ np.asarray(w.T.dequantized()), rtol=1e-6,
                             atol=1e-5)


def test_a_wide_product_forms_its_matrix_a_slice_at_a_time(monkeypatch):
  w, x = quant.quantize(random_matrix((64, 256)), "q8_0"), jnp.asarray(random_matrix((3, 64)))
  whole = np.asarray(matmul_lib.matmul(x, w))
  monkeypatch.setattr(quant, "CHUNK_BYTES", 64 * 64 * 4)  # 64 columns a slice: 4 slices
  text = jax.jit(matmul_lib.matmul).lower(x, w).as_text()
  assert text.count("dot_general") == 4  # four products of slices, not one whole matrix
  np.testing.assert_allclose(np.asarray(jax.jit(matmul_lib.matmul)(x, w)), whole, rtol=1e-6,
                             atol=1e-6)


def test_a_stacked_weight_slices_as_its_layers():
  w = random_matrix((3, 64, 16))  # [layers, in, out]
  for format in quant.FORMATS:
    stacked = quant.quantize(w, format)
    layer = jax.tree.map(lambda a: a[1], stacked)
    np.testing.assert_array_equal(np.asarray(layer.dequantized()),
                                  np.asarray(quant.quantize(w[1], format).dequantized()))


def test_no_gradient_reaches_the_codes_and_lora_trains_beside_them():
  w, x = random_matrix((64, 8)), jnp.asarray(random_matrix((5, 64), seed=2))
  base = quant.quantize(w, "q4_1")
  a, b = jnp.asarray(random_matrix((64, 2), seed=3)), jnp.asarray(random_matrix((2, 8), seed=4))

  def loss(x, a, b):
    return jnp.sum(matmul_lib.matmul(x, matmul_lib.LowRankWeight(base, a, b, 0.5)) ** 2)

  dense = np.asarray(base.dequantized()) + 0.5 * np.asarray(a) @ np.asarray(b)
  np.testing.assert_allclose(np.asarray(matmul_lib.matmul(
      x, matmul_lib.LowRankWeight(base, a, b, 0.5))), np.asarray(x) @ dense, rtol=1e-5,
      atol=1e-5)
  gx, ga, gb = jax.grad(loss, argnums=(0, 1, 2))(x, a, b)
  want = jax.grad(lambda x, a, b: jnp.sum((x @ (base.dequantized() + 0.5 * a @ b)) ** 2),
                  argnums=(0, 1, 2))(x, a, b)
  chex.assert_trees_all_close((gx, ga, gb), want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(matmul_lib.LowRankWeight(base, a, b, 0.5).merged()),
                             dense, rtol=1e-5, atol=1e-5)


def test_bad_formats_and_shapes_are_named():
  with pytest.raises(quant.QuantizeError, match="unknown quantized format 'nf3'"):
    quant.quantize(random_matrix((32, 4)), "nf3")
  with pytest.raises(quant.QuantizeError, match="blocks of 32 input rows; this matrix has 40"):
    quant.quantize(random_matrix((40, 4)), "q4_1")
  with pytest.raises(quant.QuantizeError, match="not kept quantized"):
    quant.from_gguf_blocks(np.zeros((1, 18), np.uint8), "Q4_0", (1, 32))


@pytest.mark.slow
def test_a_model_runs_on_its_quantized_matrices_as_on_their_dequantized_floats():
  from purejax import gpt
  from purejax.ops import kernels
  config = gpt.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64,
                         dropout=0.0, bias=False)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  quantized = {**params, "blocks": jax.tree.map(
      lambda w: quant.quantize(w, "q4_1") if w.ndim == 3 else w, params["blocks"])}
  assert isinstance(quantized["blocks"]["mlp"]["fc"]["w"], quant.QuantizedWeight)
  floats = jax.tree.map(quant.dense, quantized,
                        is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
  tokens = jnp.arange(16)[None] % 64
  forms = kernels.select("cpu")
  np.testing.assert_array_equal(np.asarray(gpt.forward(quantized, tokens, config, forms=forms)),
                                np.asarray(gpt.forward(floats, tokens, config, forms=forms)))


@pytest.mark.slow
def test_lora_adapts_a_quantized_base_without_forming_it_whole():
  from purejax import gpt
  from purejax import lora
  from purejax.ops import kernels
  config = gpt.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64,
                         dropout=0.0, bias=False)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  base = {**params, "blocks": jax.tree.map(
      lambda w: quant.quantize(w, "int8") if w.ndim == 3 else w, params["blocks"])}
  adapters = lora.init(base, 4, lora.ATTENTION_AND_MLP, jax.random.PRNGKey(1))
  assert set(adapters) == {"blocks.attn.qkv.w", "blocks.attn.proj.w", "blocks.mlp.fc.w",
                           "blocks.mlp.proj.w"}
  adapters = jax.tree.map(lambda b: b + 0.01, adapters)  # (B starts at 0)
  tokens, forms = jnp.arange(16)[None] % 64, kernels.select("cpu")
  view = lora.View(8.0)
  through_view = gpt.forward(view(lora.trainable(base, adapters)), tokens, config, forms=forms)
  merged = lora.merge(base, adapters, 8.0)
  assert merged["blocks"]["mlp"]["fc"]["w"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(through_view),
                             np.asarray(gpt.forward(merged, tokens, config, forms=forms)),
                             rtol=1e-4, atol=1e-4)
  # The adapters' gradient through the quantized base (the base has none to take).
  grads = jax.grad(lambda ad: jnp.sum(gpt.forward(view(lora.trainable(base, ad)), tokens,
                                                  config, forms=forms) ** 2))(adapters)
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_a_model_s_matrices_and_token_table_quantize_and_the_rest_stays_float():
  params = {"wte": {"embedding": random_matrix((64, 64))}, "ln_f": {"scale": np.ones(64)},
            "wpe": {"embedding": random_matrix((16, 64))},
            "blocks": {"mlp": {"fc": {"w": random_matrix((2, 64, 128))},
                               "proj": {"w": random_matrix((2, 40, 64))}}}}
  quantized, left = quant.quantize_matrices(params, "q4_1")
  assert isinstance(quantized["blocks"]["mlp"]["fc"]["w"], quant.QuantizedWeight)
  assert left == ["blocks.mlp.proj.w"]  # 40 rows: no whole blocks of 32
  table = quantized["wte"]["embedding"]  # blocks along a row: the transposed form
  assert isinstance(table, quant.QuantizedWeight) and table.transposed
  assert table.shape == (64, 64) and quantized["wpe"]["embedding"] is params["wpe"]["embedding"]
  assert quantized["ln_f"]["scale"] is params["ln_f"]["scale"]
  assert isinstance(quant.quantize_matrices(params, "int8")[0]["blocks"]["mlp"]["proj"]["w"],
                    quant.QuantizedWeight)


@pytest.mark.slow
def test_greedy_sampling_from_quantized_matrices_is_that_of_their_floats():
  from helpers.models import sharpened_params
  from purejax import engine
  from purejax import gpt
  from purejax.ops import kernels
  config = gpt.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64,
                         dropout=0.0, bias=False)
  quantized, _ = quant.quantize_matrices(sharpened_params(config), "q4_1")
  floats = jax.tree.map(quant.dense, quantized,
                        is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
  forms = kernels.select("cpu")
  run = lambda p: [c[0].tokens for c in engine.generate(
      p, [[1, 2, 3], [9, 8]], config, jax.random.PRNGKey(0), 12, forms=forms)]
  assert run(quantized) == run(floats)


def test_the_command_lines_refuse_an_unknown_format(capsys, tmp_path):
  from purejax.cli import sample
  code = sample.run(["sample", f"--out_dir={tmp_path}", "--quantize=nf3"])
  err = capsys.readouterr().err
  assert code == 1 and "--quantize" in err and "nf3" in err and len(err.strip().splitlines()) == 1

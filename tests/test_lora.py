"""lora: adapters as a separate pytree, a merged view of the params, export of the merge."""

import contextlib
import dataclasses
import io

import chex
import jax
from jax import ad_checkpoint
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from purejax import gpt
from purejax import lora
from purejax.ops import kernels
from purejax.ops.matmul import LowRankWeight, matmul
from purejax.optimizers import optim
from helpers.data import need
from helpers.models import TINY, dot_operand_dtypes

# in pytree order (dict keys sorted)
GPT_TARGETS = ("blocks.attn.proj.w", "blocks.attn.qkv.w", "blocks.mlp.fc.w",
               "blocks.mlp.proj.w")


def trained_adapters(adapters, seed=1):
  """Adapters with non-zero B (as after training), so merging changes the weights."""
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 * len(adapters)))
  return {path: {"a": ab["a"], "b": 0.1 * jax.random.normal(next(keys), ab["b"].shape)}
          for path, ab in adapters.items()}


def test_attention_and_mlp_targets_are_the_gpts_four_matrices():
  params = gpt.init_params(TINY, jax.random.PRNGKey(0))
  assert lora.target_paths(params, lora.ATTENTION_AND_MLP) == GPT_TARGETS
  assert lora.target_paths(params, lora.ATTENTION) == GPT_TARGETS[:2]
  # a comma-separated string, as the command line passes it
  assert lora.target_paths(params, "*mlp.fc.w,*attn.qkv.w") == GPT_TARGETS[1:3]


def test_targets_that_match_nothing_or_a_vector_are_refused():
  params = gpt.init_params(TINY, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="match no weight matrix"):
    lora.init(params, 2, ("*attn.q_proj.w",), jax.random.PRNGKey(1))
  with pytest.raises(ValueError, match="is not a dense layer's weight"):
    lora.init(params, 2, ("*attn.qkv.*",), jax.random.PRNGKey(1))  # matches the bias
  with pytest.raises(ValueError, match="rank 16 is not below"):
    lora.init(params, 16, lora.ATTENTION, jax.random.PRNGKey(1))


def test_adapters_are_stacked_like_the_blocks_and_start_at_the_base_model():
  params = gpt.init_params(TINY, jax.random.PRNGKey(0))
  adapters = lora.init(params, 4, lora.ATTENTION_AND_MLP, jax.random.PRNGKey(1))
  c, n = TINY.n_embd, TINY.n_layer
  chex.assert_shape(adapters["blocks.attn.qkv.w"]["a"], (n, c, 4))
  chex.assert_shape(adapters["blocks.attn.qkv.w"]["b"], (n, 4, 3 * c))
  chex.assert_shape(adapters["blocks.mlp.proj.w"]["a"], (n, 4 * c, 4))
  # B starts at zero: the merged params are the base params exactly.
  chex.assert_trees_all_equal(lora.merge(params, adapters, alpha=8.0), params)


def test_merge_adds_the_scaled_low_rank_product_to_the_targets_only():
  params = gpt.init_params(TINY, jax.random.PRNGKey(0))
  adapters = trained_adapters(lora.init(params, 2, ("*attn.proj.w",), jax.random.PRNGKey(1)))
  merged = lora.merge(params, adapters, alpha=6.0)
  ab = adapters["blocks.attn.proj.w"]
  expected = params["blocks"]["attn"]["proj"]["w"] + 3.0 * ab["a"] @ ab["b"]
  np.testing.assert_allclose(merged["blocks"]["attn"]["proj"]["w"], expected, atol=1e-6)
  untouched = dict(merged, blocks=dict(merged["blocks"], attn=params["blocks"]["attn"]))
  chex.assert_trees_all_equal(untouched, params)


def test_adapters_that_do_not_fit_the_params_are_refused():
  params = gpt.init_params(TINY, jax.random.PRNGKey(0))
  adapters = lora.init(params, 2, lora.ATTENTION, jax.random.PRNGKey(1))
  wider = gpt.init_params(dataclasses.replace(TINY, n_embd=32), jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="does not fit the weight"):
    lora.merge(wider, adapters, alpha=2.0)


def test_gradients_flow_to_the_adapters_only():
  params = gpt.init_params(TINY, jax.random.PRNGKey(0))
  adapters = trained_adapters(lora.init(params, 2, lora.ATTENTION_AND_MLP, jax.random.PRNGKey(1)))
  x = jax.random.randint(jax.random.PRNGKey(2), (2, TINY.block_size), 0, TINY.vocab_size)

  def loss(adapters):
    return gpt.loss(lora.merge(params, adapters, 4.0), x, jnp.roll(x, -1, axis=1), TINY)

  grads = jax.jit(jax.grad(loss))(adapters)
  chex.assert_trees_all_equal_shapes(grads, adapters)
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_the_view_reads_the_merge_and_gives_the_base_no_gradient():
  params = gpt.init_params(TINY, jax.random.PRNGKey(0))
  adapters = trained_adapters(lora.init(params, 2, lora.ATTENTION, jax.random.PRNGKey(1)))
  tree = lora.trainable(params, adapters)
  view = lora.View(alpha=4.0)
  # The adapted weights stay apart (W, A, B); whole, they are the merge's.
  low_rank = view(tree)
  is_weight = lambda x: isinstance(x, LowRankWeight)
  whole = jax.tree.map(lambda w: w.merged() if is_weight(w) else w, low_rank, is_leaf=is_weight)
  chex.assert_trees_all_equal(whole, lora.merge(params, adapters, 4.0))
  x = jax.random.randint(jax.random.PRNGKey(2), (2, TINY.block_size), 0, TINY.vocab_size)
  forward = jax.jit(gpt.forward, static_argnums=2)
  chex.assert_trees_all_close(forward(low_rank, x, TINY),
                              forward(lora.merge(params, adapters, 4.0), x, TINY),
                              atol=1e-5, rtol=1e-5)
  assert view == lora.View(alpha=4.0) and hash(view) == hash(lora.View(alpha=4.0))
  grads = jax.jit(jax.grad(lambda t: gpt.loss(view(t), x, x, TINY)))(tree)
  assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads["base"]))
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads["adapters"]))


@pytest.mark.slow
@pytest.mark.parametrize("compute_dtype, matmul_backward",
                         [("float32", "plain"), ("bfloat16", "row_major")])
def test_the_views_gradient_is_the_merges_and_skips_the_frozen_weights_products(
    compute_dtype, matmul_backward):
  # The view applies x @ W + s (x @ A) @ B; differentiating the merge instead
  # also forms each frozen weight's [d_in, d_out] gradient, then projects it
  # onto A and B. Same gradient, fewer FLOPs: the view's step lacks exactly
  # those products, 2 * tokens * d_in * d_out per adapted weight.
  # Wide enough that the dense products, not the adapters' rank-2 ones, dominate.
  config = dataclasses.replace(TINY, n_embd=64, compute_dtype=compute_dtype)
  # Unrolled layers: XLA's cost analysis counts a loop's body once.
  forms = kernels.Forms(matmul_backward=matmul_backward, scan_layers=False)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  adapters = trained_adapters(lora.init(params, 2, lora.ATTENTION_AND_MLP,
                                        jax.random.PRNGKey(1)))
  tree = lora.trainable(params, adapters)
  x = jax.random.randint(jax.random.PRNGKey(2), (2, config.block_size), 0, config.vocab_size)

  def merged(t):
    return lora.merge(jax.lax.stop_gradient(t["base"]), t["adapters"], 4.0)

  def grad_of(view):
    return jax.jit(jax.grad(lambda t: gpt.loss(view(t), x, x, config, forms=forms)))

  ours, theirs = grad_of(lora.View(4.0)), grad_of(merged)
  tolerance = 1e-5 if compute_dtype == "float32" else 3e-2
  chex.assert_trees_all_close(ours(tree)["adapters"], theirs(tree)["adapters"],
                              atol=tolerance, rtol=tolerance)

  def flops(fn):
    return fn.lower(tree).compile().cost_analysis()["flops"]

  tokens = x.size
  weights = lora._weights_by_path(params)  # pylint: disable=protected-access
  frozen_products = sum(2 * tokens * weights[path].size for path in adapters)  # all layers
  assert flops(theirs) - flops(ours) >= 0.75 * frozen_products


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_remat_dots_keeps_one_output_per_low_rank_product(compute_dtype):
  # Under remat "dots" a block keeps its products' outputs for the backward
  # pass. A low-rank product x @ W + s (x @ A) @ B is one output: keeping
  # x @ W and (x @ A) @ B apart held twice the bytes (LoRA on SmolLM2-135M:
  # 1.70 against 1.17 GiB of temporaries per step).
  rows, d_in, d_out, rank = 8, 16, 24, 2
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  x = jax.random.normal(keys[0], (rows, d_in))
  weight = LowRankWeight(jax.random.normal(keys[1], (d_in, d_out)),
                                 jax.random.normal(keys[2], (d_in, rank)),
                                 jax.random.normal(keys[3], (rank, d_out)), 2.0)

  def block(w, x):
    return jnp.sum(jax.nn.silu(matmul(x, w, compute_dtype=compute_dtype,
                                              forms=kernels.Forms())))

  forms = kernels.Forms(remat="dots")
  listing = io.StringIO()
  with contextlib.redirect_stdout(listing):  # one line per residual: "f32[8,24] output of ..."
    ad_checkpoint.print_saved_residuals(kernels.remat(block, forms, None), weight, x)
  saved = listing.getvalue().splitlines()
  assert sum(line.startswith(f"f32[{rows},{d_out}]") for line in saved) == 1, saved
  # The same function and gradients as without remat.
  plain = jax.value_and_grad(block)(weight, x)
  chex.assert_trees_all_close(jax.value_and_grad(kernels.remat(block, forms, None))(weight, x),
                              plain, rtol=1e-6, atol=1e-6)


def test_in_bfloat16_only_the_frozen_product_multiplies_bfloat16_operands():
  # The adapters' rank-wide products stay float32: in bfloat16 on XLA's CPU
  # backend they would need row-major copies of the [rows, in] activations,
  # which took longer than the products (SmolLM2-135M: 0.43 s of a 4.3 s step).
  weight = LowRankWeight(jnp.ones((16, 24)), jnp.ones((16, 2)), jnp.ones((2, 24)), 2.0)
  x = jnp.ones((8, 16))
  forward = jax.make_jaxpr(lambda w, x: matmul(
      x, w, compute_dtype=jnp.bfloat16, forms=kernels.Forms()))(weight, x)
  backward = jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(matmul(
      x, w, compute_dtype=jnp.bfloat16, forms=kernels.Forms())), argnums=(0, 1)))(weight, x)

  for jaxpr, frozen_products in ((forward, 1), (backward, 2)):  # y; y and dx in the backward
    dtypes = dot_operand_dtypes(jaxpr.jaxpr)
    assert dtypes.count(("bfloat16", "bfloat16")) == frozen_products, dtypes
    assert all(d in (("bfloat16", "bfloat16"), ("float32", "float32")) for d in dtypes), dtypes


def test_optimizer_state_at_gpt2_124m_is_under_two_percent_of_full_fine_tuning():
  # GPT-2 124M's shapes, rank 8 on the attention and MLP matrices; shapes only
  # (jax.eval_shape), so nothing is allocated.
  config = gpt.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
  optimizer = optim.make_optimizer(optim.from_flat(weight_decay=0.1, decay_iters=10))
  params = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  adapters = jax.eval_shape(
      lambda p: lora.init(p, 8, lora.ATTENTION_AND_MLP, jax.random.PRNGKey(1)), params)

  def size(tree):
    return sum(leaf.size for leaf in jax.tree.leaves(tree))

  full = size(jax.eval_shape(optimizer.init, params))
  adapted = size(jax.eval_shape(optimizer.init, adapters))
  # 12 layers x 8 x ((768 + 2304) + (768 + 768) + 2 x (768 + 3072)) = 1,179,648
  # adapter values, two Adam moments each, against ~124M x 2.
  assert size(adapters) == 1_179_648
  assert adapted / full <= 0.02, adapted / full


@pytest.mark.slow  # a subprocess or a long one; the full suite runs it
def test_fine_tuning_the_adapters_on_an_unseen_text_lowers_its_loss():
  # The base model learns one repeating pattern; the adapters alone then
  # learn another (a text it has not seen), its held-out loss falls.
  config = TINY
  vocab = config.vocab_size
  seen = jnp.tile(jnp.arange(vocab, dtype=jnp.int32), 60)
  unseen = jnp.tile(jnp.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], jnp.int32) % vocab, 60)

  def batch(data, key):
    starts = jax.random.randint(key, (16,), 0, data.shape[0] - config.block_size - 1)
    windows = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (config.block_size + 1,)))(starts)
    return windows[:, :-1], windows[:, 1:]

  def train(loss_fn, trainable, steps, lr):
    opt = optax.adam(lr)

    @jax.jit
    def step(carry, key):
      trainable, state = carry
      value, grads = jax.value_and_grad(loss_fn)(trainable, *batch(data, key))
      updates, state = opt.update(grads, state, trainable)
      return (optax.apply_updates(trainable, updates), state), value

    (trainable, _), _ = jax.lax.scan(step, (trainable, opt.init(trainable)),
                                     jax.random.split(jax.random.PRNGKey(steps), steps))
    return trainable

  data = seen
  base = train(lambda p, x, y: gpt.loss(p, x, y, config),
               gpt.init_params(config, jax.random.PRNGKey(0)), 150, 1e-2)
  adapters = lora.init(base, 4, lora.ATTENTION_AND_MLP, jax.random.PRNGKey(1))
  held_out = batch(unseen, jax.random.PRNGKey(99))

  def val_loss(adapters):
    return float(gpt.loss(lora.merge(base, adapters, 8.0), *held_out, config))

  before = val_loss(adapters)
  data = unseen
  tuned = train(lambda a, x, y: gpt.loss(lora.merge(base, a, 8.0), x, y, config),
                adapters, 150, 1e-2)
  after = val_loss(tuned)
  assert after < 0.5 * before, (before, after)


@pytest.mark.slow
def test_merged_export_reloads_in_transformers_with_the_lora_forwards_logits(tmp_path):
  torch = need("torch")
  transformers = need("transformers")
  from purejax.weights import huggingface  # pylint: disable=g-import-not-at-top
  config = gpt.GPTConfig(vocab_size=101, block_size=16, n_layer=2, n_head=2, n_embd=32)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  adapters = trained_adapters(lora.init(params, 4, lora.ATTENTION_AND_MLP, jax.random.PRNGKey(1)))
  ids = np.random.default_rng(0).integers(0, 101, (2, 16))
  lora_logits = gpt.forward(lora.merge(params, adapters, 8.0), jnp.asarray(ids), config)
  # the adapters change the model, so the comparison below can fail
  assert float(jnp.abs(lora_logits - gpt.forward(params, jnp.asarray(ids), config)).max()) > 1e-2
  folder = huggingface.to_huggingface(lora.merge(params, adapters, 8.0), config,
                                      str(tmp_path / "merged"))
  model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
  with torch.no_grad():
    hf_logits = model(torch.from_numpy(ids)).logits.numpy()
  np.testing.assert_allclose(hf_logits, np.asarray(lora_logits), atol=2e-5)

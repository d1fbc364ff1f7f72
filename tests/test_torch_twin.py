"""The PyTorch twins in bench/ compute the same functions as purejax.

This makes the benchmarks apples to apples. torch comes with the `test`
extra; without it these tests skip.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers.data import need
from helpers.models import greedy_continuations

torch = need("torch")

from bench import torch_gpt, torch_mlp  # pylint: disable=g-import-not-at-top
from purejax import gpt, mlp  # pylint: disable=g-import-not-at-top
from purejax.data import batches  # pylint: disable=g-import-not-at-top
from purejax.optimizers import optim  # pylint: disable=g-import-not-at-top

CONFIG = gpt.GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32)


def perturbed(params, seed=1, scale=0.05):
  """Params with non-trivial biases and norms, so every tensor is exercised."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(
      tree, [p + scale * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


# Dropout 0.2 without biases is the Shakespeare GPU recipe's model: the
# twin's SDPA path must switch its dropout off in eval mode.
@pytest.mark.parametrize("bias, dropout", [(True, 0.0), (False, 0.0), (False, 0.2)])
def test_gpt_logits_agree(bias, dropout):
  config = dataclasses.replace(CONFIG, bias=bias, dropout=dropout)
  params = perturbed(gpt.init_params(config, jax.random.PRNGKey(0)))
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (3, 16), 0, 65))
  twin = torch_gpt.load_purejax_params(torch_gpt.TorchGPT(config), params).eval()
  with torch.no_grad():
    theirs, _ = twin(torch.from_numpy(tokens).long())
  ours = gpt.forward(params, jnp.asarray(tokens), config)
  np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_gpt_one_training_step_agrees():
  params = perturbed(gpt.init_params(CONFIG, jax.random.PRNGKey(0)))
  data = jax.random.randint(jax.random.PRNGKey(3), (2000,), 0, 65)
  x, y = batches.sample_batch(jax.random.PRNGKey(4), data, 16, 4)
  lr, wd, betas = 1e-2, 0.1, (0.9, 0.99)

  # purejax: loss before the step, then the loss of the updated params.
  optimizer = optim.make_optimizer(optim.from_flat(
      learning_rate=lr, schedule="constant", beta2=betas[1], weight_decay=wd))
  state = optimizer.init(params)
  loss0, grads = jax.value_and_grad(gpt.loss)(params, x, y, CONFIG)
  updates, _ = optimizer.update(grads, state, params)
  loss1 = gpt.loss(optax.apply_updates(params, updates), x, y, CONFIG)

  twin = torch_gpt.load_purejax_params(torch_gpt.TorchGPT(CONFIG), params)
  opt = torch_gpt.make_optimizer(twin, lr, wd, betas)
  tx, ty = torch.from_numpy(np.asarray(x)).long(), torch.from_numpy(np.asarray(y)).long()
  _, t_loss0 = twin(tx, ty)
  t_loss0.backward()
  opt.step()
  with torch.no_grad():
    _, t_loss1 = twin(tx, ty)
  np.testing.assert_allclose(float(loss0), t_loss0.item(), rtol=1e-5)
  np.testing.assert_allclose(float(loss1), t_loss1.item(), rtol=1e-4)
  assert float(loss1) < float(loss0)


@pytest.mark.slow
def test_mlp_logits_and_step_agree():
  sizes = [784, 64, 64, 10]
  params = mlp.init_network_params(sizes, jax.random.PRNGKey(0), scale=0.05)
  images = np.asarray(jax.random.uniform(jax.random.PRNGKey(1), (32, 784)))
  labels = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (32,), 0, 10))
  twin = torch_mlp.load_purejax_params(torch_mlp.TorchMLP(sizes), params)
  with torch.no_grad():
    theirs = twin(torch.from_numpy(images))
  ours = mlp.batched_predict(params, jnp.asarray(images))
  np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-4, rtol=1e-4)

  optimizer = optax.sgd(0.1)
  new_params, _, loss0 = mlp.update(params, optimizer.init(params), jnp.asarray(images),
                                    jnp.asarray(labels), optimizer=optimizer)
  opt = torch.optim.SGD(twin.parameters(), lr=0.1)
  loss = torch.nn.functional.cross_entropy(twin(torch.from_numpy(images)),
                                           torch.from_numpy(labels).long())
  loss.backward()
  opt.step()
  np.testing.assert_allclose(float(loss0), loss.item(), rtol=1e-5)
  with torch.no_grad():
    theirs = twin(torch.from_numpy(images))
  np.testing.assert_allclose(np.asarray(mlp.batched_predict(new_params, jnp.asarray(images))),
                             theirs.numpy(), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------
# The GPU twin's paths (bench/gpu.py), checked on CPU in float32


def sharpened(config, seed=0):
  """Params scaled up so greedy decoding has clear winners (no argmax near-ties)."""
  return perturbed(gpt.init_params(config, jax.random.PRNGKey(seed)), seed + 1, scale=0.3)


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
def test_twin_kv_cache_logits_equal_forward():
  params = perturbed(gpt.init_params(CONFIG, jax.random.PRNGKey(0)))
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, 65))
  ours = np.asarray(gpt.forward(params, jnp.asarray(tokens), CONFIG))
  twin = torch_gpt.load_purejax_params(torch_gpt.TorchGPT(CONFIG), params).eval()
  twin.setup_kv_cache(batch=2)
  x = torch.from_numpy(tokens).long()
  with torch.no_grad():
    # A 5-token prompt in one pass, then one token at a time.
    logits = [twin.forward_with_cache(x[:, :5], torch.arange(5))]
    logits += [twin.forward_with_cache(x[:, t:t + 1], torch.tensor([t])) for t in range(5, 16)]
  theirs = torch.stack(logits, dim=1).numpy()  # positions 4, 5, ..., 15
  np.testing.assert_allclose(ours[:, 4:], theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prompt_len,new_tokens", [(1, 15), (4, 9)])
def test_twin_kv_generate_greedy_equals_purejax(prompt_len, new_tokens):
  params = sharpened(CONFIG)
  prompt = jax.random.randint(jax.random.PRNGKey(3), (2, prompt_len), 0, 65)
  ours = greedy_continuations(params, prompt, CONFIG, new_tokens)
  twin = torch_gpt.load_purejax_params(torch_gpt.TorchGPT(CONFIG), params).eval()
  theirs = twin.generate_kv(torch.from_numpy(np.asarray(prompt)).long(), new_tokens,
                            temperature=0.0)
  np.testing.assert_array_equal(np.asarray(ours), theirs.numpy())


def test_twin_kv_generate_top_k_sampling():
  params = sharpened(CONFIG)
  twin = torch_gpt.load_purejax_params(torch_gpt.TorchGPT(CONFIG), params).eval()
  prompt = torch.zeros((3, 1), dtype=torch.long)
  greedy = twin.generate_kv(prompt, 10, temperature=0.0)
  # top_k=1 leaves only the argmax, whatever the draw.
  np.testing.assert_array_equal(twin.generate_kv(prompt, 10, top_k=1).numpy(), greedy.numpy())
  torch.manual_seed(0)
  sampled = twin.generate_kv(prompt, 15, temperature=1.0, top_k=5)
  assert sampled.shape == (3, 16)
  assert sampled.min() >= 0 and sampled.max() < CONFIG.vocab_size
  with pytest.raises(ValueError, match="block_size"):
    twin.generate_kv(prompt, CONFIG.block_size)


def test_the_twins_float32_muon_steps_as_purejaxs_muon():
  # bench.optimizers compares Muon's cost in both libraries: the same step.
  from purejax.optimizers import muon  # pylint: disable=g-import-not-at-top
  grads = np.random.default_rng(0).normal(size=(3, 24, 72)).astype(np.float32)  # [in, out]
  ours = muon.muon_matrices(learning_rate=0.02, momentum=0.95, weight_decay=0.0)
  params = {"w": jnp.zeros_like(grads)}
  update, _ = jax.jit(ours.update)({"w": jnp.asarray(grads)}, ours.init(params), params)
  for layer in range(3):
    weight = torch.nn.Parameter(torch.zeros(72, 24))  # torch's Linear: [out, in]
    weight.grad = torch.from_numpy(grads[layer].T.copy())
    torch_gpt.Float32Muon([weight], lr=0.02, momentum=0.95, ns_steps=5).step()
    np.testing.assert_allclose(weight.detach().numpy().T, update["w"][layer], atol=2e-6)

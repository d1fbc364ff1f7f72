"""Tiny models and data the unit tests share."""


import jax
import jax.numpy as jnp
import numpy as np

from purejax import engine
from purejax import gpt
from purejax.ops import kernels
from purejax.training.pure.state import TrainState


# A GPT small enough to compile in a second: 2 layers, 2 heads, 16 wide.
TINY = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)


# How the tests' models run: the CPU's forms, as `kernels.select` chooses them.
CPU_FORMS = kernels.select("cpu")


def random_tokens(key, shape, vocab=TINY.vocab_size):
  return jax.random.randint(key, shape, 0, vocab)


def sharpened_params(config, seed=0):
  """Random params scaled up, so logits have clear winners (no argmax ties)."""
  params = gpt.init_params(config, jax.random.PRNGKey(seed))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  return jax.tree.unflatten(
      tree, [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


def greedy_continuations(params, prompts, config, max_new_tokens, **options) -> np.ndarray:
  """`[batch, prompt + max_new_tokens]`: each prompt row followed by its greedy tokens
  (`engine.generate`, every prompt in one batch), as a peer's `generate` returns them."""
  prompts = np.asarray(prompts)
  rows = engine.generate(params, prompts, config, jax.random.PRNGKey(0), max_new_tokens,
                         **options)
  assert all(len(c.tokens) == max_new_tokens for (c,) in rows), "ended early"
  return np.concatenate([prompts, np.asarray([c.tokens for (c,) in rows])], axis=1)


RTOL = 1e-5


def stacked_sweep_state(config, specs, make_optimizer) -> TrainState:
  """A sweep's start as the tests build it: a `TrainState` with a leading runs axis, each
  run's params and train key from `jax.random.split(PRNGKey(its seed))`, and its
  optimizer state from `make_optimizer()` (`optim.RunOptimizer`)."""
  keys = [jax.random.split(jax.random.PRNGKey(spec.seed)) for spec in specs]
  params = jax.tree.map(lambda *xs: jnp.stack(xs), *[gpt.init_params(config, k[0]) for k in keys])
  return TrainState(params, jax.vmap(lambda p: make_optimizer().init(p))(params),
                    {"train": jnp.stack([k[1] for k in keys])})


def dot_operand_dtypes(jaxpr):
  """Every dot_general's operand dtypes in `jaxpr`, nested jaxprs (checkpoint, custom VJP) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(tuple(v.aval.dtype.name for v in eqn.invars))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found += dot_operand_dtypes(inner)
  return found

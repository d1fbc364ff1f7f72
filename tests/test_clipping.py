"""Global-norm clipping: optax's function and state, as one scalar factor XLA fuses.

`optim.clip_by_global_norm` is what `make_optimizer` chains before the
optimizer when `grad_clip > 0`.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from purejax.training import optim


def grads(scale: float):
  key = jax.random.PRNGKey(0)
  return {"w": scale * jax.random.normal(key, (64, 32)),
          "b": scale * jax.random.normal(jax.random.fold_in(key, 1), (32,))}


@pytest.mark.parametrize("scale", [1e-3, 10.0])
def test_it_clips_as_optax_does_with_the_same_state(scale):
  ours, theirs = optim.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
  g = grads(scale)
  state = ours.init(g)
  chex.assert_trees_all_equal_structs(state, theirs.init(g))  # checkpoints interchange
  clipped, _ = ours.update(g, state)
  expected, _ = theirs.update(g, theirs.init(g))
  if scale < 1:  # under the threshold: untouched, bit for bit
    chex.assert_trees_all_equal(clipped, g)
  else:
    assert float(optax.tree.norm(g)) > 1
    np.testing.assert_allclose(float(optax.tree.norm(clipped)), 1.0, rtol=1e-6)
  chex.assert_trees_all_close(clipped, expected, rtol=1e-6, atol=0)


def test_make_optimizer_writes_each_parameter_sized_array_three_times_not_four():
  # AdamW's moments and the parameter; optax's own clipping also writes the
  # clipped gradient out, a fourth parameter-sized pass (XLA's CPU backend).
  config = optim.OptimizerConfig(name="adamw", learning_rate=1e-3, weight_decay=0.1,
                                 grad_clip=1.0, decay_iters=100)

  def written(opt):
    params = {"w": jnp.ones((256, 512)), "b": jnp.ones((512,))}

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, g):
      updates, s = opt.update(g, s, p)
      return optax.apply_updates(p, updates), s

    program = step.lower(params, opt.init(params), params).compile().as_text()
    entry = program[program.index("ENTRY"):]
    return len(re.findall(r"= f32\[256,512\]\{1,0\} fusion\(", entry))

  assert written(optim.make_optimizer(config)) == 3
  assert written(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optim.make_schedule(config), weight_decay=0.1))) == 4

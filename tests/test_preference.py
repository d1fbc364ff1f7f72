"""The losses after SFT (`preference`): DPO's and GRPO's, against their formulas in numpy.

Each test computes the loss the long way, per pair or per token in float64 numpy, as the
papers and TRL's trainers write it, and compares.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.models import CPU_FORMS
from purejax import gpt
from purejax.training.pure import preference

RNG = np.random.default_rng(0)


def log_sigmoid(x):
  return -np.log1p(np.exp(-x))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_dpo_sigmoid_loss_and_its_rewards_are_the_papers(smoothing):
  chosen, rejected, ref_c, ref_r = (RNG.normal(-20, 3, 6) for _ in range(4))
  beta = 0.2
  loss, stats = preference.dpo_loss(*map(jnp.asarray, (chosen, rejected, ref_c, ref_r)),
                                    beta=beta, label_smoothing=smoothing)
  h = (chosen - ref_c) - (rejected - ref_r)
  want = np.mean(-(1 - smoothing) * log_sigmoid(beta * h) - smoothing * log_sigmoid(-beta * h))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  r_c, r_r = beta * (chosen - ref_c), beta * (rejected - ref_r)
  np.testing.assert_allclose(
      [float(stats.chosen_reward), float(stats.rejected_reward), float(stats.margin),
       float(stats.accuracy)], [r_c.mean(), r_r.mean(), (r_c - r_r).mean(),
                                np.mean(r_c > r_r)], rtol=1e-5)


def test_dpo_pushes_the_chosen_side_up_and_the_rejected_down():
  args = [jnp.asarray(RNG.normal(-10, 1, 4)) for _ in range(4)]
  grad_c, grad_r = jax.grad(lambda c, r: preference.dpo_loss(c, r, *args[2:])[0],
                            argnums=(0, 1))(args[0], args[1])
  assert np.all(np.asarray(grad_c) < 0) and np.all(np.asarray(grad_r) > 0)
  # At the reference (h = 0) the sigmoid loss is log 2 per pair.
  np.testing.assert_allclose(float(preference.dpo_loss(*args[2:], *args[2:])[0]), np.log(2),
                             rtol=1e-6)


def test_ipo_loss_is_the_squared_distance_to_half_over_beta():
  chosen, rejected, ref_c, ref_r = (RNG.normal(-1, 0.3, 5) for _ in range(4))
  loss, _ = preference.dpo_loss(*map(jnp.asarray, (chosen, rejected, ref_c, ref_r)),
                                beta=0.5, loss_type="ipo")
  h = (chosen - ref_c) - (rejected - ref_r)
  np.testing.assert_allclose(float(loss), np.mean((h - 1.0) ** 2), rtol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(loss_type="hinge"), "unknown DPO loss 'hinge'"),
    (dict(beta=0.0), "beta must be > 0"),
    (dict(label_smoothing=0.5), r"label smoothing must be in \[0, 0.5\)")])
def test_dpo_refuses_settings_it_does_not_take(bad, message):
  x = jnp.zeros(2)
  with pytest.raises(ValueError, match=message):
    preference.dpo_loss(x, x, x, x, **bad)


def test_group_advantages_center_and_scale_each_group_alone():
  rewards = np.array([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
  got = np.asarray(preference.group_advantages(jnp.asarray(rewards), 4))
  first = rewards[:4] - rewards[:4].mean()
  np.testing.assert_allclose(got[:4], first / (rewards[:4].std(ddof=1) + 1e-4), rtol=1e-5)
  np.testing.assert_allclose(got[4:], 0.0)  # a group scored alike carries no signal
  plain = np.asarray(preference.group_advantages(jnp.asarray(rewards), 4, scale=False))
  np.testing.assert_allclose(plain[:4], first, rtol=1e-6)
  stats = preference.group_stats(jnp.asarray(rewards), 4)
  np.testing.assert_allclose(float(stats["no_signal"]), 0.5)
  with pytest.raises(ValueError, match="at least 2 completions"):
    preference.group_advantages(jnp.asarray(rewards), 1)


def reference_policy_loss(logps, old, adv, mask, ref, beta, clip, clip_high):
  """Token by token, in float64: PPO's clipped surrogate plus beta k3, over every token."""
  total, count = 0.0, 0.0
  for i in range(logps.shape[0]):
    for t in range(logps.shape[1]):
      if not mask[i, t]:
        continue
      ratio = np.exp(logps[i, t] - old[i, t])
      surrogate = min(ratio * adv[i], np.clip(ratio, 1 - clip, 1 + clip_high) * adv[i])
      d = ref[i, t] - logps[i, t]
      total += -surrogate + beta * (np.exp(d) - d - 1)
      count += 1
  return total / count


def test_policy_loss_is_the_clipped_surrogate_plus_k3_over_every_token():
  logps = RNG.normal(-2, 0.5, (4, 6))
  old = logps + RNG.normal(0, 0.3, (4, 6))  # a later update: ratios away from 1
  ref = logps + RNG.normal(0, 0.2, (4, 6))
  adv = RNG.normal(0, 1, 4)
  mask = (RNG.random((4, 6)) < 0.7).astype(np.float32)
  loss, stats = preference.policy_loss(
      *map(jnp.asarray, (logps, old, adv, mask)), ref_logps=jnp.asarray(ref), beta=0.04,
      clip=0.2, clip_high=0.28)
  want = reference_policy_loss(logps, old, adv, mask, ref, 0.04, 0.2, 0.28)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert 0 < float(stats.clipped) < 1 and float(stats.kl) > 0


def test_one_update_per_sample_is_reinforce_with_a_group_baseline():
  # ratio 1: the gradient of the loss is -A * grad log p, averaged over the tokens.
  logps = jnp.asarray(RNG.normal(-2, 0.5, (3, 5)))
  adv, mask = jnp.asarray([1.0, -0.5, 0.0]), jnp.ones((3, 5))
  grad = jax.grad(lambda l: preference.policy_loss(l, l, adv, mask)[0])(logps)
  chex.assert_trees_all_close(grad, -jnp.broadcast_to(adv[:, None], (3, 5)) / 15.0, atol=1e-7)
  with pytest.raises(ValueError, match="needs the reference"):
    preference.policy_loss(logps, logps, adv, mask, beta=0.1)


def test_completion_logps_sum_the_weighted_targets_log_probabilities():
  config = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  tokens = jnp.asarray(RNG.integers(0, 11, (2, 7)))
  weights = jnp.asarray([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], jnp.float32)
  logps, counts = preference.completion_logps(params, tokens, weights, config, forms=CPU_FORMS)
  logits = np.asarray(gpt.forward(params, tokens[:, :-1], config, forms=CPU_FORMS), np.float64)
  logp = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
  picked = np.take_along_axis(logp, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(logps), np.sum(picked * np.asarray(weights), -1),
                             rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(counts), [3, 5])

"""The losses after supervised fine-tuning, as pure functions of log-probabilities.

    logps = completion_logps(params, tokens, weights, config, forms=forms)   # [batch]
    loss, stats = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)
    advantages = group_advantages(rewards, group_size=8)                   # [prompts * 8]
    loss, stats = policy_loss(logps, old_logps, advantages, mask)          # GRPO's

Direct preference optimisation (Rafailov et al. 2023) trains on pairs of answers to one
prompt, one preferred: with the implicit reward `r = beta * (log pi(y|x) - log
pi_ref(y|x))`, the sigmoid loss is `-log sigmoid(r_chosen - r_rejected)`. The
reference model is the starting params: a LoRA run's reference is its base without
the adapters, so no second copy is held.

GRPO (Shao et al. 2024) samples a group of completions per prompt, scores them, and
weights each completion's tokens by its advantage, its reward minus the group's mean
(optionally over the group's spread); with more than one update per batch of samples the
probability ratio to the sampling policy is clipped as PPO's, and a KL term to the
reference (the k3 estimator) may hold the policy near it.

The conventions are TRL's (`DPOTrainer`'s `sigmoid`, `ipo` and label smoothing;
`GRPOTrainer`'s group statistics, clipping and k3 KL); docs/post_training.md writes
each loss as math beside the code.
"""

from typing import Dict, NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from purejax import gpt
from purejax.ops import kernels
from purejax.ops import loss

DPO_LOSSES = ("sigmoid", "ipo")


def completion_logps(params: gpt.Params, tokens: chex.Array, weights: chex.Array,
                     config: gpt.GPTConfig, *, forms: Optional[kernels.Forms] = None
                     ) -> Tuple[chex.Array, chex.Array]:
  """Each row's summed log-probability of its weighted targets, and their count.

  Args:
    params: the model's.
    tokens: `[batch, time + 1]` ids: inputs `tokens[:, :-1]`, targets `tokens[:, 1:]`.
    weights: `[batch, time]`, 1 on the targets that count (a completion's tokens), 0 on
      the prompt and padding.
    config, forms: the model and how it runs.

  Returns:
    `(logps [batch], counts [batch])`: `sum_t weights * log p(target_t | tokens <= t)`,
    float32, and `sum_t weights`.
  """
  chex.assert_rank(tokens, 2)
  chex.assert_shape(weights, (tokens.shape[0], tokens.shape[1] - 1))
  logits = gpt.forward(params, tokens[:, :-1], config, forms=forms)  # [b, t, vocab]
  picked = loss.target_log_probs(logits, tokens[:, 1:])  # [b, t]
  weights = weights.astype(jnp.float32)
  return jnp.sum(picked * weights, axis=-1), jnp.sum(weights, axis=-1)


class PreferenceStats(NamedTuple):
  """What a DPO batch shows beside its loss (means over the pairs).

  Attributes:
    chosen_reward, rejected_reward: `beta * (log pi - log pi_ref)` of each side.
    margin: chosen minus rejected reward.
    accuracy: the fraction of pairs whose chosen reward is the larger.
  """
  chosen_reward: chex.Array
  rejected_reward: chex.Array
  margin: chex.Array
  accuracy: chex.Array


def dpo_loss(chosen: chex.Array, rejected: chex.Array, ref_chosen: chex.Array,
             ref_rejected: chex.Array, *, beta: float = 0.1, label_smoothing: float = 0.0,
             loss_type: str = "sigmoid") -> Tuple[chex.Array, PreferenceStats]:
  """DPO's mean loss over pairs, from each side's log-probability under the policy and
  the reference (`[pairs]` each; for "ipo", log-probabilities averaged over each side's
  tokens, as TRL's IPO takes them).

  With `h = (chosen - ref_chosen) - (rejected - ref_rejected)`:
  "sigmoid": `-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)` (`eps` the
  label smoothing: the chance a pair's label is flipped; 0 is DPO's loss);
  "ipo": `(h - 1 / (2 beta))^2`.

  Returns:
    `(loss, PreferenceStats)`; the stats carry no gradient.
  """
  if loss_type not in DPO_LOSSES:
    raise ValueError(f"unknown DPO loss {loss_type!r}; choose one of {DPO_LOSSES}.")
  if not beta > 0:
    raise ValueError(f"beta must be > 0, got {beta}.")
  if not 0 <= label_smoothing < 0.5:
    raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}.")
  chex.assert_equal_shape((chosen, rejected, ref_chosen, ref_rejected))
  h = (chosen - ref_chosen) - (rejected - ref_rejected)
  if loss_type == "sigmoid":
    losses = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * h)
              - label_smoothing * jax.nn.log_sigmoid(-beta * h))
  else:
    losses = (h - 1.0 / (2.0 * beta)) ** 2
  chosen_reward = jax.lax.stop_gradient(beta * (chosen - ref_chosen))
  rejected_reward = jax.lax.stop_gradient(beta * (rejected - ref_rejected))
  stats = PreferenceStats(jnp.mean(chosen_reward), jnp.mean(rejected_reward),
                          jnp.mean(chosen_reward - rejected_reward),
                          jnp.mean((chosen_reward > rejected_reward).astype(jnp.float32)))
  return jnp.mean(losses), stats


def group_advantages(rewards: chex.Array, group_size: int, *, scale: bool = True,
                     eps: float = 1e-4) -> chex.Array:
  """Each completion's reward minus its group's mean (over the group's standard deviation
  plus `eps` with `scale`, as TRL's `scale_rewards`); groups are consecutive rows.

  Args:
    rewards: `[prompts * group_size]`.
    group_size: completions per prompt (>= 2: one alone has no baseline).

  Returns:
    `[prompts * group_size]` float32 advantages, no gradient.
  """
  if group_size < 2:
    raise ValueError(f"a group needs at least 2 completions to compare, got {group_size}.")
  chex.assert_rank(rewards, 1)
  if rewards.shape[0] % group_size:
    raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}.")
  groups = rewards.astype(jnp.float32).reshape(-1, group_size)
  advantages = groups - jnp.mean(groups, axis=1, keepdims=True)
  if scale:  # the unbiased std, as torch's `std` that TRL calls
    advantages = advantages / (jnp.std(groups, axis=1, ddof=1, keepdims=True) + eps)
  return jax.lax.stop_gradient(advantages.reshape(-1))


class PolicyStats(NamedTuple):
  """What a policy-gradient batch shows beside its loss.

  Attributes:
    kl: the mean k3 estimate of KL(policy || reference) over the counted tokens (0
      without a reference).
    clipped: the fraction of counted tokens whose ratio the clip held.
  """
  kl: chex.Array
  clipped: chex.Array


def policy_loss(logps: chex.Array, old_logps: chex.Array, advantages: chex.Array,
                mask: chex.Array, *, ref_logps: Optional[chex.Array] = None,
                beta: float = 0.0, clip: float = 0.2, clip_high: Optional[float] = None
                ) -> Tuple[chex.Array, PolicyStats]:
  """GRPO's loss over sampled completions' tokens, normalised by the batch's token count.

  Per token, with `ratio = exp(logps - old_logps)` and `A` its completion's advantage:
  `-min(ratio A, clip(ratio, 1 - clip, 1 + clip_high) A) + beta k3`, where
  `k3 = exp(ref - logps) - (ref - logps) - 1`; the mean over every counted token of the
  batch (token-level normalisation, so long completions weigh by their tokens, as TRL's
  "dapo"/"bnpo" and nanochat). One update per batch of samples has `old_logps == logps`
  (ratio 1: plain REINFORCE with a group baseline).

  Args:
    logps: `[batch, time]` per-token log-probabilities under the policy being trained.
    old_logps: the same under the policy that sampled them (no gradient).
    advantages: `[batch]` (`group_advantages`).
    mask: `[batch, time]`, 1 on completion tokens.
    ref_logps: `[batch, time]` under the reference; needed where `beta > 0`.
    beta: the KL term's weight (0: none, nanochat's choice).
    clip, clip_high: the ratio's lower and upper margins (`clip_high` None: `clip`).

  Returns:
    `(loss, PolicyStats)`.
  """
  chex.assert_equal_shape((logps, old_logps, mask))
  chex.assert_shape(advantages, logps.shape[:1])
  if beta > 0 and ref_logps is None:
    raise ValueError("a KL term (beta > 0) needs the reference's log-probabilities "
                     "(ref_logps).")
  mask = mask.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(mask), 1.0)
  ratio = jnp.exp(logps - jax.lax.stop_gradient(old_logps))
  high = clip if clip_high is None else clip_high
  a = advantages[:, None]
  kept = jnp.minimum(ratio * a, jnp.clip(ratio, 1.0 - clip, 1.0 + high) * a)
  per_token = -kept
  kl = jnp.zeros(())
  if ref_logps is not None:
    diff = jax.lax.stop_gradient(ref_logps) - logps
    k3 = jnp.exp(diff) - diff - 1.0
    per_token = per_token + beta * k3
    kl = jnp.sum(jax.lax.stop_gradient(k3) * mask) / count
  clipped = jax.lax.stop_gradient(((ratio * a) != kept).astype(jnp.float32))
  stats = PolicyStats(kl, jnp.sum(clipped * mask) / count)
  return jnp.sum(per_token * mask) / count, stats


def group_stats(rewards: chex.Array, group_size: int) -> Dict[str, chex.Array]:
  """What a batch of rewards shows: their mean, the mean spread within a group, and the
  fraction of groups with no signal (every completion scored alike: zero advantage)."""
  groups = rewards.astype(jnp.float32).reshape(-1, group_size)
  spread = jnp.std(groups, axis=1, ddof=1)
  return {"reward": jnp.mean(groups), "reward_spread": jnp.mean(spread),
          "no_signal": jnp.mean((spread == 0).astype(jnp.float32))}

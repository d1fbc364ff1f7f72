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

import dataclasses
import functools
from typing import Dict, NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from purejax import gpt
from purejax.data import batches
from purejax.ops import kernels

DPO_LOSSES = ("sigmoid", "ipo")


def completion_logps(params: gpt.Params, tokens: chex.Array, weights: chex.Array,
                     config: gpt.GPTConfig, *, forms: Optional[kernels.Forms] = None,
                     **model_kwargs) -> Tuple[chex.Array, chex.Array]:
  """Each row's summed log-probability of its weighted targets, and their count.

  Args:
    params: the model's.
    tokens: `[batch, time + 1]` ids: inputs `tokens[:, :-1]`, targets `tokens[:, 1:]`.
    weights: `[batch, time]`, 1 on the targets that count (a completion's tokens), 0 on
      the prompt and padding.
    config, forms: the model and how it runs.
    **model_kwargs: `gpt.forward`'s dropout arguments (`key`, `deterministic`, `dropout`).

  Returns:
    `(logps [batch], counts [batch])`: `sum_t weights * log p(target_t | tokens <= t)`,
    float32, and `sum_t weights`.
  """
  chex.assert_rank(tokens, 2)
  chex.assert_shape(weights, (tokens.shape[0], tokens.shape[1] - 1))
  picked = gpt.target_log_probs(params, tokens[:, :-1], tokens[:, 1:], config, forms=forms,
                                **model_kwargs)  # [b, t]
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
  _check_dpo(beta, label_smoothing, loss_type)
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


def _check_dpo(beta, label_smoothing, loss_type) -> None:
  if loss_type not in DPO_LOSSES:
    raise ValueError(f"unknown DPO loss {loss_type!r}; choose one of {DPO_LOSSES}.")
  if not beta > 0:
    raise ValueError(f"the DPO beta must be > 0, got {beta}.")
  if not 0 <= label_smoothing < 0.5:
    raise ValueError(f"the DPO label smoothing must be in [0, 0.5), got {label_smoothing}.")


def _sides(tokens, weights, params, config, forms, model_kwargs):
  """Both answers of each pair through the model in one batch: `(logps, counts)`, `[pairs, 2]`."""
  pairs = tokens.shape[0]
  logps, counts = completion_logps(params, tokens.reshape(2 * pairs, -1),
                                   weights.reshape(2 * pairs, -1), config, forms=forms,
                                   **model_kwargs)
  return logps.reshape(pairs, 2), counts.reshape(pairs, 2)


@dataclasses.dataclass(frozen=True)
class DPO:
  """The objective of a preference run: DPO's loss over `batches.PairBatch`es.

  A training step (`steps.train_steps(objective=DPO(...))`) calls it as it calls the
  language-model loss; the reference's log-probabilities come with the batch.

  Attributes:
    beta: the implicit reward's scale, `r = beta * (log pi - log pi_ref)`: larger keeps
      the policy nearer the reference.
    loss_type: "sigmoid" (DPO) or "ipo" (`dpo_loss`).
    label_smoothing: the chance a pair's label is wrong (conservative DPO; sigmoid only).
    sft_weight: adds this times the chosen answers' negative log-likelihood per token,
      over the batch's chosen tokens (TRL's "sft" loss type beside "sigmoid", weighted
      by `loss_weights`), which holds the chosen answers' likelihood up.
  """
  beta: float = 0.1
  loss_type: str = "sigmoid"
  label_smoothing: float = 0.0
  sft_weight: float = 0.0

  def __post_init__(self):
    _check_dpo(self.beta, self.label_smoothing, self.loss_type)
    if self.label_smoothing and self.loss_type != "sigmoid":
      raise ValueError(f"label smoothing applies to the sigmoid loss, not {self.loss_type!r}; "
                       f"drop it or use the sigmoid loss.")
    if not self.sft_weight >= 0:
      raise ValueError(f"the SFT weight must be >= 0, got {self.sft_weight}.")

  def loss_and_stats(self, params: gpt.Params, batch: batches.PairBatch,
                     config: gpt.GPTConfig, *, forms: Optional[kernels.Forms] = None,
                     **model_kwargs) -> Tuple[chex.Array, PreferenceStats, chex.Array]:
    """`(loss, PreferenceStats, the chosen answers' mean NLL per token)` of a batch.

    DPO's loss is each pair's own (`dpo_loss`), so the mean over pairs cut into equal
    microbatches is the batch's mean; the SFT term is a mean over the chosen tokens, so
    microbatches average their own means (TRL's accumulation does the same).
    """
    logps, counts = _sides(batch.tokens, batch.weights, params, config, forms, model_kwargs)
    # The chosen answers' NLL per token over the batch's chosen tokens (TRL's "sft" term).
    chosen_nll = -jnp.sum(logps[:, 0]) / jnp.maximum(jnp.sum(counts[:, 0]), 1.0)
    policy, reference = logps, batch.reference
    if self.loss_type == "ipo":  # per-token averages, as IPO's loss takes them
      counts = jnp.maximum(counts, 1.0)
      policy, reference = logps / counts, reference / counts
    value, stats = dpo_loss(policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1],
                            beta=self.beta, label_smoothing=self.label_smoothing,
                            loss_type=self.loss_type)
    if self.sft_weight:
      value = value + self.sft_weight * chosen_nll
    return value, stats, jax.lax.stop_gradient(chosen_nll)

  def __call__(self, params: gpt.Params, batch: batches.PairBatch, config: gpt.GPTConfig,
               **kwargs) -> chex.Array:
    """The batch's loss, as `steps.train_steps` and `steps.evaluate` call an objective."""
    return self.loss_and_stats(params, batch, config, **kwargs)[0]


@functools.partial(jax.jit, static_argnames=("config", "forms"))
def _pairs_logps(params, tokens, weights, config, forms):
  return _sides(tokens, weights, params, config, forms, {})


def pair_logps(params: gpt.Params, rows: np.ndarray, weights: np.ndarray,
               config: gpt.GPTConfig, *, forms: kernels.Forms, batch_size: int
               ) -> Tuple[np.ndarray, np.ndarray]:
  """Each answer's summed log-probability under `params`, and its count of targets.

  What a preference run computes once with its reference (its starting params; with
  LoRA, the base) before training, and with its policy at each evaluation.

  Args:
    rows: `[pairs, 2, block_size + 1]` ids; weights: `[pairs, 2, block_size]`.
    batch_size: pairs per forward pass (the last pass is padded to it: one program).

  Returns:
    `(logps, counts)`, `[pairs, 2]` float32 each.
  """
  pairs = rows.shape[0]
  logps, counts = np.zeros((pairs, 2), np.float32), np.zeros((pairs, 2), np.float32)
  for start in range(0, pairs, batch_size):
    take = np.arange(start, start + batch_size) % pairs  # (wraps: the pad is thrown away)
    got = _pairs_logps(params, jnp.asarray(rows[take]), jnp.asarray(weights[take]), config,
                       forms)
    end = min(start + batch_size, pairs)
    logps[start:end], counts[start:end] = (np.asarray(g)[:end - start] for g in got)
  return logps, counts


def pair_metrics(dpo: DPO, splits: Dict[str, batches.DevicePairs], batch_size: int,
                 max_pairs: int):
  """An evaluation metric (`gpt_metrics.Metric`) of a preference run: on each split's
  first `max_pairs` pairs (all of them where fewer), the chosen and rejected rewards,
  their margin, the preference accuracy, and the chosen answers' mean NLL per token
  (what DPO may lower while it widens the margin).

  Args:
    splits: `{"train": pairs, "val": pairs}`, reference log-probabilities included.
    batch_size: pairs per forward pass.

  Returns:
    `metric(params, config, forms) -> {"<split>_accuracy", "<split>_margin",
    "<split>_chosen_reward", "<split>_rejected_reward", "<split>_chosen_nll"}`.
  """
  splits = {name: batches.DevicePairs(*(np.asarray(a)[:max_pairs] for a in pairs))
            for name, pairs in splits.items()}

  def metric(params, config, forms) -> Dict[str, float]:
    values = {}
    for split, pairs in splits.items():
      logps, counts = pair_logps(params, pairs.rows, pairs.weights, config, forms=forms,
                                 batch_size=batch_size)
      ratio = logps.astype(np.float64) - pairs.reference
      if dpo.loss_type == "ipo":
        ratio = ratio / np.maximum(counts, 1.0)
      rewards = dpo.beta * ratio  # [pairs, 2]
      values.update({
          f"{split}_chosen_reward": float(np.mean(rewards[:, 0])),
          f"{split}_rejected_reward": float(np.mean(rewards[:, 1])),
          f"{split}_margin": float(np.mean(rewards[:, 0] - rewards[:, 1])),
          f"{split}_accuracy": float(np.mean(rewards[:, 0] > rewards[:, 1])),
          f"{split}_chosen_nll": float(-np.sum(logps[:, 0], dtype=np.float64)
                                       / max(float(np.sum(counts[:, 0])), 1.0))})
    return values

  return metric


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


def policy_loss(logps: chex.Array, old_logps: Optional[chex.Array], advantages: chex.Array,
                mask: chex.Array, *, ref_logps: Optional[chex.Array] = None,
                beta: float = 0.0, clip: float = 0.2, clip_high: Optional[float] = None,
                num_tokens: Optional[chex.Array] = None, kl_ratio: bool = False
                ) -> Tuple[chex.Array, PolicyStats]:
  """GRPO's loss over sampled completions' tokens, normalised by the batch's token count.

  Per token, with `ratio = exp(logps - old_logps)` and `A` its completion's advantage:
  `-min(ratio A, clip(ratio, 1 - clip, 1 + clip_high) A) + beta k3`, where
  `k3 = exp(ref - logps) - (ref - logps) - 1`; summed over every counted token of the
  batch and divided by their number (token-level normalisation, so long completions
  weigh by their tokens: TRL's default "dapo", and nanochat's). One update per batch
  of samples has `old_logps == logps` (ratio 1: REINFORCE with a group baseline).

  Args:
    logps: `[batch, time]` per-token log-probabilities under the policy being trained.
    old_logps: the same under the policy that sampled them (no gradient); None: the
      policy itself (one update per batch).
    advantages: `[batch]` (`group_advantages`).
    mask: `[batch, time]`, 1 on completion tokens.
    ref_logps: `[batch, time]` under the reference; needed where `beta > 0`.
    beta: the KL term's weight (0: none, nanochat's choice).
    clip, clip_high: the ratio's lower and upper margins (`clip_high` None: `clip`).
    num_tokens: what the sums are divided by; None: `sum(mask)`. A microbatch of a
      larger batch passes the whole batch's count (over its number of parts).
    kl_ratio: weigh each token's k3 by its ratio (`ratio * k3`, the gradient through
      both): the estimate corrected for sampling from the old policy (TRL's
      `use_bias_correction_kl`, its default). It changes the gradient even at ratio 1.

  Returns:
    `(loss, PolicyStats)`, the stats divided by `num_tokens` as the loss is.
  """
  chex.assert_equal_shape((logps, mask))
  chex.assert_shape(advantages, logps.shape[:1])
  if beta > 0 and ref_logps is None:
    raise ValueError("a KL term (beta > 0) needs the reference's log-probabilities "
                     "(ref_logps).")
  mask = mask.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(mask), 1.0) if num_tokens is None else num_tokens
  old = jax.lax.stop_gradient(logps if old_logps is None else old_logps)
  ratio = jnp.exp(logps - old)
  high = clip if clip_high is None else clip_high
  a = advantages[:, None]
  kept = jnp.minimum(ratio * a, jnp.clip(ratio, 1.0 - clip, 1.0 + high) * a)
  per_token = -kept
  kl = jnp.zeros(())
  if ref_logps is not None:
    diff = jax.lax.stop_gradient(ref_logps) - logps
    k3 = jnp.exp(diff) - diff - 1.0
    if kl_ratio:
      k3 = k3 * ratio
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

"""The jitted core of reinforcement learning: per-token log-probabilities, and one
policy update on a batch of sampled completions.

    logps = token_logps(params, rollouts.tokens, config, forms=forms)     # [n, time]
    state, metrics = policy_update(state, rollouts, config=config, optimizer=optimizer,
                                   policy=PolicySettings(beta=0.0), forms=forms)

A batch (`Rollouts`) is a group of completions per prompt, each one row of its
prompt and completion, with a weight 1 on the completion's targets; the loss is
`preference.policy_loss` (GRPO's clipped surrogate, token-level normalised, optional
k3 KL), the same for any cut of the rows into microbatches: each microbatch's sum is
divided by the whole batch's token count.
"""

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from purejax import gpt
from purejax.ops import kernels
from purejax.training.pure import parallel
from purejax.training.pure import preference
from purejax.training.pure.state import TrainState


class Rollouts(NamedTuple):
  """Sampled completions and what the update needs of them.

  Attributes:
    tokens: `[n, time + 1]` ids: a prompt, its completion, padding.
    mask: `[n, time]` float32, 1 on the completion's targets.
    advantages: `[n]` (`preference.group_advantages`).
    old_logps: `[n, time]` per-token log-probabilities under the policy that sampled
      them, for more than one update per batch (the ratio's denominator); zeros where
      unused (one update: the ratio is 1).
    ref_logps: `[n, time]` under the reference, for the KL term; zeros where unused.
  """
  tokens: chex.Array
  mask: chex.Array
  advantages: chex.Array
  old_logps: chex.Array
  ref_logps: chex.Array


@dataclasses.dataclass(frozen=True)
class PolicySettings:
  """The policy loss's settings (static in the program).

  Attributes:
    beta: the KL term's weight (0: none, and no reference is computed).
    clip, clip_high: the ratio's lower and upper margins (`clip_high` None: `clip`).
    temperature: the sampling temperature: the loss's log-probabilities are of the
      logits over it, the distribution the completions were drawn from (as TRL's).
    off_policy: the batch's `old_logps` are given (more than one update per batch);
      else the ratio is 1 and they are not read.
    kl_ratio: weigh the KL term by the ratio (`preference.policy_loss`).
  """
  beta: float = 0.0
  clip: float = 0.2
  clip_high: Optional[float] = None
  temperature: float = 1.0
  off_policy: bool = False
  kl_ratio: bool = False


def token_logps(params: gpt.Params, tokens: chex.Array, config: gpt.GPTConfig, *,
                forms: Optional[kernels.Forms] = None, temperature: float = 1.0,
                **model_kwargs) -> chex.Array:
  """`[n, time]` float32: `log p(tokens[:, t + 1] | tokens[:, :t + 1])` under the logits
  over `temperature`."""
  chex.assert_rank(tokens, 2)
  return gpt.target_log_probs(params, tokens[:, :-1], tokens[:, 1:], config, forms=forms,
                              temperature=temperature, **model_kwargs)


@functools.partial(jax.jit, static_argnames=("config", "forms", "temperature", "batch_rows"))
def batch_token_logps(params, tokens, config, forms, temperature: float = 1.0,
                      batch_rows: Optional[int] = None) -> chex.Array:
  """`token_logps` of many rows, `batch_rows` at a time (a `lax.map`; None: all at once)."""
  if batch_rows is None or batch_rows >= tokens.shape[0]:
    return token_logps(params, tokens, config, forms=forms, temperature=temperature)
  n = tokens.shape[0]
  if n % batch_rows:
    raise ValueError(f"{n} rows do not split into parts of {batch_rows}.")
  parts = tokens.reshape(n // batch_rows, batch_rows, -1)
  out = jax.lax.map(lambda t: token_logps(params, t, config, forms=forms,
                                          temperature=temperature), parts)
  return out.reshape(n, -1)


class UpdateMetrics(NamedTuple):
  """What one update reports (scalars).

  Attributes:
    loss: the policy loss.
    grad_norm: the gradient's global norm, before clipping.
    kl: the mean k3 estimate of KL(policy || reference) per completion token.
    clipped: the fraction of completion tokens whose ratio the clip held.
  """
  loss: chex.Array
  grad_norm: chex.Array
  kl: chex.Array
  clipped: chex.Array


def policy_update_fn(
    state: TrainState,
    rollouts: Rollouts,
    *,
    config: gpt.GPTConfig,
    optimizer: optax.GradientTransformation,
    policy: PolicySettings,
    forms: kernels.Forms,
    grad_accum_steps: int = 1,
    params_view: Optional[Callable[[Any], gpt.Params]] = None,
    plan: Optional[parallel.ShardingPlan] = None,
    num_tokens: Optional[chex.Array] = None,
) -> Tuple[TrainState, UpdateMetrics]:
  """One optimiser step of the policy loss over a batch of rollouts.

  Args:
    state: the policy's params (or LoRA's base and adapters), optimizer state, keys.
    rollouts: the batch; its rows are cut into `grad_accum_steps` microbatches.
    policy: the loss's settings.
    params_view: the model's params as a function of `state.params` (LoRA).
    num_tokens: the completion tokens the loss is a mean over (None: `rollouts.mask`'s):
      a batch whose rows without signal were left out (`drop_silent_groups`) still
      divides by the whole batch's count.

  Returns:
    `(state, UpdateMetrics)`.
  """
  # Each microbatch divides its sum by the whole batch's token count (times the parts,
  # which `accumulate_gradients` averages): the batch's token mean for any cut.
  if num_tokens is None:
    num_tokens = jnp.sum(rollouts.mask)
  num_tokens = jnp.maximum(num_tokens, 1.0) / grad_accum_steps

  def microbatch_loss(params, part: Rollouts, index):
    del index  # (no dropout in a policy update)
    model = params if params_view is None else params_view(params)
    logps = token_logps(model, part.tokens, config, forms=forms,
                        temperature=policy.temperature)
    value, stats = preference.policy_loss(
        logps, part.old_logps if policy.off_policy else None, part.advantages, part.mask,
        ref_logps=part.ref_logps if policy.beta > 0 else None, beta=policy.beta,
        clip=policy.clip, clip_high=policy.clip_high, num_tokens=num_tokens,
        kl_ratio=policy.kl_ratio)
    return value, stats

  (value, stats), grads = parallel.accumulate_gradients(
      microbatch_loss, state.params, rollouts, grad_accum_steps, plan=plan, has_aux=True)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = UpdateMetrics(value, optax.tree.norm(grads), stats.kl, stats.clipped)
  return state._replace(params=params, opt_state=opt_state), metrics


def drop_silent_groups(rollouts: Rollouts, group_size: int, multiple: int
                       ) -> Optional[Rollouts]:
  """The rows of the groups with signal, where the loss has no KL term: a group whose
  completions scored alike has advantages 0, so its tokens' loss is `-min(r 0, c 0) = 0`
  with no gradient, whatever the ratio; leaving its rows out changes no gradient (up to
  float rounding) and saves their forward and backward passes. The rows kept are padded
  (mask 0, advantage 0) to a multiple of `multiple`, so a batch has one of a few shapes
  (each compiles once). None: no group has signal.

  Args:
    rollouts: on the host (NumPy), groups of `group_size` consecutive rows.
  """
  advantages = np.asarray(rollouts.advantages).reshape(-1, group_size)
  kept = np.flatnonzero(np.any(advantages != 0, axis=1))
  if not len(kept):
    return None
  rows = (kept[:, None] * group_size + np.arange(group_size)).reshape(-1)
  size = -(-len(rows) // multiple) * multiple
  pad = np.concatenate([rows, np.full(size - len(rows), rows[0])])
  taken = [np.asarray(a)[pad] for a in rollouts]
  for a in taken[1:3]:  # mask and advantages: the pad rows count for nothing
    a[len(rows):] = 0
  return Rollouts(*taken)


@functools.partial(jax.jit, static_argnames=("optimizer",), donate_argnums=0)
def zero_update(state: TrainState, *, optimizer: optax.GradientTransformation) -> TrainState:
  """The optimizer's step on a zero gradient: a batch where no group has signal (its
  gradient is zero; the optimizer's moments still decay and its step counts, as they
  would through a whole update)."""
  grads = jax.tree.map(jnp.zeros_like, state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  return state._replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state)


policy_update = jax.jit(
    policy_update_fn, static_argnames=("config", "optimizer", "policy", "forms",
                                       "grad_accum_steps", "params_view", "plan"),
    donate_argnums=0)

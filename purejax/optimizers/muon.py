"""Muon: momentum orthogonalised by Newton-Schulz, for the GPT's hidden matrices.

`Muon` holds its settings and `muon` builds it (`optim.make_optimizer` by the
name "muon"): the blocks' hidden matrices (`muon_labels`) take
`muon_matrices`, every other param AdamW.
"""

import dataclasses
import functools
import math
from typing import ClassVar, List, Literal, NamedTuple, Optional, Sequence, Tuple

import chex
import jax
import jax.numpy as jnp
import optax

from purejax.optimizers import adam as adam_lib

# Muon's Newton-Schulz iteration: Keller Jordan's quintic coefficients, 5 steps.
MUON_NS_COEFFS = (3.4445, -4.7750, 2.0315)
MUON_NS_STEPS = 5
MUON, ADAMW = "muon", "adamw"

# A quintic per step, each the odd quintic `a s + b s³ + c s⁵` closest to 1 in
# the max norm over the interval the singular values lie in before it, from
# [3e-3, 1] (the greedy minimax construction of Polar Express, Amsel et al.
# 2025, computed by `minimax_coefficients(5, 3e-3)`). Singular values from 3e-3
# to 1 end in [0.80, 1.20] after 4 steps, [0.995, 1.005] after 5; Keller
# Jordan's quintic takes 5 steps to [0.68, 1.20]. Further steps take the
# classical quintic (15/8, -10/8, 3/8), whose fixed point 1 they then sit near.
MINIMAX_NS_COEFFS = (
    (8.3837, -24.7659, 18.3571), (4.0434, -3.0114, 0.5695), (3.5056, -2.6267, 0.5257),
    (2.4901, -1.8343, 0.4368), (1.9178, -1.2968, 0.3797))
CLASSICAL_NS_COEFFS = (1.875, -1.25, 0.375)
NS_COEFFICIENTS = ("keller", "minimax")


def ns_coefficients(name: str, steps: int) -> Tuple[Tuple[float, float, float], ...]:
  """The quintic `(a, b, c)` of each of `steps` Newton-Schulz steps: "keller"
  (`MUON_NS_COEFFS` at every step) or "minimax" (`MINIMAX_NS_COEFFS`' first
  `steps`, then `CLASSICAL_NS_COEFFS`)."""
  if name == "keller":
    return (MUON_NS_COEFFS,) * steps
  if name == "minimax":
    return (MINIMAX_NS_COEFFS + (CLASSICAL_NS_COEFFS,) * steps)[:steps]
  raise ValueError(f"unknown Newton-Schulz coefficients {name!r}; use one of {NS_COEFFICIENTS}.")


def minimax_coefficients(steps: int, lower: float, points: int = 2000
                         ) -> Tuple[Tuple[float, float, float], ...]:
  """Greedy minimax quintics for singular values in `[lower, 1]` (`MINIMAX_NS_COEFFS`).

  Step `k`'s `(a, b, c)` minimise `max |1 - (a s + b s³ + c s⁵)|` over the
  interval `[l_k, u_k]` (a linear program on `points` geometric and `points`
  linear samples of it); the next interval is that quintic's range there.
  Needs scipy (a dependency of jax).
  """
  import numpy as np  # pylint: disable=import-outside-toplevel
  from scipy import optimize  # pylint: disable=import-outside-toplevel
  lo, hi, coeffs = lower, 1.0, []
  for _ in range(steps):
    s = np.concatenate([np.geomspace(lo, hi, points), np.linspace(lo, hi, points)])
    powers = np.stack([s, s ** 3, s ** 5], axis=1)
    ones = np.ones((len(s), 1))
    # Variables (a, b, c, E): p(s) - 1 <= E and 1 - p(s) <= E, minimise E.
    res = optimize.linprog([0, 0, 0, 1], A_ub=np.block([[powers, -ones], [-powers, -ones]]),
                           b_ub=np.concatenate([ones[:, 0], -ones[:, 0]]),
                           bounds=[(None, None)] * 3 + [(0, None)])
    a, b, c, _ = res.x
    coeffs.append((float(a), float(b), float(c)))
    p = a * s + b * s ** 3 + c * s ** 5
    lo, hi = float(p.min()), float(p.max())
  return tuple(coeffs)


def _dotted_path(path) -> Tuple[str, ...]:
  return tuple(str(getattr(entry, "key", getattr(entry, "idx", entry))) for entry in path)


def muon_labels(params) -> chex.ArrayTree:
  """`"muon"` for the hidden matrices of the blocks, `"adamw"` for every other param.

  A hidden matrix is a dense weight `w` (`[in, out]`, or `[n_layer, in, out]`
  stacked over layers) under `blocks`, or, for LoRA's adapters
  (`{"blocks.attn.qkv.w": {"a", "b"}}`), a factor of one. Embeddings, the
  head, norms and biases are not: Muon's orthogonalised step is for the
  matrices that map one hidden vector to another.
  """
  def label(path, leaf):
    # LoRA's keys are dotted paths themselves: split them too.
    names = ".".join(_dotted_path(path)).split(".")
    is_weight = names[-1] == "w" or (names[-1] in ("a", "b") and names[-2:-1] == ["w"])
    return MUON if "blocks" in names and is_weight and jnp.ndim(leaf) >= 2 else ADAMW

  return jax.tree_util.tree_map_with_path(label, params)


def newton_schulz(x: chex.Array, steps: int = MUON_NS_STEPS, eps: float = 1e-7,
                  coeffs: Optional[Sequence[Tuple[float, float, float]]] = None) -> chex.Array:
  """Muon's orthogonalisation of each matrix `[..., m, n]`: about `U Vᵀ` of its SVD.

  Keller Jordan's quintic iteration `X <- a X + (b A + c A²) X`, `A = X Xᵀ`
  (`MUON_NS_COEFFS`, or each step's own `coeffs`), from `X / |X|_F`, on the
  wide orientation (`m <= n`); with his quintic its singular values end in
  about [0.5, 1.5], as the reference's do.
  Leading axes are batch axes: each matrix is orthogonalised alone.

  Each step multiplies `X` by a polynomial `M` of `A`, so for a wide matrix
  (`n >= 2m`) the steps run on `m x m` matrices instead: `A <- M A M`,
  `P <- M P`, and `X P`'s product once at the end, `X_5 = P X_0`. That is
  the same iteration (equal to it to float32 rounding; tested against
  optax's), at `17 m³ + 2 m² n` multiply-adds (XLA drops the last step's
  unused `A`; the first `P` is `M` itself) instead of `5 (2 m² n + m³)`: a
  third less on the blocks' `[d, 3d]` weights, 44 % less on `[d, 4d]`. The Gram
  products run at the highest precision (float32 on every platform), since
  `A` squares the conditioning.

  Args:
    x: `[..., m, n]` float32.
    steps: iterations.
    eps: keeps the normalisation finite for a zero matrix (which stays zero).
    coeffs: each step's `(a, b, c)` (`ns_coefficients`); None: Keller Jordan's.

  Returns:
    `[..., m, n]`, the orthogonalised matrices.
  """
  coeffs = ns_coefficients("keller", steps) if coeffs is None else tuple(coeffs)
  if len(coeffs) != steps:
    raise ValueError(f"{len(coeffs)} quintics for {steps} Newton-Schulz steps.")
  tall = x.shape[-2] > x.shape[-1]
  if tall:
    x = jnp.swapaxes(x, -1, -2)
  x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
  m, n = x.shape[-2:]
  mul = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
  gram = mul(x, jnp.swapaxes(x, -1, -2))  # [..., m, m], symmetric
  if n >= 2 * m:
    eye = jnp.eye(m, dtype=x.dtype)
    product = None  # the identity, never multiplied by
    for a, b, c in coeffs:
      poly = a * eye + b * gram + c * mul(gram, gram)
      product = poly if product is None else mul(poly, product)
      gram = mul(poly, mul(gram, poly))
    x = x if product is None else mul(product, x)
  else:
    for step, (a, b, c) in enumerate(coeffs):
      if step:
        gram = mul(x, jnp.swapaxes(x, -1, -2))
      x = a * x + mul(b * gram + c * mul(gram, gram), x)
  return jnp.swapaxes(x, -1, -2) if tall else x


def _shape_scale(u: chex.Array) -> float:
  return math.sqrt(max(1.0, u.shape[-1] / u.shape[-2]))


def _orthogonalise_qkv(u: chex.Array, orthogonalise: callable,
                       query_width: Optional[int] = None) -> chex.Array:
  """The fused attention projection `[..., d, q + 2 kv]` orthogonalised as its
  query, key and value matrices, each alone and each scaled by Keller Jordan's rule
  (`_shape_scale`). The queries are `query_width` wide (`n_head * head_dim`, the
  output projection's input); None: `d`, as when the heads fill the width."""
  d, width = u.shape[-2:]
  q_width = d if query_width is None else query_width
  kv = (width - q_width) // 2
  if kv == q_width:  # one batched iteration over the three matrices of one shape
    parts = jnp.stack(jnp.split(u, 3, axis=-1))
    return jnp.concatenate(list(orthogonalise(parts) * _shape_scale(parts)), axis=-1)
  q, k, v = jnp.split(u, (q_width, q_width + kv), axis=-1)
  k, v = orthogonalise(jnp.stack([k, v])) * _shape_scale(k)
  return jnp.concatenate([orthogonalise(q) * _shape_scale(q), k, v], axis=-1)


def is_fused_qkv(path: Tuple[str, ...], u: chex.Array) -> bool:
  """Whether `path` names the attention's fused query/key/value weight (not an adapter's)."""
  return path[-2:] == ("qkv", "w") and u.ndim >= 2 and u.shape[-1] > u.shape[-2]


def scale_by_newton_schulz(steps: int = MUON_NS_STEPS, split_qkv: bool = True,
                           coeffs: str = "keller") -> optax.GradientTransformation:
  """Each update matrix `[..., in, out]` orthogonalised (`newton_schulz`, `steps` steps)
  and scaled by `sqrt(max(1, out / in))`, Keller Jordan's rule for Muon.

  With `split_qkv`, the attention's fused `qkv` weight is its query, key and
  value matrices, each orthogonalised and scaled alone (square or tall, so
  by 1, unless the heads are wider than the model: Gemma's queries), as
  nanochat and modded-nanogpt do with theirs; False treats it as
  one `[d, 3d]` matrix. LoRA's factors are orthogonalised whole. `coeffs`
  names each step's quintic (`ns_coefficients`).
  """
  quintics = ns_coefficients(coeffs, steps)
  orthogonalise = functools.partial(newton_schulz, steps=steps, coeffs=quintics)

  def update(updates, state, params=None):
    del params
    # The queries' width is the output projection's input (`attn.proj.w`), which a
    # head size apart from the width (Gemma) makes other than the model's width.
    query_widths = {}

    def record(path, u):
      names = _dotted_path(path)
      if names[-3:] == ("attn", "proj", "w") and jnp.ndim(u) >= 2:
        query_widths[names[:-2]] = u.shape[-2]

    jax.tree_util.tree_map_with_path(record, updates)

    def scale(path, u):
      names = _dotted_path(path)
      if split_qkv and is_fused_qkv(names, u):
        return _orthogonalise_qkv(u, orthogonalise, query_widths.get(names[:-2]))
      return orthogonalise(u) * _shape_scale(u)

    return jax.tree_util.tree_map_with_path(scale, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


class WarmedTraceState(NamedTuple):
  """`nesterov_warmed_trace`'s state: steps taken and the momentum buffers."""
  count: chex.Array
  trace: optax.Params


def nesterov_warmed_trace(momentum: chex.Numeric, warmup_iters: int, start: float
                          ) -> optax.GradientTransformation:
  """`optax.trace(decay, nesterov=True)` whose decay rises linearly from `start` to
  `momentum` over the first `warmup_iters` steps, then stays (modded-nanogpt's and
  nanochat's Muon momentum warmup: 0.85 to 0.95 over 300 steps).

  At step `t` the decay is `b = start + min(t / warmup_iters, 1) (momentum - start)`;
  the buffer becomes `m = g + b m` and the update `g + b m`, as `optax.trace`'s.
  """
  def init(params):
    return WarmedTraceState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    del params
    frac = jnp.minimum(state.count / warmup_iters, 1.0)
    decay = start + frac * (momentum - start)
    step = lambda g, m: g + decay * m
    trace = jax.tree.map(step, updates, state.trace)
    return jax.tree.map(step, updates, trace), WarmedTraceState(state.count + 1, trace)

  return optax.GradientTransformation(init, update)


def muon_matrices(learning_rate: optax.ScalarOrSchedule, momentum: chex.Numeric,
                  weight_decay: chex.Numeric, decay_mask_fn: Optional[callable] = None,
                  ns_steps: int = MUON_NS_STEPS, momentum_warmup_iters: int = 0,
                  momentum_start: float = 0.85, split_qkv: bool = True,
                  ns_coeffs: str = "keller") -> optax.GradientTransformation:
  """Muon for a pytree of matrices `[..., in, out]`.

  Each matrix's Nesterov momentum (`momentum`; `optax.trace`, which is Muon's
  reference form `lerp(g, lerp(buf, g, 1 - beta), beta)` times `1 / (1 - beta)`,
  a scale the orthogonalisation removes; with `momentum_warmup_iters`, the
  momentum rises from `momentum_start` over those steps,
  `nesterov_warmed_trace`) is orthogonalised and scaled by
  `scale_by_newton_schulz` (`ns_steps` steps of `ns_coeffs`' quintics,
  `split_qkv`; so `learning_rate` means what it means in Muon's reference and
  in modded-nanogpt), decayed by `weight_decay` times the
  rate (where `decay_mask_fn` says, all matrices if None), and stepped by
  `learning_rate`. A stacked `[n_layer, in, out]` weight is `n_layer`
  matrices, each orthogonalised alone, never one flattened matrix.
  """
  trace = (nesterov_warmed_trace(momentum, momentum_warmup_iters, momentum_start)
           if momentum_warmup_iters else optax.trace(decay=momentum, nesterov=True))
  return optax.chain(
      trace,
      scale_by_newton_schulz(ns_steps, split_qkv, ns_coeffs),
      optax.add_decayed_weights(weight_decay, mask=decay_mask_fn),
      optax.scale_by_learning_rate(learning_rate))


@dataclasses.dataclass(frozen=True)
class Muon:
  """Muon's settings: those of the blocks' hidden matrices, and AdamW's for the rest.

  Attributes:
    learning_rate: the matrices' peak rate, on the run's schedule's shape (Keller
      Jordan's Muon default, 0.02, for updates scaled by `sqrt(max(1, out / in))`).
    momentum: the matrices' Nesterov momentum.
    weight_decay: decoupled decay of the matrices, multiplied by their rate as
      Muon's reference does (default 0, as there).
    ns_steps: Newton-Schulz steps of each orthogonalisation (`newton_schulz`; 5,
      the reference's).
    ns_coeffs: the steps' quintics (`ns_coefficients`): "keller" (Keller
      Jordan's, the reference's) or "minimax" (Polar Express's construction: as
      close to orthogonal in 4 steps as Keller Jordan's in 5).
    momentum_warmup_iters: steps over which the momentum rises linearly from
      `momentum_start` to `momentum` (0: none, as Muon's reference; modded-nanogpt
      and nanochat: 300).
    momentum_start: that warmup's first momentum (0.85, theirs).
    split_qkv: orthogonalise the attention's fused query/key/value weight as
      its three matrices, as nanochat and modded-nanogpt (whose projections are
      separate) do; False: as one `[d, 3d]` matrix.
    adamw: the AdamW that trains every other param (embeddings, head, norms,
      biases), on the run's learning rate.
  """
  PREFIX: ClassVar[str] = "muon_"
  HYPERPARAMS: ClassVar[Tuple[str, ...]] = ("learning_rate", "momentum", "weight_decay")
  learning_rate: float = 0.02
  momentum: float = 0.95
  weight_decay: float = 0.0
  ns_steps: int = MUON_NS_STEPS
  momentum_warmup_iters: int = 0
  momentum_start: float = 0.85
  split_qkv: bool = True
  ns_coeffs: Literal[NS_COEFFICIENTS] = "keller"
  adamw: adam_lib.AdamW = adam_lib.AdamW()

  def check(self) -> None:
    self.adamw.check()
    if not (self.learning_rate > 0 and 0 <= self.momentum < 1 and self.weight_decay >= 0):
      raise ValueError(f"Muon needs `muon_learning_rate` > 0, `muon_momentum` in [0, 1) and "
                       f"`muon_weight_decay` >= 0; got {self.learning_rate}, "
                       f"{self.momentum} and {self.weight_decay}.")
    if self.ns_coeffs not in NS_COEFFICIENTS:
      raise ValueError(f"unknown `muon_ns_coeffs` {self.ns_coeffs!r}; use one of "
                       f"{NS_COEFFICIENTS}.")
    if not (isinstance(self.ns_steps, int) and self.ns_steps >= 1):
      raise ValueError(f"`muon_ns_steps` must be an integer >= 1, got {self.ns_steps!r}.")
    if self.momentum_warmup_iters < 0 or not 0 <= self.momentum_start < 1:
      raise ValueError(f"`muon_momentum_warmup_iters` must be >= 0 and `muon_momentum_start` "
                       f"in [0, 1); got {self.momentum_warmup_iters} and "
                       f"{self.momentum_start}.")

  def describe(self) -> List[str]:
    parts = [f"lr {self.learning_rate:g}", f"momentum {self.momentum:g}"]
    if self.weight_decay:
      parts.append(f"weight decay {self.weight_decay:g}")
    if self.ns_steps != MUON_NS_STEPS:
      parts.append(f"{self.ns_steps} Newton-Schulz steps")
    if self.ns_coeffs != "keller":
      parts.append(f"{self.ns_coeffs} quintics")
    if not self.split_qkv:
      parts.append("qkv as one matrix")
    if self.momentum_warmup_iters:
      parts.append(f"momentum from {self.momentum_start:g} over "
                   f"{self.momentum_warmup_iters} steps")
    return [f"({', '.join(parts)}) on the blocks' matrices; adamw on the rest"] + (
        self.adamw.describe())


def muon(learning_rate: optax.Schedule, settings: Muon, *, peak_learning_rate: chex.Numeric,
         decay_mask_fn: Optional[callable] = None, **unused) -> optax.GradientTransformation:
  """Muon (`muon_matrices`) on the blocks' hidden matrices (`muon_labels`), AdamW
  (`settings.adamw`, `decay_mask_fn` choosing what decays) on the rest, each group with
  its own numbers, both on `learning_rate`'s shape: the matrices' rate is the schedule
  scaled by `settings.learning_rate / peak_learning_rate`.

  Not `optax.contrib.muon`: its AdamW group would take Muon's Nesterov flag
  (NAdam, where the references use Adam) and decay every non-matrix param
  (norms and biases too), and it labels params by rank, which sends the
  blocks' stacked `[n_layer, dim]` norm scales to Muon. Nor its
  `scale_by_muon`: its iteration costs half as much again as `newton_schulz`
  on the blocks' wide weights (a 1.42x step of AdamW's where this one is 1.26x, in CPU time on
  nanoGPT's CPU recipe), and it bias-corrects the momentum, which the
  reference does not.

  Args:
    learning_rate: the run's schedule.
    settings: Muon's.
    peak_learning_rate: the schedule's peak (the run's learning rate).
    decay_mask_fn: which params AdamW decays.

  Raises:
    ValueError (at `init`): the params hold no hidden matrices of blocks.
  """
  ratio = settings.learning_rate / peak_learning_rate

  def labels(params):
    tree = muon_labels(params)
    if MUON not in jax.tree.leaves(tree):
      raise ValueError("the optimizer muon found no hidden matrices to orthogonalise (dense "
                       "weights `w` under the GPT's `blocks`); use adamw for this model.")
    return tree

  matrices = muon_matrices(lambda step: learning_rate(step) * ratio, settings.momentum,
                           settings.weight_decay, decay_mask_fn, settings.ns_steps,
                           settings.momentum_warmup_iters, settings.momentum_start,
                           settings.split_qkv, settings.ns_coeffs)
  rest = adam_lib.adamw(learning_rate, settings.adamw, decay_mask_fn=decay_mask_fn)
  return optax.partition({MUON: matrices, ADAMW: rest}, labels)

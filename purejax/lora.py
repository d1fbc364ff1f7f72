"""LoRA: low-rank adapters as a transform of a params pytree.

    adapters = lora.init(params, rank=8, targets=lora.ATTENTION_AND_MLP, key=key)
    merged = lora.merge(params, adapters, alpha=16.0)     # W + (alpha / rank) A B
    value = gpt.loss(lora.merge(frozen, adapters, alpha), x, y, config)
    grads = jax.grad(lambda a: gpt.loss(lora.merge(frozen, a, alpha), x, y, config))(adapters)

A targeted dense weight `W` `[..., d_in, d_out]` gets two factors, `A`
`[..., d_in, rank]` (random, small) and `B` `[..., rank, d_out]` (zeros, so
training starts from the base model exactly), stacked on the same leading
axes as `W` (the `[n_layer]` axis of a GPT's blocks). The adapters are a
pytree of their own, `{path: {"a": A, "b": B}}`, so an optimizer given only
them keeps state only for them, and `jax.grad` with respect to them never
forms a gradient of the base weights.

The model's forward is left as it is: `merge` returns the params it reads,
with `W + (alpha / rank) A B` in place of each targeted weight. The same
`merge` folds the adapters in for export, so every weight format that takes
a model's params takes a LoRA fine-tune. Merging costs one `[d_in, d_out]`
matmul per weight per step, small beside the batch's matmuls with it
(`batch * time` rows against `rank`).

Targets are patterns over the weights' pytree paths written with dots
(`"blocks.attn.qkv.w"`), matched with `fnmatch` (`*` matches any characters,
dots included), so one list covers any model whose dense weights are named
alike: `ATTENTION_AND_MLP` takes a GPT's `attn.qkv`, `attn.proj`, `mlp.fc`,
`mlp.proj` and the attention and SwiGLU projections of Llama-style blocks.
"""

import dataclasses
import fnmatch
from typing import Any, Dict, Optional, Sequence, Tuple

import chex
import jax
import jax.numpy as jnp

from purejax.ops import quant
from purejax.ops.matmul import LowRankWeight


def _weights(params):
  """`[(path, leaf)]` of `params`, a quantized matrix one leaf (QLoRA's base)."""
  return jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))[0]

Params = Dict[str, Any]
Adapters = Dict[str, Dict[str, chex.Array]]

# The matrices of attention and the MLP in the GPT's blocks and in Llama-style
# ones (separate q/k/v/o projections, SwiGLU's gate/up/down); embeddings, norms
# and biases are never matched (they are not `w` of a dense layer).
ATTENTION = ("*attn.*.w",)
ATTENTION_AND_MLP = ("*attn.*.w", "*mlp.*.w")


def _dotted(path) -> str:
  """`"blocks.attn.qkv.w"` for the pytree path of `params["blocks"]["attn"]["qkv"]["w"]`."""
  return ".".join(str(getattr(entry, "key", getattr(entry, "idx", entry))) for entry in path)


def target_paths(params: Params, targets: Sequence[str]) -> Tuple[str, ...]:
  """Dotted paths of the weights in `params` that `targets` match, in tree order.

  Args:
    params: a model's params (nested dicts of arrays).
    targets: `fnmatch` patterns over dotted paths, e.g. `("*attn.qkv.w",)`.

  Returns:
    The matched paths, each a dense layer's weight `w` `[..., d_in, d_out]`.

  Raises:
    ValueError: no weight matches, or a pattern matches something else (a
      bias, a norm's scale, an embedding), which has no low-rank form here.
  """
  if isinstance(targets, str):
    targets = tuple(t for t in targets.split(",") if t)
  matched = []
  for path, leaf in _weights(params):
    name = _dotted(path)
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in targets):
      if not name.endswith(".w") or leaf.ndim < 2:
        # Stacked biases and norm scales are [n_layer, dim]: the name tells them apart.
        raise ValueError(f"LoRA target {name} is not a dense layer's weight matrix (`w`); "
                         f"narrow the lora targets to dense weights (e.g. *attn.*.w).")
      matched.append(name)
  if not matched:
    names = [_dotted(p) for p, leaf in _weights(params)
             if _dotted(p).endswith(".w")]
    raise ValueError(f"LoRA targets {list(targets)} match no weight matrix; the params' "
                     f"matrices are {names[:8]}.")
  return tuple(matched)


def init(params: Params, rank: int, targets: Sequence[str], key: chex.PRNGKey, *,
         dtype=jnp.float32) -> Adapters:
  """Adapters for the weights of `params` that `targets` match.

  `A` is drawn from N(0, 1/d_in) (the scale of a fresh dense layer's input
  projection), `B` is zeros: `merge(params, init(...), alpha)` equals
  `params` at first, exactly.

  Args:
    params: the base model's params.
    rank: the adapters' rank r (>= 1, below both sides of every target).
    targets: `fnmatch` patterns over dotted paths (`target_paths`).
    key: PRNG key of the `A` factors; each target gets its own.
    dtype: the adapters' dtype.

  Returns:
    `{dotted path: {"a": [..., d_in, rank], "b": [..., rank, d_out]}}`, the
    leading axes those of the weight (e.g. `[n_layer]`).
  """
  if not isinstance(rank, int) or rank < 1:
    raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}.")
  paths = target_paths(params, targets)
  weights = _weights_by_path(params)
  adapters = {}
  for path, path_key in zip(paths, jax.random.split(key, len(paths))):
    w = weights[path]
    *lead, d_in, d_out = w.shape
    if rank >= min(d_in, d_out):
      raise ValueError(f"LoRA rank {rank} is not below {path}'s sides {d_in}x{d_out}; "
                       f"choose a smaller rank.")
    a = jax.random.normal(path_key, (*lead, d_in, rank), dtype) / jnp.sqrt(d_in).astype(dtype)
    adapters[path] = {"a": a, "b": jnp.zeros((*lead, rank, d_out), dtype)}
  return adapters


def _weights_by_path(params: Params) -> Dict[str, chex.Array]:
  return {_dotted(path): leaf for path, leaf in _weights(params)}


def rank_of(adapters: Adapters) -> int:
  """The adapters' rank r (the last axis of every `A`)."""
  ranks = {ab["a"].shape[-1] for ab in adapters.values()}
  if len(ranks) != 1:
    raise ValueError(f"adapters of mixed ranks {sorted(ranks)}; make them with one lora.init.")
  return ranks.pop()


def merge(params: Params, adapters: Adapters, alpha: float) -> Params:
  """`params` with each adapted weight replaced by `W + (alpha / rank) A B`.

  A pure function of both trees: differentiate it with respect to `adapters`
  to train them, or call it once to fold them in for export.

  Args:
    params: the base params.
    adapters: from `init` over params of the same structure.
    alpha: LoRA's scale; the update is scaled by `alpha / rank`, so changing
      the rank keeps the learning rate's meaning.

  Returns:
    Params of `params`' structure, shapes and dtypes (an adapted quantized weight
    merges into a float32 matrix).

  Raises:
    ValueError: an adapter names a weight `params` lacks, or its shape does
      not fit the weight.
  """
  is_adapted = lambda x: isinstance(x, LowRankWeight)
  return jax.tree.map(lambda w: w.merged() if is_adapted(w) else w,
                      low_rank(params, adapters, alpha), is_leaf=is_adapted)


def _check_fits(params: Params, adapters: Adapters) -> None:
  """Raises ValueError unless every adapter names a weight of `params` of its shape."""
  weights = _weights_by_path(params)
  for path, ab in adapters.items():
    if path not in weights:
      raise ValueError(f"the adapters adapt {path}, which the params lack; pass the "
                       f"params the adapters were made for.")
    w = weights[path]
    if ab["a"].shape[:-1] != w.shape[:-1] or ab["b"].shape[-1] != w.shape[-1]:
      raise ValueError(f"adapter of {path} is {ab['a'].shape} x {ab['b'].shape}, which "
                       f"does not fit the weight {w.shape}; pass the params the adapters "
                       f"were made for.")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """A LoRA fine-tune's adapters.

  Attributes:
    rank: the adapters' rank r.
    alpha: the update is scaled by `alpha / rank`; None: `rank` (scale 1).
    targets: `fnmatch` patterns of the adapted weights (`target_paths`).
  """
  rank: int
  alpha: Optional[float] = None
  targets: Tuple[str, ...] = ATTENTION_AND_MLP

  def __post_init__(self):
    if not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}.")
    if self.alpha is not None and not self.alpha > 0:
      raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}.")
    if isinstance(self.targets, str) or not self.targets:
      raise ValueError(f"LoRA targets must be a non-empty tuple of patterns, got "
                       f"{self.targets!r}.")

  @property
  def scale_alpha(self) -> float:
    return float(self.rank if self.alpha is None else self.alpha)


@dataclasses.dataclass(frozen=True)
class View:
  """The model's params seen through trainable adapters: a training step's `params_view`.

  A LoRA run trains the pytree `{"base": params, "adapters": adapters}`
  (`trainable`); the model reads `View(alpha)(tree)`: the base behind
  `stop_gradient`, each adapted weight a `LowRankWeight`, which the
  dense layers apply as `x @ W + (alpha / rank) (x @ A) @ B` without
  forming the sum. The frozen weights then get no gradient product at all
  (merging first, `W + s A B`, would compute a whole `[d_in, d_out]`
  gradient per weight only to project it onto `A` and `B`). Hashable, so it
  can be a static jit argument.
  """
  alpha: float

  def __call__(self, tree: Params) -> Params:
    return low_rank(jax.lax.stop_gradient(tree["base"]), tree["adapters"], self.alpha)


def low_rank(params: Params, adapters: Adapters, alpha: float) -> Params:
  """`params` with each adapted weight a `LowRankWeight(W, A, B, alpha / rank)`.

  The same function as `merge(params, adapters, alpha)` (up to float
  rounding), in the form a training step differentiates cheaply (`View`).
  """
  if not adapters:
    return params
  scale = alpha / rank_of(adapters)
  _check_fits(params, adapters)

  def adapted(path, w):
    ab = adapters.get(_dotted(path))
    return w if ab is None else LowRankWeight(w, ab["a"], ab["b"], scale)

  return jax.tree_util.tree_map_with_path(
      adapted, params, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))


def trainable(params: Params, adapters: Adapters) -> Params:
  """`{"base": params, "adapters": adapters}`: what a LoRA run's state holds (`View`)."""
  return {"base": params, "adapters": adapters}


def num_params(adapters: Adapters) -> int:
  """Number of trainable adapter values."""
  return sum(x.size for x in jax.tree.leaves(adapters))

"""The few operations whose best form depends on the backend, and the one place that chooses.

    forms = select("cpu", remat="full")           # the CPU's forms, one overridden
    y = matmul.matmul(x, w, compute_dtype=jnp.bfloat16, forms=forms)  # bf16 products
    loss = loss.head_cross_entropy(x, table, labels, chunk_rows=forms.loss_chunk_rows)

Model files call these and read as the math; which form runs is decided by
`select(platform, **overrides)` alone, from measurements cited next to
each choice, and travels as one `Forms` value (the execution options: how a
model runs, never what it computes). `select` runs once, at the entry points
a user calls (the command lines, `gpt_loop.train_gpt` and `evaluate_gpt`, and
`gpt.forward`, `gpt.loss`, `engine.generate` when given no forms); every
function below them takes the `Forms` as an argument
(`tests/test_architecture.py` keeps `select` to those modules). Every form
has a plain reference form that the tests compare it with on CPU (values
and gradients), so a fast form can never quietly compute something else;
cuDNN's attention, which runs only on NVIDIA GPUs, is checked by lowering
its program for CUDA instead (`tests/test_gpu_lowering.py`). The attention
forms live in `purejax/ops/attention.py`, the products in `matmul.py` and the
losses in `loss.py`; `select` picks among their forms too.
"""

import dataclasses
from typing import Any, Optional

import jax

from purejax.ops.matmul import LOW_RANK_OUTPUT

ATTENTION_FORMS = ("plain", "blocked", "xla", "cudnn")
MATMUL_BACKWARD_FORMS = ("plain", "row_major")
MATMUL_OUTPUT_FORMS = ("float32", "compute")
LOSS_LOGITS_FORMS = ("float32", "compute")
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # The products' outputs; a low-rank product (`LowRankWeight`) counts as one.
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(LOW_RANK_OUTPUT)),
    # "full", with the saved block input in the compute dtype (`remat`).
    "full_compute_dtype": jax.checkpoint_policies.nothing_saveable,
}
# Platform names as devices and `jax.default_backend()` spell them -> select's.
_PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


@dataclasses.dataclass(frozen=True)
class Forms:
  """How a model runs: every execution option that changes speed, not the math.

  Hashable, so it is a static argument of the jitted entry points. A model's
  config holds its math only; two runs with the same config and different
  forms compute the same function (exactly, or to float rounding where a
  form reorders sums), so a run may resume with other forms. One caveat:
  with attention dropout, the "blocked" form draws its masks per query
  block, so switching to or from it continues with other (equally
  distributed) masks. `Forms()` is the plain reference form of everything;
  `select` gives a platform's.

  Attributes:
    attention: causal attention in training and evaluation (`ATTENTION_FORMS`,
      see `purejax/ops/attention.py`).
    attn_block: queries per block of the "blocked" attention form.
    matmul_backward: "row_major" writes the transposed operands of the
      low-precision gradient products out row-major and fences them with an
      optimisation barrier; "plain" uses ordinary transposes.
    matmul_output: the dtype of a low-precision product's output and of
      its input's gradient (`MATMUL_OUTPUT_FORMS`): "float32", or "compute"
      rounds them to the compute dtype, as PyTorch's autocast does, so the
      elementwise work between products moves half the bytes. The output
      head's logits (see `loss_logits`) and the weights' gradients stay
      float32 either way.
    remat: what each block keeps for the backward pass (`REMAT_POLICIES`):
      "none" stores every activation; "full" stores only the block's input
      and recomputes the rest; "full_compute_dtype" stores that input in
      the compute dtype (bf16: half the bytes; the forward is unchanged,
      the backward recomputes from the rounded input); "dots" stores the
      matmul outputs and recomputes the cheap elementwise ops.
    scan_layers: run the blocks as one `lax.scan` (compile time flat in
      depth); False unrolls them, which compiles `n_layer` copies.
    loss_chunk_rows: the output head and cross-entropy run this many rows at
      a time when the logits would exceed `loss_chunk_min_logits` elements
      (None: never chunk).
    loss_chunk_min_logits: see `loss_chunk_rows`.
    noise_ahead: sampling draws each scan's Gumbel noise in one batch before
      the scan, instead of once per token inside it.
    loss_logits: the dtype the low-precision output head writes its logits in
      (`LOSS_LOGITS_FORMS`): "float32", or "compute", as PyTorch's autocast
      writes them; the loss reads them into float32 for its exponentials and
      sums either way. In chunks, "compute" halves the bytes of the loss's
      three passes over each chunk's `[rows, vocab]` logits (written by the
      head, read by the logsumexp and by the gradient).
    recompute_activation: the MLP's activation keeps only its input (the
      first product's output, kept anyway) for the backward pass, which
      recomputes the rest (GELU's `tanh`) in its own elementwise pass: the
      forward writes one `[batch, time, hidden]` array less and the backward
      reads one less. Under a remat that recomputes the block ("full",
      "full_compute_dtype", "dots") the activation is recomputed already,
      and this only adds a second recompute.
  """
  attention: str = "plain"
  attn_block: int = 64
  matmul_backward: str = "plain"
  matmul_output: str = "float32"
  remat: str = "none"
  scan_layers: bool = True
  loss_chunk_rows: Optional[int] = None
  loss_chunk_min_logits: int = 1 << 26
  noise_ahead: bool = False
  loss_logits: str = "float32"
  recompute_activation: bool = False

  def __post_init__(self):
    for name, allowed in (("attention", ATTENTION_FORMS),
                          ("matmul_backward", MATMUL_BACKWARD_FORMS),
                          ("matmul_output", MATMUL_OUTPUT_FORMS),
                          ("loss_logits", LOSS_LOGITS_FORMS),
                          ("remat", tuple(REMAT_POLICIES))):
      if getattr(self, name) not in allowed:
        raise ValueError(f"Forms.{name}={getattr(self, name)!r} is not one of {allowed}.")
    for name in ("attn_block", "loss_chunk_min_logits"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ValueError(f"Forms.{name} must be a positive integer, got "
                         f"{getattr(self, name)!r}.")
    if self.loss_chunk_rows is not None and (not isinstance(self.loss_chunk_rows, int)
                                             or self.loss_chunk_rows < 1):
      raise ValueError(f"Forms.loss_chunk_rows must be None or a positive integer, got "
                       f"{self.loss_chunk_rows!r}.")

  def describe(self) -> str:
    """One short line for a run's log."""
    attention = (f"blocked/{self.attn_block}" if self.attention == "blocked"
                 else self.attention)
    chunks = f"{self.loss_chunk_rows} rows" if self.loss_chunk_rows else "off"
    return (f"attention {attention}, remat {self.remat}, "
            f"{'scanned' if self.scan_layers else 'unrolled'} layers, "
            f"matmul backward {self.matmul_backward}, matmul output {self.matmul_output}, "
            f"loss chunks {chunks}, loss logits {self.loss_logits}, "
            f"noise {'ahead' if self.noise_ahead else 'per token'}, "
            f"activation {'recomputed' if self.recompute_activation else 'saved'}")

  def loss_chunk(self, rows: int, vocab: int) -> Optional[int]:
    """Rows per chunk of the head and loss for `rows` x `vocab` logits, or None."""
    if self.loss_chunk_rows and rows * vocab >= self.loss_chunk_min_logits:
      return self.loss_chunk_rows
    return None


def select(platform: Optional[str] = None, **overrides) -> Forms:
  """The forms for `platform`, with `overrides` for any of them.

  Args:
    platform: "cpu", "gpu" (or "cuda", "rocm") or "tpu"; None: JAX's default
      backend. Entry points pass the platform their arrays live on
      (`platform_of`).
    **overrides: `Forms` fields to set; a value of None or "auto" keeps the
      platform's choice (so command-line defaults can say "auto");
      `loss_chunk_rows=0` turns chunking off.

  CPU: attention in query blocks, row-major gradient products, noise drawn
  ahead, remat "dots". GPU: cuDNN's attention, matmul outputs in the compute
  dtype, layers unrolled without remat (scanned: "full_compute_dtype"), the
  head and loss in chunks of 2048 rows, the MLP's activation recomputed. The
  TPU takes the GPU's forms except attention, "xla" (cuDNN is NVIDIA's). Each
  choice and its measurement: docs/performance.md, "Why each platform's forms".
  """
  name = platform or jax.default_backend()
  if name not in _PLATFORMS:
    raise ValueError(f"platform={name!r} is not one of {sorted(_PLATFORMS)}.")
  platform = _PLATFORMS[name]
  fields = {f.name for f in dataclasses.fields(Forms)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"select: {unknown} are not Forms fields; choose among {sorted(fields)}.")
  given = {k: v for k, v in overrides.items() if v is not None and v != "auto"}
  if given.get("loss_chunk_rows") == 0:
    given["loss_chunk_rows"] = None
  if platform == "cpu":
    base = dict(attention="blocked", matmul_backward="row_major", noise_ahead=True,
                remat_scanned="dots", remat_unrolled="dots")
  else:
    base = dict(attention="cudnn" if platform == "gpu" else "xla", matmul_backward="plain",
                noise_ahead=False, remat_scanned="full", remat_unrolled="none",
                loss_chunk_rows=2048)
    if platform == "gpu":  # measured on a GPU only
      base.update(matmul_output="compute", remat_scanned="full_compute_dtype",
                  scan_layers=False)
  scanned, unrolled = base.pop("remat_scanned"), base.pop("remat_unrolled")
  base["remat"] = scanned if given.get("scan_layers", base.get("scan_layers", True)) else unrolled
  if platform == "gpu":  # where no remat recomputes the block already
    base["recompute_activation"] = given.get("remat", base["remat"]) == "none"
  if given.get("attention") == "cudnn" and platform != "gpu":
    raise ValueError(f"attention='cudnn' runs on NVIDIA GPUs only, not on {platform!r}; "
                     f"choose among {ATTENTION_FORMS[:3]} there.")
  return Forms(**{**base, **given})


def platform_of(*trees: Any) -> str:
  """The platform ("cpu", "gpu", "tpu") where the arrays or meshes of `trees` live.

  Reads the first leaf that knows its devices: a `jax.Array` outside a trace,
  a `jax.sharding.Mesh`, or anything with a `.mesh` (a sharding plan). Inside
  a trace, arrays know no devices; with nothing else to go by this is JAX's
  default backend.
  """
  for leaf in jax.tree.leaves(trees, is_leaf=lambda x: hasattr(x, "mesh")):
    mesh = getattr(leaf, "mesh", leaf)
    if isinstance(mesh, jax.sharding.Mesh):
      return _PLATFORMS[mesh.devices.flat[0].platform]
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      return _PLATFORMS[next(iter(leaf.devices())).platform]
  return _PLATFORMS[jax.default_backend()]


# ----------------------------------------------------------------------------
# Mixed-precision matmul


def remat(fn, forms: Forms, compute_dtype, static_argnums=()):
  """`fn(params, x, *rest) -> y` keeping for the backward pass what `forms.remat` says.

  "full_compute_dtype" saves `x` cast to `compute_dtype` (a float32
  residual stream in a bf16 run: half the bytes) and `params`; the forward
  is `fn` itself, and the backward differentiates `fn` at the saved `x`, so
  gradients differ from "full"'s by `x`'s rounding. `rest` (keys, rates)
  gets no gradient, so everything differentiated must be an argument: `fn`
  may not close over traced values. `static_argnums` as `jax.checkpoint`'s.
  """
  if forms.remat == "none":
    return fn
  if forms.remat != "full_compute_dtype":
    return jax.checkpoint(fn, policy=REMAT_POLICIES[forms.remat],
                          static_argnums=static_argnums)

  @jax.custom_vjp
  def saving_low(params, x, rest):
    return fn(params, x, *rest)

  def forward(params, x, rest):
    return fn(params, x, *rest), (params, x.astype(compute_dtype or x.dtype), rest)

  def backward(saved, g):
    params, x_low, rest = saved
    _, pullback = jax.vjp(lambda p, x: fn(p, x, *rest), params, x_low.astype(g.dtype))
    return (*pullback(g), jax.tree.map(lambda _: None, rest))

  saving_low.defvjp(forward, backward)
  return lambda params, x, *rest: saving_low(params, x, rest)

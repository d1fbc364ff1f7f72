"""The losses over a model's logits: cross-entropy, and the output head's loss in chunks.

    loss = cross_entropy(logits, labels)
    loss = head_cross_entropy(x, table, labels, compute_dtype=jnp.bfloat16,
                              chunk_rows=forms.loss_chunk(rows, vocab), forms=forms)

The models import them from here; the `kernels.Forms` they take choose whether the
head runs in chunks. Like `matmul.py`, this
module takes any object with the `Forms` fields it reads as its forms.
"""

import functools
from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp

from purejax.ops.matmul import matmul
from purejax.ops.matmul import row_major_transpose


def cross_entropy(logits: chex.Array, labels: chex.Array,
                  weights: Optional[chex.Array] = None) -> chex.Array:
  """Mean cross-entropy of integer labels under `logits`, in float32.

  Args:
    logits: `[..., num_classes]`.
    labels: integers `[...]` in `[0, num_classes)`.
    weights: optional `[...]` per-label weights: the loss is then
      `mean(weights * per-label loss)`, over every label (a weight of 0 takes
      a label out; weights of mean 1 make it the mean over the rest,
      `batches.normalized_weights`). None: the plain mean.

  Returns:
    Scalar mean loss.
  """
  chex.assert_equal_shape_prefix((logits, labels), labels.ndim)
  chex.assert_rank(logits, labels.ndim + 1)
  chex.assert_type(labels, int)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  if weights is not None:
    chex.assert_equal_shape((labels, weights))
    picked = picked * weights.astype(jnp.float32)
  return -jnp.mean(picked)


def target_log_probs(logits: chex.Array, targets: chex.Array) -> chex.Array:
  """`log p(target)` under `logits` `[..., vocab]` for integer `targets` `[...]`, in float32."""
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def head_cross_entropy(
    x: chex.Array,
    table: chex.Array,
    labels: chex.Array,
    *,
    compute_dtype=None,
    chunk_rows: Optional[int] = None,
    forms: Optional[Any] = None,
    softcap: Optional[float] = None,
    weights: Optional[chex.Array] = None,
) -> chex.Array:
  """Mean cross-entropy of `labels` under the logits `x @ table.T` of the output head `table`.

  The plain form builds the whole `[rows, vocab]` float32 logits, which at
  GPT-2's vocabulary are gigabytes per step and are read and written
  several times. With `chunk_rows`, rows run `chunk_rows` at a time in a
  `lax.scan`, and only one chunk's logits exist at once. Under
  differentiation each chunk also forms its gradients while its logits
  exist (`weight * (softmax - one_hot)` and the two products with it), so
  the head's product runs once per chunk, never again in the backward pass,
  and the rows' and table's gradients are all that is kept for it. Values and
  gradients equal the plain form's (to float rounding).

  Args:
    x: `[..., dim]` final hidden states.
    table: the output head as a `[vocab, dim]` table: the token embedding where the
      head is tied, else the untied head transposed (`gpt.head_table`).
    labels: integers `x.shape[:-1]`.
    compute_dtype: as in `matmul`.
    chunk_rows: rows per chunk, or None for the plain form. Chunks run when
      there are more rows than one chunk; the rows left over after the whole
      chunks make one shorter chunk.
    forms: forms for the matmul (default: see `matmul`).
    softcap: None, or `c`: the logits are `c * tanh(logits / c)`, in float32.
    weights: optional per-label weights `labels.shape`, as in `cross_entropy`.

  Returns:
    Scalar mean loss.
  """
  chex.assert_equal_shape_prefix((x, labels), labels.ndim)
  dim = x.shape[-1]
  rows = x.reshape(-1, dim)
  flat_labels = labels.reshape(-1)
  flat_weights = None if weights is None else weights.reshape(-1)
  n = rows.shape[0]
  spec = _ChunkSpec(chunk_rows, None if compute_dtype is None else jnp.dtype(compute_dtype),
                    forms, softcap)
  if chunk_rows is None or n <= chunk_rows:
    return cross_entropy(_logits(rows, table, spec, _head_operand(table, spec)), flat_labels,
                         flat_weights)
  return _chunked_loss_sum(rows, table, flat_labels, flat_weights, spec) / n


def head_target_log_probs(
    x: chex.Array,
    table: chex.Array,
    targets: chex.Array,
    *,
    chunk_rows: int,
    compute_dtype=None,
    forms: Optional[Any] = None,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
) -> chex.Array:
  """`log p(target)` of each target under the logits `x @ table.T` (over `temperature`),
  `chunk_rows` rows at a time: float32 `targets.shape`.

  What a preference or policy loss reads of the head: one number a token, not
  the `[rows, vocab]` logits, which at a long context are gigabytes (SmolLM2's
  49152 ids: 3.2 GB of float32 logits for 16 rows of 1024 tokens). Each chunk's
  logits are formed, read and let go, in the forward pass and again in the
  backward (`jax.checkpoint`), so one chunk's exist at a time; the recomputation
  costs one more head product. Equal to `target_log_probs` of the whole logits
  (to float rounding). Arguments as `head_cross_entropy`'s.
  """
  chex.assert_equal_shape_prefix((x, targets), targets.ndim)
  rows, labels = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
  spec = _ChunkSpec(chunk_rows, None if compute_dtype is None else jnp.dtype(compute_dtype),
                    forms, softcap)
  table_t = _head_operand(table, spec)
  table = _table_operand(table, table_t, spec)

  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
  def chunk(h, y, table, table_t):  # [chunk, dim], [chunk] -> [chunk]
    logits = _logits(h, table, spec, table_t).astype(jnp.float32)
    return target_log_probs(logits if temperature == 1.0 else logits / temperature, y)

  (rows_c, labels_c, _), (rows_r, labels_r, _) = _chunks(rows, labels, None, chunk_rows)
  _, picked = jax.lax.scan(lambda _, c: (None, chunk(*c, table, table_t)), None,
                           (rows_c, labels_c))
  picked = picked.reshape(-1)
  if rows_r.shape[0]:  # the rows that do not fill a chunk
    picked = jnp.concatenate([picked, chunk(rows_r, labels_r, table, table_t)])
  return picked.reshape(targets.shape)


def _softcap(logits: chex.Array, cap: float) -> chex.Array:
  return cap * jnp.tanh(logits / cap)


class _ChunkSpec(NamedTuple):
  """The static choices of `_chunked_loss_sum` (hashable)."""
  rows: int
  compute_dtype: Any
  forms: Optional[Any]
  softcap: Optional[float]


def _head_operand(table, spec: _ChunkSpec) -> Optional[chex.Array]:
  """A row-major `table.T` where the forms need one, made once; else None (`_logits`)."""
  low_precision = spec.compute_dtype is not None and spec.compute_dtype != jnp.float32
  if low_precision and spec.forms is not None and spec.forms.matmul_backward == "row_major":
    # `table.T` is a layout change, and XLA's CPU backend then runs the
    # low-precision product upcast: SmolLM2-135M's bf16 head forward took
    # 440-644 ms against 283-303 ms from a row-major copy. The copy is of
    # the float32 table, so that a trained table's gradient stays float32.
    return row_major_transpose(table)
  return None


def _logits(h, table, spec: _ChunkSpec, table_t=None) -> chex.Array:
  """`[rows, vocab]` logits of `h @ table.T` (`table_t`, if given, is `table.T`),
  soft-capped if `spec` says: float32, or in the compute dtype where the forms'
  `loss_logits` is "compute"."""
  # Without a row-major copy, `table.T` here, inside the chunks' loop, where it
  # is the dot's layout: taken outside, XLA's GPU compiler keeps a transposed
  # copy of the table alive across the loop (GPT-2 124M's plan: +147 MiB).
  logits = matmul(h, table.T if table_t is None else table_t, compute_dtype=spec.compute_dtype,
                  forms=spec.forms, output=getattr(spec.forms, "loss_logits", "float32"))
  if spec.softcap is None:  # GPT-2's program, untouched
    return logits
  return _softcap(logits.astype(jnp.float32), spec.softcap)


def _table_operand(table, table_t, spec: _ChunkSpec) -> chex.Array:
  """The table in the compute dtype, cast once for all the chunks (a no-op cast in
  each), where no row-major copy stands in for it. Inside the loop XLA's GPU
  compiler casts it again per chunk (GPT-2 124M: 6 x 221 MiB moved per step)."""
  low_precision = spec.compute_dtype is not None and spec.compute_dtype != table.dtype
  return table.astype(spec.compute_dtype) if low_precision and table_t is None else table


def _chunks(rows, labels, weights, size):
  """Whole chunks of `size` rows stacked for a `lax.scan`, and the rows left over."""
  whole = rows.shape[0] - rows.shape[0] % size
  split = lambda a: (None if a is None else a[:whole].reshape(whole // size, size, *a.shape[1:]),
                     None if a is None else a[whole:])
  (rows_c, rows_r), (labels_c, labels_r), (weights_c, weights_r) = map(
      split, (rows, labels, weights))
  return (rows_c, labels_c, weights_c), (rows_r, labels_r, weights_r)


def _logsumexp_one_pass(x: chex.Array) -> chex.Array:
  """`logsumexp(x, axis=-1)` of float32 `[rows, n]` in one pass over `x`.

  Each element enters as `(max, sum) = (x, 1)`, and two partial results
  combine as `(m, s1 e^(m1 - m) + s2 e^(m2 - m))`, `m = max(m1, m2)`: one
  reduction where `jax.nn.logsumexp` makes two (the max, then the sum),
  each reading the whole `[rows, vocab]` logits (GPT-2 124M: 393 MiB a chunk).
  Not differentiable; the chunked loss forms its gradient itself.
  """
  def combine(a, b):
    (m1, s1), (m2, s2) = a, b
    m = jnp.maximum(m1, m2)
    # An empty side (-inf) adds nothing, and -inf - -inf must not make a NaN.
    e1 = jnp.where(m1 == -jnp.inf, 0.0, s1 * jnp.exp(m1 - m))
    e2 = jnp.where(m2 == -jnp.inf, 0.0, s2 * jnp.exp(m2 - m))
    return m, e1 + e2

  m, s = jax.lax.reduce((x, jnp.ones_like(x)), (jnp.float32(-jnp.inf), jnp.float32(0.0)),
                        combine, (x.ndim - 1,))
  return m + jnp.log(s)


def _chunk_losses(h, y, w, table, table_t, spec):
  """A chunk's float32 logits `[chunk, vocab]`, their logsumexp and its (weighted) losses."""
  logits = _logits(h, table, spec, table_t).astype(jnp.float32)
  lse = _logsumexp_one_pass(logits)
  losses = lse - jnp.take_along_axis(logits, y[:, None], -1)[:, 0]
  return logits, lse, losses if w is None else losses * w.astype(jnp.float32)


def _chunk_loss_sum(h, y, w, table, table_t, spec):
  return jnp.sum(_chunk_losses(h, y, w, table, table_t, spec)[2])


def _chunk_loss_sum_and_grads(h, y, w, table, table_t, spec):
  """A chunk's summed loss and its gradients for `h` `[chunk, dim]` and `table`, in one pass.

  The gradient of the summed loss for the logits is `weight * (softmax -
  one_hot(label))` (times the soft-cap's `1 - tanh²`), so it is formed
  straight from the logits while they exist: the head's product runs once
  per chunk, where a rematerialised chunk would run it in the forward pass
  and again in the backward.
  """
  logits, lse, losses = _chunk_losses(h, y, w, table, table_t, spec)
  grad = jnp.exp(logits - lse[:, None]) - (jnp.arange(logits.shape[-1]) == y[:, None])
  if w is not None:
    grad = grad * w.astype(jnp.float32)[:, None]
  if spec.softcap is not None:
    grad = grad * (1.0 - jnp.square(logits / spec.softcap))
  dtype = spec.compute_dtype or jnp.result_type(h, table)
  # The two gradient products as `matmul`'s backward forms them: operands in
  # the compute dtype, float32 accumulation and outputs.
  grad, hc, tc = grad.astype(dtype), h.astype(dtype), table.astype(dtype)
  row_major = spec.forms is not None and spec.forms.matmul_backward == "row_major"
  d_h = jnp.dot(grad, tc, preferred_element_type=jnp.float32)  # [chunk, dim]
  grad_t = row_major_transpose(grad) if row_major else grad.T
  d_table = jnp.dot(grad_t, hc, preferred_element_type=jnp.float32)  # [vocab, dim]
  if row_major:  # as `matmul`'s backward: no later transpose folded into these dots
    d_h, d_table = jax.lax.optimization_barrier((d_h, d_table))
  return jnp.sum(losses), d_h, d_table


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_loss_sum(rows, table, labels, weights, spec: _ChunkSpec):
  """Summed cross-entropy of `labels` under `rows @ table.T`, `spec.rows` rows at a time."""
  (rows_c, labels_c, weights_c), rest = _chunks(rows, labels, weights, spec.rows)
  table_t = _head_operand(table, spec)
  table = _table_operand(table, table_t, spec)

  def body(total, chunk):
    return total + _chunk_loss_sum(*chunk, table, table_t, spec), None

  # Whole chunks in the scan; rows that do not fill one (an odd batch at
  # GPT-2's T=1024 and 2048-row chunks) run after it as one shorter chunk.
  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (rows_c, labels_c, weights_c))
  if rest[0].shape[0]:
    total = total + _chunk_loss_sum(*rest, table, table_t, spec)
  return total


def _chunked_loss_sum_fwd(rows, table, labels, weights, spec):
  (rows_c, labels_c, weights_c), rest = _chunks(rows, labels, weights, spec.rows)
  table_t = _head_operand(table, spec)
  table_dtype, table = table.dtype, _table_operand(table, table_t, spec)

  def body(carry, chunk):
    total, d_table = carry
    loss, d_h, d_table_chunk = _chunk_loss_sum_and_grads(*chunk, table, table_t, spec)
    return (total + loss, d_table + d_table_chunk), d_h

  # The table's gradient accumulates in float32 across the chunks; the rows'
  # gradients are stacked, one chunk each.
  init = (jnp.zeros((), jnp.float32), jnp.zeros(table.shape, jnp.float32))
  (total, d_table), d_rows = jax.lax.scan(body, init, (rows_c, labels_c, weights_c))
  d_rows = d_rows.reshape(-1, rows.shape[-1])
  if rest[0].shape[0]:
    loss, d_h, d_table_rest = _chunk_loss_sum_and_grads(*rest, table, table_t, spec)
    total, d_table = total + loss, d_table + d_table_rest
    d_rows = jnp.concatenate([d_rows, d_h])
  return total, (d_rows, d_table, jnp.zeros((0,), rows.dtype), jnp.zeros((0,), table_dtype))


def _chunked_loss_sum_bwd(spec, residuals, g):
  del spec
  d_rows, d_table, rows_like, table_like = residuals  # the empty arrays carry the dtypes
  return ((g * d_rows).astype(rows_like.dtype), (g * d_table).astype(table_like.dtype),
          None, None)


_chunked_loss_sum.defvjp(_chunked_loss_sum_fwd, _chunked_loss_sum_bwd)

"""Training across devices, hosts and microbatches, on JAX's own engine.

    plan = ShardingPlan(make_mesh(), fsdp=True)   # all devices, axis "data"
    shardings = plan.state(params)                # a NamedSharding per leaf
    params = put(params, shardings)               # global jax.Arrays, split
    step = jit_train_step(steps.train_steps_fn, plan, state.shardings(train_state, plan),
                          config=config, optimizer=optimizer, ...)

Everything here is `jax.sharding` and `jax.distributed`; the model code stays
the same pure functions. What is split, and how:

* **Data parallel** (default). A 1-D `Mesh` over every device of every
  process, axis `"data"`. Each global batch is constrained to
  `PartitionSpec("data")`; params and optimizer state are replicated, and
  XLA inserts one all-reduce of the gradients per step.
* **FSDP / ZeRO-3** (`fsdp=True`). Every leaf of the params and optimizer
  state is stored split along one dimension (`fsdp_spec`). Each step
  all-gathers the whole params for the passes, reduces the gradients back to
  shards, and each device updates only its shard.
* **Gradient accumulation** (`accumulate_gradients`): `k` microbatches of one
  global batch in a `lax.scan`, gradients reduced across devices once per step.
* **Multi-host** (`initialize_distributed`). Every process runs the same
  program on the global mesh; process `p`'s batch rows live on, and are
  sampled by, its devices. `fetch` gathers values to every process; process 0
  writes them (`is_main_process`).
"""

import dataclasses
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence

import chex
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

DATA_AXIS = "data"


# ----------------------------------------------------------------------------
# Processes


def initialize_distributed(
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
) -> None:
  """Joins this process to a multi-process run (`jax.distributed.initialize`).

  Must run before anything else touches JAX's devices. Arguments left as None
  are taken from the environment: `JAX_COORDINATOR_ADDRESS`, or a cluster JAX
  detects (SLURM, Open MPI, Kubernetes, Cloud TPU).

  Raises:
    ValueError: the arguments are inconsistent, or the cluster cannot be
      joined; the message names the arguments to set.
  """
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"`num_processes` must be >= 1, got {num_processes}.")
  if process_id is not None and num_processes is not None and not (
      0 <= process_id < num_processes):
    raise ValueError(f"`process_id` must be in [0, `num_processes={num_processes}`), "
                     f"got {process_id}.")
  try:
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  except (ValueError, TypeError, RuntimeError) as e:
    raise ValueError(
        f"could not join the multi-process run ({e}). Pass `coordinator_address=HOST:PORT`, "
        f"`num_processes` and `process_id` on every process, or run under a cluster "
        f"JAX detects.") from None


def set_cpu_devices(num_devices: int) -> None:
  """Splits this host's CPU into `num_devices` JAX devices.

  XLA's CPU backend spreads each op over every core, which scales poorly for
  the small matmuls and attention products of a small model. As separate
  devices, each core computes the loss and gradients of its own rows of the
  batch (data parallel, one gradient all-reduce per step): nanoGPT's CPU
  recipe trained 1.0-1.2x (fp32) and 1.1-1.5x (bf16) faster on 2 cores as 2
  devices (docs/performance.md, "One device per core on a CPU"). Only the CPU
  backend is affected. Call it before anything touches JAX's devices.

  Raises:
    ValueError: `num_devices < 1`, or JAX's backends have already started.
  """
  if num_devices < 1:
    raise ValueError(f"set_cpu_devices: num_devices must be >= 1, got {num_devices}.")
  try:
    jax.config.update("jax_num_cpu_devices", num_devices)
  except RuntimeError:
    raise ValueError(
        "CPU devices must be set before JAX starts its backends; call "
        "parallel.set_cpu_devices before any JAX computation.") from None


def is_main_process() -> bool:
  """True on the process that writes logs and checkpoints (process 0)."""
  return jax.process_index() == 0


def any_process(flag: bool) -> bool:
  """Whether `flag` is True on any process (a collective: call it on all)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.array([flag], np.int32))))


def check_same_on_all_processes(value: int, message: str) -> None:
  """Raises ValueError(message) unless every process passed the same `value`."""
  if jax.process_count() == 1:
    return
  values = multihost_utils.process_allgather(np.array([value], np.int64))
  if np.any(values != value):
    raise ValueError(f"{message} (values by process: {np.ravel(values).tolist()})")


# ----------------------------------------------------------------------------
# Mesh and shardings


def make_mesh(num_devices: Optional[int] = None) -> Mesh:
  """A 1-D mesh with axis `"data"` over the first `num_devices` global devices.

  Args:
    num_devices: devices to use; None means all of them (`jax.device_count()`).
      Fewer than all is only allowed in a single-process run.
  """
  available = jax.device_count()
  num_devices = available if num_devices is None else num_devices
  if not 1 <= num_devices <= available:
    raise ValueError(f"`num_devices={num_devices}` must be in [1, {available}] "
                     f"(the devices JAX sees: {jax.devices()[0].platform} x {available}).")
  if num_devices != available and jax.process_count() > 1:
    raise ValueError("`num_devices` must be left unset in a multi-process run; "
                     "every process's devices take part.")
  # Auto axes: shardings are set at the step's boundaries and on the batch,
  # and XLA's partitioner places every op in between (the model code has no
  # sharding annotations, which "Explicit" axes would require).
  return jax.make_mesh((num_devices,), (DATA_AXIS,), devices=jax.devices()[:num_devices],
                       axis_types=(jax.sharding.AxisType.Auto,))


def fsdp_spec(shape: Sequence[int], num_shards: int) -> P:
  """How FSDP splits one array: along its largest dimension divisible by `num_shards`.

  Ties go to the later dimension, so a stacked `[n_layer, n_embd]` LayerNorm
  scale splits along `n_embd` and the `lax.scan` over layers still slices
  whole layers. Arrays with no such dimension (scalars, a `[10]` bias on 4
  devices) stay replicated.
  """
  best = None
  for dim, size in enumerate(shape):
    if size % num_shards == 0 and size >= num_shards and (
        best is None or size >= shape[best]):
      best = dim
  if best is None or num_shards == 1:
    return P()
  return P(*([None] * best + [DATA_AXIS]))


def state_shardings(tree: Any, mesh: Mesh, *, fsdp: bool) -> Any:
  """A `NamedSharding` for every leaf of a params / optimizer-state pytree.

  Args:
    tree: pytree of arrays (or `jax.ShapeDtypeStruct`s).
    mesh: mesh from `make_mesh`.
    fsdp: split each leaf per `fsdp_spec`; False replicates everything.
  """
  num_shards = mesh.shape[DATA_AXIS]
  def sharding(leaf):
    spec = fsdp_spec(np.shape(leaf), num_shards) if fsdp else P()
    return NamedSharding(mesh, spec)
  return jax.tree.map(sharding, tree)


def check_batch_size(batch_size: int, mesh: Mesh, grad_accum_steps: int = 1) -> None:
  """Fails unless every device gets whole rows of every microbatch."""
  if grad_accum_steps < 1:
    raise ValueError(f"`grad_accum_steps` must be >= 1, got {grad_accum_steps}.")
  per_step = mesh.shape[DATA_AXIS] * grad_accum_steps
  if batch_size % per_step:
    raise ValueError(
        f"`batch_size={batch_size}` must be a multiple of the {mesh.shape[DATA_AXIS]} "
        f"devices x `grad_accum_steps={grad_accum_steps}` = {per_step}; try "
        f"`batch_size={max(per_step, batch_size // per_step * per_step)}`.")


def put(tree: Any, shardings: Any) -> Any:
  """Host values (the same on every process) -> global arrays with `shardings`.

  `shardings` is one sharding for all leaves, or a matching pytree.
  """
  host = jax.tree.map(np.asarray, tree)
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, host)
  return jax.device_put(host, shardings)


def fetch(tree: Any) -> Any:
  """Global arrays -> whole numpy arrays on every process (a collective)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def bytes_per_device(tree: Any) -> Dict[Any, int]:
  """Bytes of `tree`'s arrays held on each device, `{device: bytes}`."""
  held: Dict[Any, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return held


def constrain(x: Any, sharding: Optional[NamedSharding]) -> Any:
  """`with_sharding_constraint`, or nothing when `sharding` is None (one device)."""
  return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


# ----------------------------------------------------------------------------
# A training step's plan, and gradient accumulation


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
  """How a training step is spread over devices (hashable: a static jit argument).

  Attributes:
    mesh: from `make_mesh`.
    fsdp: params and optimizer state are split across devices (`state_shardings`
      with fsdp=True); False means replicated.
  """
  mesh: Mesh
  fsdp: bool = False

  @property
  def num_devices(self) -> int:
    return self.mesh.shape[DATA_AXIS]

  @property
  def batch(self) -> NamedSharding:
    """Rows of a batch (leading axis) split across the `"data"` axis."""
    return NamedSharding(self.mesh, P(DATA_AXIS))

  @property
  def replicated(self) -> NamedSharding:
    """A whole copy on every device."""
    return NamedSharding(self.mesh, P())

  def state(self, tree: Any) -> Any:
    """Shardings of a params or optimizer-state pytree under this plan."""
    return state_shardings(tree, self.mesh, fsdp=self.fsdp)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """How a run uses its devices and hosts (what `purejax.train`'s device flags set).

  Attributes:
    num_devices: devices to train on; None means every device of every process.
    fsdp: split params and optimizer state across the devices (FSDP / ZeRO-3).
    grad_accum_steps: microbatches per optimisation step.
  """
  num_devices: Optional[int] = None
  fsdp: bool = False
  grad_accum_steps: int = 1


def make_plan(config: ParallelConfig, batch_size: int) -> ShardingPlan:
  """The step's `ShardingPlan` over the devices, checked against the global batch."""
  plan = ShardingPlan(make_mesh(config.num_devices), fsdp=config.fsdp)
  check_batch_size(batch_size, plan.mesh, config.grad_accum_steps)
  return plan


def describe(plan: ShardingPlan, batch_size: int, grad_accum_steps: int) -> str:
  """One line on how a step is spread: devices, processes, params, batch split."""
  return (f"{plan.num_devices} device(s) ({jax.devices()[0].platform}, "
          f"{jax.process_count()} process(es)), params "
          f"{'split (FSDP)' if plan.fsdp else 'replicated'}, batch {batch_size} = "
          f"{plan.num_devices} devices x {grad_accum_steps} microbatches x "
          f"{batch_size // plan.num_devices // grad_accum_steps}; {jax.devices()[0].device_kind}")


def main_process_first(load: Callable[[], Any], errors=(ValueError,)) -> Any:
  """`load()` on process 0 first, then on the others.

  TFDS prepares a dataset on first use by writing into its data dir; with a
  shared dir, processes preparing at once would race. So process 0 loads
  (and prepares) first, then the others read what it wrote. An error of a
  type in `errors` on process 0 stops every process.
  """
  if jax.process_count() == 1:
    return load()
  result, error = None, None
  if is_main_process():
    try:
      result = load()
    except errors as e:  # pylint: disable=catching-non-exception
      error = e
  if any_process(error is not None):
    raise error or ValueError("process 0 could not load the data; its error says why.")
  return result if is_main_process() else load()


def jit_train_step(fn: Callable, plan: ShardingPlan, state_shardings: Any, **static
                   ) -> "StateStep":
  """`fn(state, *inputs, plan=plan, **static, **more) -> (state, metrics)` under one `jax.jit`
  with explicit shardings; `more` are further static keywords given per call (the GPT's
  call length `num_steps`), each distinct value compiled once.

  The state goes in and comes out with `state_shardings` (and is donated);
  every other input and the metrics are replicated: `steps.train_steps_fn`
  (tokens, step), `steps.train_epoch_fn` (images, labels, epoch). `fn` is the
  plain function (not already jitted). Static arguments are bound here:
  `jax.jit` takes no keywords once `in_shardings` is set, so the per-call ones
  travel as one static positional argument.
  """
  def packed(state, inputs, more):  # one argument for all inputs, whatever their number
    return fn(state, *inputs, plan=plan, **static, **dict(more))

  return StateStep(jax.jit(packed, donate_argnums=0, static_argnums=2,
                           in_shardings=(state_shardings, plan.replicated),
                           out_shardings=(state_shardings, plan.replicated)))


class StateStep(NamedTuple):
  """`step(state, *inputs, **more) -> (state, metrics)` from `jit_train_step`; `lower` as jit's."""
  jitted: Callable

  def __call__(self, state: Any, *inputs: Any, **more: Any) -> Any:
    return self.jitted(state, inputs, tuple(sorted(more.items())))

  def lower(self, state: Any, *inputs: Any, **more: Any):
    return self.jitted.lower(state, inputs, tuple(sorted(more.items())))


def accumulate_gradients(
    loss_fn: Callable[..., chex.Array],
    params: Any,
    batch: Any,
    num_microbatches: int,
    *,
    plan: Optional[ShardingPlan] = None,
    has_aux: bool = False,
):
  """Mean loss and gradient over a batch, computed `num_microbatches` rows at a time.

  The batch is cut into `num_microbatches` equal microbatches that run in a
  `lax.scan`, so activations are held for one microbatch at a time. The
  result equals one `jax.value_and_grad` over the whole batch (up to float
  rounding), because the loss is a mean over equal-sized parts.

  Under a `plan`, each device works on its rows of every microbatch, and the
  gradients cross devices once per step:

  * one microbatch: the batch is constrained to the `"data"` axis and XLA
    all-reduces the gradient. With FSDP the whole params are gathered for
    the pass and the gradient is reduced back to shards (`state_shardings`).
  * several microbatches: a `shard_map` in which each device scans its own
    rows and sums their gradients locally, then one `pmean` per step rather
    than one per microbatch. FSDP-split params are gathered once on entry,
    so during the step a device holds whole params and a whole gradient sum.

  Args:
    loss_fn: `loss_fn(params, part, index) -> scalar mean loss`, where
      `index` (int32) tells the parts apart, e.g. to fold into a dropout key:
      0 for a whole batch; otherwise distinct for every microbatch, and in
      the `shard_map` case for every (microbatch, device) pair. A part is
      one microbatch, or in the `shard_map` case one device's rows of it.
    params: the pytree to differentiate.
    batch: pytree of arrays with a leading `[batch]` axis.
    num_microbatches: how many parts; must divide the batch.
    plan: the step's `ShardingPlan`; None on one device.
    has_aux: `loss_fn` returns `(loss, aux)`, a pytree of scalars averaged over the
      microbatches as the loss is.

  Returns:
    `(mean_loss, grads)`; with `has_aux`, `((mean_loss, mean_aux), grads)`.
  """
  batch_size = jax.tree.leaves(batch)[0].shape[0]
  if batch_size % num_microbatches:
    raise ValueError(f"a batch of {batch_size} does not split into "
                     f"{num_microbatches} equal microbatches (`num_microbatches`).")
  if plan is None:
    return _scan_microbatches(loss_fn, params, batch, num_microbatches, has_aux=has_aux)
  batch = constrain(batch, plan.batch)
  if num_microbatches == 1:
    if plan.fsdp:
      # Left to itself, XLA partitions each matmul along the split weight
      # dimension and all-gathers activations instead (5x the traffic,
      # measured). Gathering the whole params for the pass keeps every matmul
      # batch-parallel; the gradients are reduced back to shards, and the
      # optimizer updates shards.
      loss_fn = _with_gathered_params(loss_fn, plan)
    return _scan_microbatches(loss_fn, params, batch, 1, has_aux=has_aux)

  def per_device(params, rows):
    # Marked as varying, the params' gradients stay per device: differentiating
    # the replicated params directly would all-reduce every microbatch's.
    params = jax.lax.pcast(params, DATA_AXIS, to="varying")
    offset = jax.lax.axis_index(DATA_AXIS)
    def part_loss(params, part, index):
      return loss_fn(params, part, index * plan.num_devices + offset)
    value, grads = _scan_microbatches(part_loss, params, rows, num_microbatches,
                                      varying=True, has_aux=has_aux)
    return jax.lax.pmean((value, grads), DATA_AXIS)

  # in_specs P(): FSDP-split params are gathered once, on entry.
  return jax.shard_map(per_device, mesh=plan.mesh, in_specs=(P(), P(DATA_AXIS)),
                       out_specs=P())(params, batch)


def _with_gathered_params(loss_fn, plan):
  def gathered_loss(params, part, index):
    return loss_fn(constrain(params, plan.replicated), part, index)
  return gathered_loss


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def value_and_grad_of_floats(loss_fn, has_aux: bool = False):
  """`jax.value_and_grad(loss_fn)` over its first argument's float leaves; its integer
  leaves (a quantized base's codes, which QLoRA never trains) are held as they are
  and get a zero gradient of their own dtype, so the gradient has the params' tree."""
  def grad_fn(params, *args):
    leaves, tree = jax.tree.flatten(params)
    floats = [x if _is_float(x) else None for x in leaves]

    def of_floats(floats, *args):
      return loss_fn(jax.tree.unflatten(tree, [f if f is not None else x
                                               for f, x in zip(floats, leaves)]), *args)

    value, grads = jax.value_and_grad(of_floats, has_aux=has_aux)(floats, *args)
    return value, jax.tree.unflatten(tree, [g if g is not None else jnp.zeros_like(x)
                                            for g, x in zip(grads, leaves)])
  return grad_fn


def _scan_microbatches(loss_fn, params, batch, num_microbatches, varying=False,
                       has_aux=False):
  grad_fn = value_and_grad_of_floats(loss_fn, has_aux=has_aux)
  if num_microbatches == 1:
    return grad_fn(params, batch, jnp.int32(0))
  # [batch, ...] -> [k, batch / k, ...]: microbatch j is the j-th block of rows.
  micro = jax.tree.map(
      lambda x: x.reshape(num_microbatches, x.shape[0] // num_microbatches, *x.shape[1:]),
      batch)

  def body(total, xs):
    index, part = xs
    value, grads = grad_fn(params, part, index)
    return jax.tree.map(jnp.add, total, (value, grads)), None

  zero_loss = jnp.zeros((), jnp.float32)
  if has_aux:  # (the aux's zeros: its shapes, from tracing one microbatch)
    aux = jax.eval_shape(loss_fn, params, jax.tree.map(lambda x: x[0], micro),
                         jnp.int32(0))[1]
    zero_loss = (zero_loss, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux))
  if varying:  # inside shard_map: each device's sum differs until the pmean
    zero_loss = jax.lax.pcast(zero_loss, DATA_AXIS, to="varying")
  zeros = (zero_loss, jax.tree.map(jnp.zeros_like, params))
  indices = jnp.arange(num_microbatches, dtype=jnp.int32)
  (total_loss, total_grads), _ = jax.lax.scan(body, zeros, (indices, micro))
  scale = 1.0 / num_microbatches
  mean = lambda g: g * scale if _is_float(g) else g  # (an integer leaf's is 0)
  if has_aux:
    return (jax.tree.map(lambda v: v * scale, total_loss), jax.tree.map(mean, total_grads))
  return total_loss * scale, jax.tree.map(mean, total_grads)

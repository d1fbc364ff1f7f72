"""A GPU's compiled program on any machine: deviceless compiles for a named card.

    devices = gpu_plan.target_devices("h100", num_devices=1)    # no GPU needed
    compiled = gpu_plan.compile_train_step(config, devices, batch_size=12, forms=forms,
                                           opt_config=recipes.GPT_OPTIMIZER)
    plan = gpu_plan.read_program(compiled)   # bytes XLA planned, cuDNN calls, collectives

XLA's GPU compiler runs on a CPU host when JAX's CUDA plugin is installed
(`pip install jax-cuda12-plugin jax-cuda12-pjrt nvidia-cuda-nvcc-cu12`; no
driver or GPU is needed, XLA uses only `ptxas`). It compiles for the card a
`GpuTargetConfig` describes (`gpu_targets/*.txtpb`, XLA's own specs, each
with its source) on a topology of such cards (`jax.experimental.topologies`),
and the result is the program a GPU would run: its memory plan
(`memory_analysis()`) and optimised HLO, with the autotuner's untuned
defaults in place of tuned GEMM choices.
"""

import collections
import contextlib
import dataclasses
import math
import pathlib
import re
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from purejax import gpt
from purejax import lora
from purejax.data import batches
from purejax.ops import kernels
from purejax.ops import quant
from purejax.optimizers import optim
from purejax.training.pure import parallel
from purejax.training.pure import state as state_lib
from purejax.training.pure import steps

# The plugin must match jaxlib's version exactly.
PLUGIN_INSTALL = (f"pip install jax-cuda12-plugin=={jaxlib.__version__} "
                  f"jax-cuda12-pjrt=={jaxlib.__version__} nvidia-cuda-nvcc-cu12")
_TARGET_DIR = pathlib.Path(__file__).parent / "gpu_targets"
# Card name -> its XLA target config file (the file's first lines say where it comes from).
TARGETS: Dict[str, str] = {
    "h100": "h100_sxm.txtpb",
    "h100-pcie": "h100_pcie.txtpb",
    "h200": "h200_sxm.txtpb",
    "a100-80g": "a100_sxm_80.txtpb",
    "a100-40g": "a100_sxm_40.txtpb",
    "l4": "l4.txtpb",  # 24 GB
}
# JAX preallocates this fraction of a GPU's memory for its allocator by default
# (XLA_PYTHON_CLIENT_MEM_FRACTION); a program must fit in it.
JAX_MEMORY_FRACTION = 0.75
CUDNN_FORWARD, CUDNN_BACKWARD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"
# The cuDNN version assumed when the host has no cuDNN to ask (`cudnn_stand_in`).
ASSUMED_CUDNN = 90800


class PluginMissing(RuntimeError):
  """JAX's CUDA plugin is not installed, so XLA's GPU compiler is not there to plan with."""


@dataclasses.dataclass(frozen=True)
class Card:
  """A target GPU: its name here, its XLA config text, and what the config says of it."""
  name: str
  config_text: str

  def _field(self, name: str) -> float:
    return float(re.search(rf"\b{name}:\s*([\d.e+]+)", self.config_text).group(1))

  @property
  def memory_bytes(self) -> int:
    return int(self._field("device_memory_size"))

  @property
  def bandwidth(self) -> float:
    """Memory bandwidth, bytes/s."""
    return self._field("memory_bandwidth")

  @property
  def description(self) -> str:
    return re.search(r'device_description_str:\s*"([^"]*)"', self.config_text).group(1)

  @property
  def source(self) -> str:
    return " ".join(line[len("# "):] for line in self.config_text.splitlines()
                    if line.startswith("# "))


# What `Card` reads from a config; XLA reads the rest.
_NEEDED_FIELDS = ("device_memory_size", "memory_bandwidth", "device_description_str")


def card(name: str) -> Card:
  """The target GPU called `name` (a key of `TARGETS`), or read from a `.txtpb` file.

  A file is an XLA `GpuTargetConfig` in text form, for a card not in
  `TARGETS` (`bench/gpu_target_config.py` writes one for the GPU it runs on).
  """
  if name.endswith(".txtpb"):
    path = pathlib.Path(name)
    if not path.is_file():
      raise ValueError(f"no GPU target config file `{name}`; give a card among "
                       f"{', '.join(TARGETS)} or an existing .txtpb file.")
    text = path.read_text()
    missing = [field for field in _NEEDED_FIELDS if not re.search(rf"\b{field}:", text)]
    if missing:
      raise ValueError(f"`{name}` is not a GpuTargetConfig with the fields a plan reads: "
                       f"it has no {', '.join(missing)} (see gpu_targets/*.txtpb).")
    return Card(path.stem, text)
  if name not in TARGETS:
    raise ValueError(f"unknown GPU `{name}`; known: {', '.join(TARGETS)}, or a "
                     f"GpuTargetConfig .txtpb file.")
  return Card(name, (_TARGET_DIR / TARGETS[name]).read_text())


def target_devices(name: str, num_devices: int = 1) -> Sequence[jax.Device]:
  """`num_devices` abstract GPUs of kind `name` on one host, to compile for (never to run on)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  text = card(name).config_text
  try:
    topology = topologies.get_topology_desc(platform="cuda", target_config=text,
                                            topology=f"1x1x{num_devices}")
  except NotImplementedError as e:
    raise PluginMissing(f"JAX's CUDA plugin is not installed ({e}); install it with "
                        f"`{PLUGIN_INSTALL}` (a GPU is not needed).") from None
  return topology.devices


@contextlib.contextmanager
def cudnn_stand_in() -> Iterator[None]:
  """Traces cuDNN attention on a host without cuDNN, as cuDNN `ASSUMED_CUDNN`.

  JAX asks the installed cuDNN for its version while tracing a cuDNN
  attention call (to choose what the call may ask for); a host without the
  library fails there. The version is the one thing taken from the host.
  """
  from jax._src.cudnn import fused_attention_stablehlo as fused  # pylint: disable=g-import-not-at-top
  original = getattr(fused, "check_cudnn_version", None)
  if original is None:  # a JAX that no longer asks: nothing to stand in for
    yield
    return
  try:
    original()
    yield
    return
  except RuntimeError:
    pass
  fused.check_cudnn_version = lambda: ASSUMED_CUDNN
  try:
    yield
  finally:
    fused.check_cudnn_version = original


def data_mesh(devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
  """A 1-D `"data"` mesh over `devices`, as `parallel.make_mesh` builds over real ones."""
  return jax.sharding.Mesh(np.asarray(devices), (parallel.DATA_AXIS,),
                           axis_types=(jax.sharding.AxisType.Auto,))


def abstract(tree, shardings):
  """`jax.ShapeDtypeStruct`s of `tree`'s leaves, each with its sharding (one or a tree)."""
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


@dataclasses.dataclass(frozen=True)
class TrainStepProgram:
  """The training loop's step for some devices, with abstract arguments to lower it with.

  Attributes:
    step: `steps.train_steps_fn` jitted by `parallel.jit_train_step`.
    arguments: `(state, tokens, first_step)` as `jax.ShapeDtypeStruct`s with
      their shardings; `step.lower(*arguments)` lowers the program.
    start: `() -> state`, the initial train state (seed 0), unsharded.
    layout: the state's shardings.
  """
  step: Callable
  arguments: tuple
  start: Callable
  layout: object


def train_step_program(config: gpt.GPTConfig, devices: Sequence[jax.Device], *, batch_size: int,
                       forms: kernels.Forms, opt_config: optim.OptimizerConfig,
                       fsdp: bool = False, grad_accum_steps: int = 1,
                       lora_config: Optional[lora.LoraConfig] = None, num_steps: int = 1,
                       num_tokens: int = 1 << 20, held: Optional[str] = None
                       ) -> TrainStepProgram:
  """One call of the training loop's program (`steps.train_steps_fn`) for `devices`.

  The same program `gpt_loop.train_gpt` jits (`parallel.jit_train_step` over a
  data mesh), with abstract inputs: nothing is allocated.

  Args:
    config: the model.
    devices: `target_devices(...)`, or real devices; several make a
      data-parallel mesh.
    batch_size: the global batch.
    forms: how the model runs (`kernels.select("gpu")`, from the entry point).
    opt_config: the optimizer (its state's bytes are part of the plan).
    fsdp: split params and optimizer state across the devices.
    grad_accum_steps: microbatches per step.
    lora_config: train LoRA adapters instead of the weights.
    held: with `lora_config`, how the frozen base is held (`quant.hold_matrices`'
      formats: "int8", "q8_0", "q4_1" for QLoRA, "bfloat16"); None: as trained.
    num_steps: steps in the call's `lax.scan`.
    num_tokens: length of the corpus on the device, which the batches are drawn from.

  Returns:
    The `TrainStepProgram`.
  """
  plan = parallel.ShardingPlan(data_mesh(devices), fsdp=fsdp)
  parallel.check_batch_size(batch_size, plan.mesh, grad_accum_steps)
  optimizer = optim.RunOptimizer(opt_config, False, lora_config is not None)()

  def start():
    params = gpt.init_params(config, jax.random.PRNGKey(0))
    return state_lib.start_state(params, state_lib.run_keys(0), optimizer, lora_config)[0]

  state = jax.eval_shape(start)
  if held is not None:  # the base as it is held: its shapes only (`quant.held_shapes`)
    params = {**state.params, "base": quant.held_shapes(state.params["base"], held)}
    state = state._replace(params=params, opt_state=jax.eval_shape(optimizer.init, params))
  view = lora.View(lora_config.scale_alpha) if lora_config is not None else None
  layout = state_lib.shardings(state, plan)
  step = parallel.jit_train_step(steps.train_steps_fn, plan, layout, config=config,
                                 optimizer=optimizer, batch_size=batch_size, num_steps=num_steps,
                                 forms=forms, grad_accum_steps=grad_accum_steps,
                                 params_view=view)
  tokens = batches.DeviceTokens(jax.ShapeDtypeStruct((num_tokens,), jnp.int32,
                                                     sharding=plan.replicated))
  first = jax.ShapeDtypeStruct((), jnp.int32, sharding=plan.replicated)
  return TrainStepProgram(step, (abstract(state, layout), tokens, first), start, layout)


def compile_train_step(config: gpt.GPTConfig, devices: Sequence[jax.Device], **kwargs):
  """`train_step_program(config, devices, **kwargs)`, lowered and compiled for `devices`.

  Returns:
    The `jax.stages.Compiled` program.
  """
  program = train_step_program(config, devices, **kwargs)
  with cudnn_stand_in():
    return program.step.lower(*program.arguments).compile()


_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


@dataclasses.dataclass(frozen=True)
class ProgramPlan:
  """What XLA planned for one compiled program, per device.

  Attributes:
    argument_bytes, output_bytes, alias_bytes, temp_bytes: `memory_analysis()`'s
      sizes (outputs aliased to donated arguments count once).
    custom_calls: `{custom-call target: count}` in the optimised HLO (a
      `lax.scan`'s body counts once).
    collectives: `{collective kind: count}` in the optimised HLO.
    hlo: the optimised HLO text.
  """
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  custom_calls: collections.Counter
  collectives: collections.Counter
  hlo: str

  @property
  def peak_bytes(self) -> int:
    """Arguments + outputs - aliased + temporaries: the device memory one call needs."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  def memory(self) -> Dict[str, int]:
    """The planned bytes by kind and the peak, as a dict (for results files)."""
    return {"argument_bytes": self.argument_bytes, "output_bytes": self.output_bytes,
            "alias_bytes": self.alias_bytes, "temp_bytes": self.temp_bytes,
            "peak_bytes": self.peak_bytes}


def read_program(compiled) -> ProgramPlan:
  """The `ProgramPlan` of a `jax.stages.Compiled` program."""
  memory, hlo = compiled.memory_analysis(), compiled.as_text()
  return ProgramPlan(
      memory.argument_size_in_bytes, memory.output_size_in_bytes, memory.alias_size_in_bytes,
      memory.temp_size_in_bytes,
      collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo)),
      collections.Counter(_COLLECTIVE.findall(hlo)), hlo)


def batch_granule(config: gpt.GPTConfig, forms: kernels.Forms, num_devices: int,
                  grad_accum_steps: int) -> Tuple[int, str]:
  """The step between the batches a plan searches, and why.

  Each device's microbatch is whole sequences, so batches are multiples of
  devices x microbatches. Where the head and loss run in chunks
  (`forms.loss_chunk_rows`), a microbatch whose rows do not fill whole
  chunks runs a shorter last chunk, which XLA plans with buffers of its
  own: at T=1024 and 2048-row chunks, GPT-2 124M's batch 771 planned 2.3 GiB
  more than batch 770 (on an H100). So the batches also fill whole
  chunks.

  Returns:
    `(granule, a few words saying what it is made of)`.
  """
  granule, why = num_devices * grad_accum_steps, "devices x microbatches"
  chunk = forms.loss_chunk_rows
  sequences = chunk // math.gcd(chunk, config.block_size) if chunk else 1
  if sequences > 1:
    granule *= sequences
    why += f" x {sequences}, so each microbatch fills whole {chunk}-row loss chunks"
  return granule, why


def scaled_batch(batch_size: int, program: ProgramPlan, capacity: int) -> int:
  """The batch at which `program`'s temporaries, grown in proportion to the batch, fill `capacity`.

  A first guess for the largest batch from one compile: the arguments and
  outputs do not grow with the batch, the temporaries mostly do. Part of the
  temporaries does not grow (the gradients, one layer's backward), so the
  guess tends to fall short of the answer, which makes it a good second
  point for `largest_batch`'s line: far from the first, near the answer.
  """
  fixed = program.peak_bytes - program.temp_bytes
  return max(1, int(batch_size * (capacity - fixed) / max(program.temp_bytes, 1)))


def line_through_last_two(peaks: Dict[int, int], batch: int) -> Optional[float]:
  """The straight line through the last two entries of `peaks` (`{batch: peak}`, in
  the order compiled), at `batch`; None with fewer than two."""
  if len(peaks) < 2:
    return None
  (b1, p1), (b2, p2) = list(peaks.items())[-2:]
  return p2 + (p2 - p1) / (b2 - b1) * (batch - b2)


def largest_batch(peak_at: Callable[[int], int], capacity: int, granule: int, first: int,
                  limit: int = 1 << 14, second: Optional[int] = None,
                  confirm: bool = True) -> Optional[int]:
  """The largest batch, a multiple of `granule`, whose planned peak fits in `capacity`.

  The rule: compile at `first` and at `second` (four times `first` unless
  given); then, while the largest batch known to fit and the smallest known
  not to are more than a granule apart, compile where the straight line
  through the last two compiles' peaks crosses `capacity` (a secant step),
  kept strictly between those two batches. A line that lands on the batch
  known to fit tries one granule above it, which confirms the answer. After
  three steps in a row that each left more than half of the bracket in place
  comes a bisection, so a peak that bends or jumps cannot drag the search
  out. A peak that grows linearly with the batch costs four compiles.
  Assumes the peak grows with the batch.

  Without `confirm`, the search also stops when its last compile fitted and
  the line through its last two compiles puts the next granule's peak over
  `capacity`: the answer is still a batch whose compile fits, and the next
  granule is over by the line's estimate instead of by a compile (one
  compile fewer where the line is right; where the peak bends down, a
  smaller answer than the confirmed search's).

  Args:
    peak_at: planned peak bytes of the program at a batch (`ProgramPlan.peak_bytes`).
    capacity: bytes the program may use.
    granule: batches are multiples of it (devices x microbatches).
    first: a batch to start from (rounded down to the granule, at least one granule).
    limit: the largest batch tried.
    second: the batch of the second compile (rounded down to the granule),
      e.g. `scaled_batch(first, ...)`; None: four times `first`.
    confirm: compile the granule above the answer too (else the line's
      estimate may stand for it, above).

  Returns:
    The batch, or None when one granule does not fit.
  """
  top = max(1, limit // granule)
  peaks: Dict[int, int] = {}  # in granules, in the order compiled

  def fits(units: int) -> bool:
    if units not in peaks:
      peaks[units] = peak_at(units * granule)
    return peaks[units] <= capacity

  a = min(max(1, first // granule), top)
  b = min(max(1, 4 * a if second is None else second // granule), top)
  for units in (a, b if b != a else min(4 * a, top)):
    fits(units)

  def bracket() -> Tuple[int, Optional[int]]:
    """(largest batch known to fit or 0, smallest known not to or None), in granules."""
    return (max((u for u in peaks if peaks[u] <= capacity), default=0),
            min((u for u in peaks if peaks[u] > capacity), default=None))

  poor_steps = 0  # secant steps in a row that kept more than half the bracket
  while True:
    low, high = bracket()
    if high is None and low == top:
      return low * granule
    if high is not None and high - low <= 1:
      return low * granule or None
    if (not confirm and low and len(peaks) > 1 and list(peaks)[-1] == low
        and line_through_last_two(peaks, low + 1) > capacity):
      return low * granule  # the last compile fits; by the line, the next granule does not
    ceiling = top + 1 if high is None else high
    u1, u2 = list(peaks)[-2:] if len(peaks) > 1 else (a, a)
    slope = (peaks[u2] - peaks[u1]) / (u2 - u1) if u1 != u2 else 0.0
    if poor_steps >= 3 or slope <= 0:
      guess = 2 * max(low, 1) if high is None else (low + high) // 2
      poor_steps = 0
    else:  # the secant through the last two compiles, where it crosses the capacity
      guess = u2 + math.floor((capacity - peaks[u2]) / slope)
    fits(min(max(guess, low + 1), ceiling - 1))
    new_low, new_high = bracket()
    width = (ceiling if new_high is None else new_high) - new_low
    poor_steps = poor_steps + 1 if 2 * width > ceiling - low else 0


def step_floor(flops: float, peak_flops: Optional[float], moved_bytes: int, bandwidth: float
               ) -> Dict[str, Optional[float]]:
  """The fastest a step can run on a card: its FLOPs at the card's peak, and the bytes
  it must move at the card's bandwidth. Returns seconds for each and their max."""
  compute = flops / peak_flops if peak_flops else None
  memory = moved_bytes / bandwidth
  return {"compute_s": compute, "memory_s": memory,
          "floor_s": max(compute or 0.0, memory)}

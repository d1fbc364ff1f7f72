"""The execution-option flags that `purejax.train` and `purejax.sample` share.

Every field of `kernels.Forms` is a flag defaulting to "auto": the choice
`kernels.select` makes for the platform the run is on. They change how the
model runs, never what it computes, so a run may resume with other values.
The flags parse to their values at once ("auto" to None, bad values refused
as absl refuses any flag), so a command reads them as `args.attention`,
`args.attn_block`, ..., and hands them on as `kernels.select`'s overrides
(`FORMS`). `--sweep_batch`, how many runs of a sweep are vmapped together, is
the sweep's own argument (`sweep.choose_sweep_batch`), not a form.
"""

from typing import Any, Dict

from absl import flags
import jax

from purejax.ops import kernels

_AUTO = "auto"

# The flags that are `kernels.select` overrides (`Forms` fields), by their names.
FORMS = ("attention", "attn_block", "remat", "scan_layers", "matmul_backward",
         "matmul_output", "loss_chunk_rows", "loss_logits", "noise_ahead",
         "recompute_activation")


class _AutoOr(flags.ArgumentParser):
  """'auto' (None: the platform's choice), or a value `parse_value` accepts."""

  def __init__(self, kind: str, parse_value):
    self._kind, self._parse_value = kind, parse_value

  def parse(self, argument):
    if argument is None or str(argument).lower() == _AUTO:
      return None
    try:
      return self._parse_value(argument)
    except ValueError:
      raise ValueError(f"must be 'auto' or {self._kind}, got {argument!r}") from None

  def flag_type(self) -> str:
    return "string"


def _integer(least: int):
  def parse(argument):
    number = int(argument)
    if number < least:
      raise ValueError(argument)
    return number
  return parse


def _choice(choices):
  def parse(argument):
    if argument not in choices:
      raise ValueError(argument)
    return argument
  return parse


def _true_or_false(argument):
  value = str(argument).lower()
  if value not in ("true", "false"):
    raise ValueError(argument)
  return value == "true"


def _define(args, name, kind, parse_value, help_text):
  flags.DEFINE(_AutoOr(kind, parse_value), name, _AUTO,
               f"{help_text} Default: auto (the platform's choice).", flag_values=args)


def _one_of(choices) -> str:
  return "one of " + ", ".join(choices)


def define_forms_flags(args: flags.FlagValues, sweeps: bool = True) -> None:
  """Defines --attention, --attn_block, --remat, --scan_layers, --matmul_backward,
  --matmul_output, --loss_chunk_rows, --loss_logits, --noise_ahead, --recompute_activation and
  (for a command that runs sweeps) --sweep_batch."""
  _define(args, "attention", _one_of(kernels.ATTENTION_FORMS),
          _choice(kernels.ATTENTION_FORMS),
          f"Form of causal attention: {', '.join(kernels.ATTENTION_FORMS)} (all compute the "
          f"same function; 'cudnn' needs an NVIDIA GPU).")
  _define(args, "attn_block", "a positive integer", _integer(1),
          "Queries per block of the 'blocked' attention (a positive integer).")
  _define(args, "remat", _one_of(kernels.REMAT_POLICIES), _choice(kernels.REMAT_POLICIES),
          "What each block keeps for the backward pass (none, full, full_compute_dtype or "
          "dots): none (everything), full (only its "
          "input), full_compute_dtype (its input in the compute dtype: bf16 halves it; "
          "gradients to bf16 rounding), dots (the matmul outputs).")
  _define(args, "scan_layers", "'true' or 'false'", _true_or_false,
          "Run the blocks as one lax.scan (false: an unrolled loop).")
  _define(args, "matmul_backward", _one_of(kernels.MATMUL_BACKWARD_FORMS),
          _choice(kernels.MATMUL_BACKWARD_FORMS),
          f"Form of the low-precision matmul's gradient products: "
          f"{', '.join(kernels.MATMUL_BACKWARD_FORMS)}.")
  _define(args, "matmul_output", _one_of(kernels.MATMUL_OUTPUT_FORMS),
          _choice(kernels.MATMUL_OUTPUT_FORMS),
          "dtype of a low-precision matmul's output and input gradient: float32, or "
          "compute (rounded to the compute dtype, as PyTorch's autocast).")
  _define(args, "loss_chunk_rows", "a non-negative integer", _integer(0),
          "Rows per chunk of the output head and loss when the logits are large (0: never "
          "chunk).")
  _define(args, "loss_logits", _one_of(kernels.LOSS_LOGITS_FORMS),
          _choice(kernels.LOSS_LOGITS_FORMS),
          "dtype the low-precision output head writes its logits in: float32, or compute "
          "(as PyTorch's autocast; the loss still sums in float32).")
  _define(args, "noise_ahead", "'true' or 'false'", _true_or_false,
          "Sampling draws its Gumbel noise before each decode loop.")
  _define(args, "recompute_activation", "'true' or 'false'", _true_or_false,
          "The MLP's activation keeps only its input for the backward pass, which "
          "recomputes the rest (GELU's tanh).")
  if sweeps:
    _define(args, "sweep_batch", "a non-negative integer", _integer(0),
            "Runs of a --sweep vmapped together (0: all at once; 1: one after another "
            "inside the one program, the CPU's choice).")


def forms_overrides(args: flags.FlagValues) -> Dict[str, Any]:
  """The forms flags given, as `kernels.select` overrides (an absent flag: the
  platform's choice)."""
  return {name: args[name].value for name in FORMS
          if name in args and args[name].value is not None}


def check_platform(args: flags.FlagValues) -> None:
  """Refuses forms JAX's devices cannot run (--attention=cudnn without an NVIDIA GPU);
  call it after the devices are set up, before loading anything."""
  if args.attention != "cudnn":
    return
  platform = jax.devices()[0].platform
  if platform != "gpu":
    raise ValueError(f"--attention=cudnn needs an NVIDIA GPU; this run is on {platform}. "
                     f"Choose --attention=auto.")


def forms_from_flags(args: flags.FlagValues) -> kernels.Forms:
  """The forms for JAX's devices, with the flags' overrides (`sample`, `chat`, `eval`)."""
  check_platform(args)
  return kernels.select(jax.devices()[0].platform, **forms_overrides(args))

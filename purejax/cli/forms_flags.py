"""The execution-option flags that `purejax.train` and `purejax.sample` share.

Every field of `kernels.Forms` is a flag defaulting to "auto": the choice
`kernels.select` makes for the platform the run is on. They change how the
model runs, never what it computes, so a run may resume with other values.
`--sweep_batch`, how many runs of a sweep are vmapped together, is the
sweep's own argument (`sweep.choose_sweep_batch`), not a form.
"""

from typing import Any, Dict, Optional

from absl import flags
import jax

from purejax.ops import kernels

_AUTO = "auto"


def define_forms_flags(args: flags.FlagValues, sweeps: bool = True) -> None:
  """Defines --attention, --attn_block, --remat, --scan_layers, --matmul_backward,
  --matmul_output, --loss_chunk_rows, --noise_ahead and (for a command that runs
  sweeps) --sweep_batch."""
  flags.DEFINE_enum("attention", _AUTO, [_AUTO, *kernels.ATTENTION_FORMS],
                    "Form of causal attention (all compute the same function; 'cudnn' "
                    "needs an NVIDIA GPU).", flag_values=args)
  flags.DEFINE_string("attn_block", _AUTO,
                      "Queries per block of the 'blocked' attention (a positive integer).",
                      flag_values=args)
  flags.DEFINE_enum("remat", _AUTO, [_AUTO, *kernels.REMAT_POLICIES],
                    "What each block keeps for the backward pass: none (everything), "
                    "full (only its input), full_compute_dtype (its input in the compute dtype: "
                    "bf16 halves it; gradients to bf16 rounding), dots (the matmul outputs).",
                    flag_values=args)
  flags.DEFINE_enum("scan_layers", _AUTO, [_AUTO, "true", "false"],
                    "Run the blocks as one lax.scan (false: an unrolled loop).",
                    case_sensitive=False, flag_values=args)
  flags.DEFINE_enum("matmul_backward", _AUTO, [_AUTO, *kernels.MATMUL_BACKWARD_FORMS],
                    "Form of the low-precision matmul's gradient products.", flag_values=args)
  flags.DEFINE_enum("matmul_output", _AUTO, [_AUTO, *kernels.MATMUL_OUTPUT_FORMS],
                    "dtype of a low-precision matmul's output and input gradient: float32, "
                    "or compute (rounded to the compute dtype, as PyTorch's autocast).",
                    flag_values=args)
  flags.DEFINE_string("loss_chunk_rows", _AUTO,
                      "Rows per chunk of the output head and loss when the logits are "
                      "large (0: never chunk).", flag_values=args)
  flags.DEFINE_enum("noise_ahead", _AUTO, [_AUTO, "true", "false"],
                    "Sampling draws its Gumbel noise before each decode loop.",
                    case_sensitive=False, flag_values=args)
  if not sweeps:
    return
  flags.DEFINE_string("sweep_batch", _AUTO,
                      "Runs of a --sweep vmapped together (0: all at once; 1: one after "
                      "another inside the one program, the CPU's choice).", flag_values=args)


def _positive_int(args: flags.FlagValues, name: str, allow_zero: bool = False) -> Any:
  if name not in args:
    return None
  value = args[name].value
  if value == _AUTO:
    return None
  try:
    number = int(value)
  except ValueError:
    number = -1
  if number < (0 if allow_zero else 1):
    least = "a non-negative" if allow_zero else "a positive"
    raise ValueError(f"--{name} must be 'auto' or {least} integer, got {value!r}.")
  return number


def _bool(args: flags.FlagValues, name: str) -> Any:
  value = args[name].value.lower()
  return None if value == _AUTO else value == "true"


def forms_overrides(args: flags.FlagValues) -> Dict[str, Any]:
  """The forms flags as `kernels.select` overrides (None: the platform's choice)."""
  overrides = dict(attention=args.attention, attn_block=_positive_int(args, "attn_block"),
                   remat=args.remat, scan_layers=_bool(args, "scan_layers"),
                   matmul_backward=args.matmul_backward,
                   matmul_output=args.matmul_output if "matmul_output" in args else None,
                   loss_chunk_rows=_positive_int(args, "loss_chunk_rows", allow_zero=True),
                   noise_ahead=_bool(args, "noise_ahead"))
  return {k: v for k, v in overrides.items() if v not in (None, _AUTO)}


def sweep_batch_from_flags(args: flags.FlagValues) -> Optional[int]:
  """--sweep_batch as `sweep_loop.train_gpt_sweep`'s `sweep_batch` (None: the platform's)."""
  return _positive_int(args, "sweep_batch", allow_zero=True)


def forms_from_flags(args: flags.FlagValues) -> kernels.Forms:
  """The forms for JAX's devices, with the flags' overrides: the one choice of a run."""
  overrides = forms_overrides(args)  # bad values fail before JAX starts its backends
  platform = jax.devices()[0].platform
  try:
    return kernels.select(platform, **overrides)
  except ValueError:
    if overrides.get("attention") == "cudnn":  # select's words are the library's
      raise ValueError(f"--attention=cudnn needs an NVIDIA GPU; this run is on {platform}. "
                       f"Choose --attention=auto.") from None
    raise

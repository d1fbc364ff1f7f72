"""The GPU this runs on as an XLA `GpuTargetConfig` text, for deviceless compiles.

    python -m bench.gpu_target_config --base=h200 > h200_measured.txtpb

XLA keys its autotuning results by the card's compute capability, cores,
clock, memory bandwidth and L2 size, computed from the CUDA driver's
attributes. A deviceless compile can use results tuned on a real card
(`--xla_gpu_load_autotune_results_from`) only if its target config has the
same five values; a config written from a datasheet rarely does. This
reads them from the driver (through CuPy, as XLA derives them) and writes
them over the `--base` card's config (`gpu_plan.TARGETS`), also the memory
size and the device's name.
"""

import re

from absl import app
from absl import flags

from purejax.training.tools import gpu_plan

FLAGS = flags.FLAGS

# cudaDeviceAttr values (CUDA runtime API).
_CLOCK_RATE, _CORES, _MEMORY_CLOCK, _BUS_WIDTH, _L2 = 13, 16, 36, 37, 38


def measured_fields() -> dict:
  """The target-config fields XLA derives from device 0's driver attributes."""
  import cupy  # pylint: disable=import-outside-toplevel
  get = lambda attribute: cupy.cuda.runtime.deviceGetAttribute(attribute, 0)
  free, total = cupy.cuda.runtime.memGetInfo()
  del free
  return {
      "core_count": get(_CORES),
      "clock_rate_ghz": get(_CLOCK_RATE) / 1e6,  # kHz
      # Double data rate: two transfers per memory clock, bus width in bits.
      "memory_bandwidth": 2 * get(_MEMORY_CLOCK) * 1000 * get(_BUS_WIDTH) // 8,
      "l2_cache_size": get(_L2),
      "device_memory_size": total,
      "device_description_str": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
  }


def with_fields(config_text: str, fields: dict) -> str:
  """`config_text` with each `name: value` line of `fields` replaced."""
  for name, value in fields.items():
    text = f'"{value}"' if isinstance(value, str) else repr(value)
    config_text, count = re.subn(rf"(\b{name}:\s*)[^\n]+", lambda m: m.group(1) + text,
                                 config_text, count=1)
    if count != 1:
      raise ValueError(f"the base config has no `{name}` field")
  return config_text


def main(argv):
  del argv
  fields = measured_fields()
  base = gpu_plan.card(FLAGS.base).config_text
  header = (f"# {fields['device_description_str']}, read from the CUDA driver's attributes by "
            f"bench/gpu_target_config.py over the {FLAGS.base} config below.\n")
  print(header + with_fields(base, fields), end="")


if __name__ == "__main__":
  flags.DEFINE_string("base", "h100", f"The config to start from: {', '.join(gpu_plan.TARGETS)}.")
  app.run(main)

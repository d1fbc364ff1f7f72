"""`python -m purejax.plan`: a training step planned for a GPU this machine does not have.

The planning runs need JAX's CUDA plugin (see test_gpu_program.py for how
they skip or fail without it); the refusals do not.
"""

import os
import re

import pytest

from conftest import refusal
from purejax.cli import plan
from purejax.training import gpu_plan

SMALL = ["--n_layer=2", "--n_head=4", "--n_embd=256", "--block_size=256", "--vocab_size=8192",
         "--nobias", "--dtype=bfloat16"]


def test_an_unknown_gpu_is_refused_with_the_known_ones(capsys):
  line = refusal(capsys, plan, "--gpu=tpu-v9", *SMALL)
  assert "unknown GPU `tpu-v9`" in line and "h100" in line and "a100-40g" in line, line


def test_a_missing_plugin_is_one_line_with_its_install_command(capsys, monkeypatch):
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  def no_plugin(**kwargs):
    raise NotImplementedError("topology not implemented for cuda")

  monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
  line = refusal(capsys, plan, "--gpu=h100", *SMALL)
  assert gpu_plan.PLUGIN_INSTALL in line, line


@pytest.fixture(scope="module")
def plugin():
  try:
    gpu_plan.target_devices("h100")
  except gpu_plan.PluginMissing as e:
    if os.environ.get("PUREJAX_REQUIRE_GPU_PLUGIN") == "1":
      pytest.fail(str(e))
    pytest.skip(str(e))


def planned(capsys, *argv) -> str:
  capsys.readouterr()
  assert plan.run(["plan", *argv]) == 0
  return capsys.readouterr().out


@pytest.mark.slow
def test_the_plan_finds_the_largest_batch_by_its_rule(plugin, capsys):
  # A budget of 1 % of an H100 (0.79 GiB) puts the answer within a few compiles.
  out = planned(capsys, "--gpu=h100", "--batch_size=8", "--memory_fraction=0.01", *SMALL)
  assert "planned peak per device:" in out and ": fits" in out, out
  assert re.search(r"cuDNN attention calls: forward [1-9]\d*, backward 1", out), out
  best = int(re.search(r"largest batch that fits: (\d+)", out).group(1))
  capacity = int(0.01 * gpu_plan.card("h100").memory_bytes)
  peak = lambda batch: float(re.search(r"planned peak per device: ([\d.]+) GiB", planned(
      capsys, "--gpu=h100", f"--batch_size={batch}", "--nomax_batch", *SMALL)).group(1))
  assert peak(best) * (1 << 30) <= capacity * 1.001  # GiB printed to two decimals
  assert peak(best + 1) * (1 << 30) > capacity * 0.999
  assert re.search(r"step-time floor: [\d.]+ ms = max\(compute [\d.]+ ms at 989 TFLOP/s", out)


@pytest.mark.slow
def test_eight_gpus_with_fsdp_plan_their_collectives_and_a_share_of_the_state(plugin, capsys):
  one = planned(capsys, "--gpu=h200", "--batch_size=16", "--nomax_batch", *SMALL)
  eight = planned(capsys, "--gpu=h200", "--num_devices=8", "--fsdp", "--batch_size=16",
                  "--nomax_batch", *SMALL)
  params = lambda out: float(re.search(r"params ([\d.]+) GiB", out).group(1))
  assert "8 x h200" in eight and "FSDP" in eight
  assert "collectives: none" in one
  assert re.search(r"all-gather x\d+", eight) and re.search(r"all-reduce x\d+|reduce-scatter", eight)
  assert params(eight) < params(one) / 4, (one, eight)

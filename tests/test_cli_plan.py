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
  # A budget of 1 % of an H100 (0.79 GiB) puts the answer at a small batch.
  out = planned(capsys, "--gpu=h100", "--batch_size=8", "--memory_fraction=0.01", *SMALL)
  assert re.search(r"planned peak per device: [\d.]+ GiB of 0.79 GiB: fits", out), out
  assert re.search(r"cuDNN attention calls: forward [1-9]\d*, backward 1", out), out
  found = re.search(r"largest batch that fits: (\d+) \(planned peak ([\d.]+) GiB\); "
                    r"(\d+) plans ([\d.]+) GiB", out)
  assert found, out
  best, best_peak, above, above_peak = (float(x) for x in found.groups())
  assert above == best + 1 and best_peak <= 0.79 < above_peak, out
  assert re.search(r"step-time floor: [\d.]+ ms = max\(compute [\d.]+ ms at 989 TFLOP/s", out)


def test_the_largest_batch_rule_takes_few_compiles_and_survives_a_jump():
  compiled = []

  def peak(batch):  # bytes: linear in the batch, with a jump at 300
    compiled.append(batch)
    return 1000 + 37 * batch + (5000 if batch >= 300 else 0)

  assert gpu_plan.largest_batch(peak, 10_000, 4, 12) == 240
  assert len(compiled) == 4  # the line's guess, confirmed
  compiled.clear()
  assert gpu_plan.largest_batch(peak, 14_000, 4, 12) == 296  # the line overshoots the jump
  assert max(b for b in range(4, 2000, 4) if peak(b) <= 14_000) == 296
  assert gpu_plan.largest_batch(peak, 500, 4, 12) is None


@pytest.mark.slow
def test_eight_gpus_with_fsdp_plan_their_collectives_and_a_share_of_the_params(plugin, capsys):
  out = planned(capsys, "--gpu=h200", "--num_devices=8", "--fsdp", "--batch_size=16",
                "--nomax_batch", *SMALL)
  assert "8 x h200" in out and "FSDP" in out, out
  assert re.search(r"all-gather x\d+", out), out  # FSDP gathers the params it split
  # 2 layers x 12 x 256^2 + 8192 x 256 + 256 x 256 positions, float32, in 8 shares.
  whole = 4 * (2 * 12 * 256 * 256 + 8192 * 256 + 256 * 256) / (1 << 30)
  params = float(re.search(r"params ([\d.]+) GiB", out).group(1))
  assert params == pytest.approx(whole / 8, abs=0.006), out

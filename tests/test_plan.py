"""`python -m purejax.plan`: a training step planned for a GPU this machine does not have.

The planning runs need JAX's CUDA plugin (see test_gpu_program.py for how
they skip or fail without it); the refusals do not.
"""

import collections
import dataclasses
import os
import re

import jax
import numpy as np
import pytest

from helpers.cli import refusal
from helpers.data import REPO_ROOT
from purejax import gpt
from purejax.cli import plan
from purejax.ops import kernels
from purejax.training.tools import gpu_plan

SMALL = ["--n_layer=2", "--n_head=4", "--n_embd=256", "--block_size=256", "--vocab_size=8192",
         "--nobias", "--dtype=bfloat16"]


def test_an_unknown_gpu_is_refused_with_the_known_ones(capsys):
  line = refusal(capsys, plan, "--gpu=tpu-v9", *SMALL)
  assert "unknown GPU `tpu-v9`" in line and "h100" in line and "a100-40g" in line, line


@pytest.mark.parametrize("flag, message", [
    ("--batch_size=0", "--batch_size must be a positive integer, got 0"),
    ("--block_size=-1", "--block_size must be a positive integer, got -1"),
    ("--max_iters=0", "--max_iters must be a positive integer"),
    ("--warmdown_frac=0.3", "--warmdown_frac has no effect"),
])
def test_numbers_train_refuses_are_refused_before_compiling(capsys, flag, message):
  assert message in refusal(capsys, plan, "--gpu=h100", *SMALL, flag)


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


@pytest.mark.budget(30)
@pytest.mark.slow
def test_the_plan_finds_the_largest_batch_by_its_rule(plugin, capsys):
  # A budget of 1 % of an H100 (0.79 GiB) puts the answer at a small batch.
  # From batch 32 (four 2048-row loss chunks) the plans grow about linearly:
  # XLA unrolls this 2-layer model's whole program, and at batches 16 and 24
  # (two and three chunks) it planned more (0.39 and 0.59 GiB of
  # temporaries) than at 32 (0.19 GiB), which costs the search compiles.
  out = planned(capsys, "--gpu=h100", "--batch_size=32", "--memory_fraction=0.01", *SMALL)
  assert re.search(r"planned peak per device: [\d.]+ GiB of 0.79 GiB: fits", out), out
  # The GPU's layers unrolled: a forward and a backward call per layer.
  assert re.search(r"cuDNN attention calls: forward 2, backward 2", out), out
  # Unless --confirm_max_batch, the batch above the answer may be over by the
  # line through the last two compiles instead of by a compile of its own.
  found = re.search(r"largest batch that fits: (\d+) \(planned peak ([\d.]+) GiB\); "
                    r"(\d+) (?:plans|would plan about) ([\d.]+) GiB", out)
  assert found, out
  best, best_peak, above, above_peak = (float(x) for x in found.groups())
  granule = int(re.search(r"the largest multiple of (\d+)", out).group(1))
  assert above == best + granule and best % granule == 0, out
  assert best_peak <= 0.79 <= above_peak, out  # the peaks are printed to 0.01 GiB
  assert re.search(r"step-time floor: [\d.]+ ms = max\(compute [\d.]+ ms at 989 TFLOP/s", out)


def test_a_card_can_come_from_a_target_config_file(tmp_path):
  path = tmp_path / "my_h100.txtpb"
  path.write_text(gpu_plan.card("h100").config_text)
  mine = gpu_plan.card(str(path))
  assert mine.name == "my_h100" and mine.memory_bytes == gpu_plan.card("h100").memory_bytes
  with pytest.raises(ValueError, match="no GPU target config file"):
    gpu_plan.card(str(tmp_path / "absent.txtpb"))
  (tmp_path / "bad.txtpb").write_text("gpu_device_info { core_count: 1 }\n")
  with pytest.raises(ValueError, match="it has no device_memory_size, memory_bandwidth"):
    gpu_plan.card(str(tmp_path / "bad.txtpb"))


def test_searched_batches_fill_whole_loss_chunks_on_every_device():
  config = gpt.GPTConfig(vocab_size=50304, block_size=1024, n_layer=2, n_head=2, n_embd=64)
  gpu = kernels.select("gpu")  # 2048-row loss chunks
  assert gpu_plan.batch_granule(config, gpu, 1, 1)[0] == 2  # 2 x 1024 rows per chunk
  assert gpu_plan.batch_granule(config, gpu, 8, 4)[0] == 64
  long = dataclasses.replace(config, block_size=2048)
  assert gpu_plan.batch_granule(long, gpu, 1, 1) == (1, "devices x microbatches")
  short = dataclasses.replace(config, block_size=96)  # gcd(2048, 96) = 32: 64 sequences
  assert gpu_plan.batch_granule(short, gpu, 2, 1)[0] == 128
  assert gpu_plan.batch_granule(config, kernels.select("gpu", loss_chunk_rows=0), 3, 1)[0] == 3


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


def test_without_confirming_the_search_ends_a_compile_sooner_on_a_batch_that_fits():
  compiled = []
  peak = lambda batch: compiled.append(batch) or 1000 + 37 * batch
  assert gpu_plan.largest_batch(peak, 10_000, 4, 12, confirm=False) == 240
  assert compiled == [12, 48, 240]  # 244 is over by the line through 48 and 240
  # On random growing peaks the answer is a batch that fits, never above the
  # confirmed answer, after no more compiles than the confirmed search.
  rng = np.random.default_rng(1)
  for _ in range(100):
    curve = 1000 + np.cumsum(rng.exponential(1.0, 2000) * rng.uniform(1, 5))
    capacity = float(rng.uniform(curve[0], curve[-1]))
    counts = {}
    for confirm in (True, False):
      compiled = []
      peak = lambda batch: compiled.append(batch) or curve[batch // 2]
      counts[confirm] = (gpu_plan.largest_batch(peak, capacity, 2, 12, limit=3998,
                                                confirm=confirm), len(compiled))
    (exact, exact_count), (quick, quick_count) = counts[True], counts[False]
    assert quick is None or curve[quick // 2] <= capacity
    assert (quick or 0) <= (exact or 0) and quick_count <= exact_count


def test_the_largest_batch_rule_takes_few_compiles_where_the_peak_bends():
  # As XLA's plans grow: a fixed part, a part per sequence, and a slow bend.
  for capacity in (5e4, 2e5, 1e6):
    compiled = []
    peak = lambda batch: compiled.append(batch) or 3000 + 70 * batch + 0.004 * batch**2
    answer = gpu_plan.largest_batch(peak, capacity, 1, 12)
    assert peak(answer) <= capacity < peak(answer + 1)
    assert len(compiled) - 2 <= 8, compiled  # less the two checks above


def test_a_second_compile_near_the_answer_shortens_the_search():
  # GPT-2 124M's plans on an H100 (GiB): 1.39 fixed, temporaries that grow a
  # little faster than the batch, as XLA planned them at batches 12 to 802.
  compiled = []

  def peak(batch):
    compiled.append(batch)
    return int((1.39 + 0.35 + 0.0675 * batch + 5e-6 * batch**2) * 2**30)

  capacity = int(59.36 * 2**30)
  first = gpu_plan.ProgramPlan(int(1.39 * 2**30), 0, 0, peak(12) - int(1.39 * 2**30),
                               collections.Counter(), collections.Counter(), "")
  second = gpu_plan.scaled_batch(12, first, capacity)
  assert 12 < second < 800  # the part of the temporaries that does not grow makes it short
  compiled.clear()
  answer = gpu_plan.largest_batch(peak, capacity, 2, 12, second=second)
  assert peak(answer) <= capacity < peak(answer + 2)
  compiled.pop(), compiled.pop()
  assert compiled[:2] == [12, second - second % 2] and len(compiled) <= 5, compiled


def test_the_largest_batch_rule_is_the_true_largest_for_any_growing_peak():
  # Random growing peaks (flat stretches, bends and jumps): the answer is
  # the brute-force answer, and the bisections keep the count near log2.
  rng = np.random.default_rng(0)
  counts = []
  for _ in range(200):
    steps = rng.exponential(1.0, 2000) * (rng.random(2000) < rng.uniform(0.05, 1.0))
    steps[rng.integers(0, 2000, 3)] += rng.exponential(200.0, 3)  # a few jumps
    curve = 1000 + np.cumsum(steps * rng.uniform(1, 5)) + rng.uniform(0, 0.01) * np.arange(
        2000) ** 2
    capacity = float(rng.uniform(curve[0], curve[-1] * 1.1))
    compiled = []
    peak = lambda batch: compiled.append(batch) or curve[batch // 2]
    answer = gpu_plan.largest_batch(peak, capacity, 2, 12, limit=3998)
    expected = max((b for b in range(2, 3999, 2) if curve[b // 2] <= capacity), default=None)
    assert answer == expected, (answer, expected)
    assert len(compiled) == len(set(compiled))  # no batch compiled twice
    counts.append(len(compiled))
  assert max(counts) <= 2 + 2 * 11, sorted(counts)  # 2 + 2 log2(2000 granules)


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


CONFIGS = REPO_ROOT / "tests" / "data" / "hf_configs"


@pytest.mark.budget(120)
@pytest.mark.slow
def test_a_hugging_face_config_plans_qlora_on_24_gb_and_full_tuning_over_fsdp(plugin, capsys):
  # As QLoRA runs are: activations recomputed in the backward (a scan of the layers).
  llama_8b = ["--hf_config=" + str(CONFIGS / "llama-3.1-8b.json"), "--block_size=2048",
              "--dtype=bfloat16", "--batch_size=1", "--max_batch=false", "--remat=full",
              "--scan_layers=true"]
  out = planned(capsys, "--gpu=l4", "--lora_rank=16", "--quantize=q4_1", *llama_8b)
  assert "8030.3M params" in out and "LoRA rank 16, base held q4_1" in out, out
  found = re.search(r"per device: params ([\d.]+) GiB", out)
  assert found and 4.0 < float(found.group(1)) < 5.0, out  # 5 bits a weight, embeddings too
  assert re.search(r"planned peak per device: [\d.]+ GiB of [\d.]+ GiB: fits", out), out
  assert re.search(r"planned in [\d.]+ s \(\d+ compiles of the step from shapes alone", out)
  # A pure bfloat16 full fine-tune with AdamW (params and moments in bfloat16).
  out = planned(capsys, "--gpu=a100-80g", "--max_devices=8", "--param_dtype=bfloat16",
                *llama_8b)
  assert "bfloat16 params" in out
  assert re.search(r"planned peak per device: [\d.]+ GiB of [\d.]+ GiB: does NOT fit", out), out
  assert re.search(r"needs [248] x a100-80g with FSDP", out), out


def test_every_shipped_config_is_a_purejax_model():
  from purejax.weights import huggingface
  sizes = {}
  for path in sorted(CONFIGS.glob("*.json")):
    config = huggingface.config_from_file(str(path))
    params = jax.eval_shape(lambda c=config: gpt.init_params(c, jax.random.PRNGKey(0)))
    sizes[path.stem] = round(gpt.num_params(params) / 1e9, 2)
  assert sizes == {"gemma-3-1b": 1.0, "llama-3.1-8b": 8.03, "llama-3.2-1b": 1.24,
                   "qwen2.5-7b": 7.62}


def test_qlora_plans_refuse_what_they_cannot_hold(capsys):
  error = refusal(capsys, plan, "--gpu=l4", "--quantize=q4_1")
  assert "--quantize=q4_1 holds LoRA's frozen base; add --lora_rank" in error
  error = refusal(capsys, plan, "--gpu=l4", "--quantize=gguf", "--lora_rank=4")
  assert "plan with q4_1" in error
  error = refusal(capsys, plan, "--gpu=l4", "--hf_config=" + str(CONFIGS / "qwen2.5-7b.json"),
                  "--n_layer=2")
  assert "--n_layer has no effect with --hf_config" in error

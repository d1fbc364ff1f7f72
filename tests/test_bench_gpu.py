"""The benches' harness (bench/harness.py, bench/jobs.py), bench/gpu.py's and bench/finetune_profile.py's pieces; no GPU needed."""

import dataclasses
import importlib
import math
import pathlib

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.data import need
from bench import finetune_profile
from bench import gpu
from bench import gpu_rows
from bench import harness
from bench import jobs
from bench import speedrun
from purejax import gpt
from purejax.data import datasets
from purejax.optimizers import optim
from purejax.training.pure import flops


def test_alternate_runs_the_arms_in_turn_and_reports_every_round():
  order, rounds_seen = [], []
  arms = {name: (lambda name=name: order.append(name) or len(order)) for name in "ab"}
  times = harness.alternate(arms, 3, after_round=lambda t: rounds_seen.append(len(t["b"])))
  assert order == ["a", "b", "a", "b", "a", "b"]
  assert times == {"a": [1, 3, 5], "b": [2, 4, 6]}
  assert rounds_seen == [1, 2, 3]


def test_alternate_drops_a_failing_arm_and_stops_when_out_of_time():
  errors, calls = {}, []

  def broken():
    raise ValueError("no")

  times = harness.alternate({"ok": lambda: calls.append(1) or 1.0, "broken": broken}, 5,
                            min_rounds=2, out_of_time=lambda: True,
                            on_error=lambda name, e: errors.setdefault(name, str(e)))
  assert times == {"ok": [1.0, 1.0], "broken": []}  # out of time: only min_rounds
  assert errors == {"broken": "no"}
  with pytest.raises(ValueError):  # without on_error the error propagates
    harness.alternate({"broken": broken}, 1)


def test_summarise_medians_and_per_round_ratios():
  rows = harness.summarise({"ours": [1.0, 2.0, 1.0], "twin": [2.0, 3.0]}, {"twin": "ours"},
                           "s/iter")
  assert rows["ours"] == {"median": 1.0, "min": 1.0, "max": 2.0, "unit": "s/iter", "n": 3}
  np.testing.assert_allclose(rows["twin"]["ratio"], 1.75)  # median of 2/1 and 3/2
  assert rows["twin"]["vs"] == "ours" and rows["twin"]["ratio_max"] == 2.0
  # One reference for every arm; an arm without times is left out.
  rows = harness.summarise({"ref": [2.0, 4.0], "x": [4.0, 4.0], "empty": []}, "ref", "s")
  assert rows["x"]["ratio"] == 1.5 and "ratio" not in rows["ref"] and "empty" not in rows


def test_results_files_are_never_overwritten(tmp_path):
  first = harness.unused_results_path(tmp_path, "2026-01-01-gpu-hij")
  assert first == tmp_path / "2026-01-01-gpu-hij.json"
  harness.write_results(first, {"meta": {}, "results": {}})
  second = harness.unused_results_path(tmp_path, "2026-01-01-gpu-hij")
  assert second.name == "2026-01-01-gpu-hij-2.json"
  job = jobs.Job("j.sample", second, deadline=0.0, title="sampling")
  job.result["rows"] = {"purejax": {"median": 1.0}}
  job.save()
  assert harness.read_results(second)["results"]["j.sample"]["rows"]["purejax"]["median"] == 1.0
  assert harness.read_results(tmp_path / "missing.json") == {"meta": {}, "results": {}}
  assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file, then renamed


def test_markdown_lines_per_arm_and_notes():
  table = harness.markdown(
      {"a": {"rows": {"ours": {"median": 1.0}, "twin": {"median": 2.0, "ratio": 2.0,
                                                       "ratio_min": 1.5, "ratio_max": 3.0}}},
       "b": {"rows": {}, "note": "crashed"}},
      [("median", lambda row: f"{row['median']:.1f}"),
       ("ratio", lambda row: harness.ratio_text(row, "reference"))],
      notes=lambda result: [result["note"]] if "note" in result else [])
  assert table.splitlines() == [
      "| case | arm | median | ratio |", "| --- | --- | --- | --- |",
      "| a | ours | 1.0 | reference |", "| a | twin | 2.0 | 2.00x (1.50-3.00) |",
      "| b |  |  | crashed |"]


def test_gpu_markdown_takes_partial_and_failed_jobs():
  table = gpu_rows.markdown({
      "h.train": {"rows": {"purejax": {"median": 0.05, "min": 0.04, "max": 0.06,
                                       "unit": "s/iter", "tokens_per_s": 2.4e5, "mfu": 0.4,
                                       "peak_bytes": 2**31, "program_peak_bytes": 2**30,
                                       "cudnn_attention_calls": 3}}},
      "h.medium": {"status": "crashed", "errors": {"process": "exit code 1"}},
      "i.purejax_recipe": {"rows": {"purejax": {"median": 0.01, "min": None, "max": None,
                                                "unit": "s/iter", "best_val_loss": 1.47}}},
  })
  assert "50.00 ms/iter (40.00-60.00)" in table and "40.0%" in table
  assert "| 2.0 | 1.00 | 3 |" in table  # peak GiB, program peak GiB, cuDNN attention calls
  assert "status crashed" in table and "best val 1.4700" in table


def test_add_speed_counts_flops_without_position_embeddings():
  config = gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32,
                         bias=False)
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  n_params = sum(x.size for x in jax.tree.leaves(params)) - config.block_size * config.n_embd
  per_token = flops.transformer_flops_per_token(n_params, config.n_layer, config.n_head,
                                                config.head_dim, config.block_size)
  row = gpu_rows.add_speed({"median": 0.5}, config, batch=4, peak_flops=1e6)
  assert row["flops_per_token"] == per_token and row["ms_per_iter"] == 500.0
  assert row["tokens_per_s"] == 4 * 16 / 0.5
  np.testing.assert_allclose(row["mfu"], per_token * row["tokens_per_s"] / 1e6)
  # Without a known peak there is no MFU.
  assert gpu_rows.add_speed({"median": 0.5}, config, 4, peak_flops=None)["mfu"] is None


def lowered_cudnn_attention(monkeypatch):
  """A train step's attention lowered for CUDA on this (CPU) host, as StableHLO text."""
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=g-import-not-at-top
  # JAX asks the installed cuDNN for its version while tracing; a CPU host has none.
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
  q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)

  def loss(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return out.astype(jnp.float32).sum()

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(
      lowering_platforms=("cuda",)).as_text()


def test_cudnn_attention_calls_counts_forward_and_backward(monkeypatch):
  try:
    text = lowered_cudnn_attention(monkeypatch)
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"this JAX cannot lower cuDNN attention for CUDA on a CPU host: {e}")
  assert harness.cudnn_attention_calls(text) == {"__cudnn$fmhaSoftmax": 1,
                                                 "__cudnn$fmhaSoftmaxBackward": 1}
  # The optimised HLO of a compiled program names its calls this way.
  hlo = ('%c = (bf16[2,4,128,64]) custom-call(%q, %k, %v), '
         'custom_call_target="__cudnn$fmhaSoftmax", backend_config={}')
  assert harness.cudnn_attention_calls(hlo) == {"__cudnn$fmhaSoftmax": 1}
  assert harness.cudnn_attention_calls(jax.jit(jnp.sin).lower(1.0).as_text()) == {}


def test_program_stats_reads_the_compiled_programs_memory():
  x = jnp.ones((256, 256), jnp.float32)
  stats = harness.program_stats(jax.jit(lambda a: (a @ a).sum()).lower(x).compile())
  assert stats["cudnn_attention_calls"] == 0 and stats["cudnn_attention_targets"] == {}
  assert stats["program_peak_bytes"] >= x.nbytes  # at least its argument


@pytest.mark.slow  # compiles a train step: ~10 s on a loaded 2-core machine
def test_purejax_train_arm_records_what_ran():
  config = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
  info, optioned = {}, {}
  arm = harness.purejax_train_arm(config, gpu.GPT2_OPTIMIZER, batch_size=2, steps=1,
                                  data=jnp.arange(100) % 32, info=info)
  # An arm whose program alone is compiled with XLA options (a GPU option, which
  # the CPU's compiler ignores) runs the same first step.
  harness.purejax_train_arm(config, gpu.GPT2_OPTIMIZER, batch_size=2, steps=1,
                            data=jnp.arange(100) % 32, info=optioned,
                            compiler_options={"xla_gpu_enable_triton_gemm": False})
  assert optioned["last_loss"] == info["last_loss"]
  assert arm() > 0 and math.isfinite(info["last_loss"])
  assert info["cudnn_attention_calls"] == 0  # CPU forms
  assert info["program_peak_bytes"] > 0 and info["forms"]["attention"]


def test_lr_table_is_the_librarys_schedule():
  config = optim.OptimizerConfig(learning_rate=1e-3, warmup_iters=10, decay_iters=100,
                                 min_lr=1e-4)
  table = harness.lr_table(config, 120)
  schedule = optim.make_schedule(config)
  np.testing.assert_allclose(table, [float(schedule(i)) for i in range(120)], rtol=1e-6)
  # nanoGPT's get_lr: warmup from lr/(warmup+1), cosine down to min_lr, then held.
  np.testing.assert_allclose(table[0], 1e-3 / 11, rtol=1e-6)
  np.testing.assert_allclose(table[10], 1e-3, rtol=1e-6)
  np.testing.assert_allclose(table[55], 1e-4 + 0.5 * 9e-4, rtol=1e-5)
  np.testing.assert_allclose(table[100:], 1e-4, rtol=1e-6)


def test_search_largest_bisects_the_candidates():
  candidates = [12, 16, 24, 32, 48, 64, 96, 128, 192]
  tried = []

  def attempt(fits_up_to):
    return lambda batch: tried.append(batch) or batch <= fits_up_to

  assert gpu.search_largest(candidates, attempt(100), lambda: False) == 96
  assert tried == [12, 48, 96, 128]
  tried.clear()
  assert gpu.search_largest(candidates, attempt(8), lambda: False) is None and tried == [12]
  tried.clear()
  assert gpu.search_largest(candidates, attempt(1000), lambda: True) == 12 and tried == [12]


def test_select_jobs():
  assert jobs.select(["j"], list(gpu.JOBS)) == ["j.sample"]
  assert jobs.select(["h.max_batch", "h.train"], list(gpu.JOBS)) == [
      "h.train", "h.max_batch.purejax", "h.max_batch.torch", "h.max_batch.purejax_unrolled"]
  assert jobs.select(["h", "i", "j"], list(gpu.JOBS)) == list(gpu.JOBS)
  with pytest.raises(app.UsageError, match="unknown"):
    jobs.select(["k"], list(gpu.JOBS))


def test_token_file_and_consecutive_calls(tmp_path):
  path = tmp_path / "train.bin"
  gpu.write_token_file(path, 5000, vocab=300)
  tokens = np.memmap(path, dtype=np.uint16, mode="r")
  assert tokens.shape == (5000,) and tokens.max() < 300 and len(np.unique(tokens)) > 200
  calls, marks = iter([9.0, 9.0, 1.0, 3.0]), []
  arm = gpu.consecutive_calls(lambda: next(calls), untimed=2, timed=2, timing=marks.append)
  assert arm() == 2.0 and marks == [True, False]  # the mean of the timed calls only


def test_shakespeare_is_split_as_nanogpt_splits_it():
  text = gpu.shakespeare()
  raw = (pathlib.Path(datasets.EMBEDDED_SHAKESPEARE_DIR) / "input.txt").read_text()
  assert text.tokenizer.chars == "".join(sorted(set(raw))) and text.vocab_size == 65
  n = int(len(raw) * 0.9)
  assert len(text.train) == n and len(text.val) == len(raw) - n
  assert text.tokenizer.decode(text.val[:50]) == raw[n:n + 50]


BENCH_FLAGS = ("cases", "quick", "time_budget_s", "runs", "dump_to", "seeds", "epochs", "mb",
               "time_rounds")


def test_the_benches_import_together_and_define_no_flags_on_import():
  for module in ("bench.run", "bench.gpu", "bench.gpu_rows", "bench.harness", "bench.jobs",
                 "bench.sweeps", "bench.hlo_ab", "bench.mlp_epoch", "bench.tokenize_bpe",
                 "bench.arch_compare", "bench.speedrun"):
    importlib.import_module(module)
  for name in BENCH_FLAGS:
    assert name not in flags.FLAGS


def test_the_pytorch_recipe_bench_defines_no_flags_on_import():
  need("torch")  # the recipe's twin is PyTorch from its first line
  importlib.import_module("bench.torch_recipe")
  for name in BENCH_FLAGS:
    assert name not in flags.FLAGS


def test_the_speedrun_ablations_each_take_one_piece_out_of_the_modern_recipe():
  cpu = speedrun.SIZES["cpu"]
  modern, modern_optimizer = speedrun.arm_configs("modern", cpu)
  assert modern_optimizer.name == "muon" and modern.qk_norm and modern.value_embeds
  for name in speedrun.ABLATIONS:
    config, optimizer = speedrun.arm_configs(name, cpu)
    changed = [f.name for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(modern, f.name)]
    assert (len(changed) + (optimizer != modern_optimizer)) >= 1, name
    assert len(changed) <= 2, (name, changed)  # one piece: a field, or a norm's two


def test_the_speedrun_sizes_change_the_size_and_never_the_block():
  for size in speedrun.SIZES.values():
    for arm in speedrun.RECIPES:
      config, _ = speedrun.arm_configs(arm, size)
      assert (config.n_layer, config.n_embd, config.block_size, config.dropout) == (
          size.model.n_layer, size.model.n_embd, size.model.block_size, size.model.dropout)
  gpu = speedrun.SIZES["gpu"]
  assert (gpu.model.n_layer, gpu.model.n_embd, gpu.model.block_size, gpu.batch_size) == (
      6, 384, 256, 64)


@pytest.mark.slow  # trains the tokenizer and encodes the corpus: ~7 s
def test_the_speedrun_bpe_arms_train_on_the_corpus_own_bytes_at_about_the_same_size(tmp_path):
  from purejax.data import corpus, tokenizer_json  # pylint: disable=import-outside-toplevel
  tok = tokenizer_json.load(speedrun.train_bpe(str(tmp_path)))
  assert tok.vocab_size == speedrun.BPE_VOCAB_SIZE
  # The alphabet is the train split's 65 characters (plus <|endoftext|>), so the other
  # 190 tokens are merges; the val split holds no other byte, so it encodes.
  text = corpus.load_corpus("tiny_shakespeare", tokenizer=tok)
  assert text.vocab_size == speedrun.BPE_VOCAB_SIZE and len(text.val)
  assert int(tok.byte_lengths().max()) > 2
  cpu = speedrun.SIZES["cpu"]
  reference = speedrun.param_count("nanogpt", cpu)
  for arm in speedrun.RECIPES:
    if speedrun.uses_bpe(arm):
      assert speedrun.arm_configs(arm, cpu)[0].vocab_size == tok.vocab_size
      assert speedrun.param_count(arm, cpu) <= 1.07 * reference, arm


def test_the_speedrun_reads_the_first_step_that_reaches_the_target():
  evals = [{"step": 25, "val_loss": 2.5}, {"step": 50, "val_loss": 1.9},
           {"step": 75, "val_loss": 1.8}]
  assert speedrun.first_reaching(evals, 1.95) == 50
  assert speedrun.first_reaching(evals, 1.9) == 50
  assert speedrun.first_reaching(evals, 1.7) is None


def test_the_fine_tuning_profile_tells_products_attention_and_the_rest_apart():
  heads = (9, 3)  # SmolLM2: query heads, key/value heads
  kind = lambda name, shape: finetune_profile.purejax_kind(name, shape, heads)
  assert kind("ynn_fusion.5", "f32[1024,3072]{1,0}") == "products"
  assert kind("dot.322", "f32[576,3072]{1,0}") == "products"
  assert kind("ynn_fusion.13", "f32[4,3,192,256]{3,2,1,0}") == "attention"  # batched dot
  assert kind("slice_concatenate_fusion.3", "f32[4,256,9,64]{3,2,1,0}") == "attention"
  assert kind("wrapped_broadcast.3", "f32[30,1024,3072]{2,1,0}") == "other"  # scan stack
  assert kind("add_divide_fusion", "f32[4,256,1536]{2,1,0}") == "other"
  program = "  %ynn_fusion.5 = f32[1024,3072]{1,0} fusion(%a, %b), kind=kCustom\n"
  assert finetune_profile._shapes_by_op(program) == {  # pylint: disable=protected-access
      "ynn_fusion.5": ("f32[1024,3072]{1,0}", "fusion")}

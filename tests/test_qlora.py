"""LoRA on a frozen base held quantized or in bfloat16 (`purejax.train --quantize`): the
base's codes never change and get no optimizer state, the adapters train, a run
resumes exactly, and its folder reads back (merged into float32) for every use."""

import numpy as np
import pytest

from helpers.cli import final, refusal, run_cli
from helpers.runs import saved_model
from purejax import checkpoint
from purejax import gpt
from purejax import lora
from purejax import weights
from purejax.cli import train as train_cli
from purejax.data import tokenizers
from purejax.ops import quant

TEXT = "the quick brown fox jumps over the lazy dog.\n" * 40
TOKENIZER = tokenizers.CharTokenizer("".join(sorted(set(TEXT))))
# n_embd 64: whole blocks of 32 rows for q8_0/q4_1 in every matrix.
CONFIG = gpt.GPTConfig(vocab_size=TOKENIZER.vocab_size, block_size=32, n_layer=2, n_head=2,
                       n_embd=64, dropout=0.0, bias=False)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
  return saved_model(tmp_path_factory.mktemp("base"), CONFIG, TOKENIZER)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("text") / "fox.txt"
  path.write_text(TEXT)
  return path


def train(base_run, corpus, out, *flags):
  return final(run_cli(train_cli, f"--init_from={base_run}", f"--dataset={corpus}",
                       f"--out_dir={out}", "--lora_rank=4", "--batch_size=4",
                       "--eval_interval=4", "--eval_iters=1", "--learning_rate=1e-2",
                       "--warmup_iters=0", "--lr_decay_iters=8", *flags))


def base_and_adapters(out):
  params, _, _ = weights.pretrained._read_purejax(str(out), merged=False)[:3]  # pylint: disable=protected-access
  return params["base"], params["adapters"]


@pytest.mark.slow
@pytest.mark.parametrize("held", ["int8", "q4_1", "bfloat16"])
def test_a_held_base_trains_its_adapters_and_never_changes(tmp_path, base_run, corpus, held):
  first = train(base_run, corpus, tmp_path / "a", "--max_iters=4", f"--quantize={held}")
  base, adapters = base_and_adapters(tmp_path / "a")
  w = base["blocks"]["mlp"]["fc"]["w"]
  if held == "bfloat16":
    assert w.dtype == np.dtype("bfloat16") and base["wte"]["embedding"].dtype == w.dtype
    assert base["ln_f"]["scale"].dtype == np.float32
  else:
    assert isinstance(w, quant.QuantizedWeight) and w.bits == (4 if held == "q4_1" else 8)
  original, _, _ = weights.from_purejax(str(base_run))
  want, _ = quant.hold_matrices(original, held)
  import jax
  for got, expected in zip(jax.tree.leaves(base), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))  # frozen, bitwise
  assert all(np.abs(np.asarray(b)).max() > 0 for b in jax.tree.leaves(
      {k: v["b"] for k, v in adapters.items()}))  # B starts at 0: the adapters moved
  # The optimizer holds state for the adapters only (no moments of the base).
  arrays, _ = checkpoint.latest_meta(str(tmp_path / "a"))
  assert not [k for k in arrays if "opt_state" in k and "base" in k]
  # Resumed, 4 + 4 steps equal 8 in one go.
  again = train(base_run, corpus, tmp_path / "a", "--max_iters=8", f"--quantize={held}",
                "--resume")
  whole = train(base_run, corpus, tmp_path / "b", "--max_iters=8", f"--quantize={held}")
  assert again["train_loss"] == whole["train_loss"] and first["step"] == 4
  # The folder reads back merged into float32: the held base plus the adapters.
  merged, config, _ = weights.from_purejax(str(tmp_path / "b"))
  base, adapters = base_and_adapters(tmp_path / "b")
  floats = jax.tree.map(quant.dense, base, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
  expect = lora.merge(floats, adapters, 4.0)
  np.testing.assert_allclose(merged["blocks"]["mlp"]["fc"]["w"],
                             np.asarray(expect["blocks"]["mlp"]["fc"]["w"], np.float32),
                             rtol=1e-6, atol=1e-6)
  assert merged["blocks"]["mlp"]["fc"]["w"].dtype == np.float32 and config == CONFIG


@pytest.mark.slow
@pytest.mark.parametrize("dtype, held", [("bfloat16", np.dtype("bfloat16")),
                                         ("float32", np.dtype("float32"))])
def test_lora_holds_its_frozen_base_in_the_matmul_dtype(tmp_path, base_run, corpus, dtype,
                                                       held):
  # Without --quantize, the base is held as its products read it: bfloat16 under
  # bfloat16 matmuls (half the bytes, the same products), float32 otherwise.
  train(base_run, corpus, tmp_path / "a", "--max_iters=1", f"--dtype={dtype}")
  base, _ = base_and_adapters(tmp_path / "a")
  assert base["blocks"]["mlp"]["fc"]["w"].dtype == held
  assert base["wte"]["embedding"].dtype == held
  assert base["ln_f"]["scale"].dtype == np.float32  # norms stay float32
  # --quantize=float32 keeps the base as loaded whatever the matmuls' dtype (a run
  # begun that way resumes with it).
  train(base_run, corpus, tmp_path / "b", "--max_iters=1", f"--dtype={dtype}",
        "--quantize=float32")
  base, _ = base_and_adapters(tmp_path / "b")
  assert base["blocks"]["mlp"]["fc"]["w"].dtype == np.float32


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True])
def test_a_held_base_trains_on_two_devices_with_microbatches_as_on_one(tmp_path, base_run,
                                                                      corpus, fsdp):
  # Two devices, two microbatches each: every device scans its rows, then one `pmean`
  # of the gradients, whose integer leaves (the codes' zeros) must stay integer zeros.
  from helpers.runs import step_losses, train_run
  flags = [f"--init_from={base_run}", f"--dataset={corpus}", "--lora_rank=4",
           "--batch_size=4", "--eval_interval=4", "--eval_iters=1", "--max_iters=4",
           "--learning_rate=1e-2", "--warmup_iters=0", "--lr_decay_iters=8",
           "--log_interval=1", "--quantize=int8"]
  train_run(tmp_path / "one", *flags)
  train_run(tmp_path / "two", *flags, "--grad_accum_steps=2", f"--fsdp={fsdp}",
            num_devices=2)
  np.testing.assert_allclose(step_losses(tmp_path / "two"), step_losses(tmp_path / "one"),
                             rtol=1e-5)
  import jax
  for out in ("one", "two"):
    base, _ = base_and_adapters(tmp_path / out)
    w = base["blocks"]["mlp"]["fc"]["w"]
    assert isinstance(w, quant.QuantizedWeight) and w.codes.dtype == np.int8
  for a, b in zip(jax.tree.leaves(base_and_adapters(tmp_path / "one")),
                  jax.tree.leaves(base_and_adapters(tmp_path / "two"))):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("flags, message", [
    (["--quantize=int8"], "--quantize=int8 holds a pretrained model's frozen base for LoRA"),
    (["--quantize=gguf", "--lora_rank=4"], "not a .gguf file"),
])
def test_bad_quantize_requests_are_one_line(tmp_path, capsys, base_run, corpus, flags,
                                            message):
  error = refusal(capsys, train_cli, f"--init_from={base_run}", f"--dataset={corpus}",
                  f"--out_dir={tmp_path / 'out'}", "--max_iters=1", *flags)
  assert message in error
  assert not list((tmp_path / "out").glob("*"))


def test_an_export_in_a_quantized_type_the_writer_lacks_is_one_line(tmp_path, capsys,
                                                                    base_run):
  from purejax.cli import convert as convert_cli
  target = tmp_path / "out.gguf"
  error = refusal(capsys, convert_cli, f"--from=purejax:{base_run}", f"--to=gguf:{target}",
                  "--gguf_type=q4_1")
  assert "--gguf_type=q4_1" in error and "q8_0" in error
  assert not target.exists()


@pytest.mark.slow
def test_a_qlora_run_runs_unmerged_beside_its_held_base(tmp_path, base_run, corpus, capsys):
  # `--quantize=held` (sample, chat, eval, serve): the model as trained, adapters beside
  # the quantized base, in the base's memory; the same logits as the merged float32.
  from purejax.cli import sample as sample_cli
  import jax
  import jax.numpy as jnp
  from purejax.ops.matmul import LowRankWeight
  train(base_run, corpus, tmp_path / "q", "--max_iters=4", "--quantize=q4_1")
  beside, config, _ = weights.from_purejax(str(tmp_path / "q"), merge_adapters=False)
  w = beside["blocks"]["mlp"]["fc"]["w"]
  assert isinstance(w, LowRankWeight) and isinstance(w.base, quant.QuantizedWeight)
  merged, _, _ = weights.from_purejax(str(tmp_path / "q"))
  tokens = jnp.asarray([[1, 2, 3, 4, 5, 6]])
  np.testing.assert_allclose(gpt.forward(beside, tokens, config),
                             gpt.forward(merged, tokens, config), rtol=1e-4, atol=1e-4)
  held_bytes = sum(x.nbytes for x in jax.tree.leaves(beside["blocks"]))
  assert held_bytes < sum(x.nbytes for x in jax.tree.leaves(merged["blocks"])) / 3
  # The command lines: the same greedy text either way; a model that is no LoRA run is
  # refused in one line.
  texts = [final_text(run_cli(sample_cli, f"--out_dir={tmp_path / 'q'}", "--start=the ",
                              "--max_new_tokens=12", "--temperature=0", *flags))
           for flags in ([], ["--quantize=held"])]
  assert texts[0] == texts[1]
  assert "is not a LoRA run" in refusal(capsys, sample_cli, f"--out_dir={base_run}",
                                        "--quantize=held")


@pytest.mark.slow
def test_a_run_whose_frozen_base_file_is_lost_resumes_from_its_source(tmp_path, base_run,
                                                                       corpus):
  # The base is written once (frozen_<sha256>.npz); lost, it is the base loaded again
  # from --init_from (the same SHA-256), and the next checkpoint writes it back.
  train(base_run, corpus, tmp_path / "a", "--max_iters=4", "--quantize=q4_1")
  (frozen,) = (tmp_path / "a").glob("frozen_*.npz")
  frozen.unlink()
  process = run_cli(train_cli, f"--init_from={base_run}", f"--dataset={corpus}",
                    f"--out_dir={tmp_path / 'a'}", "--lora_rank=4", "--batch_size=4",
                    "--eval_interval=4", "--eval_iters=1", "--learning_rate=1e-2",
                    "--warmup_iters=0", "--lr_decay_iters=8", "--max_iters=8",
                    "--quantize=q4_1", "--resume")
  assert final(process)["step"] == 8 and "starting weights" in process.stdout + process.stderr
  assert "at step 4" in process.stdout + process.stderr  # resumed, not started anew
  assert frozen.exists()


def test_held_on_a_folder_without_a_run_is_one_line(tmp_path, capsys):
  from purejax.cli import sample as sample_cli
  assert "is not a purejax run folder" in refusal(capsys, sample_cli,
                                                  f"--out_dir={tmp_path}", "--quantize=held")


def final_text(process):
  assert process.returncode == 0, process.stderr[-2000:]
  return process.stdout

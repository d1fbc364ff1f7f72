"""loop: the GPT and MLP training loops as library calls, and what a run writes.

Each test trains a tiny model in-process for a few dozen steps on a corpus
it makes itself, then reads back what the run left in its directory.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from purejax import checkpoint
from purejax import gpt
from purejax.data import corpus as corpus_lib
from purejax.data import tokenizers
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.effects import monitor
from purejax.training.effects import runs
from purejax.training.loops import gpt_loop
from purejax.training.loops import gpt_run
from purejax.training.loops import recipes
from purejax.training.pure import flops
from purejax.training.pure import parallel

from helpers.cli import tensorboard_scalars

TINY = gpt.GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, n_embd=16, bias=False)
FAST = gpt_loop.GPTTrainConfig(batch_size=4, max_iters=20, eval_interval=10, eval_iters=2,
                           log_interval=5, steps_per_call=5, sample_tokens=0, progress=False)
OPT = dataclasses.replace(recipes.GPT_OPTIMIZER, warmup_iters=2)


def make_corpus(train_text: str, val_text: str) -> corpus_lib.Corpus:
  tok = tokenizers.CharTokenizer.from_text(train_text + val_text)
  return corpus_lib.Corpus(tokenizer=tok, train=tok.encode(train_text),
                           val=tok.encode(val_text), source="test text")


TEXT = make_corpus("abcd" * 300 + "xyz", "abcd" * 60)


def train(out_dir, corpus=TEXT, config=TINY, train_config=FAST, opt=OPT, **run):
  config = dataclasses.replace(config, vocab_size=corpus.vocab_size)
  return gpt_loop.train_gpt(config, corpus, train_config, opt,
                        runs.RunConfig(out_dir=str(out_dir), **run))

@pytest.mark.slow  # over 5 s: the full suite runs it

def test_a_run_logs_loss_lr_grad_norm_and_evals_to_metrics_jsonl(tmp_path):
  metrics = train(tmp_path)
  records = monitor.read_metrics(tmp_path)
  train_records = [r for r in records if r["kind"] == "train"]
  evals = [r for r in records if r["kind"] == "eval"]
  assert [r["step"] for r in train_records] == [5, 10, 15, 20]
  assert [r["step"] for r in evals] == [0, 10, 20]
  for r in train_records:
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "ms_per_iter"} <= r.keys()
    assert "mfu" not in r  # no known peak for a CPU
  schedule = optim.make_schedule(dataclasses.replace(OPT, decay_iters=20))
  np.testing.assert_allclose([r["lr"] for r in train_records],
                             [schedule(s - 1) for s in (5, 10, 15, 20)], rtol=1e-6)
  assert metrics["val_loss"] == evals[-1]["val_loss"]
  assert evals[-1]["val_loss"] < evals[0]["val_loss"]
  assert (tmp_path / "loss.png").exists()
  # The per-step losses live in metrics.jsonl, not in the checkpoint.
  _, meta = checkpoint.latest_meta(str(tmp_path))
  assert "losses" not in meta


@pytest.mark.slow
def test_tensorboard_reads_back_the_logged_scalars(tmp_path):
  train(tmp_path)
  scalars = tensorboard_scalars(tmp_path)
  records = monitor.read_metrics(tmp_path)
  for tag, kind, name in (("train/loss", "train", "loss"), ("train/lr", "train", "lr"),
                          ("eval/val_loss", "eval", "val_loss"),
                          ("eval/val_bpb", "eval", "val_bpb")):
    logged = [(r["step"], r[name]) for r in records if r["kind"] == kind]
    read = scalars[tag]
    assert [s for s, _ in read] == [s for s, _ in logged]
    np.testing.assert_allclose([v for _, v in read], [v for _, v in logged], rtol=1e-6)


@pytest.mark.slow
def test_resume_with_more_steps_keeps_the_run_schedule(tmp_path, capsys):
  train(tmp_path)
  longer = dataclasses.replace(FAST, max_iters=30)
  with pytest.raises(ValueError, match="pass `resume=True`"):
    train(tmp_path, train_config=longer)
  train(tmp_path, train_config=longer, resume=True)
  out = capsys.readouterr().out
  assert "keeping the run's schedule: it ends at step 20" in out
  records = monitor.read_metrics(tmp_path)
  steps = [r["step"] for r in records if r["kind"] == "train"]
  assert steps == sorted(set(steps)) and steps[-1] == 30
  late = [r["lr"] for r in records if r["kind"] == "train" and r["step"] > 20]
  np.testing.assert_allclose(late, OPT.min_lr, rtol=1e-6)
  # An explicit end changes the schedule.
  train(tmp_path, train_config=dataclasses.replace(FAST, max_iters=40),
        opt=dataclasses.replace(OPT, decay_iters=60), resume=True)
  last = [r for r in monitor.read_metrics(tmp_path) if r["kind"] == "train"][-1]
  assert last["lr"] > OPT.min_lr * 1.01

@pytest.mark.slow  # over 5 s: the full suite runs it

def test_resume_into_an_empty_directory_says_it_starts_a_new_run(tmp_path, capsys):
  train(tmp_path, train_config=dataclasses.replace(FAST, max_iters=5, eval_interval=5),
        resume=True)
  assert "no valid checkpoint" in capsys.readouterr().out


@pytest.mark.slow
def test_best_checkpoint_is_the_lowest_val_loss_when_val_loss_rises(tmp_path):
  # Train and val disagree on every transition (abcd... vs dcba...): after the
  # model learns which characters occur, learning train's order makes the
  # val loss rise, as an overfitting run's does.
  corpus = make_corpus("abcd" * 300 + "xyzw" * 3, "dcba" * 60)
  config = gpt_loop.GPTTrainConfig(batch_size=8, max_iters=60, eval_interval=5, eval_iters=2,
                               log_interval=5, steps_per_call=5, sample_tokens=0,
                               always_save_checkpoint=False, progress=False)
  train(tmp_path, corpus=corpus, train_config=config,
        opt=dataclasses.replace(OPT, learning_rate=3e-3))
  evals = [r for r in monitor.read_metrics(tmp_path) if r["kind"] == "eval" and r["step"]]
  val = [r["val_loss"] for r in evals]
  lowest = int(np.argmin(val))
  assert lowest < len(val) - 1 and val[-1] > val[lowest] + 0.05, val  # it does rise
  arrays, manifest = checkpoint.read(checkpoint.best_path(str(tmp_path)))
  assert manifest["step"] == evals[lowest]["step"]
  latest, _ = checkpoint.read(checkpoint.list_checkpoints(str(tmp_path))[0][1])
  name = "['params']['wte']['embedding']"
  assert not np.array_equal(arrays[name], latest[name])
  # And evaluating it gives the logged val loss.
  params = checkpoint.extract(arrays, {"params": gpt.init_params(
      dataclasses.replace(TINY, vocab_size=corpus.vocab_size), jax.random.PRNGKey(0))})
  losses = gpt_loop.evaluate_gpt(params["params"], dataclasses.replace(
      TINY, vocab_size=corpus.vocab_size), corpus, config)
  np.testing.assert_allclose(losses["val_loss"], val[lowest], rtol=1e-5)


@pytest.mark.slow
def test_profile_steps_write_a_trace(tmp_path):
  train(tmp_path, train_config=dataclasses.replace(FAST, profile_steps=(5, 10)))
  assert list((tmp_path / "profile").rglob("*.xplane.pb"))


@pytest.mark.slow
def test_host_batches_train_like_device_batches(tmp_path, monkeypatch):
  # Corpora too large for the device are read by the host one call ahead.
  fast = dataclasses.replace(OPT, learning_rate=1e-2)
  on_device = train(tmp_path / "device", opt=fast)
  monkeypatch.setattr(corpus_lib, "fits_on_device", lambda corpus: False)
  on_host = train(tmp_path / "host", opt=fast)
  # Other batches (the host draws with numpy), the same learning.
  assert on_host["val_loss"] < 1.0 and on_device["val_loss"] < 1.0, (on_host, on_device)
  assert [r["step"] for r in monitor.read_metrics(tmp_path / "host")] == [
      r["step"] for r in monitor.read_metrics(tmp_path / "device")]


def test_bad_settings_are_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="`profile_steps=5,50`"):
    dataclasses.replace(FAST, profile_steps=(5, 50))
  with pytest.raises(ValueError, match="below the 7 ids"):
    gpt_loop.train_gpt(dataclasses.replace(TINY, vocab_size=3), TEXT, FAST, OPT,
                   runs.RunConfig(out_dir=str(tmp_path)))
  with pytest.raises(ValueError, match="must be shorter than the validation text"):
    train(tmp_path, corpus=make_corpus("abcd" * 100, "abcd"))
  json.dumps(dataclasses.asdict(FAST))  # configs stay JSON-able


@pytest.mark.slow
def test_logged_mfu_is_nanogpts_formula_over_the_given_peak(tmp_path):
  # bench.gpu's case h computes MFU with the same two functions, so the two
  # agree whenever they time the same step.
  train(tmp_path, train_config=dataclasses.replace(FAST, peak_flops=1e12))
  config = dataclasses.replace(TINY, vocab_size=TEXT.vocab_size)
  n_params = gpt.num_params(gpt.init_params(config, jax.random.PRNGKey(0)))
  per_token = flops.transformer_flops_per_token(n_params, config.n_layer, config.n_head,
                                                config.head_dim, config.block_size)
  for record in (r for r in monitor.read_metrics(tmp_path) if r["kind"] == "train"):
    np.testing.assert_allclose(record["mfu"], per_token * record["tokens_per_s"] / 1e12,
                               rtol=1e-6)


@pytest.mark.slow  # a short training run
def test_a_schedule_that_does_not_fit_the_run_is_one_line_at_start_up(tmp_path, capsys):
  # nanoGPT's recipe warms up for 100 steps: a 20-step fine-tune never reaches its rate.
  recipe = recipes.GPT_OPTIMIZER
  warnings = optim.schedule_warnings(dataclasses.replace(recipe, decay_iters=20), 20)
  assert warnings == [
      f"warmup_iters=100 >= max_iters=20: the run only warms up, to lr "
      f"{recipe.learning_rate * 20 / 101:.3g} of {recipe.learning_rate:g}; lower "
      f"warmup_iters (e.g. 2) for a full schedule.",
      f"decay_iters=20 <= warmup_iters=100: no cosine decay; the rate drops from the warmup "
      f"to min_lr {recipe.min_lr:g} at step 100; make decay_iters longer than the warmup."]
  assert optim.schedule_warnings(dataclasses.replace(recipe, decay_iters=2000), 2000) == []
  assert optim.schedule_warnings(dataclasses.replace(recipe, schedule="constant"), 5) == []
  train(tmp_path, train_config=dataclasses.replace(FAST, max_iters=5, eval_interval=5),
        opt=dataclasses.replace(OPT, warmup_iters=8))
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("warning: ")]
  assert lines == [f"warning: {w}" for w in optim.schedule_warnings(
      dataclasses.replace(OPT, warmup_iters=8, decay_iters=5), 5)] and len(lines) == 2


def test_a_run_takes_its_forms_or_the_overrides_for_its_platform():
  """`forms` is a `kernels.Forms`, or `kernels.select`'s overrides (as the command line's
  flags pass them) chosen for the platform of the run's devices."""
  plan = parallel.make_plan(parallel.ParallelConfig(), 4)
  chosen = gpt_run.forms_of(plan, {"attention": "xla", "attn_block": None})
  assert chosen == kernels.select("cpu", attention="xla")
  assert gpt_run.forms_of(plan, chosen) is chosen
  assert gpt_run.forms_of(plan) == kernels.select("cpu")
  with pytest.raises(ValueError, match="attention='cudnn' runs on NVIDIA GPUs only"):
    gpt_run.forms_of(plan, {"attention": "cudnn"})

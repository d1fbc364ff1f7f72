"""Sweeps, LoRA fine-tunes, replayed steps and W&B logging, driven from the command line.

Each test runs the `purejax.train` command line (and `replay`, `convert`) in-process
(`run_cli`) on a tiny model and a text the test writes itself; the W&B run is a
true `python -m purejax.train`, with W&B's mode set in its environment.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.cli import (SHORT_FLAGS, TINY_FLAGS, final, read_wandb_offline_history, refusal,
                         run_cli, run_module)
from helpers.data import CHAR_GPT_TEXT, SHAKESPEARE, need
from purejax import checkpoint
from purejax import gpt
from purejax import lora
from purejax.cli import convert
from purejax.cli import replay
from purejax.cli import train
from purejax.training.effects import monitor

pytestmark = pytest.mark.slow


def train_losses(out_dir):
  return {r["step"]: r["loss"] for r in monitor.read_metrics(out_dir) if r["kind"] == "train"}


@pytest.mark.budget(40)
def test_a_sweeps_runs_each_train_as_alone_and_one_resumes_alone(tmp_path, text_file):
  args = [*TINY_FLAGS, *SHORT_FLAGS, f"--dataset={text_file}", "--dropout=0.1"]
  out = final(run_cli(train, *args, "--sweep=learning_rate=1e-3,3e-3",
                         "--sweep_seeds=2", f"--out_dir={tmp_path / 'sweep'}"))
  names = [r["run"] for r in out["runs"]]
  assert names == ["learning_rate=0.001_seed=0", "learning_rate=0.001_seed=1",
                   "learning_rate=0.003_seed=0", "learning_rate=0.003_seed=1"]
  for name in names:
    run_dir = tmp_path / "sweep" / name
    assert (run_dir / "ckpt_000000020.npz").exists()
    assert list(run_dir.glob("events.out.tfevents.*"))  # its own TensorBoard run
  # run 3 trained alone: the same losses at every logged step (bit for bit on
  # the CPU, test_a_run_of_a_sweep_one_at_a_time...; float rounding where vmapped)
  solo = tmp_path / "solo"
  final(run_cli(train, *args, "--learning_rate=3e-3", "--seed=1",
                   f"--out_dir={solo}"))
  swept = train_losses(tmp_path / "sweep" / names[3])
  alone = train_losses(solo)
  assert swept.keys() == alone.keys() == {5, 10, 15, 20}
  np.testing.assert_allclose([swept[s] for s in alone], list(alone.values()), rtol=2e-5)
  # the whole sweep goes on, keeping its schedule
  sweep_flags = ["--sweep=learning_rate=1e-3,3e-3", "--sweep_seeds=2",
                 f"--out_dir={tmp_path / 'sweep'}", "--resume"]
  more = run_cli(train, *args, *sweep_flags, "--max_iters=30")
  assert [r["step"] for r in final(more)["runs"]] == [30] * 4
  assert "keeping the sweep's schedule: it ends at step 20" in more.stdout
  # one run of the sweep goes on by itself, with that run's flags
  resumed = final(run_cli(train, *args, "--learning_rate=3e-3", "--seed=1",
                             "--max_iters=40", "--lr_decay_iters=20", "--resume",
                             f"--out_dir={tmp_path / 'sweep' / names[3]}"))
  assert resumed["step"] == 40
  # then the sweep goes on from the newest step all its runs saved, run 3's
  # newer checkpoint recomputed
  again = run_cli(train, *args, *sweep_flags, "--max_iters=50")
  assert [r["step"] for r in final(again)["runs"]] == [50] * 4
  assert "from step 30, the newest all of them saved" in again.stdout


@pytest.mark.budget(30)
def test_a_run_of_a_sweep_one_at_a_time_is_bit_identical_to_the_run_alone(tmp_path,
                                                                           text_file):
  """300 steps at a high learning rate (3e-2), where any rounding difference would grow."""
  args = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
          "--max_iters=300", "--eval_interval=100", "--eval_iters=2", "--log_interval=1",
          "--steps_per_call=25", "--sample_tokens=0", "--warmup_iters=0", "--dropout=0.1",
          f"--dataset={text_file}"]
  swept = tmp_path / "sweep"
  final(run_cli(train, *args, "--sweep=learning_rate=3e-3,3e-2",
                   "--sweep_batch=1", f"--out_dir={swept}"))
  alone = tmp_path / "alone"
  final(run_cli(train, *args, "--learning_rate=3e-2", f"--out_dir={alone}"))
  losses = train_losses(alone)
  assert len(losses) == 300 and losses[300] < losses[1] - 0.5  # it trained
  run = swept / "learning_rate=0.03_seed=0"
  assert train_losses(run) == losses  # bit for bit
  saved = [checkpoint.list_checkpoints(d) for d in (run, alone)]
  assert [s for s, _ in saved[0]] == [s for s, _ in saved[1]] == [300, 200, 100]
  for (_, ours), (_, theirs) in zip(*saved):
    a, b = checkpoint.read(ours)[0], checkpoint.read(theirs)[0]
    assert sorted(a) == sorted(b)
    for name in a:
      np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_dropout_sweep_records_each_runs_rate_and_a_run_replays_alone(tmp_path, text_file):
  args = [*TINY_FLAGS, *SHORT_FLAGS, f"--dataset={text_file}"]
  out = final(run_cli(train, *args, "--sweep=dropout=0,0.2", "--dropout=0.5",
                         "--max_iters=10", f"--out_dir={tmp_path}"))
  names = [r["run"] for r in out["runs"]]
  assert names == ["dropout=0_seed=0", "dropout=0.2_seed=0"]
  for name, rate in zip(names, (0.0, 0.2)):  # the grid's rate, not --dropout's
    _, manifest = checkpoint.read(checkpoint.list_checkpoints(tmp_path / name)[0][1])
    assert manifest["meta"]["config"]["dropout"] == rate
  # run 1 goes on alone with its own flags (its saved config matches them) ...
  run_dir = tmp_path / names[1]
  final(run_cli(train, *args, "--dropout=0.2", "--lr_decay_iters=10",
                   "--resume", f"--out_dir={run_dir}"))
  # ... and a step it trained alone replays from the saved config: with any
  # other rate its loss would not come out bit for bit
  replayed = run_cli(replay, f"--out_dir={run_dir}", "--step=15")
  assert replayed.returncode == 0, replayed.stderr[-2000:]
  assert "bit for bit the logged loss" in replayed.stdout


def test_lora_fine_tunes_a_run_and_exports_the_merged_weights(tmp_path, char_gpt_run):
  transformers = need("transformers")
  torch = need("torch")
  base_dir, tuned_dir = char_gpt_run, tmp_path / "tuned"
  unseen = tmp_path / "unseen.txt"  # a text the base has not seen, same characters
  seen = set(CHAR_GPT_TEXT)
  unseen.write_text("".join(c for c in SHAKESPEARE[-40_000:] if c in seen))
  tuned = run_cli(train, "--eval_iters=4", "--batch_size=8", "--sample_tokens=0",
                  "--max_iters=100", "--eval_interval=100", "--learning_rate=3e-2",
                  "--warmup_iters=0", "--lr_schedule=constant", f"--init_from={base_dir}",
                  f"--dataset={unseen}", "--lora_rank=4", "--lora_alpha=8",
                  f"--out_dir={tuned_dir}")
  metrics = final(tuned)
  assert "LoRA:" in tuned.stdout
  evals = [r for r in monitor.read_metrics(tuned_dir) if r["kind"] == "eval"]
  assert metrics["val_loss"] < evals[0]["val_loss"] - 0.05, evals
  # the checkpoint holds the frozen base and the adapters; only adapters have
  # optimizer moments
  arrays, _ = checkpoint.read(checkpoint.list_checkpoints(tuned_dir)[0][1])
  assert any(name.startswith("['params']['adapters']") for name in arrays)
  assert not any("mu" in name and "['base']" in name for name in arrays)
  # the merged export reloads in transformers with the LoRA forward's logits
  exported = tmp_path / "hf"
  converted = run_cli(convert, f"--from=purejax:{tuned_dir}", f"--to=hf:{exported}")
  assert converted.returncode == 0, converted.stderr[-2000:]
  _, manifest = checkpoint.read(checkpoint.list_checkpoints(tuned_dir)[0][1])
  config = gpt.GPTConfig.from_dict(manifest["meta"]["config"])
  params = _lora_params(arrays, config)
  ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 16))
  ours = np.asarray(gpt.forward(params, jnp.asarray(ids), config))
  model = transformers.GPT2LMHeadModel.from_pretrained(exported).eval()
  with torch.no_grad():
    theirs = model(torch.from_numpy(ids)).logits.numpy()
  np.testing.assert_allclose(theirs, ours[..., :theirs.shape[-1]], atol=2e-5)


def _lora_params(arrays, config):
  """The LoRA forward's params: the checkpoint's base merged with its adapters."""
  template = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  adapters = jax.eval_shape(lambda p: lora.init(p, 4, lora.ATTENTION_AND_MLP,
                                                jax.random.PRNGKey(0)), template)
  tree = checkpoint.extract(arrays, {"params": lora.trainable(template, adapters)})
  return lora.merge(tree["params"]["base"], tree["params"]["adapters"], 8.0)


@pytest.mark.xla_defaults  # XLA's older CPU emitters give the replay other bits
def test_replay_recomputes_a_logged_loss_bit_for_bit(tmp_path, text_file, capsys):
  out = tmp_path / "run"
  final(run_cli(train, *TINY_FLAGS, *SHORT_FLAGS, f"--dataset={text_file}",
                   "--dropout=0.1", "--grad_accum_steps=2", f"--out_dir={out}"))
  replayed = run_cli(replay, f"--out_dir={out}", "--step=15")
  assert replayed.returncode == 0, replayed.stderr[-2000:]
  assert "bit for bit the logged loss" in replayed.stdout
  report = np.load(out / "replay" / "step_000000015.npz")
  assert float(report["loss"]) == train_losses(out)[15]  # exactly
  assert report["tokens"].shape == (4, 17) and report["token_losses"].shape == (4, 16)
  assert report["grad_norm/blocks"].shape == (1,)
  # a step before every kept checkpoint, or past the run's end, cannot be replayed
  assert refusal(capsys, replay, f"--out_dir={out}", "--step=0") == (
      "error: --step must be >= 1 (the step count after an update), got 0.")
  assert refusal(capsys, replay, f"--out_dir={out}", "--step=21") == (
      f"error: --step=21 is past the last step {out} trained, 20; replay a step up to 20.")


def test_wandb_offline_holds_the_runs_metrics(tmp_path, text_file):
  need("wandb")
  out = tmp_path / "run"
  final(run_module("purejax.train", *TINY_FLAGS, *SHORT_FLAGS, f"--dataset={text_file}",
                   "--wandb_log", "--wandb_project=purejax-test", "--wandb_run_name=tiny",
                   f"--out_dir={out}",
                   env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}))
  logged = {}
  for record in monitor.read_metrics(out):
    logged.setdefault(record["step"], {}).update(monitor.scalars(record["kind"], record))
  rows = {row["_step"]: {k: v for k, v in row.items() if not k.startswith("_")}
          for row in read_wandb_offline_history(out)}
  assert rows == logged
  assert "eval/val_bpb" in logged[20]  # every evaluation's bits per byte too

"""Preference tuning (DPO): pairs as rows, the reference computed once, the loss an objective.

A character tokenizer and a small ChatML-like template stand in for a real model
(fast); tests/test_dpo_trl.py holds the loss against TRL's on the same weights.
"""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.cli import refusal
from helpers.runs import saved_model
from purejax import checkpoint
from purejax import gpt
from purejax import lora
from purejax.cli import train as train_cli
from purejax.data import batches, chat, preferences, tokenizers
from purejax.ops import kernels
from purejax.optimizers import optim
from purejax.training.effects import runs
from purejax.training.loops import gpt_loop
from purejax.training.pure import preference
from purejax.training.pure import steps
from purejax.training.pure.state import TrainState

TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}|\n{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")
CHARS = "<>|\nasuy" + "abcdefghijklmnopqrstuvwxyz ?.!0123456789+="
TOKENIZER = tokenizers.CharTokenizer("".join(dict.fromkeys(CHARS)))
FMT = chat.ChatFormat(TEMPLATE, eos_token="|", stop_ids=(TOKENIZER.encode("|")[0],))
CONFIG = gpt.GPTConfig(vocab_size=TOKENIZER.vocab_size, block_size=24, n_layer=1, n_head=2,
                       n_embd=16, dropout=0.0, bias=False)
FORMS = kernels.select("cpu")


def write_pairs(path, pairs):
  path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
  return str(path)


def sum_pairs(n, seed=0):
  """Standard pairs: a sum, its answer chosen, a refusal rejected."""
  rnd = np.random.default_rng(seed)
  pairs = []
  for _ in range(n):
    a, b = rnd.integers(0, 10, 2)
    pairs.append({"prompt": f"{a}+{b}=", "chosen": f"{a + b}.", "rejected": "no."})
  return pairs


def counted(rows, weights):
  """The text of each side's weighted targets."""
  return [TOKENIZER.decode(rows[s, 1:][weights[s] > 0]) for s in range(2)]


def test_standard_pairs_count_each_answer_with_its_eos(tmp_path):
  data = preferences.load_preferences(
      write_pairs(tmp_path / "p.jsonl", [{"prompt": "2+3=", "chosen": "5.", "rejected": "7."}]),
      TOKENIZER, FMT, block_size=CONFIG.block_size)
  rows, weights = data.train
  assert rows.shape == (1, 2, CONFIG.block_size + 1) and weights.shape == (1, 2, CONFIG.block_size)
  assert counted(rows[0], weights[0]) == ["5.|", "7.|"]  # the EOS ends each answer
  assert TOKENIZER.decode(rows[0, 0, :4]) == "2+3="
  # Without a chat format there is no EOS to add.
  bare = preferences.load_preferences(str(tmp_path / "p.jsonl"), TOKENIZER, None, 24)
  assert counted(bare.train[0][0], bare.train[1][0]) == ["5.", "7."]


def test_an_answer_that_shares_its_start_with_the_prompt_still_counts_only_the_answer(tmp_path):
  # "1+1=" then "2." vs "22.": the prompt's tokens are a prefix of both; nothing of the
  # prompt is counted, nothing of either answer is left out.
  data = preferences.load_preferences(
      write_pairs(tmp_path / "p.jsonl", [{"prompt": "1+1=", "chosen": "2.", "rejected": "22."}]),
      TOKENIZER, None, block_size=CONFIG.block_size)
  assert counted(*(a[0] for a in data.train)) == ["2.", "22."]


def test_conversational_pairs_count_only_the_last_answer_through_its_stop(tmp_path):
  prompt = [{"role": "user", "content": "hi?"}, {"role": "assistant", "content": "hey."},
            {"role": "user", "content": "sum?"}]
  data = preferences.load_preferences(
      write_pairs(tmp_path / "p.jsonl", [{
          "prompt": prompt, "chosen": [{"role": "assistant", "content": "four."}],
          "rejected": [{"role": "assistant", "content": "no."}]}]),
      TOKENIZER, FMT, block_size=40)
  rows, weights = data.train
  assert counted(rows[0], weights[0]) == ["four.|", "no.|"]  # the earlier "hey.|" is not
  assert TOKENIZER.decode(data.prompt_ids) == "<u>hi?|\n<a>hey.|\n<u>sum?|\n<a>"


@pytest.mark.parametrize("pair, message", [
    ({"prompt": "a", "chosen": "b"}, 'has no "rejected"'),
    ({"chosen": "b", "rejected": "c"}, 'has no "prompt"'),
    ({"prompt": "a", "chosen": "", "rejected": "c"}, '"chosen" is empty'),
    ({"prompt": "a", "chosen": "b", "rejected": 3}, '"rejected" is not a string'),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [],
      "rejected": [{"role": "assistant", "content": "c"}]}, '"chosen" must be a non-empty'),
    ({"prompt": "a" * 30, "chosen": "b", "rejected": "c"}, "the prompt is 30 tokens"),
])
def test_bad_pairs_are_named_by_their_line(tmp_path, pair, message):
  path = write_pairs(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, pair])
  with pytest.raises(preferences.PreferenceError, match=message) as raised:
    preferences.load_preferences(path, TOKENIZER, FMT, block_size=CONFIG.block_size)
  assert "p.jsonl:2" in str(raised.value) and "\n" not in str(raised.value)


def test_one_file_holds_one_format(tmp_path):
  path = write_pairs(tmp_path / "p.jsonl", [
      {"prompt": "a", "chosen": "b", "rejected": "c"},
      {"prompt": [{"role": "user", "content": "a"}],
       "chosen": [{"role": "assistant", "content": "b"}],
       "rejected": [{"role": "assistant", "content": "c"}]}])
  with pytest.raises(preferences.PreferenceError, match="p.jsonl:2 is in the conversational"):
    preferences.load_preferences(path, TOKENIZER, FMT, block_size=CONFIG.block_size)


def test_a_preference_file_is_told_from_a_conversations_file(tmp_path):
  assert preferences.is_preferences_file(write_pairs(tmp_path / "p.jsonl", sum_pairs(1)))
  (tmp_path / "c.jsonl").write_text(json.dumps({"messages": []}) + "\n")
  assert not preferences.is_preferences_file(str(tmp_path / "c.jsonl"))
  assert not preferences.is_preferences_file(str(tmp_path / "missing.jsonl"))


def loaded(tmp_path, n=12):
  return preferences.load_preferences(write_pairs(tmp_path / "p.jsonl", sum_pairs(n)),
                                      TOKENIZER, FMT, block_size=CONFIG.block_size)


def with_reference(data, params):
  return data.with_reference(*(preference.pair_logps(params, rows, w, CONFIG, forms=FORMS,
                                                     batch_size=4)[0]
                               for rows, w in (data.train, data.val)))


@pytest.mark.slow
def test_the_objective_is_dpo_of_each_answers_log_probability(tmp_path):
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(0))
  reference = gpt.init_params(CONFIG, jax.random.PRNGKey(1))
  data = with_reference(loaded(tmp_path), reference)
  rows, weights = data.train
  # By hand: every answer's summed log-probability of its counted targets.
  logits = np.asarray(gpt.forward(params, jnp.asarray(rows.reshape(-1, 25)[:, :-1]), CONFIG))
  logp = jax.nn.log_softmax(logits)
  picked = np.take_along_axis(np.asarray(logp), rows.reshape(-1, 25)[:, 1:, None], -1)[..., 0]
  sides = (picked * weights.reshape(-1, 24)).sum(-1).reshape(-1, 2)
  ref = data.reference[0]
  h = (sides[:, 0] - ref[:, 0]) - (sides[:, 1] - ref[:, 1])
  want = np.mean(np.log1p(np.exp(-0.1 * h)))
  batch = batches.PairBatch(*map(jnp.asarray, (rows, weights, ref)))
  got = preference.DPO(beta=0.1)(params, batch, CONFIG, forms=FORMS)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  # At the reference itself every pair's margin is 0: the loss is log 2.
  at_ref = preference.DPO()(reference, batch, CONFIG, forms=FORMS)
  np.testing.assert_allclose(float(at_ref), np.log(2), rtol=1e-5)


def test_dpo_settings_are_checked():
  with pytest.raises(ValueError, match="beta must be > 0"):
    preference.DPO(beta=0)
  with pytest.raises(ValueError, match="label smoothing applies to the sigmoid"):
    preference.DPO(loss_type="ipo", label_smoothing=0.1)
  with pytest.raises(ValueError, match="unknown DPO loss"):
    preference.DPO(loss_type="hinge")


@pytest.mark.slow
def test_microbatches_average_to_the_whole_batch(tmp_path):
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(0))
  pairs = batches.DevicePairs(*map(jnp.asarray, with_reference(loaded(tmp_path), params).pairs()[0]))
  optimizer = optim.make_optimizer(optim.named("adamw", learning_rate=1e-2, warmup_iters=0,
                                               schedule="constant"))

  def run(accum):
    state = TrainState(params, optimizer.init(params), {"train": jax.random.PRNGKey(3)})
    return steps.train_steps(jax.tree.map(jnp.copy, state), pairs, 0, config=CONFIG,
                             optimizer=optimizer, batch_size=4, num_steps=3, forms=FORMS,
                             grad_accum_steps=accum,
                             objective=preference.DPO(beta=0.5))

  (one, m1), (two, m2) = run(1), run(2)
  chex.assert_trees_all_close(m1, m2, rtol=2e-5)
  chex.assert_trees_all_close(one.params, two.params, rtol=1e-4, atol=1e-5)


def train_config(max_iters):
  return gpt_loop.GPTTrainConfig(batch_size=8, max_iters=max_iters, eval_interval=10,
                                 eval_iters=2, log_interval=10, steps_per_call=5,
                                 sample_tokens=0)


OPT = optim.named("adamw", learning_rate=3e-2, warmup_iters=0, decay_iters=30)


@pytest.mark.slow
def test_a_dpo_run_learns_the_preferences_and_resumes_exactly(tmp_path):
  data = loaded(tmp_path, n=40)
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(0))
  run = lambda name, steps_, resume=False: gpt_loop.train_gpt(
      CONFIG, data, train_config(steps_), OPT, runs.RunConfig(str(tmp_path / name), resume=resume),
      init_params=params, dpo=preference.DPO(beta=0.5))
  whole = run("a", 30)
  run("b", 20)
  resumed = run("b", 30, resume=True)
  assert resumed == {**whole, "ms_per_iter": resumed["ms_per_iter"]}
  first = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[0])
  assert first["val_margin"] == 0 and first["val_accuracy"] == 0  # the start is the reference
  assert whole["train_accuracy"] >= 0.9 and whole["train_loss"] < 0.5
  assert whole["train_margin"] > 0


@pytest.mark.slow
def test_with_lora_the_reference_is_the_base(tmp_path):
  data = loaded(tmp_path, n=20)
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(0))
  out = gpt_loop.train_gpt(CONFIG, data, train_config(10), OPT,
                           runs.RunConfig(str(tmp_path / "l")), init_params=params,
                           lora_config=lora.LoraConfig(rank=4), dpo=preference.DPO())
  first = json.loads((tmp_path / "l" / "metrics.jsonl").read_text().splitlines()[0])
  # New adapters leave the model the base: rewards start at 0, the loss at log 2.
  assert first["train_chosen_reward"] == 0 and abs(first["train_loss"] - np.log(2)) < 1e-6
  assert out["train_margin"] > 0


@pytest.mark.slow
def test_a_run_does_not_resume_with_another_beta(tmp_path):
  data = loaded(tmp_path)
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(0))
  gpt_loop.train_gpt(CONFIG, data, train_config(10), OPT, runs.RunConfig(str(tmp_path / "r")),
                     init_params=params, dpo=preference.DPO(beta=0.1))
  with pytest.raises(Exception, match="dpo"):
    gpt_loop.train_gpt(CONFIG, data, train_config(20), OPT,
                       runs.RunConfig(str(tmp_path / "r"), resume=True), init_params=params,
                       dpo=preference.DPO(beta=0.2))


def test_the_command_line_refuses_dpo_flags_without_pairs(tmp_path, capsys):
  code = train_cli.run(["train", "--dpo_beta=0.2", f"--out_dir={tmp_path / 'out'}",
                        "--max_iters=1"])
  err = capsys.readouterr().err.strip()
  assert code == 1 and len(err.splitlines()) == 1 and "--dpo_beta" in err
  assert not list((tmp_path / "out").glob("*"))  # nothing written (the folder may be made)


def test_the_command_line_wants_a_model_to_tune(tmp_path, capsys):
  code = train_cli.run(["train", f"--dataset={write_pairs(tmp_path / 'p.jsonl', sum_pairs(2))}",
                        f"--out_dir={tmp_path / 'out'}", "--max_iters=1"])
  err = capsys.readouterr().err.strip()
  assert code == 1 and len(err.splitlines()) == 1
  assert "preference pairs" in err and "--init_from" in err
  assert not list((tmp_path / "out").glob("*"))  # nothing written (the folder may be made)


@pytest.mark.slow
def test_the_command_line_tunes_a_run_on_pairs(tmp_path):
  base, tuned = tmp_path / "base", tmp_path / "dpo"
  assert train_cli.run(["train", "--n_layer=1", "--n_embd=16", "--n_head=2", "--block_size=24",
                        "--max_iters=2", "--eval_interval=2", "--eval_iters=1",
                        f"--out_dir={base}", "--sample_tokens=0", "--progress=false"]) == 0
  names = ["ROMEO", "JULIET", "KING", "QUEEN", "LEAR", "HAMLET"]  # (Shakespeare's characters)
  pairs = write_pairs(tmp_path / "pairs.jsonl", [
      {"prompt": f"{name} said:", "chosen": " yes.", "rejected": " no."} for name in names * 2])
  assert train_cli.run(["train", f"--init_from={base}", f"--dataset={pairs}",
                        f"--out_dir={tuned}", "--max_iters=10", "--eval_interval=10",
                        "--eval_iters=1", "--batch_size=4", "--learning_rate=1e-2",
                        "--warmup_iters=0", "--dpo_beta=0.5", "--sample_tokens=0",
                        "--progress=false"]) == 0
  records = [json.loads(l) for l in (tuned / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in records if "val_accuracy" in r]
  assert [r["step"] for r in evals] == [0, 10]
  assert evals[-1]["val_accuracy"] == 1.0 and evals[-1]["val_loss"] < evals[0]["val_loss"]
  _, meta = checkpoint.latest_meta(str(tuned))
  assert meta["dpo"]["beta"] == 0.5 and meta["init_from"] == str(base)


@pytest.fixture
def base_run(tmp_path_factory):
  """A tiny purejax run with the test's tokenizer: a model to tune."""
  return saved_model(tmp_path_factory.mktemp("base"), CONFIG, TOKENIZER)


@pytest.mark.parametrize("pair, message", [
    ({"prompt": "1+1=", "chosen": "2."}, 'has no "rejected"'),
    ({"prompt": "1+1=", "chosen": "2.", "rejected": ""}, '"rejected" is empty'),
    ({"prompt": "1+1=" * 8, "chosen": "2.", "rejected": "3."}, "leaves no room for an answer"),
])
def test_the_command_line_refuses_bad_pairs_in_one_line(tmp_path, capsys, base_run, pair,
                                                        message):
  pairs = write_pairs(tmp_path / "p.jsonl", [{"prompt": "1+1=", "chosen": "2.",
                                              "rejected": "3."}, pair])
  out = tmp_path / "out"
  error = refusal(capsys, train_cli, f"--init_from={base_run}", f"--dataset={pairs}",
                  f"--out_dir={out}", "--max_iters=1")
  assert message in error and "p.jsonl:2" in error
  assert not list(out.glob("*"))  # nothing written (the folder may be made)


@pytest.mark.slow
@pytest.mark.parametrize("sweep_batch", [1, 0])  # the runs one by one (CPU), vmapped (GPU)
def test_a_sweep_tunes_each_run_as_alone(tmp_path, sweep_batch):
  from purejax.training.loops import sweep_loop
  data = loaded(tmp_path, n=20)
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(0))
  found = sweep_loop.train_gpt_sweep(
      CONFIG, data, train_config(10), OPT, runs.RunConfig(str(tmp_path / "s")),
      {"learning_rate": (1e-2, 3e-2)}, init_params=params, sweep_batch=sweep_batch,
      dpo=preference.DPO(beta=0.5))
  alone = gpt_loop.train_gpt(CONFIG, data, train_config(10),
                             dataclasses.replace(OPT, learning_rate=3e-2),
                             runs.RunConfig(str(tmp_path / "a")), init_params=params,
                             dpo=preference.DPO(beta=0.5))
  assert len(found) == 2 and all("val_accuracy" in f for f in found)
  np.testing.assert_allclose(found[1]["train_loss"], alone["train_loss"], rtol=1e-4)
  np.testing.assert_allclose(found[1]["val_margin"], alone["val_margin"], rtol=1e-3, atol=1e-5)


def test_the_examples_arithmetic_pairs_choose_the_answer(tmp_path):
  import importlib.util
  import random
  from helpers.data import REPO_ROOT
  from purejax.data import rl_tasks
  spec = importlib.util.spec_from_file_location(
      "dpo_arithmetic", REPO_ROOT / "examples" / "dpo_arithmetic.py")
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  task = rl_tasks.load_task("arithmetic")
  pairs = list(example.arithmetic_pairs(task.val[:20], random.Random(0)))
  for pair, e in zip(pairs, task.val):
    assert pair["prompt"] == e.prompt
    assert pair["chosen"][0]["content"] == e.record["answer"]
    equation, wrong = pair["rejected"][0]["content"].rsplit(" = ", 1)
    assert equation == f"{e.record['a']} {e.record['op']} {e.record['b']}"
    assert int(wrong) != int(e.record["answer"])
  path = write_pairs(tmp_path / "p.jsonl", pairs)
  assert preferences.is_preferences_file(path)

"""Reinforcement learning with verifiable rewards: tasks, rewards, the update, the loop.

A character tokenizer and a small ChatML-like template stand in for a real model
(fast); tests/test_trl.py holds the loss against TRL's GRPOTrainer on the same weights.
"""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.cli import final, refusal, run_cli
from helpers.runs import saved_model
from purejax import checkpoint
from purejax import decode
from purejax import engine
from purejax import gpt
from purejax import lora
from purejax import weights
from purejax.cli import rl as rl_cli
from purejax.data import chat, rl_tasks, tokenizers
from purejax.evaluation import humaneval, rewards
from purejax.ops import kernels
from purejax.ops import quant
from purejax.optimizers import optim
from purejax.training.effects import monitor, runs
from purejax.training.loops import rl_loop
from purejax.training.pure import preference, rl_steps
from purejax.training.pure.state import TrainState

TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}|\n{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")
CHARS = "<>|\nasuy" + "abcdefghijklmnopqrstuvwxyzWAO ?.!0123456789+-="
TOKENIZER = tokenizers.CharTokenizer("".join(dict.fromkeys(CHARS)))
FMT = chat.ChatFormat(TEMPLATE, eos_token="|", stop_ids=(TOKENIZER.encode("|")[0],))
CONFIG = gpt.GPTConfig(vocab_size=TOKENIZER.vocab_size, block_size=64, n_layer=1, n_head=2,
                       n_embd=32, dropout=0.0, bias=False)
FORMS = kernels.select("cpu")


# ----------------------------------------------------------------------------
# Tasks and rewards


def test_the_arithmetic_task_is_seeded_right_and_its_splits_share_no_problem():
  task = rl_tasks.load_task("arithmetic", seed=3)
  again = rl_tasks.load_task("arithmetic", seed=3)
  assert task.train == again.train and len(task.train) == 2000 and len(task.val) == 200
  assert task.reward == "numeric"
  questions = lambda split: {e.record["question"] for e in split}
  assert not questions(task.train) & questions(task.val)
  for e in task.train[:50] + task.val[:50]:
    a, b = e.record["a"], e.record["b"]
    assert int(e.record["answer"]) == (a + b if e.record["op"] == "+" else a - b)
    assert e.prompt[0]["content"].startswith(e.record["question"])
  assert rl_tasks.load_task("arithmetic", seed=4).train != task.train


def test_a_task_file_gives_its_reward_and_held_out_split(tmp_path):
  path = tmp_path / "sums.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n"
                          for i in range(20)))
  task = rl_tasks.load_task(str(path))
  assert (task.name, task.reward, len(task.train), len(task.val)) == ("sums", "numeric", 18, 2)
  code = tmp_path / "code.jsonl"
  code.write_text(json.dumps({"prompt": "def f():", "test": "assert f() == 1",
                              "entry_point": "f"}) + "\n")
  assert rl_tasks.load_task(str(code)).reward == "code"


@pytest.mark.parametrize("line, message", [
    ("not json", "code.jsonl:1 is not JSON"),
    (json.dumps({"answer": 1}), 'needs a "prompt"'),
    (json.dumps({"prompt": "", "answer": 1}), '"prompt" must be a non-empty string'),
])
def test_bad_task_lines_are_named(tmp_path, line, message):
  path = tmp_path / "code.jsonl"
  path.write_text(line + "\n")
  with pytest.raises(rl_tasks.TaskError, match=message):
    rl_tasks.load_task(str(path))


def test_an_unknown_task_names_the_built_in_ones():
  with pytest.raises(rl_tasks.TaskError, match="arithmetic"):
    rl_tasks.load_task("algebra")


@pytest.mark.parametrize("completion, answer, want", [
    ("42", "42", 1.0), ("The answer is 1,042.", 1042, 1.0), ("-7", "-7", 1.0),
    ("41 or 42", "42", 1.0), ("42 or 41", "42", 0.0), ("no idea", "42", 0.0),
    ("3.5", "3.50", 1.0),
])
def test_the_numeric_reward_reads_the_final_number(completion, answer, want):
  assert rewards.numeric(None, completion, {"answer": answer}) == want


def test_rewards_load_by_name_or_path_and_refuse_what_they_cannot():
  assert rewards.load_reward("numeric") is rewards.numeric
  assert rewards.load_reward("test_rl:length_reward") is length_reward
  with pytest.raises(rewards.RewardError, match="does not import"):
    rewards.load_reward("no_such_module_here:f")
  with pytest.raises(rewards.RewardError, match="no function 'missing'"):
    rewards.load_reward("test_rl:missing")
  with pytest.raises(humaneval.CodeExecutionRefused, match="allow_code_execution"):
    rewards.load_reward("code")


def test_the_code_reward_runs_the_tests_in_the_sandbox():
  reward = rewards.load_reward("code", allow_code_execution=True)
  example = {"prompt": "", "test": "def check(f):\n  assert f(2) == 4\n", "entry_point": "double"}
  assert reward(None, "```python\ndef double(x):\n  return 2 * x\n```", example) == 1.0
  assert reward(None, "def double(x):\n  return x + 1\n", example) == 0.0


def length_reward(prompt, completion, example):
  """More letters 'a' score more: a signal a tiny model can learn in a few steps."""
  return completion.count("a") / 4.0


def bad_reward(prompt, completion, example):
  return example["kind"]


@pytest.mark.parametrize("value, message", [
    (float("nan"), "returned nan, not a finite number"),
    ("1.0", "returned '1.0', not a finite number"),
    (None, "returned None"),
])
def test_a_reward_that_returns_no_number_stops_or_scores_zero(value, message):
  args = (bad_reward, ["p"] * 2, ["x", "y"], [{"kind": 1.0}, {"kind": value}])
  with pytest.raises(rl_loop.RewardFailed, match=message):
    rl_loop.score(*args)
  scores, failed = rl_loop.score(*args, errors_score_zero=True)
  assert scores.tolist() == [1.0, 0.0] and failed == 1


def test_a_reward_that_raises_names_the_error():
  with pytest.raises(rl_loop.RewardFailed, match="raised KeyError"):
    rl_loop.score(bad_reward, ["p"], ["x"], [{}])


# ----------------------------------------------------------------------------
# The update


def test_rollout_rows_count_each_completion_after_its_prompt():
  prompts = [[5, 6, 7], [8]]
  completions = [decode.Completion((1, 2), True), decode.Completion((3,), False),
                 decode.Completion((4, 4, 4), True), decode.Completion((9,), True)]
  tokens, mask = rl_loop.rollout_rows(prompts, completions, group_size=2, length=6)
  assert tokens[0].tolist() == [5, 6, 7, 1, 2, 0, 0] and tokens[2].tolist()[:4] == [8, 4, 4, 4]
  # Target t is token t + 1: row 0 counts the targets 1 and 2, row 2 the three 4s.
  assert mask[0].tolist() == [0, 0, 1, 1, 0, 0] and mask[2].tolist() == [1, 1, 1, 0, 0, 0]
  assert tokens[0, 1:][mask[0] > 0].tolist() == [1, 2]


def random_rollouts(n=8, seed=0):
  rnd = np.random.default_rng(seed)
  tokens = jnp.asarray(rnd.integers(0, CONFIG.vocab_size, (n, 13)), jnp.int32)
  mask = np.zeros((n, 12), np.float32)
  for i in range(n):
    mask[i, 3:3 + rnd.integers(1, 9)] = 1
  advantages = preference.group_advantages(jnp.asarray(rnd.normal(size=n)), 4)
  zeros = jnp.zeros((n, 12))
  return rl_steps.Rollouts(tokens, jnp.asarray(mask), advantages, zeros, zeros)


@pytest.mark.slow
def test_an_on_policy_update_follows_the_advantage_weighted_log_likelihood():
  # With the ratio at 1, the loss's gradient is that of -sum(A * log p) / tokens.
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(0))
  batch = random_rollouts()
  optimizer = optim.make_optimizer(optim.named("sgd", learning_rate=1.0, warmup_iters=0,
                                               schedule="constant", grad_clip=0.0))
  state = TrainState(jax.tree.map(jnp.copy, params), optimizer.init(params), {})
  new, metrics = rl_steps.policy_update(state, batch, config=CONFIG, optimizer=optimizer,
                                        policy=rl_steps.PolicySettings(), forms=FORMS)

  def surrogate(p):
    logps = rl_steps.token_logps(p, batch.tokens, CONFIG, forms=FORMS)
    return -jnp.sum(batch.advantages[:, None] * logps * batch.mask) / jnp.sum(batch.mask)

  grads = jax.grad(surrogate)(params)
  chex.assert_trees_all_close(new.params, jax.tree.map(lambda p, g: p - g, params, grads),
                              rtol=1e-5, atol=1e-6)
  assert float(metrics.kl) == 0 and float(metrics.clipped) == 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", [rl_steps.PolicySettings(),
                                    rl_steps.PolicySettings(beta=0.1, off_policy=True)])
def test_microbatches_give_the_whole_batchs_update(policy):
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(1))
  batch = random_rollouts(seed=1)
  if policy.off_policy:  # a sampling policy and a reference a little away
    logps = rl_steps.token_logps(params, batch.tokens, CONFIG, forms=FORMS)
    batch = batch._replace(old_logps=logps + 0.1, ref_logps=logps - 0.2)
  optimizer = optim.make_optimizer(optim.named("adamw", learning_rate=1e-2, warmup_iters=0,
                                               schedule="constant"))

  def run(accum):
    state = TrainState(jax.tree.map(jnp.copy, params), optimizer.init(params), {})
    return rl_steps.policy_update(state, batch, config=CONFIG, optimizer=optimizer,
                                  policy=policy, forms=FORMS, grad_accum_steps=accum)

  (one, m1), (four, m4) = run(1), run(4)
  chex.assert_trees_all_close(m1, m4, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(one.params, four.params, rtol=1e-4, atol=1e-5)


def test_leaving_out_the_silent_groups_changes_no_update():
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(2))
  batch = random_rollouts(n=12, seed=2)
  # Three groups of 4; the middle one's completions all scored alike.
  advantages = np.asarray(batch.advantages).copy()
  advantages[4:8] = 0
  batch = batch._replace(advantages=jnp.asarray(advantages))
  kept = rl_steps.drop_silent_groups(jax.tree.map(np.asarray, batch), 4, multiple=4)
  assert kept.tokens.shape[0] == 8
  np.testing.assert_array_equal(kept.tokens, np.asarray(batch.tokens)[[0, 1, 2, 3, 8, 9, 10, 11]])
  optimizer = optim.make_optimizer(optim.named("adamw", learning_rate=1e-2, warmup_iters=0,
                                               schedule="constant"))

  def run(rollouts, num_tokens=None):
    state = TrainState(jax.tree.map(jnp.copy, params), optimizer.init(params), {})
    return rl_steps.policy_update(state, jax.tree.map(jnp.asarray, rollouts), config=CONFIG,
                                  optimizer=optimizer, policy=rl_steps.PolicySettings(),
                                  forms=FORMS, num_tokens=num_tokens)

  (whole, m1), (part, m2) = run(batch), run(kept, jnp.sum(batch.mask))
  chex.assert_trees_all_close(m1, m2, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(whole.params, part.params, rtol=1e-5, atol=1e-6)
  # Padded up to a multiple, the extra rows count for nothing.
  padded = rl_steps.drop_silent_groups(jax.tree.map(np.asarray, batch), 4, multiple=12)
  assert padded.tokens.shape[0] == 12 and not padded.mask[8:].any()
  chex.assert_trees_all_close(run(padded, jnp.sum(batch.mask))[0].params, whole.params,
                              rtol=1e-5, atol=1e-6)
  silent = batch._replace(advantages=jnp.zeros(12))
  assert rl_steps.drop_silent_groups(jax.tree.map(np.asarray, silent), 4, 4) is None


@pytest.mark.slow
def test_the_engine_decodes_with_new_params_and_only_when_idle():
  params = gpt.init_params(CONFIG, jax.random.PRNGKey(0))
  other = gpt.init_params(CONFIG, jax.random.PRNGKey(5))
  eng = engine.Engine(params, CONFIG, engine.EngineConfig(rows=2, length=16), forms=FORMS)
  eng.update_params(other)
  got = rl_loop.sample_groups(eng, [[1, 2, 3]], 1, jax.random.PRNGKey(0), max_new_tokens=8,
                              temperature=0.0)
  (want,), = engine.generate(other, [[1, 2, 3]], CONFIG, jax.random.PRNGKey(0), 8, forms=FORMS)
  assert got[0].tokens == want.tokens
  eng.submit(engine.Request([1, 2], 4), lambda event: None)
  with pytest.raises(ValueError, match="idle engine"):
    eng.update_params(params)


# ----------------------------------------------------------------------------
# The loop


def letters_task(n=40):
  examples = [rl_tasks.Example([{"role": "user", "content": f"say {w}"}], {"answer": 0})
              for w in ["a", "as", "us", "sa", "ya"] * (n // 5)]
  return rl_tasks.Task("letters", tuple(examples), tuple(examples[:4]), "", "letters")


def train(out_dir, max_iters, resume=False, **options):
  rl = rl_loop.RLConfig(prompts_per_step=2, group_size=4, max_new_tokens=8,
                        max_iters=max_iters, eval_interval=4, eval_examples=4, **options)
  return rl_loop.train_rl(gpt.init_params(CONFIG, jax.random.PRNGKey(0)), CONFIG, TOKENIZER,
                          FMT, letters_task(), length_reward, rl,
                          optim.named("adamw", learning_rate=3e-2, warmup_iters=0,
                                      schedule="constant"),
                          runs.RunConfig(str(out_dir), resume=resume), reward_name="length",
                          forms=FORMS)


def train_records(out_dir):
  return [{k: v for k, v in r.items() if not k.endswith("_s") and k != "time"}
          for r in monitor.read_metrics(out_dir / "metrics.jsonl") if "reward" in r]


@pytest.mark.slow
def test_a_run_learns_its_reward_and_resumes_exactly(tmp_path):
  whole = train(tmp_path / "a", 16)
  train(tmp_path / "b", 8)
  resumed = train(tmp_path / "b", 16, resume=True)
  assert train_records(tmp_path / "a") == train_records(tmp_path / "b")
  assert resumed == whole
  rewards_seen = [r["reward"] for r in train_records(tmp_path / "a")]
  assert np.mean(rewards_seen[-4:]) > np.mean(rewards_seen[:4]) + 0.2


@pytest.mark.slow
def test_lora_with_a_kl_term_and_several_updates_per_batch(tmp_path):
  out = rl_loop.train_rl(
      gpt.init_params(CONFIG, jax.random.PRNGKey(0)), CONFIG, TOKENIZER, FMT, letters_task(),
      length_reward, rl_loop.RLConfig(prompts_per_step=2, group_size=4, max_new_tokens=8,
                                      max_iters=4, eval_interval=4, eval_examples=4, beta=0.1,
                                      updates_per_batch=2, grad_accum_steps=2),
      optim.named("adamw", learning_rate=3e-2, warmup_iters=0, schedule="constant"),
      runs.RunConfig(str(tmp_path / "l")), lora_config=lora.LoraConfig(rank=4), forms=FORMS)
  records = train_records(tmp_path / "l")
  assert out["step"] == 4 and len(records) == 4
  assert records[0]["kl"] > 0 or records[-1]["kl"] > 0  # the policy moved from the base
  assert all(0 <= r["clipped"] <= 1 for r in records)


@pytest.mark.slow
@pytest.mark.parametrize("held", ["q4_1", "int8"])
def test_qlora_samples_beside_its_quantized_base_as_from_the_merged_weights(held):
  # A QLoRA run samples each step with the adapters beside the quantized base (no
  # float32 copy of the model): the same tokens as from the merged float32 weights.
  base, _ = quant.hold_matrices(gpt.init_params(CONFIG, jax.random.PRNGKey(0)), held)
  adapters = lora.init(base, 4, lora.ATTENTION_AND_MLP, jax.random.PRNGKey(1))
  adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(2),
                                                                x.shape), adapters)
  eng = engine.Engine(base, CONFIG, engine.EngineConfig(rows=4, length=24), forms=FORMS)
  beside = rl_loop.sampled_params(lora.View(4.0))(lora.trainable(base, adapters))
  assert isinstance(beside["blocks"]["mlp"]["fc"]["w"].base, quant.QuantizedWeight)
  drawn = []
  for params in (beside, lora.merge(base, adapters, 4.0)):
    eng.update_params(params)
    drawn.append([c.tokens for c in rl_loop.sample_groups(
        eng, [[1, 2, 3], [4, 5]], 2, jax.random.PRNGKey(3), max_new_tokens=12,
        temperature=0.0)])
  assert drawn[0] == drawn[1]


def qlora_flags(base_run, out, task, *flags, held="q4_1"):
  return [f"--init_from={base_run}", f"--out_dir={out}", f"--task={task}", "--reward=numeric",
          "--max_new_tokens=6", "--group_size=4", "--prompts_per_step=2", "--eval_interval=2",
          "--eval_examples=2", "--learning_rate=3e-2", "--lora_rank=4", f"--quantize={held}",
          "--beta=0.1", "--updates_per_batch=2", *flags]


def rl_command(base_run, out, task, *flags):
  return final(run_cli(rl_cli, *qlora_flags(base_run, out, task, *flags)))


@pytest.mark.slow
def test_qlora_trains_its_adapters_on_a_frozen_quantized_base_and_resumes_exactly(
    tmp_path, base_run, capsys):
  task = tmp_path / "sums.jsonl"
  task.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n"
                          for a in range(4) for b in range(4)))
  rl_command(base_run, tmp_path / "a", task, "--max_iters=2")
  resumed = rl_command(base_run, tmp_path / "a", task, "--max_iters=4", "--resume")
  whole = rl_command(base_run, tmp_path / "b", task, "--max_iters=4")
  assert resumed == whole and whole["step"] == 4
  saved, _, _ = weights.pretrained._read_purejax(str(tmp_path / "b"), merged=False)[:3]  # pylint: disable=protected-access
  want, _ = quant.hold_matrices(weights.from_purejax(str(base_run))[0], "q4_1")
  w = saved["base"]["blocks"]["attn"]["qkv"]["w"]
  assert isinstance(w, quant.QuantizedWeight) and w.bits == 4
  for got, expected in zip(jax.tree.leaves(saved["base"]), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))  # frozen, bitwise
  assert any(np.abs(np.asarray(ab["b"])).max() > 0 for ab in saved["adapters"].values())
  arrays, _ = checkpoint.latest_meta(str(tmp_path / "b"))
  assert not [k for k in arrays if "opt_state" in k and "base" in k]
  # Resumed with the base held otherwise: one line naming the leaf that does not fit.
  error = refusal(capsys, rl_cli, *qlora_flags(base_run, tmp_path / "b", task, "--max_iters=6",
                                               "--resume", held="int8"))
  assert "does not fit this model/config" in error and "['base']" in error


# ----------------------------------------------------------------------------
# The command line: bad input stops it in one line, before anything is written.


@pytest.fixture
def base_run(tmp_path_factory):
  """A tiny purejax run with the test's tokenizer: a model to start from."""
  return saved_model(tmp_path_factory.mktemp("base"), CONFIG, TOKENIZER)


@pytest.mark.parametrize("flags, message", [
    (["--group_size=1"], "group_size=1: a group needs at least 2"),
    (["--reward=no_such_module:score"], "does not import"),
    (["--reward=code"], "--allow_code_execution"),
    (["--task=missing.jsonl"], "missing.jsonl does not exist"),
    (["--allow_code_execution"], "--allow_code_execution lets the code reward"),
    (["--lora_alpha=8"], "--lora_alpha has no effect without LoRA"),
    (["--quantize=q4_1"], "--quantize has no effect without LoRA"),
    (["--lora_rank=4", "--quantize=gguf"], "not a .gguf file"),
])
def test_the_command_line_refuses_bad_input_in_one_line(tmp_path, capsys, base_run, flags,
                                                        message):
  out = tmp_path / "out"
  assert message in refusal(capsys, rl_cli, f"--init_from={base_run}", f"--out_dir={out}",
                            *flags)
  assert not out.exists() or not list(out.glob("*"))  # nothing written


@pytest.mark.parametrize("reward, message", [
    ("test_rl:raising_reward", "raised ZeroDivisionError"),
    ("test_rl:nan_reward", "returned nan"),
])
def test_a_failing_reward_stops_the_run_before_anything_is_written(tmp_path, capsys, base_run,
                                                                   reward, message):
  out, task = tmp_path / "out", tmp_path / "sums.jsonl"
  task.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n")
  assert message in refusal(capsys, rl_cli, f"--init_from={base_run}", f"--out_dir={out}",
                            f"--task={task}", f"--reward={reward}", "--max_new_tokens=4",
                            "--group_size=2", "--prompts_per_step=1")
  assert not out.exists() or not list(out.glob("*"))


def test_a_prompt_longer_than_the_context_is_refused(tmp_path, capsys, base_run):
  task = tmp_path / "long.jsonl"
  task.write_text(json.dumps({"prompt": "1+1=" * 12, "answer": 2}) + "\n")
  out = tmp_path / "out"
  assert "exceed the model's context of 64" in refusal(
      capsys, rl_cli, f"--init_from={base_run}", f"--out_dir={out}", f"--task={task}",
      "--max_new_tokens=32")
  assert not out.exists() or not list(out.glob("*"))


def raising_reward(prompt, completion, example):
  return 1 / 0


def nan_reward(prompt, completion, example):
  return float("nan")


def test_the_command_line_wants_a_model(tmp_path, capsys):
  assert "--init_from is required" in refusal(capsys, rl_cli, f"--out_dir={tmp_path / 'o'}")

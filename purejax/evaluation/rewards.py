"""Rewards: plain functions `reward(prompt, completion, example) -> float`.

    reward = load_reward("numeric")                     # built in
    reward = load_reward("my_rewards:brevity")          # module:function, importable
    reward(prompt, completion, example)                # a float (rl_loop checks it)

`prompt` is the example's prompt (text, or its messages), `completion` the model's text
(its stop token left out) and `example` the task's whole record (`rl_tasks.Example`).
Built in:

- "numeric": 1.0 where the completion's last number equals the example's `"answer"`
  (`final_number`), else 0.0;
- "code": 1.0 where the completion's code (its first fenced block, else all of it)
  passes the example's HumanEval-style `"test"` for `"entry_point"`, run in
  `sandbox` (only with code execution allowed).
"""

import importlib
import numbers
import re
from typing import Any, Callable, Dict, Optional

from purejax.evaluation import humaneval
from purejax.evaluation import sandbox

Reward = Callable[[Any, str, Dict[str, Any]], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class RewardError(ValueError):
  """A reward that cannot be loaded."""


def final_number(text: str) -> Optional[float]:
  """The last number written in `text` (thousands commas allowed), or None."""
  found = _NUMBER.findall(text)
  if not found:
    return None
  try:
    return float(found[-1].replace(",", ""))
  except ValueError:
    return None


def numeric(prompt, completion: str, example: Dict[str, Any]) -> float:
  """1.0 where `completion`'s last number equals `example["answer"]`'s (exactly)."""
  del prompt
  want = example["answer"]
  want = float(want) if isinstance(want, numbers.Real) else final_number(str(want))
  got = final_number(completion)
  return float(want is not None and got is not None and got == want)


def code_reward(timeout: float = 10.0) -> Reward:
  """The "code" reward: the completion's code against the example's tests, in `sandbox`."""

  def code(prompt, completion: str, example: Dict[str, Any]) -> float:
    del prompt
    program = humaneval.program(example, humaneval.code_of_answer(completion), chat_mode=True)
    return float(sandbox.run_program(program, timeout=timeout).passed)

  return code


BUILT_IN = ("numeric", "code")


def load_reward(spec: str, *, allow_code_execution: bool = False) -> Reward:
  """A built-in reward by name, or `module:function` (the module importable).

  Raises:
    RewardError: an unknown name, a module that does not import, a function it lacks.
    humaneval.CodeExecutionRefused: "code" without `allow_code_execution`.
  """
  if spec == "numeric":
    return numeric
  if spec == "code":
    if not allow_code_execution:
      raise humaneval.CodeExecutionRefused(
          "the code reward runs model-written programs; pass `allow_code_execution=True` "
          "to run them, in a sandboxed subprocess each.")
    return code_reward()
  module_name, sep, function = spec.partition(":")
  if not sep or not module_name or not function:
    raise RewardError(f"unknown reward {spec!r}; choose {' or '.join(BUILT_IN)}, or give "
                      f"module:function.")
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # a user's module may fail in any way as it imports
    raise RewardError(f"the reward module {module_name!r} does not import "
                      f"({type(e).__name__}: {e}); put it on PYTHONPATH or fix it.") from None
  reward = getattr(module, function, None)
  if not callable(reward):
    raise RewardError(f"{module_name} has no function {function!r} to score with.")
  return reward

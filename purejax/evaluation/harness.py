"""purejax models in EleutherAI's lm-evaluation-harness (`pip install -e ".[eval]"`).

    import lm_eval
    from purejax.evaluation import harness
    results = lm_eval.simple_evaluate(model=harness.PurejaxLM(init_from="path/to/model"),
                                      tasks=["arc_easy"])

or `python -m purejax.eval --init_from=MODEL --harness_tasks=arc_easy`. Importing
this module registers the model type as "purejax", so a program that imports
it may also call `lm_eval.cli_evaluate()` with `--model purejax --model_args
init_from=...`. Any harness task whose data is on this machine runs: log-likelihood
requests go through `loglik.score` (many per compiled call), rolling ones
through the harness's own token windows, and generation through
`engine.generate`, greedy or sampled, cut at the first stop string.
"""

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from purejax import engine
from purejax import weights
from purejax.data import tokenizers
from purejax.evaluation import loglik
from purejax.evaluation import tasks as tasks_lib

try:
  # The harness fills its registry with its own models only while it is empty:
  # they go in before "purejax" does.
  import lm_eval.models  # pylint: disable=unused-import
  from lm_eval.api.model import LM
  from lm_eval.api.registry import register_model
  from lm_eval import utils as lm_eval_utils
except ImportError as e:  # pragma: no cover - the message is the point
  raise ImportError("purejax.evaluation.harness needs lm-evaluation-harness: pip install "
                    "-e \".[eval]\" (lm-eval==0.4.13).") from e


@register_model("purejax")
class PurejaxLM(LM):
  """A purejax model as the harness's `LM`.

  Args (also `--model_args` of the harness's command line, as strings):
    init_from: what `weights.from_pretrained` reads (a Hugging Face folder, a
      GGUF file, a purejax run directory, ...).
    batch_size: requests per compiled call.
    dtype: "float32" or "bfloat16" matmuls (default: the model's).
    params, config, tokenizer: an already-loaded model, instead of `init_from`.
  """

  def __init__(self, init_from: Optional[str] = None, batch_size: Any = 8,
               dtype: Optional[str] = None, *, params=None, config=None, tokenizer=None,
               seed: Any = 0, **harness_args):
    super().__init__()
    unknown = sorted(set(harness_args) - {"device"})  # the harness passes its own `device`
    if unknown:
      raise ValueError(f"PurejaxLM does not take {', '.join(unknown)}; it takes init_from, "
                       f"batch_size, dtype and seed.")
    if params is None:
      if not init_from:
        raise ValueError("PurejaxLM needs init_from=MODEL (or params, config and tokenizer).")
      params, config, spec = weights.from_pretrained(init_from)
      params, tokenizer = jax.tree.map(jnp.asarray, params), tokenizers.from_spec(spec)
      if dtype:
        config = dataclasses.replace(config, compute_dtype=dtype)
    self.params, self.config, self.tokenizer = params, config, tokenizer
    self._batch_size = int(batch_size) if str(batch_size) != "auto" else 8
    self.seed = int(seed)
    self._texts: Optional[List[str]] = None  # each id's text, for stop strings

  @property
  def eot_token_id(self) -> int:
    return tasks_lib.start_id(self.tokenizer)

  @property
  def max_length(self) -> int:
    return self.config.block_size

  def tok_encode(self, text: str) -> List[int]:
    return [int(i) for i in self.tokenizer.encode(text)]

  def _score(self, requests: List[loglik.Request]) -> List[loglik.Scored]:
    return loglik.score(self.params, self.config, requests, batch_size=self._batch_size)

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
    pairs = [tasks_lib.encode_pair(self.tokenizer, *r.args) for r in requests]
    return [(s.logprob, s.greedy) for s in self._score(pairs)]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
    windows, owner = [], []
    for i, r in enumerate(requests):
      (text,) = r.args
      for context, continuation in map(lm_eval_utils.make_disjoint_window,
                                       lm_eval_utils.get_rolling_token_windows(
                                           token_list=self.tok_encode(text),
                                           prefix_token=self.eot_token_id,
                                           max_seq_len=self.max_length, context_len=1)):
        windows.append(loglik.Request(list(context), list(continuation)))
        owner.append(i)
    totals = np.zeros(len(requests))
    for i, scored in zip(owner, self._score(windows)):
      totals[i] += scored.logprob
    return [float(t) for t in totals]

  def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
    # Requests with the same settings go together through `engine.generate`,
    # `batch_size` decoded side by side, each row refilled as its completion ends.
    out: List[Optional[str]] = [None] * len(requests)
    groups: Dict[Tuple, List[int]] = {}
    for i, r in enumerate(requests):
      _, kwargs = r.args
      sampled = bool(kwargs.get("do_sample"))
      groups.setdefault((int(kwargs.get("max_gen_toks", 256)),
                         float(kwargs.get("temperature", 0.0)) if sampled else 0.0,
                         tuple(_stops(kwargs, self.tokenizer))), []).append(i)
    for (max_new, temperature, stops), members in groups.items():
      # Rows end at their stop strings inside the decode loop; the text is cut after.
      wanted = [s for s in stops if s]
      prompts = [self.tok_encode(requests[i].args[0]) for i in members]
      room = max(1, min(max_new, self.max_length // 2))
      prompts = [ids[-(self.max_length - room):] for ids in prompts]
      room = min(max_new, self.max_length - max(len(ids) for ids in prompts))
      rows = engine.generate(self.params, prompts, self.config, jax.random.PRNGKey(self.seed),
                             room, rows=self._batch_size, temperature=temperature,
                             valid_vocab=self.tokenizer.vocab_size, stop_strings=wanted,
                             token_texts=self._token_texts() if wanted else None)
      for i, (row,) in zip(members, rows):
        out[i] = _cut(self.tokenizer.decode(list(row.tokens)), list(stops))
    return out

  def _token_texts(self) -> List[str]:
    """Each id's text (`tokenizers.token_texts`), read once."""
    if self._texts is None:
      self._texts = tokenizers.token_texts(self.tokenizer)
    return self._texts


def _stops(kwargs: Dict[str, Any], tokenizer) -> List[str]:
  until = kwargs.get("until") or []
  until = [until] if isinstance(until, str) else list(until)
  spec = tokenizer.spec() if hasattr(tokenizer, "spec") else None
  eos = getattr(spec, "eos_token", None)
  return until + ([eos] if eos else [])


def _cut(text: str, stops: List[str]) -> str:
  """`text` up to its first stop string."""
  ends = [text.find(s) for s in stops if s and s in text]
  return text[:min(ends)] if ends else text

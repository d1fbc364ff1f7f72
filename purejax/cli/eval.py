r"""Evaluates a model on benchmark tasks: accuracies to the terminal and a JSON file.

    python -m purejax.eval --init_from=path/to/model --tasks=arc_easy.jsonl,hellaswag.json
    python -m purejax.eval --out_dir=out-gpt --tasks=lambada.jsonl --limit=100 --num_fewshot=0

Each task is a local file: a `.jsonl` of multiple-choice, schema or
language-modelling items in DCLM's CORE formats, or a `.json` spec naming
one with its few-shot count and random baseline (`purejax.evaluation.tasks`
says what each number means). The library call is
`purejax.evaluation.evaluate(params, config, tokenizer, tasks)`.
"""

import json
from typing import Sequence

from absl import flags

from purejax import checkpoint
from purejax import evaluation
from purejax.cli import command
from purejax.cli import errors
from purejax.cli import forms_flags
from purejax.cli import models
from purejax.data import chat


def define_flags(args: flags.FlagValues) -> None:
  flags.DEFINE_string(
      "init_from", None, "The model: a Hugging Face folder or Hub id in its cache, a .gguf "
      "file, a nanoGPT ckpt.pt, gpt2..., or a purejax run directory (default: --out_dir's "
      "newest checkpoint).", flag_values=args)
  flags.DEFINE_string("out_dir", "out-gpt", "Run directory of a trained model, when no "
                      "--init_from.", flag_values=args)
  flags.DEFINE_bool("best", False, "Use --out_dir's best checkpoint (ckpt_best.npz).",
                    flag_values=args)
  flags.DEFINE_list("tasks", None, "Tasks, comma-separated: humaneval, or files of .jsonl "
                    "items or .json specs.", flag_values=args)
  flags.DEFINE_bool("allow_code_execution", False, "Run the code the model writes "
                    "(HumanEval), each program in its own limited process; ideally inside a "
                    "container.", flag_values=args)
  flags.DEFINE_enum("chat", "auto", ["auto", "true", "false"], "HumanEval through the "
                    "model's chat template (auto: when it has one).", case_sensitive=False,
                    flag_values=args)
  flags.DEFINE_integer("samples", 1, "HumanEval completions per problem.", lower_bound=1,
                       flag_values=args)
  flags.DEFINE_float("temperature", 0.0, "HumanEval sampling temperature (0: greedy).",
                     lower_bound=0.0, flag_values=args)
  flags.DEFINE_list("pass_k", ["1"], "The k of HumanEval's pass@k, each <= --samples.",
                    flag_values=args)
  flags.DEFINE_integer("max_new_tokens", 256, "HumanEval's tokens per completion, at most.",
                       lower_bound=1, flag_values=args)
  flags.DEFINE_float("timeout", 10.0, "Seconds each HumanEval program may run.",
                     lower_bound=0.1, flag_values=args)
  flags.DEFINE_list("harness_tasks", None, "lm-evaluation-harness tasks to run on the model "
                    "(their data must be on this machine; needs pip install -e \".[eval]\").",
                    flag_values=args)
  flags.DEFINE_string("harness_include_path", None, "A folder of the harness's task YAML files "
                      "(local tasks) for --harness_tasks; where every task is there, the "
                      "harness's own thousands of tasks are not indexed.", flag_values=args)
  flags.DEFINE_integer("limit", None, "Score only each task's first N items.", lower_bound=1,
                       flag_values=args)
  flags.DEFINE_integer("num_fewshot", None, "Answered examples before each item (default: "
                       "the spec's, else 0).", lower_bound=0, flag_values=args)
  flags.DEFINE_integer("batch_size", 8, "Requests per compiled call (HumanEval: completions "
                       "decoded side by side).", lower_bound=1,
                       flag_values=args)
  flags.DEFINE_string("output", "eval_results.json", "Where the results go, as JSON.",
                      flag_values=args)
  flags.DEFINE_string("tokenizer_file", None, "Where the model's tokenizer file is, if not "
                      "beside it.", flag_values=args)
  flags.DEFINE_integer("block_size", None, "Context kept (default: the model's).",
                       lower_bound=1, flag_values=args)
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Dtype of the matmuls "
                    "(default: the model's).", flag_values=args)
  models.define_quantize_flag(args)
  forms_flags.define_forms_flags(args, sweeps=False)


def run_eval(args: flags.FlagValues) -> int:
  """Evaluates the model the parsed flags name on `--tasks`; prints and writes the results."""
  try:
    if not args.tasks and not args.harness_tasks:
      raise ValueError("--tasks is required: task files, comma-separated (.jsonl items or "
                       ".json specs); or --harness_tasks.")
    if args.harness_include_path and not args.harness_tasks:
      raise ValueError("--harness_include_path has no effect without --harness_tasks; add "
                       "them or drop it.")
    forms_flags.check_platform(args)  # before loading anything
    humaneval = HUMANEVAL in (args.tasks or ())
    if humaneval:
      ks = _pass_k(args)
      if not args.allow_code_execution:
        raise ValueError("--tasks=humaneval runs the code the model writes; add "
                         "--allow_code_execution to accept that (ideally in a container).")
      problems = evaluation.humaneval.load_problems()[:args.limit]
    tasks = [evaluation.load_task(path, num_fewshot=args.num_fewshot)
             for path in args.tasks or () if path != HUMANEVAL]
    harness = _harness() if args.harness_tasks else None
    params, config, tokenizer = models.load_model(args.out_dir, args.init_from,
                                                  best=args.best,
                                                  tokenizer_file=args.tokenizer_file,
                                                  quantize=args.quantize)
    params, config = models.adjust(params, config, args.block_size, args.dtype,
                                   args.quantize)
    forms = forms_flags.forms_from_flags(args)
    results = evaluation.evaluate(params, config, tokenizer, tasks,
                                  batch_size=args.batch_size, limit=args.limit, forms=forms)
    if humaneval:
      results[HUMANEVAL] = _run_humaneval(args, problems, ks, params, config, tokenizer, forms)
    if harness is not None:
      results.update(_run_harness(harness, args, params, config, tokenizer))
    evaluation.suite.write_results(args.output, results, {
        "model": args.init_from or args.out_dir, "tasks": list(args.tasks or ()),
        "harness_tasks": list(args.harness_tasks or ()), "limit": args.limit,
        "num_fewshot": args.num_fewshot})
  except (ValueError, OSError, checkpoint.CheckpointError) as e:
    errors.fail(e, args)
  own = {name: r for name, r in results.items() if "accuracy" in r}
  if own:
    print(evaluation.table(own))
  for name, r in results.items():
    if name not in own:
      where = "" if name == HUMANEVAL else " (lm-evaluation-harness)"
      print(f"{name}{where}: " + ", ".join(
          f"{k} {v:.4f}" for k, v in r.items() if isinstance(v, float)))
  print(f"results: {args.output}")
  print("final " + json.dumps({name: {k: v for k, v in r.items() if k != "outcomes"}
                               for name, r in results.items()}))
  return 0


HUMANEVAL = "humaneval"


def _pass_k(args) -> list:
  try:
    ks = [int(k) for k in args.pass_k]
  except ValueError:
    raise ValueError(f"--pass_k must be integers, got {','.join(args.pass_k)}.") from None
  if any(k < 1 or k > args.samples for k in ks):
    raise ValueError(f"--pass_k={','.join(args.pass_k)}: each k must be 1 to --samples="
                     f"{args.samples}; raise --samples (with --temperature above 0).")
  if args.samples > 1 and args.temperature == 0:
    raise ValueError(f"--samples={args.samples} with --temperature=0 gives the same greedy "
                     f"completion each time; add --temperature (e.g. 0.8) or take 1 sample.")
  return ks


def _run_humaneval(args, problems, ks, params, config, tokenizer, forms) -> dict:
  """HumanEval's pass@k on the model, through its chat template as --chat says."""
  fmt, stops = None, ()
  if args.chat != "false":
    try:
      fmt = models.chat_format(args.init_from, tokenizer)
      stops = models.stop_ids(tokenizer, fmt)
    except chat.ChatTemplateError as e:
      if args.chat == "true":
        raise ValueError(f"--chat=true: {e}") from None
  if fmt is None:
    stops = models.stop_ids(tokenizer)
  result = evaluation.humaneval.run(
      params, config, tokenizer, problems, allow_code_execution=True, fmt=fmt,
      samples=args.samples, temperature=args.temperature, ks=ks,
      max_new_tokens=args.max_new_tokens, timeout=args.timeout, stop_ids=stops,
      batch_size=args.batch_size, forms=forms)
  result["chat"] = fmt is not None
  return result


def _harness():
  """The harness adapter, or a one-line reason it cannot load."""
  try:
    from purejax.evaluation import harness  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError(f"--harness_tasks: {e}") from None
  return harness


def _run_harness(harness, args, params, config, tokenizer):
  """`{task: {metric: value}}` of the harness's tasks on the model."""
  import lm_eval  # pylint: disable=g-import-not-at-top
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  manager = None
  if args.harness_include_path:
    # Tasks all in the include path need not index the harness's thousands of own task
    # files (about 14 s on 2 cores).
    local = TaskManager(include_path=args.harness_include_path, include_defaults=False)
    manager = local if set(args.harness_tasks) <= set(local.all_tasks) else None
  manager = manager or TaskManager(include_path=args.harness_include_path)
  unknown = [t for t in args.harness_tasks if t not in manager.all_tasks]
  if unknown:
    raise ValueError(f"--harness_tasks: {', '.join(unknown)} is not a task the harness knows; "
                     f"pass --harness_include_path=FOLDER of its YAML, or see `lm_eval "
                     f"--tasks list`.")
  model = harness.PurejaxLM(params=params, config=config, tokenizer=tokenizer,
                            batch_size=args.batch_size)
  out = lm_eval.simple_evaluate(model=model, tasks=list(args.harness_tasks),
                                num_fewshot=args.num_fewshot, limit=args.limit,
                                task_manager=manager)
  return {name: {k.split(",")[0]: v for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not k.startswith("alias")}
          for name, metrics in out["results"].items()}


def run(argv: Sequence[str]) -> int:
  """`python -m purejax.eval` with `argv` (the program's name first): the exit code."""
  return command.run(argv, define_flags, run_eval, usage=__doc__)


def main() -> None:
  command.main(run)


if __name__ == "__main__":
  main()

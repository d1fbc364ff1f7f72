r"""Replays one training step of a run, to see what made its loss.

    python -m purejax.replay --out_dir=out-gpt --step=450
    python -m purejax.replay --out_dir=out-gpt --step=450 --dataset=my_notes.txt

Restores the newest checkpoint at or before the step (before every kept
checkpoint: the run's start, which its seed makes again), replays the run's
updates up to it and runs the step once more (`purejax.training.tools.replay`):
its loss equals the one `metrics.jsonl` logged at `--step`, bit for bit,
for a run trained alone on one device. It prints the loss beside the logged
one, each layer's gradient norm and the tokens of highest loss in their context,
and writes `out_dir/replay/step_<N>.npz`: `tokens` `[batch, block + 1]` (the
batch's windows), `token_losses` `[batch, block]`, `loss`, `grad_norm`, and
each param's gradient norm under `grad_norm/<path>` (`[n_layer]` for the
blocks). The data is the run's own `--dataset` (recorded in its checkpoints).
"""

from typing import Sequence

from absl import flags

from purejax import checkpoint
from purejax.cli import command
from purejax.cli import errors
from purejax.data import datasets as data_lib
from purejax.ops import kernels
from purejax.training.effects import monitor
from purejax.training.tools import replay


def define_flags(args: flags.FlagValues) -> None:
  flags.DEFINE_string("out_dir", None, "The run directory.", flag_values=args)
  flags.DEFINE_integer("step", None, "The step to replay, as metrics.jsonl numbers it (the "
                       "step count after the update).", flag_values=args)
  flags.DEFINE_string("dataset", None, "The run's data (default: what its checkpoints "
                      "record).", flag_values=args)
  flags.DEFINE_string("tokenizer_file", None, "A local copy of GPT-2's encoding, as for "
                      "purejax.train.", flag_values=args)
  flags.DEFINE_string("cache_dir", None, "Where tokenized text is cached, as for "
                      "purejax.train.", flag_values=args)
  flags.DEFINE_string("tfds_data_dir", None, "TFDS data dir, as for purejax.train.",
                      flag_values=args)
  flags.DEFINE_string("tfds_manual_dir", None, "TFDS manual dir, as for purejax.train.",
                      flag_values=args)
  flags.DEFINE_integer("show_tokens", 5, "Tokens of highest loss to print in context.",
                       flag_values=args)


def check_step(out_dir: str, step: int) -> None:
  """Refuses a `step` past the last one the run trained (logged or checkpointed)."""
  try:
    trained = [r["step"] for r in monitor.read_metrics(out_dir)]
  except FileNotFoundError:
    return  # no metrics to compare with; the replay itself says what is missing
  trained += [s for s, _ in checkpoint.list_checkpoints(out_dir)]
  if trained and step > max(trained):
    raise ValueError(f"--step={step} is past the last step {out_dir} trained, "
                     f"{max(trained)}; replay a step up to {max(trained)}.")


def replay_step(args: flags.FlagValues) -> int:
  """Replays `--step` of `--out_dir` and prints what it found."""
  try:
    missing = [f"--{name}" for name in ("out_dir", "step") if args[name].value is None]
    if missing:
      raise ValueError(f"{' and '.join(missing)} must be given: the run and the step to "
                       f"replay, e.g. --out_dir=out-gpt --step=450.")
    check_step(args.out_dir, args.step)
    result = replay.replay_run(
        args.out_dir, args.step, forms=kernels.select(kernels.platform_of()),
        dataset=args.dataset, tokenizer_file=args.tokenizer_file,
        cache_dir=args.cache_dir, tfds_data_dir=args.tfds_data_dir,
        tfds_manual_dir=args.tfds_manual_dir)
  except (ValueError, OSError, data_lib.DataUnavailableError, checkpoint.CheckpointError) as e:
    errors.fail(e, args)
  for line in replay.describe(result, show_tokens=args.show_tokens):
    print(line)
  return 0


def run(argv: Sequence[str]) -> int:
  """`python -m purejax.replay` with `argv` (the program's name first): the exit code."""
  return command.run(argv, define_flags, replay_step, usage=__doc__)


def main() -> None:
  command.main(run)


if __name__ == "__main__":
  main()

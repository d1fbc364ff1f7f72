r"""Replays one training step of a run, to see what made its loss.

    python -m purejax.replay --out_dir=out-gpt --step=450
    python -m purejax.replay --out_dir=out-gpt --step=450 --dataset=my_notes.txt

Restores the newest checkpoint at or before the step, replays the run's
updates up to it and runs the step once more (`purejax.training.replay`):
its loss equals the one `metrics.jsonl` logged at `--step`, bit for bit,
for a run trained alone on one device. It prints the loss beside the logged
one, each layer's gradient norm and the tokens of highest loss in their context,
and writes `out_dir/replay/step_<N>.npz`: `tokens` `[batch, block + 1]` (the
batch's windows), `token_losses` `[batch, block]`, `loss`, `grad_norm`, and
each param's gradient norm under `grad_norm/<path>` (`[n_layer]` for the
blocks). The data is the run's own `--dataset` (recorded in its checkpoints).
"""

from absl import app
from absl import flags
from absl import logging

from purejax import _cli
from purejax.training import checkpoint
from purejax.training import replay
from purejax.data import datasets as data_lib
from purejax.ops import kernels

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "The run directory.")
flags.DEFINE_integer("step", None, "The step to replay, as metrics.jsonl numbers it (the "
                     "step count after the update).")
flags.DEFINE_string("dataset", None, "The run's data (default: what its checkpoints record).")
flags.DEFINE_string("tokenizer_file", None, "A local copy of GPT-2's encoding, as for "
                    "purejax.train.")
flags.DEFINE_string("cache_dir", None, "Where tokenized text is cached, as for purejax.train.")
flags.DEFINE_string("tfds_data_dir", None, "TFDS data dir, as for purejax.train.")
flags.DEFINE_string("tfds_manual_dir", None, "TFDS manual dir, as for purejax.train.")
flags.DEFINE_integer("show_tokens", 5, "Tokens of highest loss to print in context.")
flags.mark_flags_as_required(["out_dir", "step"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  try:
    result = replay.replay_run(
        FLAGS.out_dir, FLAGS.step, forms=kernels.select(kernels.platform_of()),
        dataset=FLAGS.dataset, tokenizer_file=FLAGS.tokenizer_file,
        cache_dir=FLAGS.cache_dir, tfds_data_dir=FLAGS.tfds_data_dir,
        tfds_manual_dir=FLAGS.tfds_manual_dir)
  except (ValueError, OSError, data_lib.DataUnavailableError, checkpoint.CheckpointError) as e:
    _cli.fail(e)
  for line in replay.describe(result, show_tokens=FLAGS.show_tokens):
    print(line)


if __name__ == "__main__":
  app.run(main)

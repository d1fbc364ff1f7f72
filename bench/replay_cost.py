"""What replaying a run's last step from its start costs, against training the run.

    python -m bench.replay_cost                  # nanoGPT's CPU recipe, 100 steps
    python -m bench.replay_cost --steps=200 --rounds=3
    python -m bench.replay_cost --quick          # a smoke run (tiny model, 20 steps)

Each round trains a fresh run of `--steps` steps (`python -m purejax.train`,
keeping only its last checkpoint, at step N), then replays step N
(`python -m purejax.replay`): no checkpoint lies before it, so the replay
starts from the run's seeded initial state and re-runs all N updates. Both
are timed as whole commands (start-up, data, compilation, steps, files),
which is what a person waits for. It prints each round's times and the
ratio replay / training (the target: <= 1.2).
"""

import pathlib
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
CPU_RECIPE = ["--n_layer=4", "--n_head=4", "--n_embd=128", "--block_size=64",
              "--batch_size=12", "--dropout=0.0"]
QUICK = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4"]


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_integer("steps", 100, "Steps the run trains; its last is replayed.")
  flags.DEFINE_integer("rounds", 1, "Rounds (each trains one run and replays it).")
  flags.DEFINE_bool("quick", False, "A tiny model and 20 steps.")


def timed(*args: str) -> float:
  """Seconds `python -m <args>` takes; fails with its output if it fails."""
  start = time.perf_counter()
  done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                        check=False)
  seconds = time.perf_counter() - start
  if done.returncode:
    sys.exit(f"{' '.join(args[:1])} failed:\n{done.stderr[-3000:]}")
  return seconds


def one_round(folder: pathlib.Path, steps: int, model_flags) -> tuple:
  """`(training seconds, replay seconds)` of one fresh run."""
  out = folder / "run"
  train = timed("purejax.train", *model_flags, f"--max_iters={steps}",
                f"--eval_interval={steps}", "--eval_iters=5", "--log_interval=1",
                "--keep_checkpoints=1", "--sample_tokens=0", "--progress=false",
                f"--out_dir={out}", f"--cache_dir={folder / 'cache'}")
  replay = timed("purejax.replay", f"--out_dir={out}", f"--step={steps}",
                 f"--cache_dir={folder / 'cache'}")
  return train, replay


def main(argv):
  del argv
  steps = 20 if FLAGS.quick else FLAGS.steps
  ratios = []
  for i in range(FLAGS.rounds):
    with tempfile.TemporaryDirectory() as folder:
      train, replay = one_round(pathlib.Path(folder), steps, QUICK if FLAGS.quick else CPU_RECIPE)
    ratios.append(replay / train)
    print(f"round {i}: trained {steps} steps in {train:.1f} s; replayed step {steps} from the "
          f"start (all {steps} updates) in {replay:.1f} s: replay/training {ratios[-1]:.2f}x")
  ratios.sort()
  print(f"replay/training, median of {len(ratios)}: {ratios[len(ratios) // 2]:.2f}x "
        f"(target <= 1.2)")


if __name__ == "__main__":
  define_flags()
  app.run(main)

"""The MNIST MLP's training loop, as a library function that reads no flags.

    history = train_mlp(load_mnist(), MLPTrainConfig(epochs=10), MLP_OPTIMIZER,
                        RunConfig(out_dir="out-mlp"))

One jitted call per epoch, in a loop of the GPT's shape (`gpt_loop.train_gpt`):
the same progress, metrics, checkpoints and signals; an evaluation
(`accuracies`) after every epoch.
"""

import dataclasses
import time
from typing import Any, Dict, Optional, Sequence

import jax
import numpy as np

from purejax import mlp
from purejax import rng
from purejax.data import datasets as data_lib
from purejax.optimizers import optim
from purejax.training.effects import folder_lock
from purejax.training.effects import runs
from purejax.training.effects.runs import RunConfig
from purejax.training.effects.session import Recorded, Session
from purejax.training.pure import parallel
from purejax.training.pure import state as state_lib
from purejax.training.pure import steps
from purejax.training.pure.parallel import ParallelConfig
from purejax.training.pure.state import TrainState

MLP_OPTIMIZER = optim.from_flat(
    learning_rate=3e-3, schedule="cosine", warmup_iters=0, min_lr=0.0, beta2=0.999,
    weight_decay=1e-4, grad_clip=0.0)


@dataclasses.dataclass(frozen=True)
class MLPTrainConfig:
  """The MLP's network and epochs.

  Attributes:
    layer_sizes: widths, input first.
    init_scale: std of the initial weights and biases.
    batch_size: examples per step (the global batch).
    epochs: passes over the training set.
    checkpoint_every: epochs between checkpoints.
    seed: seed of the run's PRNG key.
  """
  layer_sizes: Sequence[int] = (784, 512, 512, 10)
  init_scale: float = 0.01
  batch_size: int = 128
  epochs: int = 10
  checkpoint_every: int = 1
  seed: int = 0

  def __post_init__(self):
    runs.require_positive(batch_size=self.batch_size, epochs=self.epochs,
                          checkpoint_every=self.checkpoint_every)


def train_mlp(
    mnist: data_lib.MnistData,
    train: MLPTrainConfig,
    opt_config: optim.OptimizerConfig,
    run: RunConfig,
    devices: ParallelConfig = ParallelConfig(),
    *,
    meta_config: Optional[Dict[str, Any]] = None,
    progress_bar: Optional[bool] = None,
) -> Dict[str, Any]:
  """Trains the MLP on MNIST; returns the last epoch's metrics.

  Writes checkpoints (one per `checkpoint_every` epochs), `metrics.jsonl` and
  TensorBoard events to `run.out_dir`; `progress_bar` as in `GPTTrainConfig`.

  `opt_config.decay_iters=None` ends the schedule with the run, at step
  `epochs * (examples // batch_size)` (`optim.with_schedule_end`). `meta_config` adds settings to the
  checkpoint's identity (e.g. how pixels were scaled).
  """
  sizes = [int(s) for s in train.layer_sizes]
  keys = rng.split_named(jax.random.PRNGKey(train.seed), ("params", "data"))
  params = mlp.init_network_params(sizes, keys["params"], train.init_scale)
  _check_mlp_fits(params, sizes, mnist)
  steps_per_epoch = len(mnist.train_labels) // train.batch_size
  runs.require_positive(steps_per_epoch=steps_per_epoch)
  opt_config = optim.with_schedule_end(opt_config, train.epochs * steps_per_epoch)
  plan = parallel.make_plan(devices, train.batch_size)
  runs.print_line(parallel.describe(plan, train.batch_size, devices.grad_accum_steps))
  # The whole dataset sits on every device; each device gathers its rows of
  # every batch (see steps.train_epoch).
  train_x, train_y, test_x, test_y = parallel.put(
      (mnist.train_images, mnist.train_labels, mnist.test_images, mnist.test_labels),
      plan.replicated)
  optimizer = optim.RunOptimizer(opt_config, run.skip_nonfinite)()
  schedule = optim.make_schedule(opt_config)
  meta = {"model": "mlp", "config": {"layer_sizes": sizes, "init_scale": train.init_scale,
                                     **(meta_config or {})},
          "optimizer": optim.to_saved(opt_config), "batch_size": train.batch_size,
          "seed": train.seed}
  template = TrainState(params, optimizer.init(params), {"data": keys["data"]})
  with folder_lock.hold(run.out_dir, log=runs.print_line):  # one writer per run folder
    state, epoch, saved = runs.start_or_resume(
        run, template, meta, digest_extra=[devices.fsdp, devices.grad_accum_steps])
    state, shardings = state_lib.shard(state, plan)
    train_epoch = parallel.jit_train_step(
        steps.train_epoch_fn, plan, shardings, optimizer=optimizer, batch_size=train.batch_size,
        grad_accum_steps=devices.grad_accum_steps)
    runs.print_line(f"model: mlp {sizes}, {sum(p.size for p in jax.tree.leaves(params)):,} params")
    runs.print_line(f"optimizer: {optim.describe(opt_config)}, {steps_per_epoch} steps/epoch")
    examples_per_epoch = steps_per_epoch * train.batch_size
    with Session([Recorded(run, meta, saved)], total=train.epochs, start=epoch, unit="epoch",
                 bar=progress_bar) as session:
      while epoch < train.epochs:
        began = time.perf_counter()
        state, train_loss = train_epoch(state, train_x, train_y, epoch)
        train_loss = float(train_loss)  # waits for the epoch to end
        seconds = time.perf_counter() - began
        session.record.check_finite(np.array([train_loss]), epoch + 1)  # epochs count from 1
        epoch += 1
        session.record.monitor.log_train(epoch, loss=train_loss,
                                         lr=float(schedule(epoch * steps_per_epoch - 1)),
                                         examples_per_s=examples_per_epoch / seconds)
        record = dict(epoch=epoch, seconds=seconds, examples_per_s=examples_per_epoch / seconds,
                      train_loss=train_loss, **accuracies(state.params, train_x, train_y,
                                                          test_x, test_y))
        session.record.add_eval(epoch, state, record, train_acc=record["train_acc"],
                                test_acc=record["test_acc"])
        session.progress.update_to(epoch, loss=train_loss, test_acc=record["test_acc"])
        session.log("epoch {epoch:3d} | {seconds:6.3f} s | {examples_per_s:9.0f} ex/s | "
                    "loss {train_loss:.4f} | train acc {train_acc:.4f} | "
                    "test acc {test_acc:.4f}".format(**record))
        session.save_if(runs.every(train.checkpoint_every, epoch, train.epochs), epoch, state)
    return session.record.history[-1] if session.record.history else {}


def accuracies(params: mlp.Params, train_x, train_y, test_x, test_y) -> Dict[str, float]:
  """`train_acc` and `test_acc`: the fraction of each set the MLP classifies right."""
  return {"train_acc": float(mlp.evaluate_accuracy(params, train_x, train_y)),
          "test_acc": float(mlp.evaluate_accuracy(params, test_x, test_y))}


def _check_mlp_fits(params: mlp.Params, sizes: Sequence[int], mnist: data_lib.MnistData
                    ) -> None:
  mlp.check_input_size(params, mnist.num_features)
  classes = int(mnist.train_labels.max()) + 1
  if sizes[-1] < classes:
    raise ValueError(f"the last layer size {sizes[-1]} is below the {classes} classes of "
                     f"the data.")

"""nanoGPT's CPU recipe trained by the PyTorch twin, for the val-loss comparison.

    python -m bench.torch_recipe --seeds=0,1,2

Same data (purejax.data.datasets's Tiny Shakespeare, nanoGPT's 90/10 split), same
model (bench/torch_gpt.py, bias off as in nanoGPT's train.py), the library's
schedule (`harness.lr_table`: linear warmup, cosine to min_lr), AdamW (decay
on rank >= 2), clip 1.0,
2000 iterations, then the loss over 200 random val batches, as nanoGPT's
estimate_loss computes it. Prints one val loss per seed and the median.
"""

import time

from absl import app
from absl import flags
import numpy as np
import torch

from bench import harness
from bench import torch_gpt
from purejax import gpt
from purejax.data import corpus
from purejax.optimizers import optim
from purejax.training.loops import recipes

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags; defined only when this module runs as the program."""
  flags.DEFINE_list("seeds", "0,1,2", "Seeds to train.")
  flags.DEFINE_integer("max_iters", 2000, "Training iterations.")

BATCH, EVAL_ITERS = 12, 200


def optimizer_config(max_iters: int) -> optim.OptimizerConfig:
  """`purejax.train`'s recipe optimizer, its cosine ending at the run's last step."""
  return optim.with_schedule_end(recipes.GPT_OPTIMIZER, max_iters)


def batch(data, block, generator):
  ix = torch.randint(len(data) - block, (BATCH,), generator=generator)
  return (torch.stack([data[i:i + block] for i in ix]),
          torch.stack([data[i + 1:i + 1 + block] for i in ix]))


def train(seed, text, max_iters):
  config = gpt.GPTConfig(vocab_size=text.vocab_size, block_size=64, n_layer=4, n_head=4,
                         n_embd=128, bias=False)
  torch.manual_seed(seed)
  generator = torch.Generator().manual_seed(seed)
  model = torch_gpt.TorchGPT(config)
  opt = optimizer_config(max_iters)
  lrs = harness.lr_table(opt, max_iters)
  optimizer = torch_gpt.make_optimizer(model, opt.learning_rate, opt.weight_decay,
                                       (opt.beta1, opt.beta2))
  train_data = torch.from_numpy(text.train.astype(np.int64))
  val_data = torch.from_numpy(text.val.astype(np.int64))
  start = time.perf_counter()
  for it in range(max_iters):
    for group in optimizer.param_groups:
      group["lr"] = lrs[it]
    x, y = batch(train_data, config.block_size, generator)
    _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
    optimizer.step()
  ms = 1000 * (time.perf_counter() - start) / max_iters
  model.eval()
  with torch.no_grad():
    losses = [model(*batch(val_data, config.block_size, generator))[1].item()
              for _ in range(EVAL_ITERS)]
  return float(np.mean(losses)), ms


def main(_):
  text = corpus.load_corpus("tiny_shakespeare")
  results = []
  for seed in [int(s) for s in FLAGS.seeds]:
    val, ms = train(seed, text, FLAGS.max_iters)
    results.append(val)
    print(f"torch twin seed {seed}: val loss {val:.4f} at iter {FLAGS.max_iters} ({ms:.1f} ms/iter)",
          flush=True)
  print(f"median val loss {np.median(results):.4f} over seeds {FLAGS.seeds}")


if __name__ == "__main__":
  define_flags()
  app.run(main)

"""Named recipes: a GPT's block, optimizer, schedule and steps, chosen together.

    recipe = RECIPES["modern"]
    config = recipe.model_config(vocab_size=65)        # nanoGPT's CPU shape, the recipe's block
    gpt_loop.train_gpt(config, text, GPTTrainConfig(max_iters=recipe.max_iters),
                   recipe.optimizer, RunConfig(out_dir="out-modern"))

`python -m purejax.train --recipe=NAME` takes a recipe's settings as its
flags' defaults, so any flag still overrides one setting; `bench.speedrun`
trains the same definitions. Every recipe keeps nanoGPT's CPU shape (4
layers, 4 heads, width 128, context 64, batch 12) so they compare on one
footing; what they change is the block, the optimizer and the steps.
"""

import dataclasses
from typing import Any, Dict, Mapping

from purejax import gpt
from purejax.optimizers import adam
from purejax.optimizers import muon
from purejax.optimizers import optim

# nanoGPT's character-level Shakespeare recipe for a CPU: the model (no
# biases, as nanoGPT's train.py; GPTConfig's own default is GPT-2's biases)
# and its optimizer. `purejax.train`'s GPT flags default to these.
SHAKESPEARE_CHAR = gpt.GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4,
                                 n_embd=128, dropout=0.0, bias=False)
GPT_OPTIMIZER = optim.OptimizerConfig(
    learning_rate=1e-3, schedule="cosine", warmup_iters=100, min_lr=1e-4, grad_clip=1.0,
    settings=adam.AdamW(beta2=0.99, weight_decay=0.1))

# The modern recipe's optimizer: Muon on the blocks' matrices, AdamW (nanoGPT's
# betas, decay and clipping) on embeddings, head and value embeddings. Three
# minimax Newton-Schulz steps (as close to orthogonal as Keller Jordan's five,
# for 0.6 of their cost), the fused qkv weight as one matrix: at this size
# Newton-Schulz is a quarter of the step, and both buy steps at equal time
# (docs/architectures.md).
MODERN_OPTIMIZER = dataclasses.replace(
    GPT_OPTIMIZER, learning_rate=1e-2, warmup_iters=20,
    settings=muon.Muon(learning_rate=1e-2, ns_steps=3, ns_coeffs="minimax", split_qkv=False,
                       adamw=GPT_OPTIMIZER.settings))

# The modern recipe's block: nanochat's, with RMSNorm's learned scales and no
# norm after the embedding, which train better at this size (bench.speedrun's
# ablations).
MODERN_BLOCK = {"arch": "nanochat", "norm_scale": True, "embed_norm": False}


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A named way to train a GPT.

  Attributes:
    block: `{"arch": name in gpt.ARCHITECTURES, GPTConfig field: value}`: the
      block's architecture and what the recipe changes in it.
    optimizer: the optimizer and its schedule (`decay_iters=None`: the run's end).
    max_iters: steps of a run.
    summary: one line for `--help` and the log.
  """
  block: Mapping[str, Any]
  optimizer: optim.OptimizerConfig
  max_iters: int
  summary: str

  @property
  def arch(self) -> str:
    return self.block.get("arch", "gpt2")

  def block_options(self) -> Dict[str, Any]:
    """The GPTConfig options of the recipe's block: its architecture's, then its own."""
    options = dict(gpt.ARCHITECTURES[self.arch])
    options.update({k: v for k, v in self.block.items() if k != "arch"})
    return options

  def model_config(self, **changes) -> gpt.GPTConfig:
    """nanoGPT's CPU shape (`SHAKESPEARE_CHAR`) with the recipe's block, and `changes`."""
    return dataclasses.replace(SHAKESPEARE_CHAR, **{**self.block_options(), **changes})


RECIPES = {
    "nanogpt": Recipe({"arch": "gpt2"}, GPT_OPTIMIZER, 2000,
                      "nanoGPT's CPU recipe: GPT-2's block, AdamW, warmup and cosine, "
                      "2000 steps"),
    "llama": Recipe({"arch": "llama"}, GPT_OPTIMIZER, 2000,
                    "the Llama block (RMSNorm, RoPE, SwiGLU) on nanoGPT's optimizer and steps"),
    "modern": Recipe(MODERN_BLOCK, MODERN_OPTIMIZER, 400,
                     "nanochat's block with learned norm scales, Muon with 3 minimax "
                     "Newton-Schulz steps, 400 steps: nanoGPT's val loss in a fifth of "
                     "its time"),
}
DEFAULT_RECIPE = "nanogpt"

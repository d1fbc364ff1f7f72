"""Train a small character-level GPT on Tiny Shakespeare, then sample from it.

    python examples/shakespeare_gpt.py         # 1000 steps, about a minute on 2 cores
    python examples/shakespeare_gpt.py 200     # fewer steps

The text ships inside the package, so this runs offline.
"""

import sys

import jax
import jax.numpy as jnp

import purejax
from purejax import gpt
from purejax.data import batches
from purejax.ops import kernels
from purejax.optimizers import adam, optim
from purejax.training.pure import steps

text = purejax.data.corpus.load_corpus("tiny_shakespeare")
config = gpt.GPTConfig(vocab_size=text.vocab_size, block_size=64, n_layer=4,
                       n_head=4, n_embd=128, bias=False)  # nanoGPT's CPU recipe
keys = purejax.rng.split_named(jax.random.PRNGKey(0), ("params", "train", "eval", "sample"))
params = gpt.init_params(config, keys["params"])

num_steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
optimizer = optim.make_optimizer(optim.OptimizerConfig(
    learning_rate=1e-3, warmup_iters=50, decay_iters=num_steps, min_lr=1e-4, grad_clip=1.0,
    settings=adam.AdamW(beta2=0.99, weight_decay=0.1)))  # an optax GradientTransformation
state = purejax.TrainState(params, optimizer.init(params), {"train": keys["train"]})
train_data = batches.DeviceTokens(jnp.asarray(text.train))  # each step draws its batch
val_data = batches.DeviceTokens(jnp.asarray(text.val))
forms = kernels.select()  # how the model runs on this machine, chosen once

every = max(num_steps // 10, 1)  # steps per jitted call: 10 calls, each then evaluated
for step in range(0, num_steps, every):
  state, metrics = steps.train_steps(state, train_data, step, config=config,
                                     optimizer=optimizer, batch_size=12,
                                     num_steps=min(every, num_steps - step), forms=forms)
  val = steps.evaluate(state.params, val_data, keys["eval"], config=config, batch_size=12,
                       num_batches=50, forms=forms)
  print(f"step {min(step + every, num_steps)}: train loss {float(metrics.loss[-1]):.3f}, "
        f"val loss {float(val):.3f}")

prompt = text.tokenizer.encode("ROMEO:")
# 300 tokens from a context of 64: past it, sampling goes on from its last half (slide).
((sample,),) = purejax.generate(state.params, [prompt], config, keys["sample"], 300,
                                temperature=0.8, top_k=40, slide=True, forms=forms)
print(text.tokenizer.decode(list(prompt) + list(sample.tokens)))

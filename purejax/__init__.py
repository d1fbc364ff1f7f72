"""purejax: pure-functional deep learning on JAX.

Models are params pytrees (nested dicts of arrays) plus pure functions:

    from purejax import mlp
    params = mlp.init_network_params([784, 512, 512, 10], jax.random.PRNGKey(0))
    logits = mlp.batched_predict(params, images)
"""

from purejax import attention
from purejax import batches
from purejax import checkpoint
from purejax import corpus
from purejax import data
from purejax import decode
from purejax import flops
from purejax import gpt
from purejax import kernels
from purejax import loop
from purejax import mlp
from purejax import monitor
from purejax import nn
from purejax import optim
from purejax import parallel
from purejax import progress
from purejax import rng
from purejax import runs
from purejax import steps
from purejax import tokenizers

__all__ = ["attention", "batches", "checkpoint", "corpus", "data", "decode", "flops",
           "gpt", "kernels", "loop", "mlp", "monitor", "nn", "optim", "parallel",
           "progress", "rng", "runs", "steps", "tokenizers"]
__version__ = "0.1.0"

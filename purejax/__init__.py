"""purejax: pure-functional deep learning on JAX.

Models are params pytrees (nested dicts of arrays) plus pure functions:

    from purejax import mlp
    params = mlp.init_network_params([784, 512, 512, 10], jax.random.PRNGKey(0))
    logits = mlp.batched_predict(params, images)
"""

from purejax import attention
from purejax import checkpoint
from purejax import data
from purejax import decode
from purejax import gpt
from purejax import kernels
from purejax import loop
from purejax import mlp
from purejax import nn
from purejax import optim
from purejax import parallel
from purejax import rng
from purejax import runs
from purejax import steps

__all__ = ["attention", "checkpoint", "data", "decode", "gpt", "kernels", "loop", "mlp",
           "nn", "optim", "parallel", "rng", "runs", "steps"]
__version__ = "0.1.0"

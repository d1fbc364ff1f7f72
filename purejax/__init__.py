"""purejax: pure-functional deep learning on JAX.

Models are params pytrees (nested dicts of arrays) plus pure functions:

    from purejax import mlp
    params = mlp.init_network_params([784, 512, 512, 10], jax.random.PRNGKey(0))
    logits = mlp.batched_predict(params, images)
"""

from purejax import checkpoint
from purejax import data
from purejax import gpt
from purejax import mlp
from purejax import nn
from purejax import optim
from purejax import rng

__all__ = ["checkpoint", "data", "gpt", "mlp", "nn", "optim", "rng"]
__version__ = "0.1.0"

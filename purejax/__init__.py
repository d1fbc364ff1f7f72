"""purejax: pure-functional deep learning on JAX.

Models are params pytrees (nested dicts of arrays) plus pure functions:

    import purejax
    params = purejax.mlp.init_network_params([784, 512, 512, 10], jax.random.PRNGKey(0))
    logits = purejax.mlp.batched_predict(params, images)

    config = purejax.GPTConfig(vocab_size=65, block_size=64)
    params = purejax.gpt.init_params(config, jax.random.PRNGKey(0))

The layers, bottom to top (each imports only from its own and those below
it; tests/test_architecture.py checks that against this drawing):

    _files      crash-safe file writes
    ops/, rng   execution forms (`Forms`, chosen per platform by `select`: matmul,
                attention, the large-vocabulary loss), and dropout; key helpers
    nn          layers as init_<layer> + a pure apply (they use ops.kernels'
                matmul; `nn.dropout` is ops.dropout's)
    gpt, gpt_config, gpt_init, mlp, kv_cache, decode, lora   the models (GPTConfig
                and init beside gpt); the KV cache and sampling with it; low-rank
                adapters over any model's params (below training and weights,
                which both use it)
    data/       tokenizers (and training them), corpora, batches, MNIST and TFDS
    training/   state, steps, optimizer, devices, checkpoints, metrics, the loops,
                sweeps, replayed steps
    weights/    pretrained weights in and out, one module per format
    cli/, train, sample, chat, plot, convert, replay, tokenizer, plan   the command lines, the only layer
                that speaks of --flags: `purejax.cli.<cmd>` is `python -m
                purejax.<cmd>` (the top-level modules only give them those names;
                `purejax.convert` itself is the function `weights.convert`)
"""

from purejax import data
from purejax import decode
from purejax import gpt
from purejax import lora
from purejax import mlp
from purejax import nn
from purejax import ops
from purejax import rng
from purejax import training
from purejax import weights
from purejax.data.batches import sample_batch
from purejax.data.corpus import Corpus
from purejax.data.corpus import load_corpus
from purejax.data.tokenizers import CharTokenizer
from purejax.decode import KVCache
from purejax.decode import generate
from purejax.gpt import GPTConfig
from purejax.ops.kernels import Forms
from purejax.ops.kernels import select as select_forms
from purejax.training.loop import GPTTrainConfig
from purejax.training.mlp_loop import MLPTrainConfig
from purejax.training.loop import evaluate_gpt
from purejax.training.loop import train_gpt
from purejax.training.mlp_loop import train_mlp
from purejax.training.optim import OptimizerConfig
from purejax.training.optim import make_optimizer
from purejax.training.parallel import ParallelConfig
from purejax.training.runs import RunConfig
from purejax.training.steps import StepMetrics
from purejax.training.steps import evaluate
from purejax.training.steps import train_steps
from purejax.training.state import TrainState
from purejax.weights import convert
from purejax.weights import from_pretrained

__all__ = [
    # modules and layers
    "data", "decode", "gpt", "lora", "mlp", "nn", "ops", "rng", "training", "weights",
    # models, how they run, and sampling
    "Forms", "GPTConfig", "KVCache", "generate", "select_forms",
    # data
    "CharTokenizer", "Corpus", "load_corpus", "sample_batch",
    # training
    "GPTTrainConfig", "MLPTrainConfig", "OptimizerConfig", "ParallelConfig", "RunConfig",
    "StepMetrics", "TrainState", "evaluate", "evaluate_gpt", "make_optimizer", "train_gpt",
    "train_mlp",
    "train_steps",
    # weights
    "convert", "from_pretrained",
]
__version__ = "0.1.0"

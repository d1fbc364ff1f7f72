"""purejax: pure-functional deep learning on JAX.

Models are params pytrees (nested dicts of arrays) plus pure functions:

    import purejax
    params = purejax.mlp.init_network_params([784, 512, 512, 10], jax.random.PRNGKey(0))
    logits = purejax.mlp.batched_predict(params, images)

    config = purejax.GPTConfig(vocab_size=65, block_size=64)
    params = purejax.gpt.init_params(config, jax.random.PRNGKey(0))

The layers, bottom to top (each imports only from its own and those below
it; tests/test_architecture.py checks that against this drawing):

    _files, _docstrings, checkpoint, host_memory   crash-safe file writes; docstrings'
                attributes (the flags' help); checkpoint files (the format training writes
                and weights reads); freed host memory handed back to the system
    ops/, rng   execution forms (`Forms`, chosen per platform by `select`: matmul,
                attention, the large-vocabulary loss), and dropout; key helpers
    nn          layers as init_<layer> + a pure apply (they use ops.kernels'
                matmul and loss)
    gpt/, mlp, kv_cache, decode, cache_rows, engine, lora   the models (gpt/: its
                config, and its model with each init beside its apply); the KV cache,
                token choice, the programs over the cache's rows and the one generation
                engine (requests in rows of the cache, admitted as they come, streamed
                out as they decode); low-rank adapters over any model's params (below
                training and weights, which both use it)
    data/       tokenizers (and training them), corpora, batches (each kind draws its
                own), MNIST and TFDS
    optimizers/ optax optimizers and schedules, Muon
    training/   pure/ (state, steps, sweeps, devices), effects/ (a run's files,
                signals, progress), loops/ (the one training loop, GPT runs, recipes),
                tools/ (replayed steps, GPU plans)
    weights/    pretrained weights in and out, one module per format
    evaluation/ benchmarks on a model: continuation log-likelihoods, many per call;
                multiple-choice, schema and language-modelling tasks from local files;
                the model in lm-evaluation-harness (a training loop takes them as
                metrics from the command line, so they sit above it)
    serving/    OpenAI's API over the engine: requests checked, responses shaped, the
                ASGI application and its chat page
    cli/, train, rl, sample, chat, serve, plot, convert, replay, tokenizer, plan, eval
                the command lines, the only layer that speaks of --flags: `purejax.cli.<cmd>` is `python -m
                purejax.<cmd>` (the top-level modules only give them those names;
                `purejax.convert` itself is the function `weights.convert`)
"""

from purejax import data
from purejax import decode
from purejax import engine
from purejax import evaluation
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
from purejax.engine import generate
from purejax.kv_cache import KVCache
from purejax.gpt import GPTConfig
from purejax.ops.kernels import Forms
from purejax.ops.kernels import select as select_forms
from purejax.optimizers.optim import make_optimizer
from purejax.optimizers.optim import OptimizerConfig
from purejax.training.effects.runs import RunConfig
from purejax.training.loops.gpt_loop import evaluate_gpt
from purejax.training.loops.gpt_loop import GPTTrainConfig
from purejax.training.loops.gpt_loop import train_gpt
from purejax.training.loops.mlp_loop import MLPTrainConfig
from purejax.training.loops.mlp_loop import train_mlp
from purejax.training.pure.parallel import ParallelConfig
from purejax.training.pure.state import TrainState
from purejax.training.pure.steps import evaluate
from purejax.training.pure.steps import StepMetrics
from purejax.training.pure.steps import train_steps
from purejax.weights import convert
from purejax.weights import from_pretrained

__all__ = [
    # modules and layers
    "data", "decode", "engine", "gpt", "lora", "mlp", "nn", "ops", "rng", "training", "weights",
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

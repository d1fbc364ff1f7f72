"""The GPT: nanoGPT as pure functions over a params pytree, and its family as options.

    config = gpt.GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    params = gpt.init_params(config, jax.random.PRNGKey(0))
    logits = gpt.forward(params, tokens, config)               # [batch, time, vocab]

`config` is the model's math (`GPTConfig`, the named `ARCHITECTURES`, the
depth rule); `model` is the model itself, each layer's `init_*` beside the
function that applies it. This package's names are the ones to use:
`gpt.GPTConfig`, `gpt.init_params`, `gpt.forward`, `gpt.loss`.
"""

from purejax.gpt.config import ARCHITECTURES
from purejax.gpt.config import EXECUTION_FIELDS
from purejax.gpt.config import GPTConfig
from purejax.gpt.config import depth_lr_scale
from purejax.gpt.config import depth_shape
from purejax.gpt.model import Attend
from purejax.gpt.model import Consts
from purejax.gpt.model import Context
from purejax.gpt.model import Params
from purejax.gpt.model import block
from purejax.gpt.model import causal_attend
from purejax.gpt.model import check_params
from purejax.gpt.model import check_tokens
from purejax.gpt.model import embed
from purejax.gpt.model import final_norm
from purejax.gpt.model import forward
from purejax.gpt.model import head_table
from purejax.gpt.model import init_block
from purejax.gpt.model import init_norm
from purejax.gpt.model import init_params
from purejax.gpt.model import input_states
from purejax.gpt.model import layer_at
from purejax.gpt.model import layer_consts
from purejax.gpt.model import logits_of
from purejax.gpt.model import loss
from purejax.gpt.model import merge_heads
from purejax.gpt.model import mlp
from purejax.gpt.model import norm
from purejax.gpt.model import num_params
from purejax.gpt.model import one_layer_consts
from purejax.gpt.model import qkv_heads
from purejax.gpt.model import run_blocks
from purejax.gpt.model import self_attention
from purejax.gpt.model import shared_consts
from purejax.gpt.model import target_log_probs
from purejax.gpt.model import value_embedding

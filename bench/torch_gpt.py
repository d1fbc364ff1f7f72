"""The PyTorch twin of `purejax.gpt`, for side-by-side benchmarks.

Same architecture, written the way nanoGPT writes it: pre-LayerNorm blocks,
tanh-GELU MLP, output head tied to the token embedding, biases as
configured, causal attention via `scaled_dot_product_attention`. Its
`generate` recomputes the (cropped) context for every new token, as
nanoGPT's does. `load_purejax_params` copies a purejax params pytree in, so
both can be checked to compute the same function.

torch is a bench-only dependency: `pip install -r bench/requirements.txt`.
"""

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):

  def __init__(self, n_embd, n_head, bias, dropout):
    super().__init__()
    self.n_head, self.dropout = n_head, dropout
    self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
    self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
    self.resid_dropout = nn.Dropout(dropout)

  def forward(self, x):
    b, t, c = x.shape
    q, k, v = self.c_attn(x).split(c, dim=2)
    q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(
        q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(b, t, c)
    return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):

  def __init__(self, n_embd, n_head, bias, dropout):
    super().__init__()
    self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
    self.attn = CausalSelfAttention(n_embd, n_head, bias, dropout)
    self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
    self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
    self.mlp_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
    self.mlp_dropout = nn.Dropout(dropout)

  def forward(self, x):
    x = x + self.attn(self.ln_1(x))
    h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
    return x + self.mlp_dropout(self.mlp_proj(h))


class TorchGPT(nn.Module):
  """GPT with the fields of a `purejax.gpt.GPTConfig`."""

  def __init__(self, config):
    super().__init__()
    self.config = config
    c = config.n_embd
    self.wte = nn.Embedding(config.vocab_size, c)
    self.wpe = nn.Embedding(config.block_size, c)
    self.drop = nn.Dropout(config.dropout)
    self.blocks = nn.ModuleList(
        [Block(c, config.n_head, config.bias, config.dropout) for _ in range(config.n_layer)])
    self.ln_f = nn.LayerNorm(c, bias=config.bias)
    self.apply(self._init_weights)
    for name, p in self.named_parameters():
      if name.endswith("c_proj.weight") or name.endswith("mlp_proj.weight"):
        nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

  @staticmethod
  def _init_weights(module):
    if isinstance(module, (nn.Linear, nn.Embedding)):
      nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
      nn.init.zeros_(module.bias)

  def forward(self, idx, targets=None):
    t = idx.shape[1]
    pos = torch.arange(t, device=idx.device)
    x = self.drop(self.wte(idx) + self.wpe(pos))
    for block in self.blocks:
      x = block(x)
    logits = self.ln_f(x) @ self.wte.weight.T  # tied head
    if targets is None:
      return logits, None
    return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

  @torch.no_grad()
  def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
    """nanoGPT's sampler: crop to block_size and recompute every token."""
    for _ in range(max_new_tokens):
      context = idx[:, -self.config.block_size:]
      logits, _ = self(context)
      logits = logits[:, -1, :] / temperature
      if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("inf")
      idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
      idx = torch.cat((idx, idx_next), dim=1)
    return idx


def make_optimizer(model, learning_rate, weight_decay, betas):
  """AdamW with decay on tensors of rank >= 2 only, as nanoGPT configures it."""
  params = [p for p in model.parameters() if p.requires_grad]
  groups = [
      {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
  ]
  return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def _copy(dst, src, transpose=False):
  array = np.array(src, dtype=np.float32)  # a writable copy
  dst.data.copy_(torch.from_numpy(np.ascontiguousarray(array.T) if transpose else array))


def load_purejax_params(model: TorchGPT, params) -> TorchGPT:
  """Copies a purejax GPT params pytree into `model` (dense `w` is `[in, out]`)."""
  _copy(model.wte.weight, params["wte"]["embedding"])
  _copy(model.wpe.weight, params["wpe"]["embedding"])
  blocks = params["blocks"]
  pairs = [("attn", "qkv", "attn.c_attn"), ("attn", "proj", "attn.c_proj"),
           ("mlp", "fc", "c_fc"), ("mlp", "proj", "mlp_proj")]
  for i, block in enumerate(model.blocks):
    for group, name, path in pairs:
      layer = block.get_submodule(path)
      _copy(layer.weight, blocks[group][name]["w"][i], transpose=True)
      if layer.bias is not None:
        _copy(layer.bias, blocks[group][name]["b"][i])
    for ln in ("ln_1", "ln_2"):
      _copy(getattr(block, ln).weight, blocks[ln]["scale"][i])
      if getattr(block, ln).bias is not None:
        _copy(getattr(block, ln).bias, blocks[ln]["bias"][i])
  _copy(model.ln_f.weight, params["ln_f"]["scale"])
  if model.ln_f.bias is not None:
    _copy(model.ln_f.bias, params["ln_f"]["bias"])
  return model

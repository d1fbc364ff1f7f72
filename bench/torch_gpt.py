"""The PyTorch twin of `purejax.gpt`, for side-by-side benchmarks.

Same architecture, written the way nanoGPT writes it: pre-LayerNorm blocks,
tanh-GELU MLP, output head tied to the token embedding, biases as
configured, causal attention via `scaled_dot_product_attention` (flash
attention on a GPU in bf16). Its `generate` recomputes the (cropped) context
for every new token, as nanoGPT's does; `generate_kv` decodes through a KV
cache instead, optionally under `torch.compile`, as a fast PyTorch sampler
would. `load_purejax_params` copies a purejax params pytree in, so both can be
checked to compute the same function.

On a GPU (bench/gpu.py) the same module trains under `torch.compile` and
bf16 autocast, with `make_optimizer(..., fused=True)`.

torch comes with the `test` extra: `pip install -e ".[test]"`.
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

  def forward_cached(self, x, input_pos, mask):
    """Tokens at positions `input_pos` [t] attend through `self.kv_cache` (no dropout)."""
    b, t, c = x.shape
    q, k, v = self.c_attn(x).split(c, dim=2)
    q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
    k_all, v_all = self.kv_cache.update(input_pos, k, v)
    # Slots past a query's position hold zeros or stale entries; the mask
    # hides them, so the cache never needs clearing.
    y = F.scaled_dot_product_attention(q.to(k_all.dtype), k_all, v_all, attn_mask=mask)
    y = y.transpose(1, 2).contiguous().view(b, t, c)
    return self.c_proj(y)


class KVCache(nn.Module):
  """One layer's keys and values, `[batch, head, block_size, head_dim]`, updated in place.

  Fixed shapes and in-place writes at tensor positions are what let
  `torch.compile` (and CUDA graphs) run one program for every decoding step.
  """

  def __init__(self, batch, n_head, block_size, head_dim, dtype, device):
    super().__init__()
    shape = (batch, n_head, block_size, head_dim)
    self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
    self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

  def update(self, input_pos, k, v):
    self.k.index_copy_(2, input_pos, k.to(self.k.dtype))
    self.v.index_copy_(2, input_pos, v.to(self.v.dtype))
    return self.k, self.v


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

  def forward_cached(self, x, input_pos, mask):
    x = x + self.attn.forward_cached(self.ln_1(x), input_pos, mask)
    h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
    return x + self.mlp_proj(h)


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

  # --------------------------------------------------------------------------
  # Decoding through a KV cache

  def setup_kv_cache(self, batch, dtype=None):
    """Gives every layer a cache for `batch` sequences (kept if one of that shape exists).

    Args:
      batch: sequences decoded at once.
      dtype: cache dtype; under bf16 autocast the keys are bf16, so pass
        `torch.bfloat16`. Default: the params' dtype.
    """
    device, dtype = self.wte.weight.device, dtype or self.wte.weight.dtype
    n, c = self.config.block_size, self.config.n_embd
    shape = (batch, self.config.n_head, n, c // self.config.n_head)
    cache = getattr(self.blocks[0].attn, "kv_cache", None)
    if (cache is not None and tuple(cache.k.shape) == shape and cache.k.dtype == dtype
        and cache.k.device == device):
      return  # reusing the buffers keeps a compiled step's inputs the same
    for block in self.blocks:
      block.attn.kv_cache = KVCache(batch, shape[1], n, shape[3], dtype, device)
    # Row p: which cache slots position p may attend to.
    self.register_buffer("causal_mask", torch.tril(torch.ones(n, n, dtype=torch.bool,
                                                              device=device)),
                         persistent=False)

  def forward_with_cache(self, idx, input_pos):
    """Logits `[batch, vocab]` of the last of `idx` `[batch, t]` at positions `input_pos` [t].

    Writes the tokens' keys and values into the caches (`setup_kv_cache`
    first); attends to every cached position up to each token's own.
    """
    mask = self.causal_mask[input_pos]  # [t, block_size]
    x = self.wte(idx) + self.wpe(input_pos)
    for block in self.blocks:
      x = block.forward_cached(x, input_pos, mask)
    return self.ln_f(x[:, -1]) @ self.wte.weight.T

  def _autocast(self):
    dtype = getattr(self, "_autocast_dtype", None)
    return torch.autocast(self.wte.weight.device.type, dtype=dtype or torch.bfloat16,
                          enabled=dtype is not None)

  def _decode_step(self, token, input_pos, temperature, top_k):
    """Feeds `token` [batch, 1] at position `input_pos` [1]; returns the next token [batch]."""
    with self._autocast():
      logits = self.forward_with_cache(token, input_pos)
    return sample_next(logits, temperature, top_k)

  def compiled_decode_step(self, mode=None):
    """`_decode_step` under `torch.compile(mode=mode, fullgraph=True)`, compiled once per mode."""
    steps = self.__dict__.setdefault("_compiled_steps", {})
    if mode not in steps:
      steps[mode] = torch.compile(self._decode_step, mode=mode, fullgraph=True)
    return steps[mode]

  @torch.no_grad()
  def generate_kv(self, idx, max_new_tokens, temperature=1.0, top_k=None, *,
                  autocast_dtype=None, compile_mode=False):
    """Continues `idx` `[batch, prompt]` by `max_new_tokens` tokens through a KV cache.

    The prompt runs once (eager); then each token is one decoding step, the
    whole step (model and sampling) optionally compiled. The sequence must
    fit the context: `prompt + max_new_tokens <= block_size`.

    Args:
      idx: `[batch, prompt_len]` long tensor, prompt_len >= 1.
      max_new_tokens: tokens to add (>= 1).
      temperature: <= 0 for greedy decoding.
      top_k: keep the k most likely tokens (None: all).
      autocast_dtype: e.g. `torch.bfloat16` to decode under autocast (the
        cache then holds that dtype); None for the params' dtype.
      compile_mode: False for eager steps; otherwise the `torch.compile` mode
        of the step (None: default, "reduce-overhead": CUDA graphs).

    Returns:
      `[batch, prompt_len + max_new_tokens]`: the prompt, then the new tokens.
    """
    b, p = idx.shape
    if p < 1 or max_new_tokens < 1 or p + max_new_tokens > self.config.block_size:
      raise ValueError(f"generate_kv needs 1 <= prompt ({p}) and prompt + max_new_tokens "
                       f"({p + max_new_tokens}) <= block_size ({self.config.block_size}).")
    self._autocast_dtype = autocast_dtype
    self.setup_kv_cache(b, autocast_dtype)
    device = self.wte.weight.device
    # Positions as slices of one device tensor: building each from a Python
    # int would copy from the host, which waits for the GPU every token.
    positions = torch.arange(self.config.block_size, device=device)
    out = torch.empty(b, p + max_new_tokens, dtype=torch.long, device=device)
    out[:, :p] = idx
    with self._autocast():
      logits = self.forward_with_cache(idx.to(device), positions[:p])
    token = sample_next(logits, temperature, top_k)
    out[:, p] = token
    step = self._decode_step if compile_mode is False else self.compiled_decode_step(compile_mode)
    graphs = compile_mode == "reduce-overhead"
    for i in range(1, max_new_tokens):
      if graphs:
        torch.compiler.cudagraph_mark_step_begin()
      pos = p + i - 1  # position of the token fed in
      token = step(token[:, None], positions[pos:pos + 1], temperature, top_k)
      if compile_mode is not False:
        # A compiled step's output may live in CUDA-graph memory that the
        # next replay overwrites: keep a copy (as gpt-fast does).
        token = token.clone()
      out[:, p + i] = token
    return out


def sample_next(logits, temperature=1.0, top_k=None):
  """One token per row of `logits` `[batch, vocab]` -> `[batch]` long; greedy if temperature <= 0.

  The draw is argmax(p / E) with E ~ Exp(1), which picks token i with
  probability p_i, like `torch.multinomial`, without its host sync.
  """
  logits = logits.float()
  if temperature <= 0:
    return logits.argmax(dim=-1)
  logits = logits / temperature
  if top_k is not None and top_k < logits.size(-1):
    kth = torch.topk(logits, top_k).values[:, -1:]
    logits = logits.masked_fill(logits < kth, -float("inf"))
  probs = F.softmax(logits, dim=-1)
  return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


def make_optimizer(model, learning_rate, weight_decay, betas, *, fused=False):
  """AdamW with decay on tensors of rank >= 2 only, as nanoGPT configures it.

  `fused=True` runs the update as one fused kernel per step, as nanoGPT does
  on CUDA.
  """
  params = [p for p in model.parameters() if p.requires_grad]
  groups = [
      {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
  ]
  extra = {"fused": True} if fused else {}
  return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)


def newton_schulz_float32(g, ns_steps, coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7):
  """`torch.optim.Muon`'s orthogonalisation of one matrix, in float32 instead of bf16
  (a CPU without bf16 units runs bf16 products many times slower than float32)."""
  a, b, c = coefficients
  x = g.float()
  tall = x.size(0) > x.size(1)
  if tall:
    x = x.T
  x = x / x.norm().clamp(min=eps)
  for _ in range(ns_steps):
    gram = x @ x.T
    x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
  return x.T if tall else x


class Float32Muon(torch.optim.Optimizer):
  """`torch.optim.Muon`'s step (Nesterov momentum, the rate scaled by
  `sqrt(max(1, rows / cols))`, no decay) with `newton_schulz_float32`."""

  def __init__(self, params, lr, momentum, ns_steps):
    super().__init__(params, {"lr": lr, "momentum": momentum, "ns_steps": ns_steps})

  @torch.no_grad()
  def step(self):
    for group in self.param_groups:
      for p in group["params"]:
        if p.grad is None:
          continue
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        buf.lerp_(p.grad, 1 - group["momentum"])
        update = newton_schulz_float32(p.grad.lerp(buf, group["momentum"]), group["ns_steps"])
        p.add_(update, alpha=-group["lr"] * max(1.0, p.size(0) / p.size(1)) ** 0.5)


class MuonAdamW:
  """Muon on the blocks' 2-D weights, AdamW (as `make_optimizer`) on embeddings
  and norms: the split purejax's "muon" makes. Muon is PyTorch's own
  (`torch.optim.Muon`, Keller Jordan's reference: Nesterov momentum, quintic
  Newton-Schulz steps in bf16, the rate scaled by `sqrt(max(1, rows / cols))`),
  or with `float32=True` the same step with its products in float32
  (`Float32Muon`). Steps and zeroes both. `param_groups` are AdamW's: a rate
  table sets AdamW's rate only (Muon keeps its peak rate).
  """

  def __init__(self, model, learning_rate, muon_learning_rate, weight_decay, betas,
               momentum, ns_steps=5, float32=False):
    hidden = [p for name, p in model.named_parameters()
              if p.requires_grad and p.dim() == 2 and name.startswith("blocks.")]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    if float32:
      self.muon = Float32Muon(hidden, muon_learning_rate, momentum, ns_steps)
    else:
      self.muon = torch.optim.Muon(hidden, lr=muon_learning_rate, weight_decay=0.0,
                                   momentum=momentum, nesterov=True, ns_steps=ns_steps)
    self.adamw = torch.optim.AdamW(
        [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
         {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
        lr=learning_rate, betas=betas)
    self.param_groups = self.adamw.param_groups

  def zero_grad(self, set_to_none=True):
    self.muon.zero_grad(set_to_none=set_to_none)
    self.adamw.zero_grad(set_to_none=set_to_none)

  def step(self):
    self.muon.step()
    self.adamw.step()


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

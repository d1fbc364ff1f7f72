"""The PyTorch twin of `purejax.mlp`: 784-512-512-10 ReLU, trained the usual way.

An epoch is the loop people write in PyTorch: a shuffled index tensor cut
into batches, forward, `loss.backward()`, `optimizer.step()`.
"""

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class TorchMLP(nn.Module):

  def __init__(self, sizes):
    super().__init__()
    self.layers = nn.ModuleList(nn.Linear(m, n) for m, n in zip(sizes[:-1], sizes[1:]))

  def forward(self, x):
    for layer in self.layers[:-1]:
      x = F.relu(layer(x))
    return self.layers[-1](x)


def load_purejax_params(model: TorchMLP, params) -> TorchMLP:
  for i, layer in enumerate(model.layers):
    layer.weight.data.copy_(torch.from_numpy(np.asarray(params[f"dense_{i}"]["w"]).T.copy()))
    layer.bias.data.copy_(torch.from_numpy(np.asarray(params[f"dense_{i}"]["b"]).copy()))
  return model


def train_epoch(model, optimizer, images, labels, batch_size, generator):
  """One shuffled pass; drops the last partial batch like purejax's epoch."""
  perm = torch.randperm(images.shape[0], generator=generator)
  total = 0.0
  num_batches = images.shape[0] // batch_size
  for i in range(num_batches):
    idx = perm[i * batch_size:(i + 1) * batch_size]
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(images[idx]), labels[idx])
    loss.backward()
    optimizer.step()
    total += loss.item()
  return total / num_batches

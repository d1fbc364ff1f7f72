"""The operations whose fastest form depends on the backend.

`kernels`: `Forms`, every execution option of a model in one hashable value,
and `select(platform, **overrides)`, which picks them for a platform; the
remat policies. `loss`: cross-entropy and the tied head's loss. `matmul`: the
mixed-precision matmul and its gradient, and `LowRankWeight`, a frozen
weight plus a trained low-rank update applied without forming the sum
(LoRA's training form).
`attention`: causal attention in its plain, blocked, XLA and cuDNN forms, and
over a KV cache. Every form is tested against the plain one. `dropout`: the
dropout both attention and `purejax.nn` (which re-exports it) use; `ops`
imports nothing of the package above it.
"""

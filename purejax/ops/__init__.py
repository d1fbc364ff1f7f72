"""The operations whose fastest form depends on the backend.

`kernels`: the mixed-precision matmul and its gradient, the tied-head loss,
remat policies, and `select(platform)`, which picks every form for a backend.
`attention`: causal attention in its plain, blocked and fused forms, and over
a KV cache. Every form is tested against the plain one.
"""

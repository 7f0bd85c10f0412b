"""Triple attention (FAMILIES.md §2): a third-order linear-time state read by two queries,
S[i, j, k] = c sum_n K1[n, i] V[n, j] K2[n, k], Y[n, j] = sum_{i,k} Q1[n, i] S[i, j, k] Q2[n, k].

    attention(q1, q2, k1, k2, v, *, scale, causal)   differentiable (a torch.library op), CPU or GPU
    attention_varlen(q1, ..., v, cu_seqlens, max_seqlen, ...)   packed sequences [T, H, D], a
                                                     state per sequence (FlashAttention's varlen)
    context_parallel_attention(..., group=pg)        one sequence sharded over the ranks of pg
    TripleAttention(dim, n_heads, ...)               a layer: five projections, optional L2 norm
    forward / backward                               one pass on the GPU kernels, no autograd
    step(q1, q2, k1, k2, v, state, *, scale)          decoding: T new tokens read and advance
                                                     the state in place (inference)
    reference / reference_backward                   plain PyTorch in fp64
    variants("fwd" | "bwd")                          the registered kernels
"""
from .context_parallel import context_parallel_attention
from .decode import step
from .layer import TripleAttention
from .ops import attention
from .passes import backward, forward
from .reference import reference, reference_backward
from .spec import TripleSpec
from .varlen import attention_varlen


def variants(pass_: str = "fwd") -> dict[str, str]:
    """Registered variant names of a pass, each with the shapes it supports."""
    from .. import registry
    return registry.variants(pass_, "triple")


__all__ = ["TripleAttention", "TripleSpec", "attention", "attention_varlen", "backward",
           "context_parallel_attention", "forward", "reference", "reference_backward", "step",
           "variants"]

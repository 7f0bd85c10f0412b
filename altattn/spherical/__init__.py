"""Spherical attention (FlashSign): softmax replaced by each score row's L2 norm,
out[y] = sum_x s[y, x] v[x] / (||s[y, :]|| + eps): no exp, no running max.

    attention(q, k, v, *, causal, seqlens)   differentiable (a torch.library op), CPU or GPU
    attention_with_kvcache(q, k_cache, ...)  decoding against KV caches (inference only)
    context_parallel_attention(q, k, v, ...) one sequence sharded over a process group
    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
                                             packed sequences (FlashAttention's varlen), the same
    SphericalAttention(dim, n_heads, ...)    a layer: projections, GQA, padding, multiplicity
    forward / backward                       one pass on the GPU kernels, no autograd
    reference / reference_backward           plain PyTorch in fp64
    variants("fwd" | "bwd")                  the registered kernels
"""
from .context_parallel import context_parallel_attention
from .kvcache import attention_with_kvcache
from .layer import SphericalAttention
from .ops import attention
from .passes import backward, forward
from .reference import reference, reference_backward
from .spec import SphericalSpec
from .varlen import attention_varlen, backward_varlen, forward_varlen


def variants(pass_: str = "fwd") -> dict[str, str]:
    """Registered variant names of a pass, each with the shapes it supports."""
    from .. import registry
    return registry.variants(pass_, "spherical")


__all__ = ["attention", "attention_varlen", "attention_with_kvcache",
           "context_parallel_attention", "forward_varlen", "backward_varlen",
           "SphericalAttention", "forward", "backward", "reference", "reference_backward",
           "variants", "SphericalSpec"]

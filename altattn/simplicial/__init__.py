"""2-simplicial attention ("Fast and Simplex"): trilinear logits over a query and two keys in
sliding windows w1 and w2, softmax over the (j, k) pairs; GQA; the determinant form.

    attention(q, k1, k2, v1, v2, w1, w2)   differentiable (a torch.library op), CPU or GPU
    attention_varlen(..., cu_seqlens, ...) packed variable-length sequences, differentiable
    attention_with_kvcache(q, caches, ...) decoding against KV caches (linear or ring buffers)
    context_parallel_attention(...)        one sequence sharded over a process group's ranks
    SimplicialAttention(dim, ...)          a layer: projections, GQA, attention, output
    forward / backward                     one pass on the GPU kernels, no autograd
    reference / reference_backward         plain PyTorch in fp64 (brute_force: a loop, tiny shapes)
    det_rotary                             rotary embeddings for form="det"
    variants("fwd" | "bwd"), flops         the registered kernels; the FLOP model
"""
from .context_parallel import context_parallel_attention
from .flops import flops
from .kvcache import attention_with_kvcache
from .layer import SimplicialAttention
from .ops import attention
from .passes import backward, forward
from .reference import brute_force, reference, reference_backward
from .rotary import det_rotary
from .spec import ProblemSpec
from .varlen import attention_varlen


def variants(pass_: str = "fwd") -> dict[str, str]:
    """Registered variant names of a pass, each with the shapes it supports."""
    from .. import registry
    return registry.variants(pass_, "simplicial")


__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "context_parallel_attention",
           "SimplicialAttention", "forward", "backward", "reference", "reference_backward",
           "brute_force", "det_rotary", "variants", "flops", "ProblemSpec"]

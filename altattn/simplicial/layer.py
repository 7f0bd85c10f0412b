"""`SimplicialAttention`: a 2-simplicial attention layer a model can drop in (GQA, projections)."""
from __future__ import annotations

import torch
from torch import nn

from ..checks import check_layer_input, positive_int
from ..distributed import process_group
from .context_parallel import context_parallel_attention
from .ops import attention, check_variant_names
from .spec import SUPPORTED_HEAD_DIMS, check_form
from .varlen import attention_varlen


class SimplicialAttention(nn.Module):
    """x [B, N, dim] -> [B, N, dim]: q, k1, k2, v1, v2 projections, 2-simplicial attention over
    windows w1 and w2 (causal: token i sees j in (i-w1, i], k in (i-w2, i]), output projection.

    n_heads query heads share n_kv_heads key/value heads (n_heads % n_kv_heads == 0, the ratio a
    power of two up to 128 for the kernels), each of size head_dim (64 or 128 for the kernels).
    On CUDA the attention runs in bf16 (the kernels' dtype): projections are cast to bf16 and the
    result back to x's dtype; on the CPU it runs the fp64 reference (slow; tests and small runs).
    form: the logits' form, "trilinear" or "det" (see `attention`). deterministic: bitwise
    repeatable gradients (see `attention`). cp_group: context parallelism, a ProcessGroup or a
    1-D DeviceMesh (mesh["cp"]) over which the sequence is sharded: x is then this rank's
    contiguous shard [B, n_r, dim] (`context_parallel_attention`); None: the whole sequence.

    A configuration no device can run (a size or window that is no positive int, n_heads not a
    multiple of n_kv_heads, head_dim not in {64, 128}, an unknown variant name or form) raises at
    construction, naming the argument, not at the first forward. Limits of the kernels alone
    (the head ratio, form "det") are checked at the first CUDA forward, as `attention` does.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, w1: int, w2: int,
                 *, bias: bool = False, variant: str = "auto", bwd_variant: str = "auto",
                 form: str = "trilinear", deterministic: bool = False, cp_group=None):
        super().__init__()
        dim, n_heads, n_kv_heads, head_dim, w1, w2 = (
            positive_int(name, v) for name, v in (
                ("dim", dim), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads),
                ("head_dim", head_dim), ("w1", w1), ("w2", w2)))
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        if head_dim not in SUPPORTED_HEAD_DIMS:  # the reference refuses it too: no device runs it
            raise ValueError(f"head_dim={head_dim} is not supported; supported: "
                             f"{SUPPORTED_HEAD_DIMS}")
        check_variant_names(variant, bwd_variant, deterministic)
        self.form = check_form(form)
        self.dim, self.n_heads, self.n_kv_heads, self.head_dim = dim, n_heads, n_kv_heads, head_dim
        self.w1, self.w2 = w1, w2
        self.variant, self.bwd_variant = variant, bwd_variant
        self.deterministic = deterministic
        self.cp_group = None if cp_group is None else process_group(cp_group)
        self.q = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.k1, self.k2, self.v1, self.v2 = (nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
                                              for _ in range(4))
        self.out = nn.Linear(n_heads * head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> torch.Tensor:
        """x [B, N, dim] -> [B, N, dim]; with cu_seqlens (int32 [n + 1]), x is [T, dim]: packed
        sequences whose windows end at each start (`attention_varlen`)."""
        if cu_seqlens is not None and self.cp_group is not None:
            raise ValueError("cu_seqlens: packed sequences are not sharded (cp_group is set)")
        if cu_seqlens is not None:  # packed: one batch element of T tokens, cut at the starts
            check_layer_input(x[None] if isinstance(x, torch.Tensor) and x.dim() == 2 else x,
                              self.dim)
            x = x[None]
        else:
            check_layer_input(x, self.dim)
        B, N, _ = x.shape
        dtype = torch.bfloat16 if x.device.type == "cuda" else x.dtype
        q = self.q(x).view(B, N, self.n_heads, self.head_dim).to(dtype)
        k1, k2, v1, v2 = (p(x).view(B, N, self.n_kv_heads, self.head_dim).to(dtype)
                          for p in (self.k1, self.k2, self.v1, self.v2))
        opts = dict(variant=self.variant, bwd_variant=self.bwd_variant, form=self.form,
                    deterministic=self.deterministic)
        if cu_seqlens is not None:
            o, _ = attention_varlen(q[0], k1[0], k2[0], v1[0], v2[0], cu_seqlens, max_seqlen,
                                    self.w1, self.w2, **opts)
            return self.out(o.reshape(N, self.n_heads * self.head_dim).to(x.dtype))
        if self.cp_group is not None:
            o, _ = context_parallel_attention(q, k1, k2, v1, v2, self.w1, self.w2,
                                              group=self.cp_group, **opts)
        else:
            o, _ = attention(q, k1, k2, v1, v2, self.w1, self.w2, **opts)
        return self.out(o.reshape(B, N, self.n_heads * self.head_dim).to(x.dtype))

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, w1={self.w1}, w2={self.w2}, form={self.form}")

"""`SphericalAttention`: a spherical-attention layer a model can drop in (projections, GQA, padding,
and the per-key multiplicity scale of the paper's gene model)."""
from __future__ import annotations

import torch
from torch import nn

from ..checks import check_bool, check_layer_input, positive_int
from ..distributed import process_group
from .context_parallel import check_layout, context_parallel_attention
from .ops import attention, check_variant_names
from .spec import DEFAULT_EPS, SUPPORTED_HEAD_DIMS, _check_eps
from .varlen import attention_varlen


class SphericalAttention(nn.Module):
    """x [B, N, dim] -> [B, N, dim]: q, k, v projections, spherical attention (each score row
    L2-normalised instead of softmaxed), output projection.

    n_heads query heads share n_kv_heads key/value heads (n_heads % n_kv_heads == 0), each of size
    head_dim (64 or 128). causal: token y sees x <= y. forward(x, seqlens=None, multiplicity=None,
    cu_seqlens=None, max_seqlen=None): seqlens int32 [B] real lengths of padded sequences (padded
    rows give 0); multiplicity [B, N] scales each token's key (FlashSign's gene model scales keys
    by each gene's count in the cell); cu_seqlens int32 [n + 1]: x is [T, dim], packed sequences
    (`attention_varlen`; multiplicity then [T]). On CUDA the attention runs in bf16 and the result
    is cast back to x's dtype; on the CPU the fp64 reference runs. A configuration no device runs
    raises at construction, naming the argument. cp_group: context parallelism, a ProcessGroup or a
    1-D DeviceMesh (mesh["cp"]) over which the sequence is sharded: x is then this rank's shard [B,
    n_r, dim] in layout cp_layout ("contiguous" or "zigzag": `context_parallel_attention`); None:
    the whole sequence."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None,
                 head_dim: int = 128, *, causal: bool = False, bias: bool = False,
                 eps: float = DEFAULT_EPS, variant: str = "auto", bwd_variant: str = "auto",
                 deterministic: bool = False, cp_group=None, cp_layout: str = "contiguous"):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        dim, n_heads, n_kv_heads, head_dim = (positive_int(name, v) for name, v in (
            ("dim", dim), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim)))
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim={head_dim} is not supported; supported: "
                             f"{SUPPORTED_HEAD_DIMS}")
        check_variant_names(variant, bwd_variant, deterministic)
        self.causal = check_bool("causal", causal)
        self.eps = _check_eps(eps)
        self.dim, self.n_heads, self.n_kv_heads, self.head_dim = dim, n_heads, n_kv_heads, head_dim
        self.variant, self.bwd_variant, self.deterministic = variant, bwd_variant, deterministic
        self.cp_group = None if cp_group is None else process_group(cp_group)
        self.cp_layout = check_layout(cp_layout)
        self.q = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.k, self.v = (nn.Linear(dim, n_kv_heads * head_dim, bias=bias) for _ in range(2))
        self.out = nn.Linear(n_heads * head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, seqlens: torch.Tensor | None = None,
                multiplicity: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> torch.Tensor:
        if (seqlens is not None or cu_seqlens is not None) and self.cp_group is not None:
            raise ValueError(f"{'seqlens' if seqlens is not None else 'cu_seqlens'}: padded or "
                             "packed batches are not sharded (cp_group is set)")
        if cu_seqlens is not None:  # packed: one batch element of T tokens, cut at the offsets
            if seqlens is not None:
                raise ValueError("give seqlens (padded batches) or cu_seqlens (packed), not both")
            check_layer_input(x[None] if isinstance(x, torch.Tensor) and x.dim() == 2 else x,
                              self.dim)
            x = x[None]
            if multiplicity is not None and isinstance(multiplicity, torch.Tensor):
                multiplicity = multiplicity[None]
        else:
            check_layer_input(x, self.dim)
        B, N, _ = x.shape
        dtype = torch.bfloat16 if x.device.type == "cuda" else x.dtype
        k = self.k(x).view(B, N, self.n_kv_heads, self.head_dim)
        if multiplicity is not None:
            if not isinstance(multiplicity, torch.Tensor) or tuple(multiplicity.shape) != (B, N):
                raise ValueError(f"multiplicity must be a tensor of shape {(B, N)} [B, N], got "
                                 f"{getattr(multiplicity, 'shape', type(multiplicity).__name__)}")
            k = k * multiplicity.to(k.dtype)[:, :, None, None]
        q = self.q(x).view(B, N, self.n_heads, self.head_dim).to(dtype)
        v = self.v(x).view(B, N, self.n_kv_heads, self.head_dim).to(dtype)
        opts = dict(causal=self.causal, eps=self.eps, variant=self.variant,
                    bwd_variant=self.bwd_variant, deterministic=self.deterministic)
        if cu_seqlens is not None:
            o, _ = attention_varlen(q[0], k[0].to(dtype), v[0], cu_seqlens, cu_seqlens, max_seqlen,
                                    max_seqlen, **opts)
            return self.out(o.reshape(N, self.n_heads * self.head_dim).to(x.dtype))
        if self.cp_group is None:
            o, _ = attention(q, k.to(dtype), v, seqlens=seqlens, **opts)
        else:
            o, _ = context_parallel_attention(q, k.to(dtype), v, group=self.cp_group,
                                              layout=self.cp_layout, **opts)
        return self.out(o.reshape(B, N, self.n_heads * self.head_dim).to(x.dtype))

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}")

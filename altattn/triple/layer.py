"""`TripleAttention`: a triple-attention layer a model can drop in (five projections, optional L2
normalisation of queries and keys, the op, an output projection)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_bool, check_layer_input, positive_int
from ..distributed import process_group
from .context_parallel import context_parallel_attention
from .decode import step as triple_step
from .ops import attention, check_variant_names
from .spec import SUPPORTED_DIMS, check_scale
from .varlen import attention_varlen


class TripleAttention(nn.Module):
    """x [B, N, dim] -> [B, N, dim]: q1, q2, k1, k2, v projections, triple attention (a third-order
    state S = c sum_n k1 (x) v (x) k2 per head, read by q1 and q2), output projection.

    n_heads heads, each with query/key size head_dim and value size v_head_dim (default
    head_dim), both in {32, 64, 128}. causal: token n reads the tokens m <= n. scale: c, None for
    1/N (the state is a mean). normalize=True: q1, q2, k1, k2 L2-normalised over the head dim
    (every score Q1.K1 and Q2.K2 in [-1, 1]). On CUDA the attention runs in bf16 and the result
    is cast back to x's dtype; on the CPU the fp64 reference runs. A configuration no device runs
    raises at construction, naming the argument. forward(x, initial_state=None, return_state=
    False): the attention's initial state [B, n_heads, head_dim, v_head_dim, head_dim] (the op's;
    scale must then be given) and, with return_state=True, (y, state): a causal layer fed in
    chunks, each chunk's state the next one's, equals one call; cu_seqlens / max_seqlen: x is
    [T, dim], packed sequences (as SimplicialAttention's). step(x, state): decoding, the state
    advanced in place. cp_group: context parallelism, a ProcessGroup or a 1-D DeviceMesh
    (mesh["cp"]) over which the sequence is sharded: x is then this rank's contiguous shard
    [B, n_r, dim] and the state the whole sequence's (`context_parallel_attention`; scale None
    is 1/N of the whole sequence); None: the whole sequence."""

    def __init__(self, dim: int, n_heads: int, head_dim: int = 64, v_head_dim: int | None = None,
                 *, causal: bool = False, scale: float | None = None, normalize: bool = False,
                 bias: bool = False, variant: str = "auto", bwd_variant: str = "auto",
                 deterministic: bool = False, cp_group=None):
        super().__init__()
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        dim, n_heads, head_dim, v_head_dim = (positive_int(name, v) for name, v in (
            ("dim", dim), ("n_heads", n_heads), ("head_dim", head_dim),
            ("v_head_dim", v_head_dim)))
        for name, d in (("head_dim", head_dim), ("v_head_dim", v_head_dim)):
            if d not in SUPPORTED_DIMS:
                raise ValueError(f"{name}={d} is not supported; supported: {SUPPORTED_DIMS}")
        check_variant_names(variant, bwd_variant, deterministic)
        self.causal = check_bool("causal", causal)
        self.normalize = check_bool("normalize", normalize)
        self.scale = None if scale is None else check_scale(scale, 1)
        self.dim, self.n_heads, self.head_dim, self.v_head_dim = dim, n_heads, head_dim, v_head_dim
        self.variant, self.bwd_variant, self.deterministic = variant, bwd_variant, deterministic
        self.cp_group = None if cp_group is None else process_group(cp_group)
        self.q1, self.q2, self.k1, self.k2 = (nn.Linear(dim, n_heads * head_dim, bias=bias)
                                              for _ in range(4))
        self.v = nn.Linear(dim, n_heads * v_head_dim, bias=bias)
        self.out = nn.Linear(n_heads * v_head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, initial_state: torch.Tensor | None = None, *,
                return_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None):
        """x [B, N, dim] -> [B, N, dim]; with cu_seqlens (int32 [n + 1]), x is [T, dim]: packed
        sequences, each its own state (`attention_varlen`; initial_state and the state
        returned [n, n_heads, head_dim, v_head_dim, head_dim])."""
        check_bool("return_state", return_state)
        opts = dict(scale=self.scale, causal=self.causal, initial_state=initial_state,
                    variant=self.variant, bwd_variant=self.bwd_variant,
                    deterministic=self.deterministic)
        if cu_seqlens is not None:  # packed: one batch element of T tokens, cut at the starts
            if self.cp_group is not None:
                raise ValueError("cu_seqlens: packed batches are not sharded (cp_group is set)")
            check_layer_input(x[None] if isinstance(x, torch.Tensor) and x.dim() == 2 else x,
                              self.dim)
            o, state = attention_varlen(*(t[0] for t in self._heads(x[None])), cu_seqlens,
                                        max_seqlen, **opts)
            y = self._project(o[None], x[None])[0]
            return (y, state) if return_state else y
        check_layer_input(x, self.dim)
        if self.cp_group is not None:
            o, state = context_parallel_attention(*self._heads(x), group=self.cp_group, **opts)
        else:
            o, state = attention(*self._heads(x), **opts)
        return (self._project(o, x), state) if return_state else self._project(o, x)

    def step(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Decoding: x [B, T, dim] the next T tokens of each sequence, `state` the state of the
        tokens before (forward's with return_state=True, or an earlier step's), advanced in
        place (altattn.triple.step); returns y [B, T, dim], the rows a forward over all the
        tokens would give. A causal layer with an explicit scale; inference only (call it
        under torch.no_grad())."""
        if self.cp_group is not None:
            raise ValueError("step decodes on one rank: the layer's cp_group is set (after a "
                             "sharded prefill every rank holds the whole state; decode with a "
                             "layer without cp_group, or altattn.triple.step)")
        if not self.causal:
            raise ValueError("step decodes a causal layer (causal=True): a non-causal token "
                             "reads every token of its call, including later ones")
        if self.scale is None:
            raise ValueError("step needs the layer's scale given (scale=None is 1/N of one "
                             "call's tokens, which a state of earlier tokens does not have)")
        check_layer_input(x, self.dim)
        return self._project(triple_step(*self._heads(x), state, scale=self.scale), x)

    def _heads(self, x: torch.Tensor) -> list[torch.Tensor]:
        """q1, q2, k1, k2 [B, N, n_heads, head_dim] and v [B, N, n_heads, v_head_dim] of x, in
        the attention's dtype (bf16 on CUDA)."""
        B, N, _ = x.shape
        dtype = torch.bfloat16 if x.device.type == "cuda" else x.dtype

        def heads(proj: nn.Linear, size: int, normalize: bool) -> torch.Tensor:
            t = proj(x).view(B, N, self.n_heads, size)
            return (F.normalize(t, dim=-1) if normalize else t).to(dtype)

        return [*(heads(p, self.head_dim, self.normalize)
                  for p in (self.q1, self.q2, self.k1, self.k2)),
                heads(self.v, self.v_head_dim, False)]

    def _project(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        return self.out(o.reshape(B, N, self.n_heads * self.v_head_dim).to(x.dtype))

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, head_dim={self.head_dim}, "
                f"v_head_dim={self.v_head_dim}, causal={self.causal}, "
                f"normalize={self.normalize}, scale={'1/N' if self.scale is None else self.scale}")


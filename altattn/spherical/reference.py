"""Spherical attention in plain PyTorch, fp64, read as the math (docs/MATH.md §2):

    s[y, x] = c * q[y] . k[x]                   over the keys x query y sees (visible)
    r[y]    = sqrt(sum_x s[y, x]^2)             the row's L2 norm
    out[y]  = sum_x s[y, x] v[x] / (r[y] + eps)

visible(y, x): y < Lq, x < Lk and (causal: x <= y), with Lq = N, Lk = Nk, or with `seqlens`
Lq = min(seqlens[b], N), Lk = min(seqlens[b], Nk). Rows that see no key give out = 0 and r = 0.
GQA: query head h reads KV head h // (Hq / Hk). The backward is the closed form below; a CPU test
holds it against autograd (tests/spherical/test_spherical_cpu.py).
"""
from __future__ import annotations

import math

import torch


def visible(B: int, N: int, Nk: int, causal: bool, seqlens, device) -> torch.Tensor:
    """bool [B, 1, N, Nk]: may query y see key x (the module docstring's rule)."""
    y = torch.arange(N, device=device)[:, None]
    x = torch.arange(Nk, device=device)[None, :]
    m = (x <= y) if causal else torch.ones(N, Nk, dtype=torch.bool, device=device)
    m = m.expand(B, 1, N, Nk)
    if seqlens is not None:
        L = seqlens.to(device=device, dtype=torch.int64).view(B, 1, 1, 1)
        m = m & (y < L) & (x < L)
    return m


def scores(q, k, causal, sm_scale, seqlens, dtype):
    """(s [B, Hq, N, Nk] with the hidden pairs 0, k and the mask), in `dtype`."""
    B, N, Hq, D = q.shape
    G = Hq // k.shape[2]
    c = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    kx = k.to(dtype).repeat_interleave(G, dim=2)
    mask = visible(B, N, k.shape[1], causal, seqlens, q.device)
    s = c * torch.einsum("bnhd,bmhd->bhnm", q.to(dtype), kx)
    return s.masked_fill(~mask, 0.0), c, mask


def reference(q, k, v, causal: bool = False, sm_scale: float | None = None, eps: float = 1e-6,
              seqlens=None, dtype: torch.dtype = torch.float64):
    """(out [B, N, Hq, D], r [B, Hq, N]) in `dtype` (fp64 by default): the module docstring's math.
    sm_scale defaults to 1/sqrt(D)."""
    G = q.shape[2] // k.shape[2]
    s, _, _ = scores(q, k, causal, sm_scale, seqlens, dtype)
    r = s.square().sum(-1).sqrt()
    o = torch.einsum("bhnm,bmhd->bnhd", s, v.to(dtype).repeat_interleave(G, dim=2))
    return o / (r + eps).transpose(1, 2)[..., None], r


def _group_sum(t: torch.Tensor, G: int) -> torch.Tensor:
    """[B, N, Hq, D] -> [B, N, Hk, D]: the sum over each KV head's G query heads."""
    B, N, Hq, D = t.shape
    return t.view(B, N, Hq // G, G, D).sum(3)


def reference_backward(q, k, v, dout, dr=None, causal: bool = False,
                       sm_scale: float | None = None, eps: float = 1e-6, seqlens=None,
                       dtype: torch.dtype = torch.float64):
    """(dq, dk, dv) in `dtype`, given dout [B, N, Hq, D] and dr [B, Hq, N] (or None: r unused).

    With a = 1/(r + eps), P = a s, dP = dout v^T, delta = sum_d dout * out:
        ds = a dP + (dr - delta a) s / r          (second term 0 where r = 0)
        dv = P^T dout,   dq = c ds k,   dk = c ds^T q   (dk, dv summed over each KV head's G)
    FlashAttention-2's backward with the softmax line replaced; out's and r's dependence on s
    gives the two terms of ds."""
    G = q.shape[2] // k.shape[2]
    s, c, mask = scores(q, k, causal, sm_scale, seqlens, dtype)
    kx, vx = (t.to(dtype).repeat_interleave(G, dim=2) for t in (k, v))
    do = dout.to(dtype)
    r = s.square().sum(-1).sqrt()                                  # [B, Hq, N]
    a = 1.0 / (r + eps)
    out = torch.einsum("bhnm,bmhd->bhnd", s, vx) * a[..., None]
    delta = (do.transpose(1, 2) * out).sum(-1)                     # [B, Hq, N]
    g = -delta * a if dr is None else dr.to(dtype) - delta * a
    beta = torch.where(r > 0, g / torch.where(r > 0, r, 1.0), 0.0)
    dp = torch.einsum("bnhd,bmhd->bhnm", do, vx)
    ds = (a[..., None] * dp + beta[..., None] * s).masked_fill(~mask, 0.0)
    p = a[..., None] * s
    dq = c * torch.einsum("bhnm,bmhd->bnhd", ds, kx)
    dk = _group_sum(c * torch.einsum("bhnm,bnhd->bmhd", ds, q.to(dtype)), G)
    dv = _group_sum(torch.einsum("bhnm,bnhd->bmhd", p, do), G)
    return dq, dk, dv

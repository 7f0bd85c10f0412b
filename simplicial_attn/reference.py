"""Plain-PyTorch 2-simplicial attention, written to read like the math. Never imported by kernels.

    s[i,j,k] = sm_scale * sum_d Q[i,h,d] K1[j,g,d] K2[k,g,d]   j in (i-w1, i], k in (i-w2, i], j,k >= 0
    O[i,h]   = sum_{j,k} softmax_{j,k}(s)[i,j,k] * V1[j,g,:] * V2[k,g,:]
    LSE[i,h] = log sum_{j,k} exp(s[i,j,k])

Queries are processed in chunks so that N = 4096 with full-size windows fits in memory.
"""
from __future__ import annotations

import math

import torch

from .spec import REFERENCE_DTYPES, validate, validate_aux

_CHUNK_ELEMENTS = 1 << 25  # elements of the largest per-chunk intermediate


def _window(x: torch.Tensor, i0: int, i1: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (i-w, i] of x for each query i in [i0, i1): returns x_win [B, C, w, H, D] and valid [C, w]."""
    i = torch.arange(i0, i1, device=x.device)[:, None]
    pos = i - w + 1 + torch.arange(w, device=x.device)[None, :]  # [C, w], position of each window slot
    valid = pos >= 0
    return x[:, pos.clamp(min=0)], valid


def _chunk(q, k1, k2, v1, v2, i0: int, i1: int, spec):
    """Queries i0 .. i1-1 (C of them), pairs already ordered (spec.w1 <= spec.w2): their q
    [B, C, Hk, G, D], windows k1w, k2w, v1w, v2w [B, C, w, Hk, D], softmax p [B, C, Hk, G, w1, w2]
    (0 on invisible pairs), lse [B, C, Hk, G] and output o [B, C, Hk, G, D]."""
    B, C = q.shape[0], i1 - i0
    qc = q[:, i0:i1].reshape(B, C, spec.Hk, spec.G, spec.D)
    k1w, ok1 = _window(k1, i0, i1, spec.w1)
    v1w, _ = _window(v1, i0, i1, spec.w1)
    k2w, ok2 = _window(k2, i0, i1, spec.w2)
    v2w, _ = _window(v2, i0, i1, spec.w2)
    # s[b,c,g,h,j,k] = scale * sum_d q[b,c,g,h,d] k1[b,c,j,g,d] k2[b,c,k,g,d]
    s = torch.einsum("bcghd,bcjgd,bckgd->bcghjk", qc, k1w, k2w) * spec.sm_scale
    valid = ok1[:, :, None] & ok2[:, None, :]  # [C, w1, w2]
    s = s.masked_fill(~valid[None, :, None, None], float("-inf"))
    lse = torch.logsumexp(s.flatten(-2), dim=-1)  # every query sees at least (j, k) = (i, i)
    p = torch.exp(s - lse[..., None, None])
    o = torch.einsum("bcghjk,bcjgd,bckgd->bcghd", p, v1w, v2w)
    return qc, k1w, k2w, v1w, v2w, p, lse, o


def reference(q, k1, k2, v1, v2, w1, w2, *, sm_scale=None, dtype=torch.float64):
    """Forward pass in `dtype` (fp64 by default) on the inputs' device. Returns (out [B,N,Hq,D] in
    `dtype`, lse [B,Hq,N] natural log in `dtype`). Same argument checks as `forward`, any device;
    inputs may be bf16, fp16, fp32 or fp64. Differentiable: with fp64 inputs that require grad,
    autograd gives the exact gradients of out and lse (the fp64 backward reference)."""
    spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, dtypes=REFERENCE_DTYPES)
    B, N, Hq, Hk, D = spec.B, spec.N, spec.Hq, spec.Hk, spec.D
    w1, w2 = spec.w1, spec.w2
    if spec.swapped:  # the form is symmetric in (K1, V1, w1) <-> (K2, V2, w2)
        k1, v1, k2, v2 = k2, v2, k1, v1
    q, k1, k2, v1, v2 = (t.to(dtype) for t in (q, k1, k2, v1, v2))
    outs, lses = [], []
    # per query: scores [Hq, w1, w2], einsum intermediates [Hq, w1 or w2, D], gathered windows
    per_query = B * (Hq * w1 * w2 + Hq * (w1 + w2) * D + 2 * (w1 + w2) * Hk * D)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, per_query))
    for i0 in range(0, N, chunk):
        i1 = min(N, i0 + chunk)
        C = i1 - i0
        _, _, _, _, _, _, lse_c, o = _chunk(q, k1, k2, v1, v2, i0, i1, spec)
        outs.append(o.reshape(B, C, Hq, D))
        lses.append(lse_c.reshape(B, C, Hq).transpose(1, 2))
    if not outs:  # N = 0
        return (torch.empty(B, N, Hq, D, dtype=dtype, device=q.device),
                torch.empty(B, Hq, N, dtype=dtype, device=q.device))
    return torch.cat(outs, 1), torch.cat(lses, 2)


def reference_backward(q, k1, k2, v1, v2, w1, w2, dout, dlse=None, *, sm_scale=None,
                       dtype=torch.float64):
    """Gradients (dq, dk1, dk2, dv1, dv2) in `dtype` of out and lse, given their incoming
    gradients dout [B,N,Hq,D] and dlse [B,Hq,N] (or None), from the formulas of
    ../shared/docs/BACKWARD.md §1 (no autograd; the tests check them against autograd of
    `reference`). With c = sm_scale, row r = (i, h) and pair (j, k) visible from i:

        dP = (dO_r * V1[j]) . V2[k]      Delta_r = dO_r . O_r - dLSE_r      dS = P (dP - Delta)
        dQ = c sum_jk dS K1[j]*K2[k]   dK1[j] = c sum_rk dS q*K2[k]   dK2[k] = c sum_rj dS q*K1[j]
        dV1[j] = sum_rk P dO_r*V2[k]     dV2[k] = sum_rj P dO_r*V1[j]
    """
    spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, dtypes=REFERENCE_DTYPES)
    B, N, Hq, Hk, D, G = spec.B, spec.N, spec.Hq, spec.Hk, spec.D, spec.G
    w1, w2, c = spec.w1, spec.w2, spec.sm_scale
    validate_aux("dout", dout, (B, N, Hq, D), "[B, N, Hq, D]", q.device)
    if dlse is not None:  # [B, N, Hq] has the right size: the reshape below would take it
        validate_aux("dlse", dlse, (B, Hq, N), "[B, Hq, N]", q.device)
    if spec.swapped:
        k1, v1, k2, v2 = k2, v2, k1, v1
    q, k1, k2, v1, v2, dout = (t.to(dtype) for t in (q, k1, k2, v1, v2, dout))
    dq = torch.zeros_like(q)
    dk1, dk2, dv1, dv2 = (torch.zeros_like(k1) for _ in range(4))
    per_query = B * (3 * Hq * w1 * w2 + Hq * (w1 + w2) * D + 4 * (w1 + w2) * Hk * D)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, per_query))
    for i0 in range(0, N, chunk):
        i1 = min(N, i0 + chunk)
        C = i1 - i0
        qc, k1w, k2w, v1w, v2w, p, _, o = _chunk(q, k1, k2, v1, v2, i0, i1, spec)
        do = dout[:, i0:i1].reshape(B, C, Hk, G, D)
        delta = (do * o).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(dtype)[:, :, i0:i1].transpose(1, 2).reshape(B, C, Hk, G)
        dp = torch.einsum("bcghd,bcjgd,bckgd->bcghjk", do, v1w, v2w)
        ds = p * (dp - delta[..., None, None])
        dq[:, i0:i1] = (c * torch.einsum("bcghjk,bcjgd,bckgd->bcghd", ds, k1w, k2w)
                        ).reshape(B, C, Hq, D)
        pos1 = (torch.arange(i0, i1)[:, None] - w1 + 1 + torch.arange(w1)).clamp(min=0).flatten()
        pos2 = (torch.arange(i0, i1)[:, None] - w2 + 1 + torch.arange(w2)).clamp(min=0).flatten()
        pos1, pos2 = pos1.to(q.device), pos2.to(q.device)
        # invisible pairs have P = dS = 0: their (clamped) positions receive zeros
        for grad, pos, part in (
                (dk1, pos1, c * torch.einsum("bcghjk,bcghd,bckgd->bcjgd", ds, qc, k2w)),
                (dk2, pos2, c * torch.einsum("bcghjk,bcghd,bcjgd->bckgd", ds, qc, k1w)),
                (dv1, pos1, torch.einsum("bcghjk,bcghd,bckgd->bcjgd", p, do, v2w)),
                (dv2, pos2, torch.einsum("bcghjk,bcghd,bcjgd->bckgd", p, do, v1w))):
            grad.index_add_(1, pos, part.flatten(1, 2))
    if spec.swapped:
        dk1, dv1, dk2, dv2 = dk2, dv2, dk1, dv1
    return dq, dk1, dk2, dv1, dv2


def brute_force(q, k1, k2, v1, v2, w1, w2, sm_scale=None):
    """The same function from the full N x N x N score tensor, fp64, for tiny shapes only (tests).
    Differentiable like `reference`."""
    B, N, Hq, D = q.shape
    Hk = k1.shape[2]
    G = Hq // Hk
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    q, k1, k2, v1, v2 = (t.double() for t in (q, k1, k2, v1, v2))
    kv = [t.repeat_interleave(G, dim=2) for t in (k1, k2, v1, v2)]  # [B, N, Hq, D]
    s = torch.einsum("bihd,bjhd,bkhd->bhijk", q, kv[0], kv[1]) * scale
    i = torch.arange(N)[:, None, None]
    j = torch.arange(N)[None, :, None]
    k = torch.arange(N)[None, None, :]
    mask = (j <= i) & (j > i - w1) & (k <= i) & (k > i - w2)
    s = s.masked_fill(~mask, float("-inf")).reshape(B, Hq, N, N * N)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).reshape(B, Hq, N, N, N)
    out = torch.einsum("bhijk,bjhd,bkhd->bihd", p, kv[2], kv[3])
    return out, lse

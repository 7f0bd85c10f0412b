"""Plain-PyTorch 2-simplicial attention, written to read like the math. Never imported by kernels.

    s[i,j,k] = sm_scale * sum_d Q[i,h,d] K1[j,g,d] K2[k,g,d]   j in (i-w1, i], k in (i-w2, i], j,k >= 0
    O[i,h]   = sum_{j,k} softmax_{j,k}(s)[i,j,k] * V1[j,g,:] * V2[k,g,:]
    LSE[i,h] = log sum_{j,k} exp(s[i,j,k])

The determinant form (form="det", "Fast and Simplex", arXiv:2507.02754, section 5) replaces the
sum over d: with q^(l) = q[3l : 3l+3] (likewise K1, K2), l = 0 .. L-1, L = D // 3,

    s[i,j,k] = sm_scale * (sum_l det[Q_i^(l); K1_j^(l); K2_k^(l)] + sum_{d>=3L} Q[i,d] K1[j,d] K2[k,d])

the D mod 3 leftover dims keeping the trilinear term (the paper's eq. 9 has whole chunks only).
As det[a; b; c] = (a x b) . c = a . (b x c), these are the plain form's sums with the Hadamard
product u * w replaced by the chunkwise cross product u x3 w = (pi u) * (pi^2 w) - (pi^2 u) *
(pi w), pi rotating each 3-chunk ((pi u)[3l+m] = u[3l + (m+1) mod 3]). On the leftover dims pi
is the identity and the subtracted product is left out, so u x3 w = u * w there (`cross3`).
Softmax, O and LSE are the plain form's. sm_scale defaults to 1/sqrt(D) for both forms: the
paper scales the trilinear logits by 1/sqrt(d) (eq. 5) and writes eq. 9 with no factor
(sm_scale=1.0 gives it as written). Each 3x3 determinant has six products where the trilinear
sum has three, so with unit-variance inputs the det logits have about twice the variance. det is
invariant under one rotation (SO(3)) of every chunk of q, k1 and k2 (`altattn.simplicial.det_rotary`
builds rotary position embeddings on it) and changes sign under a reflection, or when K1 and K2
are exchanged.

Queries are processed in chunks so that N = 4096 with full-size windows fits in memory.
"""
from __future__ import annotations

import math

import torch

from ..checks import validate_aux
from .spec import NAMES, REFERENCE_DTYPES, check_form, validate

_CHUNK_ELEMENTS = 1 << 25  # elements of the largest per-chunk intermediate


def _window(x: torch.Tensor, i0: int, i1: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (i-w, i] of x for each query i in [i0, i1): returns x_win [B, C, w, H, D] and valid [C, w]."""
    i = torch.arange(i0, i1, device=x.device)[:, None]
    pos = i - w + 1 + torch.arange(w, device=x.device)[None, :]  # [C, w], position of each window slot
    valid = pos >= 0
    return x[:, pos.clamp(min=0)], valid


def chunk_dims(x: torch.Tensor) -> torch.Tensor:
    """Which of x's last-dim entries lie in a whole 3-chunk (bool [D]; False on the D mod 3
    leftover dims)."""
    D = x.shape[-1]
    return torch.arange(D, device=x.device) < D // 3 * 3


def pi_chunks(x: torch.Tensor, r: int) -> torch.Tensor:
    """pi^r x: each 3-chunk of the last dim rotated r places, (pi x)[3l+m] = x[3l + (m+1) mod 3];
    the leftover dims as they are."""
    d = torch.arange(x.shape[-1], device=x.device)
    return x[..., torch.where(chunk_dims(x), d - d % 3 + (d % 3 + r) % 3, d)]


def cross3(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """u x3 w: the cross product of each 3-chunk of the last dim, u * w on the leftover dims
    (broadcasting as `*` does)."""
    return pi_chunks(u, 1) * pi_chunks(w, 2) - chunk_dims(u) * pi_chunks(u, 2) * pi_chunks(w, 1)


def _negate_chunks(x: torch.Tensor) -> torch.Tensor:
    """x with its chunk dims negated (a reflection of every 3-chunk; the leftover dims kept)."""
    return torch.where(chunk_dims(x), -x, x)


def _coords(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Coordinates 0, 1, 2 of every 3-chunk of the last dim ([..., L] each), and the leftover
    dims."""
    n = x.shape[-1] // 3 * 3
    return x[..., 0:n:3], x[..., 1:n:3], x[..., 2:n:3], x[..., n:]


def _logits(eq: str, q: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, form: str):
    """The unscaled logits: torch.einsum(eq, q, k1, k2), eq summing the last dim d away (the
    trilinear form), or with form "det" the sum over chunks of det[q; k1; k2] by Sarrus' rule
    plus that einsum over the leftover dims."""
    if form == "trilinear":
        return torch.einsum(eq, q, k1, k2)
    (q0, q1, q2, qr), (a0, a1, a2, ar), (b0, b1, b2, br) = _coords(q), _coords(k1), _coords(k2)

    def e(x, y, z):
        return torch.einsum(eq, x, y, z)

    return (e(q0, a1, b2) + e(q1, a2, b0) + e(q2, a0, b1)
            - e(q0, a2, b1) - e(q1, a0, b2) - e(q2, a1, b0) + e(qr, ar, br))


def _products(eq: str, p: torch.Tensor, u: torch.Tensor, w: torch.Tensor, form: str):
    """torch.einsum(eq, p, u, w), eq keeping the last dim d: p-weighted sums of u * w, or with form
    "det" of u x3 w (`cross3`, term by term)."""
    if form == "trilinear":
        return torch.einsum(eq, p, u, w)
    return (torch.einsum(eq, p, pi_chunks(u, 1), pi_chunks(w, 2))
            - chunk_dims(u) * torch.einsum(eq, p, pi_chunks(u, 2), pi_chunks(w, 1)))


def _in_spec_order(q, k1, k2, v1, v2, spec):
    """(q, k1, k2, v1, v2) with the pairs in the spec's order (w1 <= w2). Exchanging (K1, V1) and
    (K2, V2) leaves the trilinear form as it is; for form "det" it negates every determinant and
    keeps the leftover term, so q's chunk dims are negated too. The map is its own inverse and
    its own transpose: applied to (dq, dk1, dk2, dv1, dv2) it gives the caller's gradients."""
    if not spec.swapped:
        return q, k1, k2, v1, v2
    if spec.form == "det":
        q = _negate_chunks(q)
    return q, k2, k1, v2, v1


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
    # s[b,c,g,h,j,k] = scale * sum_d q[b,c,g,h,d] k1[b,c,j,g,d] k2[b,c,k,g,d] (or the det form)
    s = _logits("bcghd,bcjgd,bckgd->bcghjk", qc, k1w, k2w, spec.form) * spec.sm_scale
    valid = ok1[:, :, None] & ok2[:, None, :]  # [C, w1, w2]
    s = s.masked_fill(~valid[None, :, None, None], float("-inf"))
    lse = torch.logsumexp(s.flatten(-2), dim=-1)  # every query sees at least (j, k) = (i, i)
    p = torch.exp(s - lse[..., None, None])
    o = torch.einsum("bcghjk,bcjgd,bckgd->bcghd", p, v1w, v2w)
    return qc, k1w, k2w, v1w, v2w, p, lse, o


def reference(q, k1, k2, v1, v2, w1, w2, *, sm_scale=None, dtype=torch.float64,
              form="trilinear"):
    """Forward pass in `dtype` (fp64 by default) on the inputs' device. Returns (out [B,N,Hq,D] in
    `dtype`, lse [B,Hq,N] natural log in `dtype`). Same argument checks as `forward`, any device;
    inputs may be bf16, fp16, fp32 or fp64. Differentiable: with fp64 inputs that require grad,
    autograd gives the exact gradients of out and lse (the fp64 backward reference).
    form="det": the determinant form of the module docstring (sums of 3x3 determinants over the
    3-chunks of D, the D mod 3 leftover dims trilinear); sm_scale defaults to 1/sqrt(D) for both."""
    spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, dtypes=REFERENCE_DTYPES, form=form)
    B, N, Hq, Hk, D = spec.B, spec.N, spec.Hq, spec.Hk, spec.D
    w1, w2 = spec.w1, spec.w2
    q, k1, k2, v1, v2 = (t.to(dtype) for t in _in_spec_order(q, k1, k2, v1, v2, spec))
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
                       dtype=torch.float64, form="trilinear"):
    """Gradients (dq, dk1, dk2, dv1, dv2) in `dtype` of out and lse, given their incoming
    gradients dout [B,N,Hq,D] and dlse [B,Hq,N] (or None), from the formulas of
    docs/MATH.md §1 (no autograd; the tests check them against autograd of
    `reference`). With c = sm_scale, row r = (i, h) and pair (j, k) visible from i:

        dP = (dO_r * V1[j]) . V2[k]      Delta_r = dO_r . O_r - dLSE_r      dS = P (dP - Delta)
        dQ = c sum_jk dS K1[j]*K2[k]   dK1[j] = c sum_rk dS K2[k]*q   dK2[k] = c sum_rj dS q*K1[j]
        dV1[j] = sum_rk P dO_r*V2[k]     dV2[k] = sum_rj P dO_r*V1[j]

    form="det": the key and query products become cross products in this order, K1[j] x3 K2[k],
    K2[k] x3 q and q x3 K1[j] (`cross3`; det[a; b; c] = a . (b x c) = b . (c x a) = c . (a x b)).
    """
    spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, dtypes=REFERENCE_DTYPES, form=form)
    B, N, Hq, Hk, D, G = spec.B, spec.N, spec.Hq, spec.Hk, spec.D, spec.G
    w1, w2, c = spec.w1, spec.w2, spec.sm_scale
    validate_aux("dout", dout, (B, N, Hq, D), "[B, N, Hq, D]", q.device, ", ".join(NAMES))
    if dlse is not None:  # [B, N, Hq] has the right size: the reshape below would take it
        validate_aux("dlse", dlse, (B, Hq, N), "[B, Hq, N]", q.device, ", ".join(NAMES))
    q, k1, k2, v1, v2 = _in_spec_order(q, k1, k2, v1, v2, spec)
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
        dq[:, i0:i1] = (c * _products("bcghjk,bcjgd,bckgd->bcghd", ds, k1w, k2w, spec.form)
                        ).reshape(B, C, Hq, D)
        pos1 = (torch.arange(i0, i1)[:, None] - w1 + 1 + torch.arange(w1)).clamp(min=0).flatten()
        pos2 = (torch.arange(i0, i1)[:, None] - w2 + 1 + torch.arange(w2)).clamp(min=0).flatten()
        pos1, pos2 = pos1.to(q.device), pos2.to(q.device)
        # invisible pairs have P = dS = 0: their (clamped) positions receive zeros
        for grad, pos, part in (
                (dk1, pos1, c * _products("bcghjk,bckgd,bcghd->bcjgd", ds, k2w, qc, spec.form)),
                (dk2, pos2, c * _products("bcghjk,bcghd,bcjgd->bckgd", ds, qc, k1w, spec.form)),
                (dv1, pos1, torch.einsum("bcghjk,bcghd,bckgd->bcjgd", p, do, v2w)),
                (dv2, pos2, torch.einsum("bcghjk,bcghd,bcjgd->bckgd", p, do, v1w))):
            grad.index_add_(1, pos, part.flatten(1, 2))
    return _in_spec_order(dq, dk1, dk2, dv1, dv2, spec)


def brute_force(q, k1, k2, v1, v2, w1, w2, sm_scale=None, form="trilinear"):
    """The same function from the full N x N x N score tensor, fp64, for tiny shapes only (tests).
    Differentiable like `reference`. No pair exchange: w1 > w2 is computed as given."""
    form = check_form(form)
    B, N, Hq, D = q.shape
    Hk = k1.shape[2]
    G = Hq // Hk
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    q, k1, k2, v1, v2 = (t.double() for t in (q, k1, k2, v1, v2))
    kv = [t.repeat_interleave(G, dim=2) for t in (k1, k2, v1, v2)]  # [B, N, Hq, D]
    s = _logits("bihd,bjhd,bkhd->bhijk", q, kv[0], kv[1], form) * scale
    i = torch.arange(N)[:, None, None]
    j = torch.arange(N)[None, :, None]
    k = torch.arange(N)[None, None, :]
    mask = (j <= i) & (j > i - w1) & (k <= i) & (k > i - w2)
    s = s.masked_fill(~mask, float("-inf")).reshape(B, Hq, N, N * N)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).reshape(B, Hq, N, N, N)
    out = torch.einsum("bhijk,bjhd,bkhd->bihd", p, kv[2], kv[3])
    return out, lse

"""Triple attention in plain PyTorch, read as the math (docs/MATH.md §3), chunked over N
so that long sequences (N = 524,288) fit on a GPU in fp32:

    S[i, j, k] = c * sum_n K1[n, i] V[n, j] K2[n, k]      the state, [Dq, Dv, Dq] per (b, h)
    Y[n, j]    = sum_{i,k} Q1[n, i] S[i, j, k] Q2[n, k]

q1, q2, k1, k2 [B, N, H, Dq], v [B, N, H, Dv]; c = `scale`, 1/N by default (the state is a mean:
the public code's convention; scale=1.0 gives the blog's formula). Causal: token n reads the
state of tokens m <= n only, Y[n] = c * sum_{m<=n} (Q1[n].K1[m]) (Q2[n].K2[m]) V[m], computed
in chunks: inside a chunk the masked quadratic form, across chunks the prefix state.

State in, state out: with `initial_state` S0 [B, H, Dq, Dv, Dq] (earlier tokens' state, already
scaled) the sums start from S0 instead of 0,
    S = S0 + c * sum_n K1[n] (x) V[n] (x) K2[n]       (the state returned)
and every token reads S0 plus its sum (all tokens, or m <= n when causal), so a sequence cut in
chunks, each chunk's returned state the next one's initial_state, gives one call's out and state
(the scale must then be explicit: 1/N is the mean over one call's tokens only).

The backward is closed-form in both modes (no autograd: the op's CPU path runs it inside a
torch.library op, where autograd does not record); CPU tests hold it against autograd.
"""
from __future__ import annotations

import torch

from .spec import check_scale

CHUNK = 4096  # tokens per chunk: bounds the [chunk, chunk] scores and the outer products


def _scale(N: int, scale, initial_state=None) -> float:
    return check_scale(scale, N, initial_state is not None)


def _start(q1, v, initial_state, dtype: torch.dtype) -> torch.Tensor:
    """The state before the first token, [B, H, Dq, Dv, Dq] in `dtype`: initial_state, or 0."""
    if initial_state is not None:
        return initial_state.to(dtype=dtype, device=q1.device, copy=True)
    B, _, H, Dq = q1.shape
    return torch.zeros(B, H, Dq, v.shape[-1], Dq, dtype=dtype, device=q1.device)


def reference(q1, q2, k1, k2, v, scale=None, causal: bool = False, initial_state=None,
              dtype: torch.dtype = torch.float64, chunk: int = CHUNK):
    """(out [B, N, H, Dv], state [B, H, Dq, Dv, Dq]) in `dtype`: the module docstring's math,
    the sums started from initial_state (None: 0). For causal, state is the whole sequence's
    (what the last token reads)."""
    B, N, H, _ = q1.shape
    c = _scale(N, scale, initial_state)
    state = _start(q1, v, initial_state, dtype)
    Dv = v.shape[-1]
    out = torch.empty(B, N, H, Dv, dtype=dtype, device=q1.device)
    for a in range(0, N, chunk):
        x1, x2, y1, y2, vv = (t[:, a:a + chunk].to(dtype) for t in (k1, k2, q1, q2, v))
        if causal:  # the state of earlier chunks, then this chunk's masked quadratic form
            inter = torch.einsum("bnhi,bhijk,bnhk->bnhj", y1, state, y2)
            s = torch.einsum("bnhi,bmhi->bhnm", y1, x1) * torch.einsum("bnhk,bmhk->bhnm", y2, x2)
            s = s.tril()
            out[:, a:a + chunk] = inter + c * torch.einsum("bhnm,bmhj->bnhj", s, vv)
        state = state + c * torch.einsum("bnhi,bnhj,bnhk->bhijk", x1, vv, x2)  # autograd: no +=
    if not causal:
        for a in range(0, N, chunk):
            y1, y2 = (t[:, a:a + chunk].to(dtype) for t in (q1, q2))
            out[:, a:a + chunk] = torch.einsum("bnhi,bhijk,bnhk->bnhj", y1, state, y2)
    return out, state


def reference_backward(q1, q2, k1, k2, v, dout, dstate=None, scale=None, causal: bool = False,
                       initial_state=None, dtype: torch.dtype = torch.float64,
                       chunk: int = CHUNK):
    """(dq1, dq2, dk1, dk2, dv) in `dtype`, given dout [B, N, H, Dv] and dstate [B, H, Dq, Dv, Dq]
    (the returned state's gradient, or None when the state is unused); with an initial_state,
    a sixth, its gradient: every token reads it and the returned state holds it, so it is the
    total gradient reaching the state, dstate + sum_n Q1[n] (x) dO[n] (x) Q2[n] (both modes).
    Non-causal, the four contractions of docs/MATH.md (S the state the tokens read):
        dS = sum_n Q1[n] (x) dO[n] (x) Q2[n]  (+ dstate)
        T[n, i, k] = sum_j dO[n, j] S[i, j, k]:   dQ1 = sum_k T Q2,   dQ2 = sum_i T Q1
        U[n, i, k] = c sum_j V[n, j] dS[i, j, k]: dK1 = sum_k U K2,   dK2 = sum_i U K1
        dV[n, j] = c sum_{i,k} K1[n, i] K2[n, k] dS[i, j, k]
    Causal: the same per chunk with S the prefix state of the earlier chunks (from
    initial_state) and dS the suffix sum of the later chunks (plus dstate), and the masked
    quadratic form inside each chunk (_causal_backward)."""
    N = q1.shape[1]
    c = _scale(N, scale, initial_state)
    if causal:
        return _causal_backward(q1, q2, k1, k2, v, dout, dstate, c, initial_state, dtype, chunk)
    _, S = reference(q1, q2, k1, k2, v, c, initial_state=initial_state, dtype=dtype, chunk=chunk)
    dS = torch.zeros_like(S) if dstate is None else dstate.to(dtype).clone()
    for a in range(0, N, chunk):
        y1, y2, do = (t[:, a:a + chunk].to(dtype) for t in (q1, q2, dout))
        dS += torch.einsum("bnhi,bnhj,bnhk->bhijk", y1, do, y2)
    grads = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in (q1, q2, k1, k2, v)]
    for a in range(0, N, chunk):
        sl = slice(a, a + chunk)
        y1, y2, x1, x2, vv, do = (t[:, sl].to(dtype) for t in (q1, q2, k1, k2, v, dout))
        T = torch.einsum("bnhj,bhijk->bnhik", do, S)
        U = c * torch.einsum("bnhj,bhijk->bnhik", vv, dS)
        grads[0][:, sl] = torch.einsum("bnhik,bnhk->bnhi", T, y2)
        grads[1][:, sl] = torch.einsum("bnhik,bnhi->bnhk", T, y1)
        grads[2][:, sl] = torch.einsum("bnhik,bnhk->bnhi", U, x2)
        grads[3][:, sl] = torch.einsum("bnhik,bnhi->bnhk", U, x1)
        grads[4][:, sl] = c * torch.einsum("bnhi,bnhk,bhijk->bnhj", x1, x2, dS)
    return (*grads, dS) if initial_state is not None else tuple(grads)


def _causal_backward(q1, q2, k1, k2, v, dout, dstate, c: float, initial_state,
                     dtype: torch.dtype, chunk: int):
    """The causal gradients, chunk by chunk. Inside a chunk, out = c (A * B * mask) V with
    A = Q1 K1^T, B = Q2 K2^T: dP = c (dO V^T) * mask, dA = dP * B, dB = dP * A,
    dQ1 = dA K1, dK1 = dA^T Q1, dQ2 = dB K2, dK2 = dB^T Q2, dV = c (A * B * mask)^T dO.
    Across chunks, the non-causal contractions: a first pass in order (the prefix state S of the
    earlier chunks, from initial_state, gives dQ1, dQ2 through T), a second in reverse (dS =
    dstate + sum over the later chunks of Q1 (x) dO (x) Q2 gives dK1, dK2, dV through U; past
    the first chunk it is initial_state's gradient)."""
    grads = [torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q1, q2, k1, k2, v)]
    dq1, dq2, dk1, dk2, dv = grads
    S = _start(q1, v, initial_state, dtype)
    starts = range(0, q1.shape[1], chunk)
    for a in starts:
        sl = slice(a, a + chunk)
        y1, y2, x1, x2, vv, do = (t[:, sl].to(dtype) for t in (q1, q2, k1, k2, v, dout))
        T = torch.einsum("bnhj,bhijk->bnhik", do, S)
        dq1[:, sl] = torch.einsum("bnhik,bnhk->bnhi", T, y2)
        dq2[:, sl] = torch.einsum("bnhik,bnhi->bnhk", T, y1)
        A = torch.einsum("bnhi,bmhi->bhnm", y1, x1)
        Bs = torch.einsum("bnhk,bmhk->bhnm", y2, x2)
        dP = (c * torch.einsum("bnhj,bmhj->bhnm", do, vv)).tril()
        dA, dB = dP * Bs, dP * A
        dq1[:, sl] += torch.einsum("bhnm,bmhi->bnhi", dA, x1)
        dq2[:, sl] += torch.einsum("bhnm,bmhk->bnhk", dB, x2)
        dk1[:, sl] = torch.einsum("bhnm,bnhi->bmhi", dA, y1)
        dk2[:, sl] = torch.einsum("bhnm,bnhk->bmhk", dB, y2)
        dv[:, sl] = c * torch.einsum("bhnm,bnhj->bmhj", (A * Bs).tril(), do)
        S += c * torch.einsum("bnhi,bnhj,bnhk->bhijk", x1, vv, x2)
    dS = torch.zeros_like(S) if dstate is None else dstate.to(dtype).clone()
    for a in reversed(starts):
        sl = slice(a, a + chunk)
        y1, y2, x1, x2, vv, do = (t[:, sl].to(dtype) for t in (q1, q2, k1, k2, v, dout))
        U = c * torch.einsum("bnhj,bhijk->bnhik", vv, dS)
        dk1[:, sl] += torch.einsum("bnhik,bnhk->bnhi", U, x2)
        dk2[:, sl] += torch.einsum("bnhik,bnhi->bnhk", U, x1)
        dv[:, sl] += c * torch.einsum("bnhi,bnhk,bhijk->bnhj", x1, x2, dS)
        dS += torch.einsum("bnhi,bnhj,bnhk->bhijk", y1, do, y2)
    return (*grads, dS) if initial_state is not None else tuple(grads)

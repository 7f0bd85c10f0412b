"""Causal triple attention, the chunked form (published by nobody before; FAMILIES.md §2):

    Y[n] = c sum_{m <= n} (Q1[n].K1[m]) (Q2[n].K2[m]) V[m]
         = Q1[n] S_<(chunk(n)) Q2[n]           keys of earlier chunks: their state (fp32 sums)
         + c sum_{m in chunk(n), m <= n} ...   keys of its own chunk: intra.py's quadratic form

Forward: `partials` with one split per chunk of CHUNK tokens gives each chunk's state; their
exclusive prefix sums (torch.cumsum: a fixed order) are the states S_<(c) every token of chunk c
reads through `apply` (one W slab per chunk) into an fp32 "inter" output; intra.py adds the
chunk's own pairs and writes bf16. The state returned is the whole sequence's, as non-causal.
Backward: dQ1, dQ2 read the prefix states as the forward does; dK1, dK2, dV read the exclusive
suffix sums of dS (tokens of later chunks, plus the incoming dstate), then intra.py adds the
pairs inside each chunk. Bitwise repeatable (no atomics).

Extra memory: the per-chunk states, cdiv(N, CHUNK) * B * H * Dq^2 * Dv fp32 (and their bf16 slabs,
one per layout read), plus an fp32 copy of each output ([B, N, H, D]).
"""
from __future__ import annotations

import torch

from kernels_triton.triple import host, intra

# Tokens per chunk: the intra part costs ~CHUNK/2 pairs a token, the states N/CHUNK of Dq^2 Dv.
# Measured at N 524,288 (docs/perf-triple.md): 2048 best at Dq = Dv = 32 and 64.
CHUNK = 2048


def _suffix(P, dstate):
    """The exclusive suffix sums of P over its chunk axis, plus dstate: total - inclusive prefix,
    in place (fp32)."""
    P.cumsum_(2)
    torch.sub(P[:, :, -1:].clone(), P, out=P)
    return P if dstate is None else P.add_(dstate[:, :, None])


def _chunk_states(x1, y, x2, N: int, chunk: int, impl):
    """Each chunk's sum (`partials` with one split per chunk; impl as in fwd.state)."""
    return impl.partials(x1, y, x2, max(1, -(-N // chunk)), split_len=chunk)


def forward(spec, q1, q2, k1, k2, v, out, out_state, profile: bool = False, impl=host) -> None:
    C = CHUNK
    P = _chunk_states(k1, v, k2, spec.N, C, impl)
    out_state.copy_(P.sum(2)).mul_(spec.scale)
    W = host.slab(P.cumsum_(2), "ikj", shift=1)  # exclusive prefix sums; apply scales by c
    del P
    inter = torch.empty(out.shape, device=out.device, dtype=torch.float32)
    impl.apply(q2, q1, W, inter, spec.scale, chunk=C, profile=profile)
    intra.intra_forward(q1, q2, k1, k2, v, inter, out, C, spec.scale)


def backward(spec, q1, q2, k1, k2, v, dout, dstate, grads, profile: bool = False,
             impl=host) -> None:
    """FAMILIES.md's gradients (bwd.gradients) with S the prefix states (unscaled here, so the dQ
    applies take c) and dS the suffix ones, then intra.py's pairs inside each chunk."""
    from kernels_triton.triple.bwd import gradients
    c, C = spec.scale, CHUNK
    P = _chunk_states(k1, v, k2, spec.N, C, impl).cumsum_(2)
    dS = _suffix(_chunk_states(q1, dout, q2, spec.N, C, impl), dstate)
    inter = [torch.empty(g.shape, device=g.device, dtype=torch.float32) for g in grads]
    gradients(q1, q2, k1, k2, v, dout, lambda o: host.slab(P, o, shift=1),
              lambda o: host.slab(dS, o), inter, c, c, chunk=C, profile=profile, impl=impl)
    P = dS = None  # free the chunk states before the intra kernels
    names = ("dq1", "dq2", "dk1", "dk2", "dv")
    intra.intra_backward(q1, q2, k1, k2, v, dout, dict(zip(names, inter)),
                         dict(zip(names, grads)), C, c)

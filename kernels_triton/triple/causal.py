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


def _prepare_chunk_states(spec, impl, profile: bool = False):
    """run(x1, y, x2) -> each chunk's sum, [B, H, chunks, Dq, Dv, Dq] fp32 (`partials` with one
    split per chunk; impl as in fwd.prepare): (K1, V, K2) and (Q1, dO, Q2) alike."""
    return impl.prepare_partials(spec.B, spec.N, spec.H, spec.Dq, spec.Dv, spec.Dq,
                                 max(1, -(-spec.N // CHUNK)), split_len=CHUNK, profile=profile)


def prepare_forward(spec, profile: bool | str = False, impl=host):
    """fwd.prepare's launches for a causal `spec`: run(q1, q2, k1, k2, v, out, out_state), its
    run's arguments."""
    B, N, H, Dq, Dv, c = spec.B, spec.N, spec.H, spec.Dq, spec.Dv, spec.scale
    chunk_states = _prepare_chunk_states(spec, impl, host.scoped(profile, "partials"))
    (dims,) = host.apply_dims(Dq, Dv, "fwd")
    apply = impl.prepare_apply(B, N, H, *dims, c, chunk=CHUNK,
                               profile=host.scoped(profile, "apply"))
    intra_forward = intra.prepare_forward(B, N, H, Dq, Dv, CHUNK, c)

    def run(q1, q2, k1, k2, v, out, out_state) -> None:
        P = chunk_states(k1, v, k2)
        torch.sum(P, 2, out=out_state).mul_(c)
        W = host.slab(P.cumsum_(2), "ikj", shift=1)  # exclusive prefix sums; apply scales by c
        del P
        inter = torch.empty(out.shape, device=out.device, dtype=torch.float32)
        apply(q2, q1, W, inter)
        intra_forward(q1, q2, k1, k2, v, inter, out)

    return run


def prepare_backward(spec, profile: bool | str = False, impl=host):
    """bwd.prepare's launches for a causal `spec`: run(q1, q2, k1, k2, v, state, dout, dstate,
    dq1, dq2, dk1, dk2, dv), its run's arguments (state unused: the chunk states are made again).
    FAMILIES.md's gradients (bwd.prepare_gradients) with S the prefix states (unscaled here, so
    the dQ applies take c) and dS the suffix ones, then intra.py's pairs inside each chunk."""
    from kernels_triton.triple.bwd import prepare_gradients
    B, N, H, Dq, Dv, c = spec.B, spec.N, spec.H, spec.Dq, spec.Dv, spec.scale
    chunk_states = _prepare_chunk_states(spec, impl, host.scoped(profile, "partials"))
    gradients = prepare_gradients(spec, c, c, CHUNK, host.scoped(profile, "apply"), impl)
    intra_backward = intra.prepare_backward(B, N, H, Dq, Dv, CHUNK, c)

    def run(q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv) -> None:
        grads = (dq1, dq2, dk1, dk2, dv)
        P = chunk_states(k1, v, k2).cumsum_(2)
        dS = _suffix(chunk_states(q1, dout, q2), dstate)
        inter = [torch.empty(g.shape, device=g.device, dtype=torch.float32) for g in grads]
        gradients(q1, q2, k1, k2, v, dout, lambda o: host.slab(P, o, shift=1),
                  lambda o: host.slab(dS, o), inter)
        P = dS = None  # free the chunk states before the intra kernels
        intra_backward(q1, q2, k1, k2, v, dout, inter, grads)

    return run

"""Causal triple attention, the chunked form (published by nobody before; FAMILIES.md §2):

    Y[n] = c sum_{m <= n} (Q1[n].K1[m]) (Q2[n].K2[m]) V[m]
         = Q1[n] S_<(chunk(n)) Q2[n]           keys of earlier chunks: their state (fp32 sums)
         + c sum_{m in chunk(n), m <= n} ...   keys of its own chunk: intra.py's quadratic form

Forward: `partials` with one split per chunk of CHUNK tokens gives each chunk's state; their
exclusive prefix sums (torch.cumsum: a fixed order) are the states S_<(c) every token of chunk c
reads through `apply` (one W slab per chunk) into an fp32 "inter" output; intra.py adds the
chunk's own pairs and writes bf16. The state returned is the whole sequence's, as non-causal.
An initial state S0 (already scaled) starts the prefix sums: the chunk states are unscaled (apply
scales by c), so the prefix of chunk k is S0 / c + the sum of chunks before k, and the state
returned S0 + c * the sum of all.
Backward: dQ1, dQ2 read the prefix states as the forward does; dK1, dK2, dV read the exclusive
suffix sums of dS (tokens of later chunks, plus the incoming dstate), then intra.py adds the
pairs inside each chunk. S0's gradient is the whole sum of dS plus dstate (every token reads S0).
Bitwise repeatable (no atomics).

Extra memory: the per-chunk states, cdiv(N, CHUNK) * B * H * Dq^2 * Dv fp32 (and their bf16 slabs,
one per layout read), plus an fp32 copy of each output ([B, N, H, D]).
"""
from __future__ import annotations

import torch

from kernels_triton.triple import host, intra

# Tokens per chunk: the intra part costs ~CHUNK/2 pairs a token, the states N/CHUNK of Dq^2 Dv.
# Measured at N 524,288 (docs/perf-triple.md): 2048 best at Dq = Dv = 32 and 64.
CHUNK = 2048


def _suffix(P, dstate, dinitial_state=None):
    """The exclusive suffix sums of P over its chunk axis, plus dstate: total - inclusive prefix,
    in place (fp32). dinitial_state (or None): the total plus dstate written into it."""
    P.cumsum_(2)
    if dinitial_state is not None:
        dinitial_state.copy_(P[:, :, -1])
        if dstate is not None:
            dinitial_state.add_(dstate)
    torch.sub(P[:, :, -1:].clone(), P, out=P)
    return P if dstate is None else P.add_(dstate[:, :, None])


def _prefix(P, initial_state, c: float):
    """The inclusive prefix sums of the chunk states P over their chunk axis, in place, started
    from initial_state / c (unscaled like P: apply scales by c), and that start (None without
    an initial state): what host.slab(P, order, shift=1, first=start) turns into each chunk's
    exclusive prefix."""
    P.cumsum_(2)
    if initial_state is None:
        return P, None
    start = initial_state / c
    return P.add_(start[:, :, None]), start


def _prepare_chunk_states(spec, impl, profile: bool = False):
    """run(x1, y, x2) -> each chunk's sum, [B, H, chunks, Dq, Dv, Dq] fp32 (`partials` with one
    split per chunk; impl as in fwd.prepare): (K1, V, K2) and (Q1, dO, Q2) alike."""
    return impl.prepare_partials(spec.B, spec.N, spec.H, spec.Dq, spec.Dv, spec.Dq,
                                 max(1, -(-spec.N // CHUNK)), split_len=CHUNK, profile=profile)


def prepare_forward(spec, profile: bool | str = False, impl=host):
    """fwd.prepare's launches for a causal `spec`: run(q1, q2, k1, k2, v, out, out_state,
    initial_state=None), its run's arguments."""
    B, N, H, Dq, Dv, c = spec.B, spec.N, spec.H, spec.Dq, spec.Dv, spec.scale
    chunk_states = _prepare_chunk_states(spec, impl, host.scoped(profile, "partials"))
    (dims,) = host.apply_dims(Dq, Dv, "fwd")
    apply = impl.prepare_apply(B, N, H, *dims, c, chunk=CHUNK,
                               profile=host.scoped(profile, "apply"))
    intra_forward = intra.prepare_forward(B, N, H, Dq, Dv, CHUNK, c)

    def run(q1, q2, k1, k2, v, out, out_state, initial_state=None) -> None:
        P = chunk_states(k1, v, k2)
        torch.sum(P, 2, out=out_state).mul_(c)
        if initial_state is not None:
            out_state.add_(initial_state)
        P, start = _prefix(P, initial_state, c)
        W = host.slab(P, "ikj", shift=1, first=start)  # exclusive prefixes; apply scales by c
        del P, start
        inter = torch.empty(out.shape, device=out.device, dtype=torch.float32)
        apply(q2, q1, W, inter)
        intra_forward(q1, q2, k1, k2, v, inter, out)

    return run


def prepare_backward(spec, profile: bool | str = False, impl=host):
    """bwd.prepare's launches for a causal `spec`: run(q1, q2, k1, k2, v, state, dout, dstate,
    dq1, dq2, dk1, dk2, dv, initial_state=None, dinitial_state=None), its run's arguments (state
    unused: the chunk states are made again, from initial_state).
    FAMILIES.md's gradients (bwd.prepare_gradients) with S the prefix states (unscaled here, so
    the dQ applies take c) and dS the suffix ones, then intra.py's pairs inside each chunk."""
    from kernels_triton.triple.bwd import prepare_gradients
    B, N, H, Dq, Dv, c = spec.B, spec.N, spec.H, spec.Dq, spec.Dv, spec.scale
    chunk_states = _prepare_chunk_states(spec, impl, host.scoped(profile, "partials"))
    gradients = prepare_gradients(spec, c, c, CHUNK, host.scoped(profile, "apply"), impl)
    intra_backward = intra.prepare_backward(B, N, H, Dq, Dv, CHUNK, c)

    def run(q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv, initial_state=None,
            dinitial_state=None) -> None:
        grads = (dq1, dq2, dk1, dk2, dv)
        P, start = _prefix(chunk_states(k1, v, k2), initial_state, c)
        dS = _suffix(chunk_states(q1, dout, q2), dstate, dinitial_state)
        inter = [torch.empty(g.shape, device=g.device, dtype=torch.float32) for g in grads]
        gradients(q1, q2, k1, k2, v, dout, lambda o: host.slab(P, o, shift=1, first=start),
                  lambda o: host.slab(dS, o), inter)
        P = dS = start = None  # free the chunk states before the intra kernels
        intra_backward(q1, q2, k1, k2, v, dout, inter, grads)

    return run

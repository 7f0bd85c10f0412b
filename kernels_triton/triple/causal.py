"""Causal triple attention, the chunked form (published by nobody before; FAMILIES.md §2):

    Y[n] = c sum_{m <= n} (Q1[n].K1[m]) (Q2[n].K2[m]) V[m]
         = Q1[n] S_<(chunk(n)) Q2[n]           keys of earlier chunks: their state (fp32 sums)
         + c sum_{m in chunk(n), m <= n} ...   keys of its own chunk: intra.py's quadratic form

Forward: `partials` with one split per chunk of CHUNK tokens gives each chunk's state; one scan
over them (host.prepare_scan, PREFIX: in chunk order, a fixed order) writes the exclusive prefix
sum S_<(c) every token of chunk c reads through `apply`, as its bf16 slab (one W slab per chunk),
and the state returned, in one pass; `apply` writes an fp32 "inter" output and intra.py adds the
chunk's own pairs and writes bf16. The state returned is the whole sequence's, as non-causal.
An initial state S0 (already scaled) starts the prefix sums: the chunk states are unscaled (apply
scales by c), so the prefix of chunk k is S0 / c + the sum of chunks before k, and the state
returned S0 + c * the sum of all.
Backward: dQ1, dQ2 read the prefix states as the forward does (a PREFIX scan writes their two
slabs); dK1, dK2, dV read the exclusive suffix sums of dS (tokens of later chunks, plus the
incoming dstate: a SUFFIX scan, in reverse chunk order, writes their three slabs and S0's
gradient, the whole sum of dS plus dstate: every token reads S0), then intra.py adds the pairs
inside each chunk. Bitwise repeatable (no atomics).

Extra memory: the per-chunk states, cdiv(N, CHUNK) * B * H * Dq^2 * Dv fp32, and their bf16 slabs
(the forward one; the backward the dQ applies' two, then the dK / dV applies' three: the chunk
states of one scan and the slabs of the other are never held at once), plus an fp32 copy of each
output ([B, N, H, D]).
"""
from __future__ import annotations

import torch

from kernels_triton.triple import host, intra

# Tokens per chunk: the intra part costs ~CHUNK/2 pairs a token, the states N/CHUNK of Dq^2 Dv.
# Measured at N 524,288 (docs/perf-triple.md): 2048 best at Dq = Dv = 32 and 64.
CHUNK = 2048


def n_chunks(N: int) -> int:
    """Chunks of CHUNK tokens in N (one for N = 0: the partials' and scans' shapes)."""
    return max(1, -(-N // CHUNK))


def _prepare_chunk_states(spec, impl, profile: bool = False):
    """run(x1, y, x2) -> each chunk's sum, [B, H, chunks, Dq, Dv, Dq] fp32 (`partials` with one
    split per chunk; impl as in fwd.prepare): (K1, V, K2) and (Q1, dO, Q2) alike."""
    return impl.prepare_partials(spec.B, spec.N, spec.H, spec.Dq, spec.Dv, spec.Dq,
                                 n_chunks(spec.N), split_len=CHUNK, profile=profile)


def prepare_forward(spec, profile: bool | str = False, impl=host):
    """fwd.prepare's launches for a causal `spec`: run(q1, q2, k1, k2, v, out, out_state,
    initial_state=None), its run's arguments."""
    B, N, H, Dq, Dv, c = spec.B, spec.N, spec.H, spec.Dq, spec.Dv, spec.scale
    chunks = n_chunks(N)
    chunk_states = _prepare_chunk_states(spec, impl, host.scoped(profile, "partials"))
    prefix = host.prepare_scan(B * H, Dq, Dv, Dq, host.PREFIX)
    (dims,) = host.apply_dims(Dq, Dv, "fwd")
    apply = impl.prepare_apply(B, N, H, *dims, c, chunk=CHUNK,
                               profile=host.scoped(profile, "apply"))
    intra_forward = intra.prepare_forward(B, N, H, Dq, Dv, CHUNK, c)

    def run(q1, q2, k1, k2, v, out, out_state, initial_state=None) -> None:
        P = chunk_states(k1, v, k2)
        slabs = host.new_slabs((B, H, chunks), ("ikj",), Dq, Dv, Dq, q1.device)
        prefix(P, chunks, c, out_state, slabs, initial_state)  # exclusive prefixes, the state
        del P
        inter = torch.empty(out.shape, device=out.device, dtype=torch.float32)
        apply(q2, q1, slabs.pop("ikj"), inter)  # apply scales by c
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
    chunks = n_chunks(N)
    chunk_states = _prepare_chunk_states(spec, impl, host.scoped(profile, "partials"))
    prefix = host.prepare_scan(B * H, Dq, Dv, Dq, host.PREFIX)
    suffix = host.prepare_scan(B * H, Dq, Dv, Dq, host.SUFFIX)
    gradients = prepare_gradients(spec, c, c, CHUNK, host.scoped(profile, "apply"), impl)
    intra_backward = intra.prepare_backward(B, N, H, Dq, Dv, CHUNK, c)

    def run(q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv, initial_state=None,
            dinitial_state=None) -> None:
        grads = (dq1, dq2, dk1, dk2, dv)
        inter = [torch.empty(g.shape, device=g.device, dtype=torch.float32) for g in grads]
        lead = (B, H, chunks)
        S = host.new_slabs(lead, ("jki", "ijk"), Dq, Dv, Dq, q1.device)
        P = chunk_states(k1, v, k2)
        prefix(P, chunks, c, None, S, initial_state)
        del P
        gradients(q1, q2, k1, k2, v, dout, S.__getitem__, None, inter)  # dQ1, dQ2
        del S
        dS = host.new_slabs(lead, ("jki", "ijk", "ikj"), Dq, Dv, Dq, q1.device)
        P = chunk_states(q1, dout, q2)
        suffix(P, chunks, 1.0, dinitial_state, dS, dstate)
        del P
        gradients(q1, q2, k1, k2, v, dout, None, dS.__getitem__, inter)  # dK1, dK2, dV
        del dS  # free the slabs before the intra kernels
        intra_backward(q1, q2, k1, k2, v, dout, inter, grads)

    return run

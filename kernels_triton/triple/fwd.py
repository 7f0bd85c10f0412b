"""`triton`: the plain-Triton triple-attention forward, two launches of core.py's kernels and a
fixed-order sum between them:

    1. P = partials(K1, V, K2)        the state's split-N partial sums (fp32)
    2. state = scale * sum_s P[s]     (torch, a fixed order: bitwise repeatable)
    3. out = apply(Q2, Q1, W)         W[i, k, j] = bf16(state[i, j, k])

Causal: causal.py's chunked form (the state of earlier chunks, plus each chunk's masked
quadratic form).
"""
from __future__ import annotations

from kernels_triton.triple import host
from kernels_triton.triple.host import supports  # noqa: F401  (this variant's `supports`)


def state(spec, k1, k2, v, out_state, profile: bool = False, impl=host) -> None:
    """out_state [B, H, Dq, Dv, Dq] fp32 = scale * sum_n K1[n] (x) V[n] (x) K2[n]. impl: the
    module whose `partials`, `n_splits` and `apply` compute the contractions (host: plain
    Triton; the TLX variants pass kernels_tlx.triple.contractions)."""
    splits = impl.n_splits(spec.B, spec.H, spec.N, spec.Dq, spec.Dv, spec.Dq, k1.device)
    P = impl.partials(k1, v, k2, splits, profile=profile)
    out_state.copy_(P.sum(2)).mul_(spec.scale)


def launch(spec, q1, q2, k1, k2, v, out, out_state, profile: bool = False, impl=host) -> None:
    """out [B, N, H, Dv] bf16 and out_state [B, H, Dq, Dv, Dq] fp32 from the five inputs (bf16,
    contiguous); impl as in `state`."""
    if spec.causal:
        from kernels_triton.triple import causal
        causal.forward(spec, q1, q2, k1, k2, v, out, out_state, profile, impl)
        return
    state(spec, k1, k2, v, out_state, profile, impl)
    impl.apply(q2, q1, host.slab(out_state, "ikj"), out, 1.0, profile=profile)


def compile_configs():
    from kernels_triton.triple import causal, intra
    return host.compile_configs(causal.CHUNK) + intra.compile_configs()

"""`triton`: the plain-Triton triple-attention backward. dS is a `partials` launch on (Q1, dO, Q2)
summed in a fixed order with the incoming dstate by the forward's state kernel (which writes dS's
three slabs in the same pass, host.prepare_state; S's two are one more pass, host.prepare_slabs);
each input gradient is one `apply` launch,
its outer product built on the fly (FAMILIES.md §2's contractions, each a GEMM):

    dQ1[n, i] =     sum_{j,k} (Q2[n, k] dO[n, j]) S[i, j, k]     apply(Q2, dO, S as [j, k, i])
    dQ2[n, k] =     sum_{i,j} (dO[n, j] Q1[n, i]) S[i, j, k]     apply(dO, Q1, S as [i, j, k])
    dK1[n, i] = c * sum_{j,k} (K2[n, k] V[n, j])  dS[i, j, k]    apply(K2, V,  dS as [j, k, i])
    dK2[n, k] = c * sum_{i,j} (V[n, j] K1[n, i])  dS[i, j, k]    apply(V,  K1, dS as [i, j, k])
    dV[n, j]  = c * sum_{i,k} (K2[n, k] K1[n, i]) dS[i, j, k]    apply(K2, K1, dS as [i, k, j])

Six GEMMs of 2 N Dq^2 Dv FLOPs each against the four the useful-FLOP count credits (T and U of
FAMILIES.md are folded into the gradients' GEMMs). Every sum in a fixed order: bitwise repeatable.
With an initial state (the forward's S holds it, so the five gradients read it already), its
gradient is dS itself: every token reads it and the returned state holds it. Causal: causal.py.
Short (N <= short.longest(spec, "bwd"); causal too) with the state unused and no initial state: the
quadratic form's backward, two launches (short.py).
"""
from __future__ import annotations

import torch

from kernels_triton.triple import host, short
from kernels_triton.triple.host import supports  # noqa: F401  (this variant's `supports`)


def prepare_gradients(spec, c_S: float, c_dS: float, chunk: int = 0, profile: bool = False,
                      impl=host):
    """The five applies above, made once: run(q1, q2, k1, k2, v, dout, S_slab, dS_slab, grads)
    writes grads (dq1, dq2, dk1, dk2, dv: bf16, or fp32 with chunk > 0). S_slab(order) and
    dS_slab(order) give the bf16 slabs (`apply`'s W) of S and dS; None skips the applies that
    read it (causal.py runs the two halves apart); c_S and c_dS scale the applies that read
    them; chunk > 0: one slab per chunk (causal.py). impl as in fwd.prepare."""
    B, N, H, Dq, Dv = spec.B, spec.N, spec.H, spec.Dq, spec.Dv
    applies = [impl.prepare_apply(B, N, H, dx, dy, do, c, chunk, profile)
               for (dx, dy, do), c in zip(host.apply_dims(Dq, Dv, "bwd"),
                                          (c_S, c_S, c_dS, c_dS, c_dS))]

    def run(q1, q2, k1, k2, v, dout, S_slab, dS_slab, grads) -> None:
        for apply, x, y, w, order, g in zip(applies, (q2, dout, k2, v, k2), (dout, q1, v, k1, k1),
                                            (S_slab, S_slab, dS_slab, dS_slab, dS_slab),
                                            ("jki", "ijk", "jki", "ijk", "ikj"), grads):
            if w is not None:
                apply(x, y, w(order), g)

    return run


def prepare(spec, profile: bool | str = False, impl=host):
    """The launches of `spec`, made once: run(q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2,
    dk1, dk2, dv, initial_state=None, dinitial_state=None) writes the five input gradients
    (bf16, the inputs' shapes) given the forward's state and the incoming dout (and dstate, or
    None), and with an initial_state its gradient into dinitial_state (fp32). dS = sum_n Q1[n]
    (x) dO[n] (x) Q2[n] (+ dstate); impl as in fwd.prepare."""
    if spec.causal:
        from kernels_triton.triple import causal
        general = causal.prepare_backward(spec, profile, impl)
        return short.backward(spec, general) if short.takes(spec, "bwd") else general
    B, N, H, Dq, Dv = spec.B, spec.N, spec.H, spec.Dq, spec.Dv
    splits = impl.n_splits(B, N, H, Dq, Dv, Dq)
    partials = impl.prepare_partials(B, N, H, Dq, Dv, Dq, splits,
                                     profile=host.scoped(profile, "partials"))
    gradients = prepare_gradients(spec, 1.0, spec.scale, profile=host.scoped(profile, "apply"),
                                  impl=impl)
    # dS = dstate + the partials' sum and its three slabs, in one pass (sum, add, slabs); S's
    # two slabs in another
    dS_of = host.prepare_state(B, H, Dq, Dv, Dq, splits, 1.0, orders=("jki", "ijk", "ikj"))
    S_slabs = host.prepare_slabs(B, H, Dq, Dv, Dq, ("jki", "ijk"))

    def run(q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv, initial_state=None,
            dinitial_state=None) -> None:
        # dS is the initial state's gradient: written there where there is one
        dS = dinitial_state if dinitial_state is not None else torch.empty_like(state)
        dS_slabs = dS_of(partials(q1, dout, q2), dS, dstate)
        gradients(q1, q2, k1, k2, v, dout, S_slabs(state).__getitem__, dS_slabs.__getitem__,
                  (dq1, dq2, dk1, dk2, dv))

    return short.backward(spec, run) if short.takes(spec, "bwd") else run


def launch(spec, q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv,
           initial_state=None, dinitial_state=None, profile: bool | str = False) -> None:
    prepare(spec, profile)(q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv,
                           initial_state, dinitial_state)


def profiled_kernels(spec) -> dict[str, int]:
    return host.profiled_kernels(spec, "bwd")


def compile_configs():
    from kernels_triton.triple import causal, intra
    return host.compile_configs(causal.CHUNK) + intra.compile_configs() + short.compile_configs()

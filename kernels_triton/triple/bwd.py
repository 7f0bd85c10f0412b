"""`triton`: the plain-Triton triple-attention backward. dS is a `partials` launch on (Q1, dO, Q2)
summed in a fixed order (plus the incoming dstate); each input gradient is one `apply` launch,
its outer product built on the fly (FAMILIES.md §2's contractions, each a GEMM):

    dQ1[n, i] =     sum_{j,k} (Q2[n, k] dO[n, j]) S[i, j, k]     apply(Q2, dO, S as [j, k, i])
    dQ2[n, k] =     sum_{i,j} (dO[n, j] Q1[n, i]) S[i, j, k]     apply(dO, Q1, S as [i, j, k])
    dK1[n, i] = c * sum_{j,k} (K2[n, k] V[n, j])  dS[i, j, k]    apply(K2, V,  dS as [j, k, i])
    dK2[n, k] = c * sum_{i,j} (V[n, j] K1[n, i])  dS[i, j, k]    apply(V,  K1, dS as [i, j, k])
    dV[n, j]  = c * sum_{i,k} (K2[n, k] K1[n, i]) dS[i, j, k]    apply(K2, K1, dS as [i, k, j])

Six GEMMs of 2 N Dq^2 Dv FLOPs each against the four the useful-FLOP count credits (T and U of
FAMILIES.md are folded into the gradients' GEMMs). Every sum in a fixed order: bitwise repeatable.
Causal: causal.py.
"""
from __future__ import annotations

from kernels_triton.triple import host
from kernels_triton.triple.host import supports  # noqa: F401  (this variant's `supports`)


def grad_state(spec, q1, q2, dout, dstate, profile: bool = False, impl=host):
    """dS [B, H, Dq, Dv, Dq] fp32 = sum_n Q1[n] (x) dO[n] (x) Q2[n] (+ dstate); impl as in
    fwd.state."""
    splits = impl.n_splits(spec.B, spec.H, spec.N, spec.Dq, spec.Dv, spec.Dq, q1.device)
    dS = impl.partials(q1, dout, q2, splits, profile=profile).sum(2)
    return dS if dstate is None else dS.add_(dstate)


def gradients(q1, q2, k1, k2, v, dout, S_slab, dS_slab, grads, c_S: float, c_dS: float,
              chunk: int = 0, profile: bool = False, impl=host) -> None:
    """The five applies above into grads (dq1, dq2, dk1, dk2, dv). S_slab(order) and
    dS_slab(order) give the bf16 slabs (host.slab) of S and dS, made one at a time as each apply
    needs them; c_S and c_dS scale the applies that read them; chunk > 0: one slab per chunk
    (causal.py)."""
    dq1, dq2, dk1, dk2, dv = grads
    for x, y, w, order, g, scale in ((q2, dout, S_slab, "jki", dq1, c_S),
                                     (dout, q1, S_slab, "ijk", dq2, c_S),
                                     (k2, v, dS_slab, "jki", dk1, c_dS),
                                     (v, k1, dS_slab, "ijk", dk2, c_dS),
                                     (k2, k1, dS_slab, "ikj", dv, c_dS)):
        impl.apply(x, y, w(order), g, scale, chunk=chunk, profile=profile)


def launch(spec, q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv,
           profile: bool = False, impl=host) -> None:
    """The five input gradients (bf16, the inputs' shapes) given the forward's state and the
    incoming dout (and dstate, or None); impl as in fwd.state."""
    grads = (dq1, dq2, dk1, dk2, dv)
    if spec.causal:
        from kernels_triton.triple import causal
        causal.backward(spec, q1, q2, k1, k2, v, dout, dstate, grads, profile, impl)
        return
    dS = grad_state(spec, q1, q2, dout, dstate, profile, impl)
    gradients(q1, q2, k1, k2, v, dout, lambda o: host.slab(state, o), lambda o: host.slab(dS, o),
              grads, 1.0, spec.scale, profile=profile, impl=impl)


def compile_configs():
    from kernels_triton.triple import causal, intra
    return host.compile_configs(causal.CHUNK) + intra.compile_configs()

"""`triton`: the plain-Triton triple-attention forward, two launches of core.py's kernels and a
fixed-order sum between them:

    1. P = partials(K1, V, K2)        the state's split-N partial sums (fp32)
    2. state = initial_state + scale * sum_s P[s]     (core.scan_kernel, a fixed order:
       bitwise repeatable; no initial_state: 0), W[i, k, j] = bf16(state[i, j, k]) in the
       same pass
    3. out = apply(Q2, Q1, W)

Short sequences (N <= short.longest(spec): the output by the quadratic form; causal or not, any
variant): short.py, two or three launches.

Causal: causal.py's chunked form (the state of earlier chunks, plus each chunk's masked
quadratic form).
"""
from __future__ import annotations

from kernels_triton.triple import host, short
from kernels_triton.triple.host import supports  # noqa: F401  (this variant's `supports`)


def prepare(spec, profile: bool | str = False, impl=host):
    """The launches of `spec`, made once: run(q1, q2, k1, k2, v, out, out_state,
    initial_state=None) writes out [B, N, H, Dv] bf16 and out_state [B, H, Dq, Dv, Dq] fp32 =
    initial_state + scale * sum_n K1[n] (x) V[n] (x) K2[n] from the five inputs (bf16,
    contiguous; initial_state fp32, contiguous, or None: 0). impl: the module whose `n_splits`,
    `prepare_partials` and `prepare_apply` make the contractions (host: plain Triton; the TLX
    variants pass kernels_tlx.triple.contractions). profile: True, or one name of host.KERNELS
    (a trace samples one kernel's warps at a time): the Proton-scoped copies."""
    if spec.causal:
        from kernels_triton.triple import causal
        general = causal.prepare_forward(spec, profile, impl)
    else:
        general = _prepare(spec, profile, impl)
    return short.forward(spec, impl, general, profile) if short.takes(spec) else general


def _prepare(spec, profile, impl):
    """The non-causal form's launches (prepare's, beyond the short form's N)."""
    state = host.prepare_split_state(spec, impl, host.scoped(profile, "partials"))
    (dims,) = host.apply_dims(spec.Dq, spec.Dv, "fwd")
    apply = impl.prepare_apply(spec.B, spec.N, spec.H, *dims, 1.0,
                               profile=host.scoped(profile, "apply"))

    def run(q1, q2, k1, k2, v, out, out_state, initial_state=None) -> None:
        apply(q2, q1, state(k1, v, k2, out_state, initial_state), out)

    return run


def launch(spec, q1, q2, k1, k2, v, out, out_state, initial_state=None,
           profile: bool | str = False) -> None:
    prepare(spec, profile)(q1, q2, k1, k2, v, out, out_state, initial_state)


def profiled_kernels(spec) -> dict[str, int]:
    return host.profiled_kernels(spec, "fwd")


def compile_configs():
    """The contractions', the causal intra-chunk kernels' and the decoding step's."""
    from kernels_triton.triple import causal, intra, step, varlen
    return (host.compile_configs(causal.CHUNK) + intra.compile_configs()
            + short.compile_configs() + step.compile_configs()
            + varlen.compile_configs(host))

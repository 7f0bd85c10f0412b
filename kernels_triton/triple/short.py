"""The short passes (N <= longest(spec, pass_): causal to 4096 at Dq, Dv >= 64, to one chunk
(2048) at D 32; non-causal at Dq, Dv >= 64 to 16 D forward, 32 D backward, at most 4096; at D 32
to ONE_PASS_N = 512; every variant):
the forward in two or three launches where the general form takes four (fwd.py) or more
(causal.py), and the backward, with the state unused and no initial state, in two where bwd.py
takes nine (`backward`); each cheaper on the GPU there too.

    1. S = initial_state + c sum_n K1[n] (x) V[n] (x) K2[n]: to ONE_PASS_N core.partials_kernel
       over one split, the scan's sum, scale and initial state in its epilogue (bitwise the
       split form's result at one split), with an initial state (non-causal) also the bf16 slab
       W[i, k, j] = S[i, j, k]; past it the split form's partials and one scan (no slab)
    2. out, without an initial state: the quadratic form
           out[n] = c sum_{m (<= n, causal)} (Q1[n].K1[m]) (Q2[n].K2[m]) V[m]
       (intra.py's forward kernel over one chunk of every row: N^2 (4 Dq + 2 Dv) FLOPs a head,
       half that causal, against apply's 2 N Dq^2 Dv, over B H cdiv(N, 128) programs where
       apply's each walk the Dq slabs of W in order); with one, non-causal to ONE_PASS_N
       apply(Q2, Q1, W) as in fwd.py, else the general form (the initial state's part has no
       quadratic form).

Why: at N <= 512 a call's kernels take a few to a few tens of microseconds and each launch and
allocation saved is ~5-8 of host time; the one-pass state and the quadratic output measured
faster on the GPU than the split form's partials, scan and apply at every shape up to 512
(docs/perf-triple-short.md, first round), the one-pass state slower from 768 on where B H is small
(one program walks every token). The quadratic output and gradients stay ahead of `apply`'s
walks to the lengths `longest` gives (second and third rounds: forward 0.48-0.87x, backward
0.07-0.75x the general form's GPU time where taken; left out where it loses or wins only at some
B H: D 32 non-causal past 512, 1.06-2.8x; D 64 non-causal past 2048, forward 1.26-1.55x,
backward 0.77-1.31x).
"""
from __future__ import annotations

import torch
import triton

from altattn.triple.spec import TripleSpec
from kernels_triton.triple import causal, host, intra

ONE_PASS_N = 512  # the longest sequence whose state takes one launch (step 1)
LONGEST_N = 4096  # the quadratic form's longest at Dq, Dv >= 64 (measured to here)


def longest(spec, pass_: str = "fwd") -> int:
    """The longest N whose output ("fwd") or gradients ("bwd") take the quadratic form
    (measured: docs/perf-triple-short.md, second round to 2048, third round to 4096). Causal:
    LONGEST_N at Dq, Dv >= 64, one chunk (causal.CHUNK) at D 32 (there the chunked form's other
    parts add nothing). Non-causal at Dq, Dv >= 64: 16 min(Dq, Dv) (forward) or 32 min(Dq, Dv)
    (backward), at most LONGEST_N; at D 32, ONE_PASS_N."""
    d = min(spec.Dq, spec.Dv)
    if spec.causal:
        return LONGEST_N if d >= 64 else causal.CHUNK
    if d < 64:
        return ONE_PASS_N
    return min(LONGEST_N, (16 if pass_ == "fwd" else 32) * d)


def takes(spec, pass_: str = "fwd") -> bool:
    """Whether `spec`'s pass ("fwd" or "bwd") runs here: N <= longest(spec, pass_)."""
    return spec.N <= longest(spec, pass_)


def prepare_state(B: int, N: int, H: int, d1: int, dy: int, d2: int, c: float,
                  slab: bool = False, profile: bool = False):
    """Step 1, made once: run(x1, y, x2, S, S0=None) writes S [B, H, D1, DY, D2] fp32 = S0 +
    c * sum_n x1[n, i] y[n, j] x2[n, k] (S0 None: 0) and returns its bf16 slab in order "ikj"
    where `slab`, else None."""
    programs = B * H * host.split_blocks(d1, dy, d2)
    kernels = {s0: host.partials_launch(programs, H, d1, dy, d2, profile)
               for s0 in (False, True)}  # without and with S0 (Kernel: one set of arguments)
    shape, split_len, c = host.slab_shape((B, H), "ikj", d1, dy, d2), max(N, 1), float(c)

    def run(x1, y, x2, S, S0=None):
        w = torch.empty(shape, device=x1.device, dtype=torch.bfloat16) if slab else None
        if S0 is None:
            kernels[False](x1, y, x2, S, N, split_len, 1, W_IKJ=w, c=c)
        else:
            kernels[True](x1, y, x2, S, N, split_len, 1, W_IKJ=w, S0=S0, c=c)
        return w

    return run


def _one_chunk(N: int) -> int:
    """The chunk the quadratic kernels get: N rounded up to 128, a multiple of every tile (one
    chunk of every row)."""
    return triton.cdiv(max(N, 1), 128) * 128


def prepare_out(B: int, N: int, H: int, Dq: int, Dv: int, c: float, causal: bool = False):
    """Step 2 without an initial state, made once: run(q1, q2, k1, k2, v, out) writes out =
    c sum_m (q1[n].k1[m]) (q2[n].k2[m]) v[m] over all N keys (causal: m <= n): intra.py's
    forward over one chunk, no inter."""
    intra_fwd = intra.prepare_forward(B, N, H, Dq, Dv, _one_chunk(N), c, causal=causal)

    def run(q1, q2, k1, k2, v, out) -> None:
        intra_fwd(q1, q2, k1, k2, v, None, out)

    return run


def prepare_grads(B: int, N: int, H: int, Dq: int, Dv: int, c: float, causal: bool = False):
    """The backward of step 2's quadratic form, made once: run(q1, q2, k1, k2, v, dout, grads)
    writes grads (dq1, dq2, dk1, dk2, dv; bf16) of out = c sum_m (q1[n].k1[m]) (q2[n].k2[m])
    v[m] over all N keys (causal: m <= n) given dout: intra.py's backward over one chunk, no
    inter (two launches). With the state also used (dstate) or an initial state, the general
    form."""
    intra_bwd = intra.prepare_backward(B, N, H, Dq, Dv, _one_chunk(N), c, causal=causal)

    def run(q1, q2, k1, k2, v, dout, grads) -> None:
        intra_bwd(q1, q2, k1, k2, v, dout, None, grads)

    return run


def backward(spec, general):
    """bwd.prepare's run for a spec this form `takes`: without dstate and initial state (the
    state unused, as in training on `out`), `prepare_grads`; else `general`, bwd.py's."""
    grads = prepare_grads(spec.B, spec.N, spec.H, spec.Dq, spec.Dv, spec.scale, spec.causal)

    def run(q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv, initial_state=None,
            dinitial_state=None) -> None:
        if dstate is None and initial_state is None:
            grads(q1, q2, k1, k2, v, dout, (dq1, dq2, dk1, dk2, dv))
        else:
            general(q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv,
                    initial_state, dinitial_state)

    return run


def forward(spec, impl, general, profile: bool | str = False):
    """fwd.prepare's run for a spec this form `takes`: steps 1 (one launch to ONE_PASS_N, then
    the split form's partials and scan) and 2; with an initial state, non-causal to ONE_PASS_N:
    step 1 with its slab, then `apply` (impl's); else `general` (fwd.py's, or causal.py's
    chunked form, whose chunks read the initial state)."""
    B, N, H, Dq, Dv, scale = spec.B, spec.N, spec.H, spec.Dq, spec.Dv, spec.scale
    part = host.scoped(profile, "partials")
    one = N <= ONE_PASS_N
    state = (prepare_state(B, N, H, Dq, Dv, Dq, scale, profile=part) if one
             else host.prepare_split_state(spec, impl, part, orders=()))
    out_q = prepare_out(B, N, H, Dq, Dv, scale, spec.causal)
    if spec.causal or not one:
        with_init = general
    else:
        state_w = prepare_state(B, N, H, Dq, Dv, Dq, scale, slab=True, profile=part)
        (dims,) = host.apply_dims(Dq, Dv, "fwd")
        apply = impl.prepare_apply(B, N, H, *dims, 1.0, profile=host.scoped(profile, "apply"))

        def with_init(q1, q2, k1, k2, v, out, out_state, initial_state) -> None:
            apply(q2, q1, state_w(k1, v, k2, out_state, initial_state), out)

    def run(q1, q2, k1, k2, v, out, out_state, initial_state=None) -> None:
        if initial_state is None:
            state(k1, v, k2, out_state)
            out_q(q1, q2, k1, k2, v, out)
        else:
            with_init(q1, q2, k1, k2, v, out, out_state, initial_state)

    return run


def compile_configs() -> list:
    """Step 1 (with and without S0 and the slab) at the contractions' dims and step 2 at every
    (Dq, Dv) (recorded on meta tensors, H and N the compile configs')."""
    from kernels_triton.launch import compile_configs as configs_of
    from kernels_triton.launch import meta
    N, H, out = host.COMPILE_N, host.COMPILE_H, []
    f32 = torch.float32
    for dq, dv in ((32, 32), (64, 64), (128, 128), (64, 32)):
        S = meta(1, H, dq, dv, dq, dtype=f32)
        for slab, s0 in ((False, None), (True, None), (True, S)):
            tag = ("_slab" if slab else "") + ("_S0" if s0 is not None else "")
            out += configs_of(lambda sl=slab: prepare_state(1, N, H, dq, dv, dq, 1.0, slab=sl),
                              (host.tokens(dq), host.tokens(dv), host.tokens(dq), S, s0),
                              lambda launch, n=f"short_state_D{dq}x{dv}x{dq}{tag}": n)
        # past ONE_PASS_N: the scan of the split partials without a slab (the partials: host's)
        out += configs_of(lambda d=(dq, dv): host.prepare_split_state(TripleSpec(1, N, H, *d),
                                                                      host, orders=()),
                          (host.tokens(dq), host.tokens(dv), host.tokens(dq), S),
                          lambda launch, n=f"short_scan_D{dq}x{dv}x{dq}": (
                              n if launch.fn is host.scan_kernel else None))
    for dq in intra.SUPPORTED_D:
        for dv in intra.SUPPORTED_D:
            q, v = host.tokens(dq), host.tokens(dv)
            for is_causal, tag in ((False, ""), (True, "_causal")):
                out += configs_of(lambda d=(dq, dv), c=is_causal: prepare_out(1, N, H, *d, 1.0, c),
                                  (q, q, q, q, v, v),
                                  lambda launch, n=f"short_out_Dq{dq}_Dv{dv}{tag}": n)
                out += configs_of(
                    lambda d=(dq, dv), c=is_causal: prepare_grads(1, N, H, *d, 1.0, c),
                    (q, q, q, q, v, v, (q, q, q, q, v)),
                    lambda launch, d=(dq, dv), t=tag: (f"short_{intra.KERNELS[launch.fn]}_"
                                                       f"Dq{d[0]}_Dv{d[1]}{t}"))
    return out

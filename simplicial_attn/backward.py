"""The backward entry point: validate -> problem spec -> pick the backward variant -> launch ->
(dq, dk1, dk2, dv1, dv2). `simplicial_attn.attention`'s autograd calls it; so does bench/bwd.py."""
from __future__ import annotations

import torch

from . import registry
from .launcher import _dense_aligned, pick, select
from .spec import ProblemSpec, check_bool, validate, validate_aux


def check_variant(variant: str, spec: ProblemSpec, deterministic: bool = False) -> registry.Variant:
    """The backward variant `variant` ("auto" or a name) resolves to for `spec`, or raise
    ValueError (an unknown name, a shape no backward variant takes, or with deterministic=True
    a variant that is not bitwise repeatable). No device check."""
    return pick(spec, variant, True, "bwd", deterministic)


def backward(dout, dlse, q, k1, k2, v1, v2, out, lse, w1, w2, *, sm_scale=None,
             variant: str = "auto", profile: bool | str = False, form: str = "trilinear",
             deterministic: bool = False):
    """Gradients of 2-simplicial attention with respect to q, k1, k2, v1, v2 (bf16, their shapes).

    dout [B, N, Hq, D] (any layout and floating dtype, cast to bf16) and dlse [B, Hq, N] (or None)
    are the incoming gradients of out and lse; out [B, N, Hq, D] and lse [B, Hq, N] are what the
    forward returned for these inputs (cast to bf16 and fp32). Every argument is checked (shape
    errors first, then the device) before anything is launched. "auto" takes the fastest variant
    that takes the shape; `tlx_pairs` (taken at G >= 16, D = 128) reduce-adds its sums in
    the hardware's order, so its gradients may differ in the last bits from run to run:
    deterministic=True takes the fastest bitwise-repeatable one (`tlx_ws` at G >= 64, `triton`
    below: neither has atomics). profile=True runs the kernels' Proton-scoped copies; profile=NAME
    only that kernel's (a key of the variant's `profiled_kernels`,
    profiling/trace_capture.py). form: as `forward`'s."""
    check_bool("deterministic", deterministic)
    if not isinstance(variant, str):
        raise TypeError(f"variant must be a str, got {type(variant).__name__}")
    spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, form=form)
    rows, lses = (spec.B, spec.N, spec.Hq, spec.D), (spec.B, spec.Hq, spec.N)
    aux = [("out", out, rows, "[B, N, Hq, D]"), ("lse", lse, lses, "[B, Hq, N]"),
           ("dout", dout, rows, "[B, N, Hq, D]")]
    if dlse is not None:
        aux.append(("dlse", dlse, lses, "[B, Hq, N]"))
    for name, t, shape, layout in aux:
        validate_aux(name, t, shape, layout, q.device)
    v = select(spec, variant, q.device, "bwd", deterministic)
    dout = _dense_aligned(dout.to(torch.bfloat16))
    if dlse is not None:
        dlse = _dense_aligned(dlse.float())
    grads = [torch.empty(t.shape, dtype=torch.bfloat16, device=q.device)
             for t in (q, k1, k2, v1, v2)]
    if grads[0].numel() == 0 or grads[1].numel() == 0:
        return tuple(g.zero_() for g in grads)
    if spec.swapped:  # the kernel sees w1 <= w2: exchange the pairs, and their gradients
        k1, v1, k2, v2 = k2, v2, k1, v1
    dq, dk1, dk2, dv1, dv2 = grads
    if spec.swapped:
        dk1, dv1, dk2, dv2 = dk2, dv2, dk1, dv1
    q, k1, k2, v1, v2 = (_dense_aligned(t) for t in (q, k1, k2, v1, v2))
    out = _dense_aligned(out.to(torch.bfloat16))
    lse = _dense_aligned(lse.float())
    with torch.cuda.device(q.device):
        v.load().launch(spec, q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2,
                        profile=profile)
    return tuple(grads)

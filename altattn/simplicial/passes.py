"""2-simplicial attention's two passes on the one launcher (altattn.launcher.run): what each takes,
checks, allocates and hands its kernels, and the public entry points `forward` and `backward`.

The kernels see w1 <= w2: when the caller's w1 > w2, the pairs (k1, v1) and (k2, v2) are exchanged
on the way in (and the backward's gradients on the way out); `ProblemSpec.swapped` records it.
"""
from __future__ import annotations

import torch

from .. import launcher
from ..checks import dense_aligned, output, validate_aux
from ..launcher import Call
from .spec import NAMES, validate

FAMILY = "simplicial"
GRADS = ("dq", "dk1", "dk2", "dv1", "dv2")


def _kernel_order(spec, t: dict, names=NAMES) -> list:
    """The tensors `names` in the kernels' order: the pairs exchanged when spec.swapped."""
    q, k1, k2, v1, v2 = (t[n] for n in names)
    if spec.swapped:
        k1, v1, k2, v2 = k2, v2, k1, v1
    return [q, k1, k2, v1, v2]


class Forward:
    """forward(q, k1, k2, v1, v2, w1, w2, sm_scale=None, form="trilinear") -> (out, lse):
    out [B, N, Hq, D] bf16 and lse [B, Hq, N] fp32."""

    outputs = ("out", "lse")

    @staticmethod
    def validate(q, k1, k2, v1, v2, w1, w2, sm_scale=None, form="trilinear") -> Call:
        spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, form=form)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k1, k2, v1, v2)):
            raise ValueError("altattn.simplicial.forward is forward-only and the inputs require "
                             "grad: use altattn.simplicial_attention (differentiable), or call "
                             "forward under torch.no_grad() or with detached tensors")
        return Forward.bind(spec, q, k1, k2, v1, v2, w1, w2, sm_scale, form)

    @staticmethod
    def bind(spec, q, k1, k2, v1, v2, w1, w2, sm_scale=None, form="trilinear") -> Call:
        """The call of arguments `spec` was validated from (no checks)."""
        return Call(spec, q.device, {"q": q, "k1": k1, "k2": k2, "v1": v1, "v2": v2})

    @staticmethod
    def allocate(call: Call, given: dict) -> dict:
        s, dev = call.spec, call.device
        return {"out": output(given.get("out"), "out", (s.B, s.N, s.Hq, s.D), torch.bfloat16, dev),
                "lse": output(given.get("lse"), "lse", (s.B, s.Hq, s.N), torch.float32, dev)}

    @staticmethod
    def kernel_args(call: Call, outs: dict):
        if outs["out"].numel() == 0:
            return None
        x = [dense_aligned(t) for t in _kernel_order(call.spec, call.tensors)]
        return (*x, outs["out"], outs["lse"])

    @staticmethod
    def result(call: Call, outs: dict) -> tuple:
        return outs["out"], outs["lse"]


class Backward:
    """backward(dout, dlse, q, k1, k2, v1, v2, out, lse, w1, w2, sm_scale=None,
    form="trilinear") -> (dq, dk1, dk2, dv1, dv2), bf16, the inputs' shapes."""

    outputs = GRADS
    optional = ("dlse",)  # None: lse unused (plans differ)

    @staticmethod
    def validate(dout, dlse, q, k1, k2, v1, v2, out, lse, w1, w2, sm_scale=None,
                 form="trilinear") -> Call:
        spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, form=form)
        rows, lses = (spec.B, spec.N, spec.Hq, spec.D), (spec.B, spec.Hq, spec.N)
        aux = [("out", out, rows, "[B, N, Hq, D]"), ("lse", lse, lses, "[B, Hq, N]"),
               ("dout", dout, rows, "[B, N, Hq, D]")]
        if dlse is not None:
            aux.append(("dlse", dlse, lses, "[B, Hq, N]"))
        for name, t, shape, layout in aux:
            validate_aux(name, t, shape, layout, q.device, ", ".join(NAMES))
        return Backward.bind(spec, dout, dlse, q, k1, k2, v1, v2, out, lse, w1, w2, sm_scale,
                             form)

    @staticmethod
    def bind(spec, dout, dlse, q, k1, k2, v1, v2, out, lse, w1, w2, sm_scale=None,
             form="trilinear") -> Call:
        """The call of arguments `spec` was validated from (no checks)."""
        return Call(spec, q.device, {"q": q, "k1": k1, "k2": k2, "v1": v1, "v2": v2, "out": out,
                                     "lse": lse, "dout": dout, "dlse": dlse})

    @staticmethod
    def allocate(call: Call, given: dict) -> dict:
        return {g: output(given.get(g), g, tuple(call.tensors[n].shape), torch.bfloat16,
                          call.device) for g, n in zip(GRADS, NAMES)}

    @staticmethod
    def kernel_args(call: Call, outs: dict):
        if outs["dq"].numel() == 0 or outs["dk1"].numel() == 0:
            for g in outs.values():
                g.zero_()
            return None
        t, spec = call.tensors, call.spec
        x = [dense_aligned(v) for v in _kernel_order(spec, t)]
        grads = _kernel_order(spec, outs, GRADS)  # the gradients of the exchanged pairs, too
        dlse = None if t["dlse"] is None else dense_aligned(t["dlse"].float())
        return (*x, dense_aligned(t["out"].to(torch.bfloat16)), dense_aligned(t["lse"].float()),
                dense_aligned(t["dout"].to(torch.bfloat16)), dlse, *grads)

    @staticmethod
    def result(call: Call, outs: dict) -> tuple:
        return tuple(outs[g] for g in GRADS)


@launcher.remembered
def forward(q, k1, k2, v1, v2, w1, w2, *, variant: str = "auto", sm_scale=None,
            form: str = "trilinear", out=None, lse=None, profile: bool = False):
    """2-simplicial attention forward on the GPU, no autograd.

    q: [B, N, Hq, D], k1, k2, v1, v2: [B, N, Hk, D], bfloat16 CUDA tensors; w1, w2 >= 1 window
    sizes (w1 > w2 allowed). Non-contiguous inputs, or ones whose start is not 16-byte aligned,
    are copied first (correct, costs a copy). Returns out [B, N, Hq, D] bfloat16 and lse
    [B, Hq, N] float32 (natural log); `out`/`lse` to write into (contiguous, those shapes and
    dtypes). Inputs that require grad (with grad mode on) are refused rather than silently cut
    off: `altattn.simplicial_attention` is differentiable. form: "trilinear" or "det" (the
    determinant form, `reference` states it); "auto" takes the fastest measured variant that
    computes it, and a named variant that does not refuses it with ValueError. profile=True:
    the Proton-scoped kernel (profiling/trace_capture.py).
    """
    return launcher.run(FAMILY, "fwd", q, k1, k2, v1, v2, w1, w2, sm_scale, form,
                        variant=variant, profile=profile, outputs={"out": out, "lse": lse})


@launcher.remembered
def backward(dout, dlse, q, k1, k2, v1, v2, out, lse, w1, w2, *, sm_scale=None,
             variant: str = "auto", profile: bool | str = False, form: str = "trilinear",
             deterministic: bool = False):
    """Gradients of 2-simplicial attention with respect to q, k1, k2, v1, v2 (bf16, their shapes).

    dout [B, N, Hq, D] (any layout and floating dtype, cast to bf16) and dlse [B, Hq, N] (or None)
    are the incoming gradients of out and lse; out [B, N, Hq, D] and lse [B, Hq, N] are what the
    forward returned for these inputs (cast to bf16 and fp32). Every argument is checked (shape
    errors first, then the device) before anything is launched. "auto" takes the fastest variant
    that takes the shape; `tlx_pairs` (taken at G >= 16) reduce-adds its sums in the
    hardware's order, so its gradients may differ in the last bits from run to run:
    deterministic=True takes the fastest bitwise-repeatable one (`tlx_ws` at G >= 64 and
    D = 128, `triton` otherwise: neither has atomics). profile=True runs the kernels'
    Proton-scoped copies; profile=NAME only that kernel's (a key of the variant's
    `profiled_kernels`). form: as `forward`'s."""
    return launcher.run(FAMILY, "bwd", dout, dlse, q, k1, k2, v1, v2, out, lse, w1, w2, sm_scale,
                        form, variant=variant, profile=profile, deterministic=deterministic)

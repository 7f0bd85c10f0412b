"""Triple attention's two passes on the one launcher (altattn.launcher.run): what each takes,
checks, allocates and hands its kernels, and the public entry points `forward` and `backward`.

What a kernel module's `launch(spec, *kernel_args, profile=False)` gets after the spec (every
tensor contiguous with a 16-byte aligned start):
    forward   (q1, q2, k1, k2, v, out, state)
              q1, q2, k1, k2 [B, N, H, Dq] bf16, v [B, N, H, Dv] bf16; out [B, N, H, Dv] bf16 and
              state [B, H, Dq, Dv, Dq] fp32 to write, both uninitialized: the kernel writes every
              element (a kernel that accumulates into state zeroes it first)
    backward  (q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv)
              state [B, H, Dq, Dv, Dq] fp32 (the forward's, whole sequence), dout [B, N, H, Dv]
              bf16, dstate [B, H, Dq, Dv, Dq] fp32 or None (the state unused); the gradients bf16
              with the inputs' shapes, uninitialized
Nothing is launched when B*H == 0 (every tensor empty) or N == 0 (out empty, state zeroed,
gradients empty).
"""
from __future__ import annotations

import torch

from .. import launcher
from ..checks import dense_aligned, output, validate_aux
from ..launcher import Call
from .spec import NAMES, validate

FAMILY = "triple"
GRADS = ("dq1", "dq2", "dk1", "dk2", "dv")
STATE_LAYOUT = "[B, H, Dq, Dv, Dq]"


def _state_shape(s) -> tuple:
    return (s.B, s.H, s.Dq, s.Dv, s.Dq)


class Forward:
    """forward(q1, q2, k1, k2, v, scale=None, causal=False) -> (out, state):
    out [B, N, H, Dv] bf16 and state [B, H, Dq, Dv, Dq] fp32."""

    outputs = ("out", "state")

    @staticmethod
    def validate(q1, q2, k1, k2, v, scale=None, causal=False) -> Call:
        spec = validate(q1, q2, k1, k2, v, scale, causal)
        x = (q1, q2, k1, k2, v)
        if torch.is_grad_enabled() and any(t.requires_grad for t in x):
            raise ValueError("altattn.triple.forward is forward-only and the inputs require "
                             "grad: use altattn.triple_attention (differentiable), or call "
                             "forward under torch.no_grad() or with detached tensors")
        return Forward.bind(spec, *x, scale, causal)

    @staticmethod
    def bind(spec, q1, q2, k1, k2, v, scale=None, causal=False) -> Call:
        """The call of arguments `spec` was validated from (no checks)."""
        return Call(spec, q1.device, {"q1": q1, "q2": q2, "k1": k1, "k2": k2, "v": v})

    @staticmethod
    def allocate(call: Call, given: dict) -> dict:
        s, dev = call.spec, call.device
        return {"out": output(given.get("out"), "out", (s.B, s.N, s.H, s.Dv), torch.bfloat16,
                              dev),
                "state": output(given.get("state"), "state", _state_shape(s), torch.float32,
                                dev)}

    @staticmethod
    def kernel_args(call: Call, outs: dict):
        s = call.spec
        if s.B * s.H == 0:  # every tensor empty
            return None
        if s.N == 0:  # no tokens: out is empty, the state a sum of nothing
            outs["state"].zero_()
            return None
        x = [dense_aligned(call.tensors[n]) for n in NAMES]
        return (*x, outs["out"], outs["state"])

    @staticmethod
    def result(call: Call, outs: dict) -> tuple:
        return outs["out"], outs["state"]


class Backward:
    """backward(dout, dstate, q1, q2, k1, k2, v, state, scale=None, causal=False)
    -> (dq1, dq2, dk1, dk2, dv), bf16, the inputs' shapes."""

    outputs = GRADS
    optional = ("dstate",)  # None: the state unused (plans differ)

    @staticmethod
    def validate(dout, dstate, q1, q2, k1, k2, v, state, scale=None, causal=False) -> Call:
        spec = validate(q1, q2, k1, k2, v, scale, causal)
        inputs = ", ".join(NAMES)
        aux = [("dout", dout, (spec.B, spec.N, spec.H, spec.Dv), "[B, N, H, Dv]"),
               ("state", state, _state_shape(spec), STATE_LAYOUT)]
        if dstate is not None:
            aux.append(("dstate", dstate, _state_shape(spec), STATE_LAYOUT))
        for name, t, shape, layout in aux:
            validate_aux(name, t, shape, layout, q1.device, inputs)
        return Backward.bind(spec, dout, dstate, q1, q2, k1, k2, v, state, scale, causal)

    @staticmethod
    def bind(spec, dout, dstate, q1, q2, k1, k2, v, state, scale=None, causal=False) -> Call:
        """The call of arguments `spec` was validated from (no checks)."""
        return Call(spec, q1.device, {"q1": q1, "q2": q2, "k1": k1, "k2": k2, "v": v,
                                      "state": state, "dout": dout, "dstate": dstate})

    @staticmethod
    def allocate(call: Call, given: dict) -> dict:
        return {g: output(given.get(g), g, tuple(call.tensors[n].shape), torch.bfloat16,
                          call.device) for g, n in zip(GRADS, NAMES)}

    @staticmethod
    def kernel_args(call: Call, outs: dict):
        s = call.spec
        if s.N == 0 or s.B * s.H == 0:  # no tokens: nothing flows (the gradients are empty)
            for g in outs.values():
                g.zero_()
            return None
        t = call.tensors
        x = [dense_aligned(t[n]) for n in NAMES]
        dstate = None if t["dstate"] is None else dense_aligned(t["dstate"].float())
        return (*x, dense_aligned(t["state"].float()), dense_aligned(t["dout"].to(torch.bfloat16)),
                dstate, *(outs[g] for g in GRADS))

    @staticmethod
    def result(call: Call, outs: dict) -> tuple:
        return tuple(outs[g] for g in GRADS)


def forward(q1, q2, k1, k2, v, *, scale=None, causal: bool = False, variant: str = "auto",
            out=None, state=None, profile: bool | str = False):
    """Triple attention forward on the GPU, no autograd.

    q1, q2, k1, k2 [B, N, H, Dq], v [B, N, H, Dv], bf16 CUDA tensors; Dq, Dv in {32, 64, 128}.
    scale c defaults to 1/N (the state is a mean; 1.0 gives the blog's formula). causal: token n
    reads the state of tokens m <= n only. Returns out [B, N, H, Dv] bf16 and state
    [B, H, Dq, Dv, Dq] fp32, S[i, j, k] = c sum_n K1[n, i] V[n, j] K2[n, k] over the whole
    sequence (causal too), into `out` / `state` when given. "auto" takes the fastest registered
    variant for the shape."""
    return launcher.run(FAMILY, "fwd", q1, q2, k1, k2, v, scale, causal, variant=variant,
                        profile=profile, outputs={"out": out, "state": state})


def backward(dout, dstate, q1, q2, k1, k2, v, state, *, scale=None, causal: bool = False,
             variant: str = "auto", deterministic: bool = False, profile: bool | str = False):
    """Gradients of triple attention with respect to q1, q2, k1, k2, v (bf16, their shapes),
    given the incoming gradients dout [B, N, H, Dv] and dstate [B, H, Dq, Dv, Dq] (or None when
    the state is unused) and the state the forward returned for these inputs.
    deterministic=True takes only bitwise repeatable variants. Other arguments as `forward`'s."""
    return launcher.run(FAMILY, "bwd", dout, dstate, q1, q2, k1, k2, v, state, scale, causal,
                        variant=variant, profile=profile, deterministic=deterministic)

"""Triple attention's two passes on the one launcher (altattn.launcher.run): what each takes,
checks, allocates and hands its kernels, and the public entry points `forward` and `backward`.

What a kernel module's `launch(spec, *kernel_args, profile=False)` gets after the spec (every
tensor contiguous with a 16-byte aligned start):
    forward   (q1, q2, k1, k2, v, out, state, initial_state)
              q1, q2, k1, k2 [B, N, H, Dq] bf16, v [B, N, H, Dv] bf16; out [B, N, H, Dv] bf16 and
              state [B, H, Dq, Dv, Dq] fp32 to write, both uninitialized: the kernel writes every
              element (a kernel that accumulates into state zeroes it first); initial_state
              [B, H, Dq, Dv, Dq] fp32 (the sums start from it) or None
    backward  (q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv, initial_state,
               dinitial_state)
              state [B, H, Dq, Dv, Dq] fp32 (the forward's, whole sequence), dout [B, N, H, Dv]
              bf16, dstate [B, H, Dq, Dv, Dq] fp32 or None (the state unused); the gradients bf16
              with the inputs' shapes, uninitialized; initial_state as the forward's, and with it
              dinitial_state [B, H, Dq, Dv, Dq] fp32 to write (both None without one)
Nothing is launched when B*H == 0 (every tensor empty) or N == 0 (out empty, state the initial
state or zeros, gradients empty, dinitial_state dstate or zeros).
"""
from __future__ import annotations

import torch

from .. import launcher
from ..checks import dense_aligned, output, validate_aux
from ..launcher import Call
from .spec import NAMES, STATE_LAYOUT, validate

FAMILY = "triple"
GRADS = ("dq1", "dq2", "dk1", "dk2", "dv")


def _state_shape(s) -> tuple:
    return (s.B, s.H, s.Dq, s.Dv, s.Dq)


def _fp32(t):
    """A state-shaped tensor as the kernels take it (fp32, dense, aligned), or None."""
    return None if t is None else dense_aligned(t.float())


class Forward:
    """forward(q1, q2, k1, k2, v, scale=None, causal=False, initial_state=None) -> (out, state):
    out [B, N, H, Dv] bf16 and state [B, H, Dq, Dv, Dq] fp32."""

    outputs = ("out", "state")
    optional = ("initial_state",)  # None: the sums start from 0 (plans differ)

    @staticmethod
    def validate(q1, q2, k1, k2, v, scale=None, causal=False, initial_state=None) -> Call:
        spec = validate(q1, q2, k1, k2, v, scale, causal, initial_state)
        x = (q1, q2, k1, k2, v, initial_state)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in x):
            raise ValueError("altattn.triple.forward is forward-only and the inputs require "
                             "grad: use altattn.triple_attention (differentiable), or call "
                             "forward under torch.no_grad() or with detached tensors")
        return Forward.bind(spec, q1, q2, k1, k2, v, scale, causal, initial_state)

    @staticmethod
    def bind(spec, q1, q2, k1, k2, v, scale=None, causal=False, initial_state=None) -> Call:
        """The call of arguments `spec` was validated from (no checks)."""
        return Call(spec, q1.device, {"q1": q1, "q2": q2, "k1": k1, "k2": k2, "v": v,
                                      "initial_state": initial_state})

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
        init = call.tensors["initial_state"]
        if s.B * s.H == 0:  # every tensor empty
            return None
        if s.N == 0:  # no tokens: out is empty, the state a sum of nothing
            if init is None:
                outs["state"].zero_()
            else:
                outs["state"].copy_(init)
            return None
        x = [dense_aligned(call.tensors[n]) for n in NAMES]
        return (*x, outs["out"], outs["state"], _fp32(init))

    @staticmethod
    def result(call: Call, outs: dict) -> tuple:
        return outs["out"], outs["state"]


class Backward:
    """backward(dout, dstate, q1, q2, k1, k2, v, state, scale=None, causal=False,
    initial_state=None) -> (dq1, dq2, dk1, dk2, dv), bf16, the inputs' shapes, and with an
    initial_state its gradient dinitial_state [B, H, Dq, Dv, Dq] fp32 as a sixth."""

    outputs = GRADS
    optional = ("dstate", "initial_state")  # None: the state unused; no initial state

    @staticmethod
    def validate(dout, dstate, q1, q2, k1, k2, v, state, scale=None, causal=False,
                 initial_state=None) -> Call:
        spec = validate(q1, q2, k1, k2, v, scale, causal, initial_state)
        inputs = ", ".join(NAMES)
        aux = [("dout", dout, (spec.B, spec.N, spec.H, spec.Dv), "[B, N, H, Dv]"),
               ("state", state, _state_shape(spec), STATE_LAYOUT)]
        if dstate is not None:
            aux.append(("dstate", dstate, _state_shape(spec), STATE_LAYOUT))
        for name, t, shape, layout in aux:
            validate_aux(name, t, shape, layout, q1.device, inputs)
        return Backward.bind(spec, dout, dstate, q1, q2, k1, k2, v, state, scale, causal,
                             initial_state)

    @staticmethod
    def bind(spec, dout, dstate, q1, q2, k1, k2, v, state, scale=None, causal=False,
             initial_state=None) -> Call:
        """The call of arguments `spec` was validated from (no checks)."""
        return Call(spec, q1.device, {"q1": q1, "q2": q2, "k1": k1, "k2": k2, "v": v,
                                      "state": state, "dout": dout, "dstate": dstate,
                                      "initial_state": initial_state})

    @staticmethod
    def allocate(call: Call, given: dict) -> dict:
        outs = {g: output(given.get(g), g, tuple(call.tensors[n].shape), torch.bfloat16,
                          call.device) for g, n in zip(GRADS, NAMES)}
        if call.tensors["initial_state"] is not None:
            outs["dinitial_state"] = output(given.get("dinitial_state"), "dinitial_state",
                                            _state_shape(call.spec), torch.float32, call.device)
        return outs

    @staticmethod
    def kernel_args(call: Call, outs: dict):
        s = call.spec
        t = call.tensors
        dinit = outs.get("dinitial_state")
        if s.N == 0 or s.B * s.H == 0:  # no tokens: nothing flows but dstate to the initial state
            for g in GRADS:
                outs[g].zero_()
            if dinit is not None and t["dstate"] is None:
                dinit.zero_()
            elif dinit is not None:
                dinit.copy_(t["dstate"])
            return None
        x = [dense_aligned(t[n]) for n in NAMES]
        return (*x, _fp32(t["state"]), dense_aligned(t["dout"].to(torch.bfloat16)),
                _fp32(t["dstate"]), *(outs[g] for g in GRADS), _fp32(t["initial_state"]), dinit)

    @staticmethod
    def result(call: Call, outs: dict) -> tuple:
        grads = tuple(outs[g] for g in GRADS)
        return grads if "dinitial_state" not in outs else (*grads, outs["dinitial_state"])


@launcher.remembered
def forward(q1, q2, k1, k2, v, *, scale=None, causal: bool = False, initial_state=None,
            variant: str = "auto", out=None, state=None, profile: bool | str = False):
    """Triple attention forward on the GPU, no autograd.

    q1, q2, k1, k2 [B, N, H, Dq], v [B, N, H, Dv], bf16 CUDA tensors; Dq, Dv in {32, 64, 128}.
    scale c defaults to 1/N (the state is a mean; 1.0 gives the blog's formula). causal: token n
    reads the state of tokens m <= n only. initial_state [B, H, Dq, Dv, Dq] fp32 (the state of
    earlier tokens, already scaled; scale then explicit): the sums start from it. Returns out
    [B, N, H, Dv] bf16 and state [B, H, Dq, Dv, Dq] fp32, S[i, j, k] = initial_state[i, j, k] +
    c sum_n K1[n, i] V[n, j] K2[n, k] over the whole sequence (causal too), into `out` / `state`
    when given. "auto" takes the fastest registered variant for the shape."""
    return launcher.run(FAMILY, "fwd", q1, q2, k1, k2, v, scale, causal, initial_state,
                        variant=variant, profile=profile, outputs={"out": out, "state": state})


@launcher.remembered
def backward(dout, dstate, q1, q2, k1, k2, v, state, *, scale=None, causal: bool = False,
             initial_state=None, variant: str = "auto", deterministic: bool = False,
             profile: bool | str = False):
    """Gradients of triple attention with respect to q1, q2, k1, k2, v (bf16, their shapes),
    given the incoming gradients dout [B, N, H, Dv] and dstate [B, H, Dq, Dv, Dq] (or None when
    the state is unused) and the state the forward returned for these inputs; with the
    forward's initial_state, also its gradient (fp32, a sixth: dstate plus
    sum_n Q1[n] (x) dO[n] (x) Q2[n]). deterministic=True takes only bitwise repeatable variants.
    Other arguments as `forward`'s."""
    return launcher.run(FAMILY, "bwd", dout, dstate, q1, q2, k1, k2, v, state, scale, causal,
                        initial_state, variant=variant, profile=profile,
                        deterministic=deterministic)

"""Spherical attention's two passes on the one launcher (altattn.launcher.run): what each takes,
checks, allocates and hands its kernels, and the public entry points `forward` and `backward`."""
from __future__ import annotations

import torch

from .. import launcher
from ..checks import dense_aligned, output, validate_aux
from ..launcher import Call
from .spec import DEFAULT_EPS, NAMES, validate

FAMILY = "spherical"
GRADS = ("dq", "dk", "dv")


def _seqlens(seqlens):
    return None if seqlens is None else dense_aligned(seqlens.to(torch.int32))


def validate_saved(dout, dr, out, r, rows: tuple, norms: tuple, rows_layout: str,
                   norms_layout: str, device) -> None:
    """The backward's tensors besides q, k, v checked against the spec's shapes: out and dout
    `rows`, r and dr (None: r unused) `norms`; each layout named in the error."""
    aux = [("out", out, rows, rows_layout), ("r", r, norms, norms_layout),
           ("dout", dout, rows, rows_layout)]
    if dr is not None:
        aux.append(("dr", dr, norms, norms_layout))
    for name, t, shape, layout in aux:
        validate_aux(name, t, shape, layout, device, ", ".join(NAMES))


def _same(t):
    return t


def forward_args(call: Call, outs: dict, lengths, view=_same):
    """What the forward kernels take after the spec (Forward.kernel_args): q, k, v, the lengths
    argument (`seqlens`; packed: the sequences), out, r, each tensor through `view` (packed: a
    batch of one); None where nothing launches (no rows; no keys: out and r zeroed)."""
    if outs["out"].numel() == 0:
        return None
    if call.spec.Nk == 0:  # no keys: every row sees none
        outs["out"].zero_()
        outs["r"].zero_()
        return None
    x = [view(dense_aligned(call.tensors[n])) for n in NAMES]
    return (*x, lengths, view(outs["out"]), view(outs["r"]))


def backward_args(call: Call, outs: dict, lengths, view=_same):
    """What the backward kernels take after the spec (Backward.kernel_args), as forward_args:
    q, k, v, out, r, dout, dr (or None), the lengths argument, dq, dk, dv; None where nothing
    flows (no rows or no keys: the gradients zeroed)."""
    if any(g.numel() == 0 for g in outs.values()):  # no rows or no keys: nothing flows
        for g in outs.values():
            g.zero_()
        return None
    t = call.tensors
    x = [view(dense_aligned(t[n])) for n in NAMES]
    dr = None if t["dr"] is None else view(dense_aligned(t["dr"].float()))
    return (*x, view(dense_aligned(t["out"].to(torch.bfloat16))),
            view(dense_aligned(t["r"].float())), view(dense_aligned(t["dout"].to(torch.bfloat16))),
            dr, lengths, *(view(outs[g]) for g in GRADS))


class Forward:
    """forward(q, k, v, causal=False, sm_scale=None, eps=1e-6, seqlens=None) -> (out, r):
    out [B, N, Hq, D] bf16 and r [B, Hq, N] fp32."""

    outputs = ("out", "r")

    @staticmethod
    def validate(q, k, v, causal=False, sm_scale=None, eps=DEFAULT_EPS, seqlens=None) -> Call:
        spec = validate(q, k, v, causal, sm_scale, eps, seqlens)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError("altattn.spherical.forward is forward-only and the inputs require "
                             "grad: use altattn.spherical_attention (differentiable), or call "
                             "forward under torch.no_grad() or with detached tensors")
        return Forward.bind(spec, q, k, v, causal, sm_scale, eps, seqlens)

    @staticmethod
    def bind(spec, q, k, v, causal=False, sm_scale=None, eps=DEFAULT_EPS, seqlens=None) -> Call:
        """The call of arguments `spec` was validated from (no checks)."""
        return Call(spec, q.device, {"q": q, "k": k, "v": v, "seqlens": seqlens})

    @staticmethod
    def allocate(call: Call, given: dict) -> dict:
        s, dev = call.spec, call.device
        return {"out": output(given.get("out"), "out", (s.B, s.N, s.Hq, s.D), torch.bfloat16, dev),
                "r": output(given.get("r"), "r", (s.B, s.Hq, s.N), torch.float32, dev)}

    @staticmethod
    def kernel_args(call: Call, outs: dict):
        return forward_args(call, outs, _seqlens(call.tensors["seqlens"]))

    @staticmethod
    def result(call: Call, outs: dict) -> tuple:
        return outs["out"], outs["r"]


class Backward:
    """backward(dout, dr, q, k, v, out, r, causal=False, sm_scale=None, eps=1e-6, seqlens=None)
    -> (dq, dk, dv), bf16, the inputs' shapes."""

    outputs = GRADS
    optional = ("dr",)  # None: r unused (plans differ)

    @staticmethod
    def validate(dout, dr, q, k, v, out, r, causal=False, sm_scale=None, eps=DEFAULT_EPS,
                 seqlens=None) -> Call:
        spec = validate(q, k, v, causal, sm_scale, eps, seqlens)
        validate_saved(dout, dr, out, r, (spec.B, spec.N, spec.Hq, spec.D),
                       (spec.B, spec.Hq, spec.N), "[B, N, Hq, D]", "[B, Hq, N]", q.device)
        return Backward.bind(spec, dout, dr, q, k, v, out, r, causal, sm_scale, eps, seqlens)

    @staticmethod
    def bind(spec, dout, dr, q, k, v, out, r, causal=False, sm_scale=None, eps=DEFAULT_EPS,
             seqlens=None) -> Call:
        """The call of arguments `spec` was validated from (no checks)."""
        return Call(spec, q.device, {"q": q, "k": k, "v": v, "out": out, "r": r, "dout": dout,
                                     "dr": dr, "seqlens": seqlens})

    @staticmethod
    def allocate(call: Call, given: dict) -> dict:
        return {g: output(given.get(g), g, tuple(call.tensors[n].shape), torch.bfloat16,
                          call.device) for g, n in zip(GRADS, NAMES)}

    @staticmethod
    def kernel_args(call: Call, outs: dict):
        return backward_args(call, outs, _seqlens(call.tensors["seqlens"]))

    @staticmethod
    def result(call: Call, outs: dict) -> tuple:
        return tuple(outs[g] for g in GRADS)


@launcher.remembered
def forward(q, k, v, *, causal: bool = False, sm_scale=None, eps: float = DEFAULT_EPS,
            seqlens=None, variant: str = "auto", out=None, r=None, profile: bool = False):
    """Spherical attention forward on the GPU, no autograd.

    q [B, N, Hq, D], k and v [B, Nk, Hk, D] (Hq a multiple of Hk), bf16 CUDA tensors; D in
    {64, 128}. causal: query y sees keys x <= y (needs N == Nk). sm_scale defaults to
    1/sqrt(D); eps is added to the row norm r before dividing. seqlens: int32 [B], the real
    length of each sequence (queries and keys past it are padding: never read into a real row;
    their outputs are 0; it must hold finite values); values are clamped to [0, N] (queries) and
    [0, Nk] (keys).
    Returns out [B, N, Hq, D] bf16 and r [B, Hq, N] fp32 (each row's L2 norm of scores), into
    `out` / `r` when given. "auto" takes the fastest registered variant for the shape."""
    return launcher.run(FAMILY, "fwd", q, k, v, causal, sm_scale, eps, seqlens, variant=variant,
                        profile=profile, outputs={"out": out, "r": r})


@launcher.remembered
def backward(dout, dr, q, k, v, out, r, *, causal: bool = False, sm_scale=None,
             eps: float = DEFAULT_EPS, seqlens=None, variant: str = "auto",
             deterministic: bool = False, profile: bool | str = False):
    """Gradients of spherical attention with respect to q, k, v (bf16, their shapes), given the
    incoming gradients dout [B, N, Hq, D] and dr [B, Hq, N] (or None when r is unused) and what
    the forward returned for these inputs (out, r). deterministic=True takes only bitwise
    repeatable variants. Other arguments as `forward`'s."""
    return launcher.run(FAMILY, "bwd", dout, dr, q, k, v, out, r, causal, sm_scale, eps, seqlens,
                        variant=variant, profile=profile, deterministic=deterministic)

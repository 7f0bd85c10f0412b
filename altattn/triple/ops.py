"""The differentiable op: `attention(q1, q2, k1, k2, v, ...) -> (out, state)` with gradients.

Two `torch.library.custom_op`s, `altattn::triple_fwd` and `altattn::triple_bwd`, each with a fake
(meta) implementation, joined by `register_autograd`, so `torch.compile(fullgraph=True)` traces a
training step through them and `torch.library.opcheck` passes. On CUDA tensors (bf16) they run the
kernels (`variant`, `bwd_variant`); on CPU tensors (bf16, fp16, fp32, fp64) the plain-PyTorch
reference in fp64 and its closed-form backward. Saved for backward: q1, q2, k1, k2, v and the
state (what the non-causal backward reads; the causal one rebuilds its prefix states).
"""
from __future__ import annotations

import torch

from .. import launcher
from .passes import FAMILY
from .passes import backward as _kernel_backward
from .passes import forward as _kernel_forward
from .reference import reference, reference_backward
from .spec import validate

Tensor = torch.Tensor


def _state_dtype(q: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (the reference path: gradcheck needs it)."""
    return torch.promote_types(q.dtype, torch.float32)


@torch.library.custom_op("altattn::triple_fwd", mutates_args=())
def _fwd(q1: Tensor, q2: Tensor, k1: Tensor, k2: Tensor, v: Tensor, causal: bool, scale: float,
         variant: str, bwd_variant: str, deterministic: bool) -> tuple[Tensor, Tensor]:
    """The forward; `bwd_variant` and `deterministic` are kept for the backward."""
    if q1.device.type == "cpu":
        out, state = reference(q1, q2, k1, k2, v, scale, causal)
        return out.to(q1.dtype).contiguous(), state.to(_state_dtype(q1)).contiguous()
    with torch.no_grad():
        return _kernel_forward(q1, q2, k1, k2, v, scale=scale, causal=causal, variant=variant)


@_fwd.register_fake
def _(q1, q2, k1, k2, v, causal, scale, variant, bwd_variant, deterministic):
    B, N, H, Dq = q1.shape
    return (q1.new_empty(B, N, H, v.shape[-1]),
            q1.new_empty(B, H, Dq, v.shape[-1], Dq, dtype=_state_dtype(q1)))


@torch.library.custom_op("altattn::triple_bwd", mutates_args=())
def _bwd_op(dout: Tensor, dstate: Tensor | None, q1: Tensor, q2: Tensor, k1: Tensor, k2: Tensor,
            v: Tensor, state: Tensor, causal: bool, scale: float, variant: str,
            deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    x = (q1, q2, k1, k2, v)
    if q1.device.type == "cpu":
        grads = reference_backward(*x, dout, dstate, scale, causal)
        return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, x))
    return _kernel_backward(dout, dstate, *x, state, scale=scale, causal=causal, variant=variant,
                            deterministic=deterministic)


@_bwd_op.register_fake
def _(dout, dstate, q1, q2, k1, k2, v, state, causal, scale, variant, deterministic):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (q1, q2, k1, k2, v))


def _setup_context(ctx, inputs, output):
    q1, q2, k1, k2, v, causal, scale, _variant, bwd_variant, deterministic = inputs
    _out, state = output
    ctx.save_for_backward(q1, q2, k1, k2, v, state)
    ctx.args = (causal, scale, bwd_variant, deterministic)


def _backward(ctx, dout, dstate):
    q1, q2, k1, k2, v, state = ctx.saved_tensors
    causal, scale, bwd_variant, deterministic = ctx.args
    grads = torch.ops.altattn.triple_bwd(dout, dstate, q1, q2, k1, k2, v, state, causal, scale,
                                         bwd_variant, deterministic)
    return (*grads, None, None, None, None, None)


_fwd.register_autograd(_backward, setup_context=_setup_context)


def check_variant_names(variant, bwd_variant, deterministic=False) -> None:
    """launcher.check_variant_names for this family (`attention` and the layer call it)."""
    launcher.check_variant_names(FAMILY, variant, bwd_variant, deterministic)


def attention(q1, q2, k1, k2, v, *, scale=None, causal: bool = False, variant: str = "auto",
              bwd_variant: str = "auto", deterministic: bool = False):
    """Differentiable triple attention: a third-order state read by two queries,

        S[i, j, k] = c sum_n K1[n, i] V[n, j] K2[n, k],   Y[n, j] = sum_{i,k} Q1[n, i] S[i, j, k] Q2[n, k]

    q1, q2, k1, k2 [B, N, H, Dq], v [B, N, H, Dv] on one device; CUDA tensors bf16 with Dq, Dv in
    {32, 64, 128}, CPU tensors bf16, fp16, fp32 or fp64 (the fp64 reference runs). scale c
    defaults to 1/N (the state is a mean; 1.0 gives the blog's formula). causal: token n reads
    the state of tokens m <= n only, Y[n] = c sum_{m<=n} (Q1[n].K1[m]) (Q2[n].K2[m]) V[m].
    Returns out [B, N, H, Dv] (the inputs' dtype) and state [B, H, Dq, Dv, Dq] (the whole
    sequence's, in both modes; fp32, fp64 for fp64 inputs), both differentiable. variant /
    bwd_variant name the kernels ("auto": the fastest that takes the shape); deterministic=True:
    bitwise-repeatable gradients. Bad input raises TypeError / ValueError naming the argument
    before anything is launched."""
    check_variant_names(variant, bwd_variant, deterministic)
    spec = validate(q1, q2, k1, k2, v, scale, causal, cpu_reference=True)
    if q1.device.type == "cuda" and not torch.compiler.is_compiling():  # errors now, not later
        launcher.pick(spec, bwd_variant, True, "bwd", deterministic, FAMILY)
    return torch.ops.altattn.triple_fwd(q1, q2, k1, k2, v, spec.causal, spec.scale, variant,
                                        bwd_variant, deterministic)

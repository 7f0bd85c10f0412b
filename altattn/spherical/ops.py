"""The differentiable op: `attention(q, k, v, ...) -> (out, r)` with gradients.

Two `torch.library.custom_op`s, `altattn::spherical_fwd` and `altattn::spherical_bwd`, each with a
fake (meta) implementation, joined by `register_autograd`, so `torch.compile(fullgraph=True)`
traces a training step through them and `torch.library.opcheck` passes. On CUDA tensors (bf16)
they run the kernels (`variant`, `bwd_variant`); on CPU tensors (bf16, fp16, fp32, fp64) the
plain-PyTorch reference in fp64 and its closed-form backward. Saved for backward: q, k, v, out, r
(and seqlens), as FlashAttention saves q, k, v, out and the LSE.
"""
from __future__ import annotations

import torch

from .. import launcher
from .passes import FAMILY
from .passes import backward as _kernel_backward
from .passes import forward as _kernel_forward
from .reference import reference, reference_backward
from .spec import DEFAULT_EPS, validate

Tensor = torch.Tensor


def _r_dtype(q: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (the reference path: gradcheck needs it)."""
    return torch.promote_types(q.dtype, torch.float32)


@torch.library.custom_op("altattn::spherical_fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, seqlens: Tensor | None, causal: bool,
         sm_scale: float, eps: float, variant: str, bwd_variant: str,
         deterministic: bool) -> tuple[Tensor, Tensor]:
    """The forward; `bwd_variant` and `deterministic` are kept for the backward."""
    if q.device.type == "cpu":
        out, r = reference(q, k, v, causal, sm_scale, eps, seqlens)
        return out.to(q.dtype).contiguous(), r.to(_r_dtype(q)).contiguous()
    with torch.no_grad():
        return _kernel_forward(q, k, v, causal=causal, sm_scale=sm_scale, eps=eps,
                               seqlens=seqlens, variant=variant)


@_fwd.register_fake
def _(q, k, v, seqlens, causal, sm_scale, eps, variant, bwd_variant, deterministic):
    B, N, Hq, D = q.shape
    return q.new_empty(B, N, Hq, D), q.new_empty(B, Hq, N, dtype=_r_dtype(q))


@torch.library.custom_op("altattn::spherical_bwd", mutates_args=())
def _bwd_op(dout: Tensor, dr: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
            r: Tensor, seqlens: Tensor | None, causal: bool, sm_scale: float, eps: float,
            variant: str, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    if q.device.type == "cpu":
        grads = reference_backward(q, k, v, dout, dr, causal, sm_scale, eps, seqlens)
        return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, (q, k, v)))
    return _kernel_backward(dout, dr, q, k, v, out, r, causal=causal, sm_scale=sm_scale, eps=eps,
                            seqlens=seqlens, variant=variant, deterministic=deterministic)


@_bwd_op.register_fake
def _(dout, dr, q, k, v, out, r, seqlens, causal, sm_scale, eps, variant, deterministic):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, seqlens, causal, sm_scale, eps, _variant, bwd_variant, deterministic = inputs
    out, r = output
    ctx.save_for_backward(q, k, v, out, r, seqlens)
    ctx.args = (causal, sm_scale, eps, bwd_variant, deterministic)


def _backward(ctx, dout, dr):
    q, k, v, out, r, seqlens = ctx.saved_tensors
    causal, sm_scale, eps, bwd_variant, deterministic = ctx.args
    dq, dk, dv = torch.ops.altattn.spherical_bwd(dout, dr, q, k, v, out, r, seqlens, causal,
                                                 sm_scale, eps, bwd_variant, deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def check_variant_names(variant, bwd_variant, deterministic=False) -> None:
    """launcher.check_variant_names for this family (`attention` and the layer call it)."""
    launcher.check_variant_names(FAMILY, variant, bwd_variant, deterministic)


def attention(q, k, v, *, causal: bool = False, sm_scale=None, eps: float = DEFAULT_EPS,
              seqlens=None, variant: str = "auto", bwd_variant: str = "auto",
              deterministic: bool = False):
    """Differentiable spherical attention (FlashSign): softmax replaced by each score row's L2
    norm, out[y] = sum_x s[y, x] v[x] / (r[y] + eps), s = sm_scale * q k^T, r[y] = ||s[y, :]||.

    q [B, N, Hq, D], k and v [B, Nk, Hk, D] (Hq a multiple of Hk: grouped-query heads) on one
    device; CUDA tensors bf16 with D in {64, 128}, CPU tensors bf16, fp16, fp32 or fp64 (the fp64
    reference runs). causal: query y sees keys x <= y (N == Nk). sm_scale defaults to
    1/sqrt(D). seqlens: int32 [B] real lengths, for batches of sequences padded to N: padded
    queries give out = 0 and r = 0, padded keys are never read into a real row, and their
    gradients are 0 (lengths are clamped to [0, N] for queries and [0, Nk] for keys; padding must
    hold finite values, since the tail tile multiplies it by exact zeros, and 0 * inf is NaN). Returns out [B, N, Hq, D] (the inputs' dtype) and r [B, Hq, N] (fp32; fp64
    for fp64 inputs), both differentiable. variant / bwd_variant name the kernels ("auto": the
    fastest that takes the shape); deterministic=True: bitwise-repeatable gradients. Bad input
    raises TypeError / ValueError naming the argument before anything is launched."""
    check_variant_names(variant, bwd_variant, deterministic)
    spec = validate(q, k, v, causal, sm_scale, eps, seqlens, cpu_reference=True)
    if q.device.type == "cuda" and not torch.compiler.is_compiling():  # errors now, not at backward
        launcher.pick(spec, bwd_variant, True, "bwd", deterministic, FAMILY)
    if seqlens is not None:
        seqlens = seqlens.to(torch.int32)
    return torch.ops.altattn.spherical_fwd(q, k, v, seqlens, spec.causal, spec.sm_scale,
                                           spec.eps, variant, bwd_variant, deterministic)

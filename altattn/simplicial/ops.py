"""The differentiable op: `attention(q, k1, k2, v1, v2, w1, w2) -> (out, lse)` with gradients.

Two `torch.library.custom_op`s, `altattn::simplicial_fwd` and `altattn::simplicial_bwd`, each
with a fake (meta) implementation, joined by `register_autograd`, so `torch.compile(fullgraph=True)`
traces a training step through them with no graph break and `torch.library.opcheck` passes.

On CUDA tensors (bf16) they run the kernels: the forward variant `variant`, the backward variant
`bwd_variant` ("auto": the fastest registered backward that takes the shape). On CPU tensors
(bf16, fp16, fp32 or fp64) they run the plain-PyTorch reference in fp64 and its closed-form
backward (`reference_backward`): slow, exact, so CI can check gradients, opcheck and compile
without a GPU. Form "det" runs the `triton` forward and backward on CUDA (the only variants
that compute it: "auto" takes them, a named TLX variant refuses the form with ValueError).

Saved for backward: q, k1, k2, v1, v2, out and lse (as FlashAttention saves q, k, v, out, lse).
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


def _lse_dtype(q: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (the reference path: gradcheck needs it)."""
    return torch.promote_types(q.dtype, torch.float32)


@torch.library.custom_op("altattn::simplicial_fwd", mutates_args=())
def _fwd(q: Tensor, k1: Tensor, k2: Tensor, v1: Tensor, v2: Tensor, w1: int, w2: int,
         sm_scale: float, variant: str, bwd_variant: str, form: str,
         deterministic: bool) -> tuple[Tensor, Tensor]:
    """The forward; `bwd_variant` and `deterministic` are only kept for the backward (see
    `_setup_context`)."""
    if q.device.type == "cpu":
        out, lse = reference(q, k1, k2, v1, v2, w1, w2, sm_scale=sm_scale, form=form)
        return out.to(q.dtype), lse.to(_lse_dtype(q))
    with torch.no_grad():
        return _kernel_forward(q, k1, k2, v1, v2, w1, w2, variant=variant, sm_scale=sm_scale,
                               form=form)


@_fwd.register_fake
def _(q, k1, k2, v1, v2, w1, w2, sm_scale, variant, bwd_variant, form, deterministic):
    B, N, Hq, D = q.shape
    return q.new_empty(B, N, Hq, D), q.new_empty(B, Hq, N, dtype=_lse_dtype(q))


@torch.library.custom_op("altattn::simplicial_bwd", mutates_args=())
def _bwd_op(dout: Tensor, dlse: Tensor | None, q: Tensor, k1: Tensor, k2: Tensor, v1: Tensor,
            v2: Tensor, out: Tensor, lse: Tensor, w1: int, w2: int, sm_scale: float,
            variant: str, form: str,
            deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if q.device.type == "cpu":
        return _reference_grads(dout, dlse, q, k1, k2, v1, v2, w1, w2, sm_scale, form)
    return _kernel_backward(dout, dlse, q, k1, k2, v1, v2, out, lse, w1, w2, sm_scale=sm_scale,
                         variant=variant, form=form, deterministic=deterministic)


@_bwd_op.register_fake
def _(dout, dlse, q, k1, k2, v1, v2, out, lse, w1, w2, sm_scale, variant, form, deterministic):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (q, k1, k2, v1, v2))


def _reference_grads(dout, dlse, q, k1, k2, v1, v2, w1, w2, sm_scale, form):
    """Gradients of the fp64 reference, cast to the inputs' dtype."""
    grads = reference_backward(q, k1, k2, v1, v2, w1, w2, dout, dlse, sm_scale=sm_scale,
                               form=form)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k1, k2, v1, v2)))


def _setup_context(ctx, inputs, output):
    q, k1, k2, v1, v2, w1, w2, sm_scale, _variant, bwd_variant, form, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k1, k2, v1, v2, out, lse)
    ctx.args = (w1, w2, sm_scale, bwd_variant, form, deterministic)


def _backward(ctx, dout, dlse):
    q, k1, k2, v1, v2, out, lse = ctx.saved_tensors
    w1, w2, sm_scale, bwd_variant, form, deterministic = ctx.args
    grads = torch.ops.altattn.simplicial_bwd(dout, dlse, q, k1, k2, v1, v2, out, lse, w1, w2,
                                          sm_scale, bwd_variant, form, deterministic)
    return (*grads, None, None, None, None, None, None, None)


_fwd.register_autograd(_backward, setup_context=_setup_context)


def check_variant_names(variant, bwd_variant, deterministic=False) -> None:
    """launcher.check_variant_names for this family (`attention` and the layer call it)."""
    launcher.check_variant_names(FAMILY, variant, bwd_variant, deterministic)


def attention(q, k1, k2, v1, v2, w1, w2, *, sm_scale=None, variant: str = "auto",
              bwd_variant: str = "auto", form: str = "trilinear", deterministic: bool = False):
    """Differentiable 2-simplicial attention.

    q: [B, N, Hq, D], k1, k2, v1, v2: [B, N, Hk, D] on one device; CUDA tensors must be bf16 (the
    kernels), CPU tensors may be bf16, fp16, fp32 or fp64 (the fp64 reference runs). w1, w2 >= 1
    (either may be the larger; a window longer than N acts as N); sm_scale defaults to
    1/sqrt(D). Returns out [B, N, Hq, D] (the inputs' dtype) and lse [B, Hq, N] (natural log;
    fp32, fp64 for fp64 inputs), both differentiable: gradients flow to every input that requires
    grad (None for the others). B = 0 or N = 0 gives empty outputs and gradients.
    `variant` / `bwd_variant` name the forward / backward kernels ("auto": the fastest that takes
    the shape). form="det": logits from 3x3 determinants over the 3-chunks of D, the D mod 3
    leftover dims trilinear, sm_scale again defaulting to 1/sqrt(D) (`altattn.simplicial.reference`
    states the form; on CUDA the `triton` variants and, forward only, `tlx_pipelined_kv` and
    `tlx_pipelined_pingpong` at G = 128 compute it). Bad input raises TypeError /
    ValueError naming the argument before anything is launched; a wrong-shape or complex
    incoming gradient is refused by torch's autograd, which casts one of another real dtype to
    the output's. deterministic=True: the backward takes only bitwise-repeatable variants
    (`altattn.simplicial.backward`; "auto" otherwise takes `tlx_pairs` where it is fastest,
    whose reduce-adds run in the hardware's order).
    """
    check_variant_names(variant, bwd_variant, deterministic)
    spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, form=form, cpu_reference=True)
    if q.device.type == "cuda" and not torch.compiler.is_compiling():  # errors now, not at backward
        launcher.pick(spec, bwd_variant, True, "bwd", deterministic, FAMILY)
    # the op takes int64 windows: pass the spec's, clamped to N (the same function, and 10**40
    # fits), in the caller's order
    w1, w2 = (spec.w2, spec.w1) if spec.swapped else (spec.w1, spec.w2)
    return torch.ops.altattn.simplicial_fwd(q, k1, k2, v1, v2, w1, w2, spec.sm_scale, variant,
                                         bwd_variant, spec.form, deterministic)

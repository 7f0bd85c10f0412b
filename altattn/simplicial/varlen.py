"""Packed variable-length sequences: `attention_varlen(q, k1, k2, v1, v2, cu_seqlens, max_seqlen,
w1, w2)`, FlashAttention's `flash_attn_varlen_func` convention for 2-simplicial attention.

Sequences are concatenated along dim 0 (q [T, Hq, D], the others [T, Hk, D]); sequence s holds
tokens cu_seqlens[s] .. cu_seqlens[s + 1] - 1, and token i of it sees j in (i - w1, i] and k in
(i - w2, i] within its own sequence only: no window crosses a sequence start, and no value of one
sequence (not even inf or NaN) reaches another's outputs or gradients.

Two `torch.library.custom_op`s (`altattn::simplicial_varlen_fwd` / `_bwd`) joined by
`register_autograd`, as `ops.attention`'s: differentiable, `torch.compile`-able. On CUDA the
variants that take packed sequences (`accepts` "varlen": the G = 128 forwards built on
`tlx_ws_kv`, the `tlx_pairs` backward) run all sequences in one launch (packing.py); other shapes
run the dense kernels sequence by sequence. On CPU the fp64 reference runs sequence by sequence.
"""
from __future__ import annotations

import torch

from ..checks import check_group, validate_aux
from . import packing
from .ops import _lse_dtype, check_variant_names
from .passes import Backward, Forward
from .passes import backward as dense_backward
from .passes import forward as dense_forward
from .reference import reference, reference_backward
from .spec import NAMES, REFERENCE_DTYPES, SUPPORTED_DTYPES, validate

Tensor = torch.Tensor


def validate_packed(q, k1, k2, v1, v2, w1, w2, sm_scale=None, form="trilinear",
                    cpu_reference=False):
    """The checks of `spec.validate` for packed tensors (q [T, Hq, D], the others [T, Hk, D]),
    naming packed dims; returns the B = 1 spec of the packed tokens."""
    tensors = (q, k1, k2, v1, v2)
    on_cpu = cpu_reference and isinstance(q, Tensor) and q.device.type == "cpu"
    check_group(NAMES, tensors, 3, "[T, H, D]", REFERENCE_DTYPES if on_cpu else SUPPORTED_DTYPES,
                SUPPORTED_DTYPES)
    T, _, D = q.shape
    for name, t in zip(NAMES[1:], tensors[1:]):
        for what, got, want in (("T (dim 0)", t.shape[0], T), ("D (dim 2)", t.shape[2], D),
                                ("Hk (dim 1)", t.shape[1], k1.shape[1])):
            if got != want:
                raise ValueError(f"{name} has {what} = {got} but {'k1' if 'Hk' in what else 'q'}"
                                 f" has {want}: shapes q{tuple(q.shape)} vs "
                                 f"{name}{tuple(t.shape)}")
    return validate(*(t[None] for t in tensors), w1, w2, sm_scale, form=form,
                    cpu_reference=cpu_reference)


def _reference(q, k1, k2, v1, v2, cu, w1, w2, sm_scale, form):
    def one(*x):
        o, lse = reference(*(t[None] for t in x), w1, w2, sm_scale=sm_scale, form=form)
        return o[0].to(q.dtype), lse[0].to(_lse_dtype(q))
    outs = packing.per_sequence(cu, one, q, k1, k2, v1, v2)
    return (torch.cat([o for o, _ in outs]) if outs else q.new_empty(q.shape),
            torch.cat([lse for _, lse in outs], 1) if outs
            else q.new_empty(q.shape[1], 0, dtype=_lse_dtype(q)))


@torch.library.custom_op("altattn::simplicial_varlen_fwd", mutates_args=())
def _fwd(q: Tensor, k1: Tensor, k2: Tensor, v1: Tensor, v2: Tensor, cu_seqlens: Tensor,
         w1: int, w2: int, sm_scale: float, variant: str, bwd_variant: str, form: str,
         deterministic: bool) -> tuple[Tensor, Tensor]:
    if q.device.type == "cpu":
        return _reference(q, k1, k2, v1, v2, cu_seqlens.tolist(), w1, w2, sm_scale, form)
    return forward_varlen(q, k1, k2, v1, v2, cu_seqlens, w1, w2, sm_scale=sm_scale,
                          variant=variant, form=form)


@_fwd.register_fake
def _(q, k1, k2, v1, v2, cu_seqlens, w1, w2, sm_scale, variant, bwd_variant, form,
      deterministic):
    T, Hq, D = q.shape
    return q.new_empty(T, Hq, D), q.new_empty(Hq, T, dtype=_lse_dtype(q))


def forward_varlen(q, k1, k2, v1, v2, cu_seqlens, w1, w2, *, sm_scale=None, variant="auto",
                   form="trilinear"):
    """The packed forward on the GPU, no autograd: (out [T, Hq, D] bf16, lse [Hq, T] fp32)."""
    spec = validate_packed(q, k1, k2, v1, v2, w1, w2, sm_scale, form)
    T = spec.N
    v = packing.packed_variant(spec, variant, q.device, "fwd")
    if v is None:
        def one(*x):
            o, lse = dense_forward(*(t[None] for t in x), w1, w2, variant=variant,
                                   sm_scale=spec.sm_scale, form=form)
            return o[0], lse[0]
        outs = packing.per_sequence(cu_seqlens.tolist(), one, q, k1, k2, v1, v2)
        if not outs:
            return (q.new_empty(q.shape), q.new_empty(q.shape[1], 0, dtype=torch.float32))
        return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs], 1)
    out = q.new_empty(1, T, spec.Hq, spec.D)
    lse = q.new_empty(1, spec.Hq, T, dtype=torch.float32)
    packing.launch(Forward, v, spec, packing.token_maps(cu_seqlens, T),
                   dict(zip(NAMES, (t[None] for t in (q, k1, k2, v1, v2)))),
                   {"out": out, "lse": lse})
    return out[0], lse[0]


@torch.library.custom_op("altattn::simplicial_varlen_bwd", mutates_args=())
def _bwd_op(dout: Tensor, dlse: Tensor | None, q: Tensor, k1: Tensor, k2: Tensor, v1: Tensor,
            v2: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor, w1: int, w2: int,
            sm_scale: float, variant: str, form: str,
            deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if q.device.type == "cpu":
        def one(do, dl, *x):  # dl: the sequence's [n, Hq] rows of dlse, or None
            grads = reference_backward(*(t[None] for t in x), w1, w2, do[None],
                                       None if dl is None else dl.t()[None], sm_scale=sm_scale,
                                       form=form)
            return [g[0] for g in grads]
        parts = packing.per_sequence(cu_seqlens.tolist(), one, dout,
                                     None if dlse is None else dlse.t(), q, k1, k2, v1, v2)
        return tuple(torch.cat([p[i] for p in parts]).to(t.dtype) if parts
                     else torch.zeros_like(t) for i, t in enumerate((q, k1, k2, v1, v2)))
    return backward_varlen(dout, dlse, q, k1, k2, v1, v2, out, lse, cu_seqlens, w1, w2,
                           sm_scale=sm_scale, variant=variant, form=form,
                           deterministic=deterministic)


@_bwd_op.register_fake
def _(dout, dlse, q, k1, k2, v1, v2, out, lse, cu_seqlens, w1, w2, sm_scale, variant, form,
      deterministic):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (q, k1, k2, v1, v2))


def backward_varlen(dout, dlse, q, k1, k2, v1, v2, out, lse, cu_seqlens, w1, w2, *,
                    sm_scale=None, variant="auto", form="trilinear", deterministic=False):
    """The packed backward on the GPU: (dq, dk1, dk2, dv1, dv2) bf16, the inputs' shapes;
    dout [T, Hq, D], dlse [Hq, T] or None, out and lse as `forward_varlen` returned them."""
    spec = validate_packed(q, k1, k2, v1, v2, w1, w2, sm_scale, form)
    T, Hq, D = spec.N, spec.Hq, spec.D
    for name, t, shape, layout in (("out", out, (T, Hq, D), "[T, Hq, D]"),
                                   ("lse", lse, (Hq, T), "[Hq, T]"),
                                   ("dout", dout, (T, Hq, D), "[T, Hq, D]")) + (
            () if dlse is None else (("dlse", dlse, (Hq, T), "[Hq, T]"),)):
        validate_aux(name, t, shape, layout, q.device, ", ".join(NAMES))
    v = packing.packed_variant(spec, variant, q.device, "bwd", deterministic)
    if v is None:
        def one(do, dl, *x):
            o, l_ = x[-2:]
            grads = dense_backward(do[None], None if dl is None else dl.t()[None],
                                   *(t[None] for t in x[:-2]), o[None], l_.t()[None], w1, w2,
                                   sm_scale=spec.sm_scale, variant=variant, form=form,
                                   deterministic=deterministic)
            return [g[0] for g in grads]
        parts = packing.per_sequence(cu_seqlens.tolist(), one, dout,
                                     None if dlse is None else dlse.t(), q, k1, k2, v1, v2, out,
                                     lse.t())
        return tuple(torch.cat([p[i] for p in parts]) if parts else torch.zeros_like(t)
                     for i, t in enumerate((q, k1, k2, v1, v2)))
    grads = {g: torch.empty((1, *t.shape), dtype=torch.bfloat16, device=q.device)
             for g, t in zip(("dq", "dk1", "dk2", "dv1", "dv2"), (q, k1, k2, v1, v2))}
    tensors = dict(zip(NAMES, (t[None] for t in (q, k1, k2, v1, v2))), out=out[None],
                   lse=lse[None], dout=dout[None], dlse=None if dlse is None else dlse[None])
    packing.launch(Backward, v, spec, packing.token_maps(cu_seqlens, T), tensors, grads)
    return tuple(g[0] for g in grads.values())


def _setup_context(ctx, inputs, output):
    q, k1, k2, v1, v2, cu_seqlens, w1, w2, sm_scale, _variant, bwd_variant, form, det = inputs
    ctx.save_for_backward(q, k1, k2, v1, v2, *output, cu_seqlens)
    ctx.args = (w1, w2, sm_scale, bwd_variant, form, det)


def _backward(ctx, dout, dlse):
    q, k1, k2, v1, v2, out, lse, cu_seqlens = ctx.saved_tensors
    w1, w2, sm_scale, bwd_variant, form, det = ctx.args
    grads = torch.ops.altattn.simplicial_varlen_bwd(dout, dlse, q, k1, k2, v1, v2, out, lse,
                                                    cu_seqlens, w1, w2, sm_scale, bwd_variant,
                                                    form, det)
    return (*grads, *([None] * 8))


_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_varlen(q, k1, k2, v1, v2, cu_seqlens, max_seqlen, w1, w2, *, sm_scale=None,
                     variant: str = "auto", bwd_variant: str = "auto", form: str = "trilinear",
                     deterministic: bool = False):
    """Differentiable 2-simplicial attention over packed sequences.

    q [T, Hq, D], k1, k2, v1, v2 [T, Hk, D]: the sequences concatenated; cu_seqlens int32
    [n + 1], their offsets (0 first, T last; empty sequences allowed); max_seqlen, the longest
    one's length (FlashAttention's argument: checked, not needed). Windows end at each
    sequence's start. Returns out [T, Hq, D] (the inputs' dtype) and lse [Hq, T] (natural log;
    fp32, fp64 for fp64 inputs), both differentiable. Every other argument as
    `altattn.simplicial.attention`'s. The offsets are read on the host to check them (skipped
    while torch.compile traces or a CUDA graph is captured), and by the shapes whose kernels run
    sequence by sequence (the module docstring says which run packed)."""
    check_variant_names(variant, bwd_variant, deterministic)
    spec = validate_packed(q, k1, k2, v1, v2, w1, w2, sm_scale, form, cpu_reference=True)
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)
                                   or max_seqlen < 0):
        raise TypeError(f"max_seqlen must be an int >= 0 (or None), got {max_seqlen!r}")
    packing.check_cu_seqlens(cu_seqlens, spec.N, q.device, max_seqlen)
    w1, w2 = (spec.w2, spec.w1) if spec.swapped else (spec.w1, spec.w2)
    return torch.ops.altattn.simplicial_varlen_fwd(q, k1, k2, v1, v2, cu_seqlens, w1, w2,
                                                   spec.sm_scale, variant, bwd_variant,
                                                   spec.form, deterministic)

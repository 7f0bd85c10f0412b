"""The differentiable op: `attention(q, k1, k2, v1, v2, w1, w2) -> (out, lse)` with gradients.

Its torch.library ops `altattn::simplicial_fwd` and `altattn::simplicial_bwd` (fake
implementations, autograd; `torch.compile(fullgraph=True)` traces a training step through them
with no graph break, `torch.library.opcheck` passes) and its eager path are generated from the
declaration below (altattn/ops.py).

On CUDA tensors (bf16) the kernels run: the forward variant `variant`, the backward variant
`bwd_variant` ("auto": the fastest registered backward that takes the shape). On CPU tensors
(bf16, fp16, fp32 or fp64) the plain-PyTorch reference in fp64 and its closed-form backward
(`reference_backward`): slow, exact, so CI can check gradients, opcheck and compile without a
GPU. Form "det" on CUDA: the variants whose record accepts it (the `triton` forward and
backward, the forwards `tlx_pipelined_kv` and `tlx_pipelined_pingpong` at G = 128, the backward
`tlx_pairs` at G >= 16: "auto" takes the fastest of them; a named variant without it refuses the
form with ValueError).

Saved for backward: q, k1, k2, v1, v2, out and lse (as FlashAttention saves q, k, v, out, lse).
"""
from __future__ import annotations

import torch

from ..launcher import remembered
from ..ops import OpDecl, make_op
from .passes import FAMILY
from .reference import reference, reference_backward
from .spec import validate


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (the reference path: gradcheck needs it)."""
    return torch.promote_types(q.dtype, torch.float32)


def _fake(q, k1, k2, v1, v2, w1, w2, sm_scale, form):
    """out [B, N, Hq, D] in q's dtype, lse [B, Hq, N] (_lse_dtype)."""
    B, N, Hq, D = q.shape
    return q.new_empty(B, N, Hq, D), q.new_empty(B, Hq, N, dtype=_lse_dtype(q))


def _cpu_forward(q, k1, k2, v1, v2, w1, w2, sm_scale, form):
    return reference(q, k1, k2, v1, v2, w1, w2, sm_scale=sm_scale, form=form)


def _cpu_backward(grads, x, params):
    w1, w2, sm_scale, form = params
    return reference_backward(*x, w1, w2, *grads, sm_scale=sm_scale, form=form)


OP = make_op(OpDecl(
    family=FAMILY, inputs=("q", "k1", "k2", "v1", "v2"),
    params=(("w1", "int"), ("w2", "int"), ("sm_scale", "float"), ("form", "str")),
    outputs=("out", "lse"), saved=("out", "lse"), fake=_fake, cpu_forward=_cpu_forward,
    cpu_backward=_cpu_backward))


def check_variant_names(variant, bwd_variant, deterministic=False) -> None:
    """The names `attention` and the layer take, checked (altattn.launcher.check_variant_names)."""
    OP.check_names(variant, bwd_variant, deterministic)


@remembered
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
    states the form; on CUDA the `triton` variants, the forwards `tlx_pipelined_kv` and
    `tlx_pipelined_pingpong` at G = 128 and the backward `tlx_pairs` at G >= 16 compute it).
    Bad input raises TypeError / ValueError naming the argument before anything is launched; a
    wrong-shape or complex incoming gradient is refused by torch's autograd, which casts one of
    another real dtype to the output's. deterministic=True: the backward takes only
    bitwise-repeatable variants (`altattn.simplicial.backward`; "auto" otherwise takes
    `tlx_pairs` where it is fastest, whose reduce-adds run in the hardware's order).
    """
    check_variant_names(variant, bwd_variant, deterministic)
    spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, form=form, cpu_reference=True)
    # the op takes int64 windows: pass the spec's, clamped to N (the same function, and 10**40
    # fits), in the caller's order
    w1, w2 = (spec.w2, spec.w1) if spec.swapped else (spec.w1, spec.w2)
    return OP(spec, q, k1, k2, v1, v2, w1, w2, spec.sm_scale, spec.form, variant=variant,
              bwd_variant=bwd_variant, deterministic=deterministic)

"""The differentiable op: `attention(q, k, v, ...) -> (out, r)` with gradients.

Its torch.library ops `altattn::spherical_fwd` and `altattn::spherical_bwd` (fake implementations,
autograd; `torch.compile(fullgraph=True)` traces them, `torch.library.opcheck` passes) and its
eager path are generated from the declaration below (altattn/ops.py). On CUDA tensors (bf16) the
kernels run (`variant`, `bwd_variant`); on CPU tensors (bf16, fp16, fp32, fp64) the plain-PyTorch
reference in fp64 and its closed-form backward. Saved for backward: q, k, v, out, r (and seqlens),
as FlashAttention saves q, k, v, out and the LSE.
"""
from __future__ import annotations

import torch

from ..launcher import remembered
from ..ops import OpDecl, make_op
from .passes import FAMILY
from .reference import reference, reference_backward
from .spec import DEFAULT_EPS, validate


def _fake(q, k, v, causal, sm_scale, eps, seqlens):
    """out [B, N, Hq, D] in q's dtype, r [B, Hq, N] fp32 (fp64 for fp64 inputs: gradcheck)."""
    B, N, Hq, D = q.shape
    return q.new_empty(B, N, Hq, D), q.new_empty(B, Hq, N, dtype=torch.promote_types(
        q.dtype, torch.float32))


OP = make_op(OpDecl(
    family=FAMILY, inputs=("q", "k", "v"),
    params=(("causal", "bool"), ("sm_scale", "float"), ("eps", "float"), ("seqlens", "Tensor?")),
    outputs=("out", "r"), saved=("out", "r"), fake=_fake, cpu_forward=reference,
    cpu_backward=lambda grads, x, params: reference_backward(*x, *grads, *params)))


def check_variant_names(variant, bwd_variant, deterministic=False) -> None:
    """The names `attention` and the layer take, checked (altattn.launcher.check_variant_names)."""
    OP.check_names(variant, bwd_variant, deterministic)


@remembered
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
    hold finite values, since the tail tile multiplies it by exact zeros, and 0 * inf is NaN).
    Returns out [B, N, Hq, D] (the inputs' dtype) and r [B, Hq, N] (fp32; fp64 for fp64 inputs),
    both differentiable. variant / bwd_variant name the kernels ("auto": the fastest that takes
    the shape); deterministic=True: bitwise-repeatable gradients. Bad input raises TypeError /
    ValueError naming the argument before anything is launched."""
    check_variant_names(variant, bwd_variant, deterministic)
    spec = validate(q, k, v, causal, sm_scale, eps, seqlens, cpu_reference=True)
    if seqlens is not None:
        seqlens = seqlens.to(torch.int32)
    return OP(spec, q, k, v, spec.causal, spec.sm_scale, spec.eps, seqlens, variant=variant,
              bwd_variant=bwd_variant, deterministic=deterministic)

"""The differentiable op: `attention(q1, q2, k1, k2, v, ...) -> (out, state)` with gradients.

Its torch.library ops `altattn::triple_fwd` and `altattn::triple_bwd` (fake implementations,
autograd; `torch.compile(fullgraph=True)` traces them, `torch.library.opcheck` passes) and its eager
path are generated from the declaration below (altattn/ops.py). On CUDA tensors (bf16) the kernels
run (`variant`, `bwd_variant`); on CPU tensors (bf16, fp16, fp32, fp64) the plain-PyTorch reference
in fp64 and its closed-form backward. Saved for backward: q1, q2, k1, k2, v, the initial state
(optional, differentiable: the causal backward's prefix states start from it) and the state (what
the non-causal backward reads; the causal one rebuilds its prefix states).
"""
from __future__ import annotations

import torch

from ..launcher import remembered
from ..ops import OpDecl, make_op
from .passes import FAMILY
from .reference import reference, reference_backward
from .spec import validate


def _fake(q1, q2, k1, k2, v, scale, causal, initial_state=None):
    """out [B, N, H, Dv] in q1's dtype, state [B, H, Dq, Dv, Dq] fp32 (fp64 for fp64 inputs)."""
    B, N, H, Dq = q1.shape
    Dv = v.shape[-1]
    return q1.new_empty(B, N, H, Dv), q1.new_empty(B, H, Dq, Dv, Dq, dtype=torch.promote_types(
        q1.dtype, torch.float32))


OP = make_op(OpDecl(
    family=FAMILY, inputs=("q1", "q2", "k1", "k2", "v"),
    params=(("scale", "float"), ("causal", "bool")), optional=("initial_state",),
    outputs=("out", "state"), saved=("state",), fake=_fake, cpu_forward=reference,
    cpu_backward=lambda grads, x, rest: reference_backward(*x, *grads, *rest)))


def check_variant_names(variant, bwd_variant, deterministic=False) -> None:
    """The names `attention` and the layer take, checked (altattn.launcher.check_variant_names)."""
    OP.check_names(variant, bwd_variant, deterministic)


@remembered
def attention(q1, q2, k1, k2, v, *, scale=None, causal: bool = False, initial_state=None,
              variant: str = "auto", bwd_variant: str = "auto", deterministic: bool = False):
    """Differentiable triple attention: a third-order state read by two queries,

        S[i, j, k] = S0[i, j, k] + c sum_n K1[n, i] V[n, j] K2[n, k]
        Y[n, j]    = sum_{i,k} Q1[n, i] S[i, j, k] Q2[n, k]

    q1, q2, k1, k2 [B, N, H, Dq], v [B, N, H, Dv] on one device; CUDA tensors bf16 with Dq, Dv in
    {32, 64, 128}, CPU tensors bf16, fp16, fp32 or fp64 (the fp64 reference runs). scale c
    defaults to 1/N (the state is a mean; 1.0 gives the blog's formula). causal: token n reads
    the state of tokens m <= n only, Y[n] = c sum_{m<=n} (Q1[n].K1[m]) (Q2[n].K2[m]) V[m].
    initial_state S0 [B, H, Dq, Dv, Dq] (the state of earlier tokens, already scaled; fp32, on
    the CPU fp64 too; None: 0): every token reads S0 plus its own sum, so prefill in chunks,
    each chunk's returned state the next one's initial_state, equals one call; differentiable
    (its gradient flows to the chunk that made it). With an initial_state, scale must be given
    (1/N is the mean over one call's tokens only).
    Returns out [B, N, H, Dv] (the inputs' dtype) and state [B, H, Dq, Dv, Dq] (the whole
    sequence's, S0 included, in both modes; fp32, fp64 for fp64 inputs), both differentiable.
    variant / bwd_variant name the kernels ("auto": the fastest that takes the shape);
    deterministic=True: bitwise-repeatable gradients. Bad input raises TypeError / ValueError
    naming the argument before anything is launched."""
    check_variant_names(variant, bwd_variant, deterministic)
    spec = validate(q1, q2, k1, k2, v, scale, causal, initial_state, cpu_reference=True)
    return OP(spec, q1, q2, k1, k2, v, spec.scale, spec.causal, initial_state, variant=variant,
              bwd_variant=bwd_variant, deterministic=deterministic)

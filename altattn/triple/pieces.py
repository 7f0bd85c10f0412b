"""Triple attention's non-causal forward cut at the state, as two differentiable functions (what
context parallelism needs: the state is made from every rank's tokens, then read by each rank's):

    shard_state(k1, k2, v, scale)   S = c sum_n K1[n] (x) V[n] (x) K2[n]     [B, H, Dq, Dv, Dq]
    read_state(q1, q2, S)           Y[n, j] = sum_{i,k} Q1[n, i] S[i, j, k] Q2[n, k]

`attention` (non-causal, no initial state) is read_state(q1, q2, shard_state(k1, k2, v, c)), and
the two run exactly its kernels, split: shard_state the `partials` launch and the fixed-order
state kernel, read_state the `apply`; their backwards its backward's five applies and its dS
(kernels_triton/triple/fwd.py, bwd.py, with kernels_tlx/triple/contractions.py as the `impl` of
the `tlx` variant). So each costs half the op's work, in both passes:

    shard_state   forward: partials (2 N Dq^2 Dv FLOPs)       backward: dK1, dK2, dV (3 applies)
    read_state    forward: apply (2 N Dq^2 Dv)                 backward: dS (partials), dQ1, dQ2

CUDA tensors: bf16 inputs, the state fp32, outputs and gradients bf16. CPU tensors: the einsums
in fp64, cast back (the state: fp32, fp64 for fp64 inputs), as the op's CPU path. No checks
here: the caller (context_parallel.py) has validated the arguments.
"""
from __future__ import annotations

import functools

import torch

from .. import launcher
from ..checks import dense_aligned
from .spec import TripleSpec

Tensor = torch.Tensor
BF16, F64 = torch.bfloat16, torch.float64


def _impl(B, N, H, Dq, Dv, c, variant: str, pass_: str, device):
    """The module whose contractions the `variant` of `pass_` runs: kernels_tlx's for `tlx`,
    kernels_triton's host for `triton` ("auto" picked as the op picks)."""
    spec = TripleSpec(B, max(N, 1), H, Dq, Dv, False, c)
    v = launcher.choose(spec, variant, device, pass_, family="triple")
    if v.name == "tlx":
        from kernels_tlx.triple import contractions
        return contractions
    from kernels_triton.triple import host
    return host


@functools.lru_cache(maxsize=256)
def _launches(B, N, H, Dq, Dv, c, variant, pass_, device):
    """The launches of one shape, made once: `partials` + the state kernel (sum(x1, y, x2, c) ->
    fp32 [B, H, D1, DY, D2]) and `apply(dims, c)` by (dx, dy, do)."""
    from kernels_triton.triple import host
    impl = _impl(B, N, H, Dq, Dv, c, variant, pass_, device)
    splits = impl.n_splits(B, N, H, Dq, Dv, Dq)
    partials = impl.prepare_partials(B, N, H, Dq, Dv, Dq, splits)
    states = {cc: host.prepare_state(B, H, Dq, Dv, Dq, splits, cc) for cc in (c, 1.0)}
    applies = {}

    def total(x1, y, x2, cc) -> Tensor:
        S = torch.empty(B, H, Dq, Dv, Dq, device=x1.device, dtype=torch.float32)
        states[cc](partials(x1, y, x2), S)
        return S

    def apply(x, y, w, dims, cc) -> Tensor:
        if (dims, cc) not in applies:
            applies[dims, cc] = impl.prepare_apply(B, N, H, *dims, cc)
        out = torch.empty(B, N, H, dims[2], device=x.device, dtype=BF16)
        applies[dims, cc](x, y, w, out)
        return out

    return total, apply


def _kernels(x: Tensor, Dq: int, Dv: int, c: float, variant: str, pass_: str):
    B, N, H, _ = x.shape
    return _launches(B, N, H, Dq, Dv, float(c), variant, pass_, x.device)


def _slab(S: Tensor, order: str) -> Tensor:
    from kernels_triton.triple import host
    return host.slab(S, order)


def _gpu(x: Tensor) -> bool:
    return x.device.type == "cuda"


def _empty(x: Tensor) -> bool:
    """No tokens or no heads: nothing to launch."""
    return x.numel() == 0


def _state_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


class _ShardState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k1, k2, v, c: float, variant: str, bwd_variant: str):
        ctx.c, ctx.bwd_variant = c, bwd_variant
        ctx.save_for_backward(k1, k2, v)
        Dq, Dv = k1.shape[-1], v.shape[-1]
        if _empty(k1) or not _gpu(k1):
            S = c * torch.einsum("bnhi,bnhj,bnhk->bhijk", k1.to(F64), v.to(F64), k2.to(F64))
            return S.to(_state_dtype(k1))
        with torch.cuda.device(k1.device):
            total, _ = _kernels(k1, Dq, Dv, c, variant, "fwd")
            return total(*(dense_aligned(t) for t in (k1, v, k2)), c)

    @staticmethod
    def backward(ctx, dS):
        k1, k2, v = ctx.saved_tensors
        c, need = ctx.c, ctx.needs_input_grad
        if _empty(k1) or not _gpu(k1):
            x1, x2, vv, d = (t.to(F64) for t in (k1, k2, v, dS))
            grads = (c * torch.einsum("bnhk,bnhj,bhijk->bnhi", x2, vv, d) if need[0] else None,
                     c * torch.einsum("bnhi,bnhj,bhijk->bnhk", x1, vv, d) if need[1] else None,
                     c * torch.einsum("bnhi,bnhk,bhijk->bnhj", x1, x2, d) if need[2] else None)
            return (*(None if g is None else g.to(k1.dtype) for g in grads), None, None, None)
        Dq, Dv = k1.shape[-1], v.shape[-1]
        with torch.cuda.device(k1.device):
            _, apply = _kernels(k1, Dq, Dv, c, ctx.bwd_variant, "bwd")
            k1, k2, v = (dense_aligned(t) for t in (k1, k2, v))
            dS = dense_aligned(dS.float())
            dk1 = apply(k2, v, _slab(dS, "jki"), (Dq, Dv, Dq), c) if need[0] else None
            dk2 = apply(v, k1, _slab(dS, "ijk"), (Dv, Dq, Dq), c) if need[1] else None
            dv = apply(k2, k1, _slab(dS, "ikj"), (Dq, Dq, Dv), c) if need[2] else None
        return dk1, dk2, dv, None, None, None


class _ReadState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q1, q2, S, variant: str, bwd_variant: str):
        ctx.bwd_variant = bwd_variant
        ctx.save_for_backward(q1, q2, S)
        Dq, Dv = q1.shape[-1], S.shape[3]
        if _empty(q1) or not _gpu(q1):
            out = torch.einsum("bnhi,bhijk,bnhk->bnhj", q1.to(F64), S.to(F64), q2.to(F64))
            return out.to(q1.dtype)
        with torch.cuda.device(q1.device):
            _, apply = _kernels(q1, Dq, Dv, 1.0, variant, "fwd")
            return apply(dense_aligned(q2), dense_aligned(q1), _slab(dense_aligned(S), "ikj"),
                         (Dq, Dq, Dv), 1.0)

    @staticmethod
    def backward(ctx, dout):
        q1, q2, S = ctx.saved_tensors
        need = ctx.needs_input_grad
        if _empty(q1) or not _gpu(q1):
            y1, y2, s, do = (t.to(F64) for t in (q1, q2, S, dout))
            dq1 = torch.einsum("bnhj,bhijk,bnhk->bnhi", do, s, y2) if need[0] else None
            dq2 = torch.einsum("bnhi,bnhj,bhijk->bnhk", y1, do, s) if need[1] else None
            dS = torch.einsum("bnhi,bnhj,bnhk->bhijk", y1, do, y2) if need[2] else None
            return (None if dq1 is None else dq1.to(q1.dtype),
                    None if dq2 is None else dq2.to(q1.dtype),
                    None if dS is None else dS.to(S.dtype), None, None)
        Dq, Dv = q1.shape[-1], S.shape[3]
        with torch.cuda.device(q1.device):
            total, apply = _kernels(q1, Dq, Dv, 1.0, ctx.bwd_variant, "bwd")
            q1, q2, S = (dense_aligned(t) for t in (q1, q2, S))
            dout = dense_aligned(dout.to(BF16))
            dq1 = apply(q2, dout, _slab(S, "jki"), (Dq, Dv, Dq), 1.0) if need[0] else None
            dq2 = apply(dout, q1, _slab(S, "ijk"), (Dv, Dq, Dq), 1.0) if need[1] else None
            dS = total(q1, dout, q2, 1.0) if need[2] else None
        return dq1, dq2, dS, None, None


def shard_state(k1: Tensor, k2: Tensor, v: Tensor, scale: float, variant: str = "auto",
                bwd_variant: str = "auto") -> Tensor:
    """S = scale * sum_n K1[n] (x) V[n] (x) K2[n], [B, H, Dq, Dv, Dq] (fp32; fp64 for fp64 CPU
    inputs), differentiable: `attention`'s state with no initial state, without its output."""
    return _ShardState.apply(k1, k2, v, float(scale), variant, bwd_variant)


def read_state(q1: Tensor, q2: Tensor, S: Tensor, variant: str = "auto",
               bwd_variant: str = "auto") -> Tensor:
    """Y[n, j] = sum_{i,k} Q1[n, i] S[i, j, k] Q2[n, k], [B, N, H, Dv] in q1's dtype,
    differentiable in q1, q2 and S: `attention`'s non-causal output given the state."""
    return _ReadState.apply(q1, q2, S, variant, bwd_variant)


__all__ = ["read_state", "shard_state"]

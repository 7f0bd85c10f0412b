"""Context parallelism: one sequence sharded along N across the ranks of a process group.

Rank r of a group of P holds the contiguous tokens [o_r, o_r + n_r) of every batch element
(o_r = n_0 + ... + n_{r-1}; shards may differ in length, or be empty). Its queries see keys up
to max(w1, w2) - 1 tokens back, so it needs only that many tokens of K1, K2, V1, V2 before o_r:
its halo, owned by the ranks before it (several of them when a window is longer than a shard).

    halo:      `_Halo` receives the halo by point-to-point messages (one batched exchange, each
               owner's piece of all four tensors in one message) and prepends it; its backward
               sends the halo's gradients back, and the owners add them to their own.
    attention: the one-process op (`ops.attention`) on [halo, shard], with zero queries in the
               halo rows; their outputs are dropped (their incoming gradients are 0, so they add
               nothing to any gradient).

No ring over all ranks, unlike dense context parallelism: at w2 = 512 a halo is 511 tokens of
Hk heads, against a shard of many thousands. The exchange is not overlapped with the interior's
attention: at Hk = 1 it moves 511 x 4 rows of D, a few microseconds, while the attention of a
shard takes milliseconds (overlap would cost a second launch and an output merge; see
docs/perf-cp.md).

Transport: altattn.distributed (NCCL for CUDA tensors, gloo for CPU ones; a group whose
backend has no NCCL takes CUDA tensors through host memory: tests on one GPU).
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..distributed import agree, check_lens, exchange, process_group
from .ops import attention, check_variant_names
from .spec import FORMS, REFERENCE_DTYPES, validate

Tensor = torch.Tensor


class Plan(NamedTuple):
    """Who sends which tokens to whom, from the shard lengths. Ranks are the group's.

    recv[r]: (src, a, b): rank r's halo, in order, is rows [a, b) of each src's shard;
    send[s]: (dst, a, b): the same messages seen by their sender."""

    offsets: list[int]
    recv: list[list[tuple[int, int, int]]]
    send: list[list[tuple[int, int, int]]]

    def halo(self, rank: int) -> int:
        return sum(b - a for _, a, b in self.recv[rank])


def halo_plan(lens: list[int], halo: int) -> Plan:
    """The messages that give every non-empty shard the `halo` tokens before it (fewer at the
    sequence's start); empty shards need none."""
    offsets = [0, *itertools.accumulate(lens)]
    recv = [[] for _ in lens]
    for r, n in enumerate(lens):
        start = max(0, offsets[r] - halo)
        for s in range(r):
            a, b = max(start, offsets[s]), min(offsets[r], offsets[s + 1])
            if n and a < b:
                recv[r].append((s, a - offsets[s], b - offsets[s]))
    send = [[(r, a, b) for r in range(len(lens)) for src, a, b in recv[r] if src == s]
            for s in range(len(lens))]
    return Plan(offsets, recv, send)


class _Halo(torch.autograd.Function):
    """(k1, k2, v1, v2) of this rank's shard -> the same with the halo prepended (rows of the
    ranks before it); backward: the halo rows' gradients go back to their owners, which add
    them to their own rows' gradients. Every rank of the group must run both directions."""

    @staticmethod
    def forward(ctx, plan: Plan, rank: int, group, *xs: Tensor):
        ctx.plan, ctx.rank, ctx.group = plan, rank, group
        B, _, H, D = xs[0].shape
        sends = [(dst, torch.stack([x[:, a:b] for x in xs])) for dst, a, b in plan.send[rank]]
        recvs = [(src, xs[0].new_empty(4, B, b - a, H, D)) for src, a, b in plan.recv[rank]]
        exchange(group, sends, recvs)
        return tuple(torch.cat([*(buf[i] for _, buf in recvs), x], 1) for i, x in enumerate(xs))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        plan, rank = ctx.plan, ctx.rank
        h = plan.halo(rank)
        sends, row = [], 0
        for src, a, b in plan.recv[rank]:  # the halo rows' gradients, back to their owners
            sends.append((src, torch.stack([g[:, row:row + b - a] for g in grads])))
            row += b - a
        B, _, H, D = grads[0].shape
        recvs = [(dst, grads[0].new_empty(4, B, b - a, H, D)) for dst, a, b in plan.send[rank]]
        exchange(ctx.group, sends, recvs)
        own = [g[:, h:].clone(memory_format=torch.contiguous_format) for g in grads]
        for (_, a, b), (_, buf) in zip(plan.send[rank], recvs):
            for i, g in enumerate(own):
                g[:, a:b] += buf[i]
        return (None, None, None, *own)


def _describe(q, k1, k2, v1, v2, w1, w2, sm_scale, form, variant, bwd_variant,
              deterministic) -> tuple[list[float], Exception | None]:
    """This rank's call as numbers every rank compares (its shard length first), or the error
    its own checks raised (then the numbers say only that)."""
    try:
        check_variant_names(variant, bwd_variant, deterministic)
        spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, form=form, cpu_reference=True)
    except (TypeError, ValueError) as e:
        return [-1.0] * 10, e
    grad = torch.is_grad_enabled() and sum(t.requires_grad << i for i, t in
                                           enumerate((q, k1, k2, v1, v2)))
    return [float(spec.N), spec.B, spec.Hq, spec.Hk, spec.D, float(min(w1, 2 ** 53)),
            float(min(w2, 2 ** 53)), spec.sm_scale, REFERENCE_DTYPES.index(q.dtype) +
            10 * FORMS.index(spec.form) + 100 * (q.device.type == "cuda"), float(grad)], None


_AGREED = ("B", "Hq", "Hk", "D", "w1", "w2", "sm_scale", "dtype, form and device type",
           "requires_grad of each input (and grad mode)")


def context_parallel_attention(q, k1, k2, v1, v2, w1, w2, *, group=None, sm_scale=None,
                               variant: str = "auto", bwd_variant: str = "auto",
                               form: str = "trilinear", deterministic: bool = False,
                               shard_lens=None):
    """2-simplicial attention of one sequence sharded along N over the ranks of `group`.

    Each rank passes its contiguous shard, in rank order: q [B, n_r, Hq, D], k1, k2, v1, v2
    [B, n_r, Hk, D] (shards may differ in length, or be empty; a window may be longer than a
    shard). Returns this shard's out [B, n_r, Hq, D] and lse [B, Hq, n_r], equal to those rows
    of `attention` on the whole sequence, both differentiable. Every other argument, and the
    devices and dtypes, as `altattn.simplicial.attention`'s; every rank must pass the same ones,
    or every rank raises ValueError. group: a ProcessGroup, a 1-D DeviceMesh (mesh["cp"]) or None
    (the default group). A collective: every rank of the group calls it, and every rank runs
    the backward through its outputs when gradients are needed (each returns its halo's
    gradients to their owners).

    Each call first all-gathers every rank's shard length and arguments, to check them (a
    small collective and a host sync). shard_lens, every rank's shard length in rank order,
    skips it: the lengths and the other ranks' arguments are then trusted.
    """
    group = process_group(group)
    rank = dist.get_rank(group)
    if shard_lens is None:
        described, error = _describe(q, k1, k2, v1, v2, w1, w2, sm_scale, form, variant,
                                     bwd_variant, deterministic)
        lens = agree(group, q, described, error, _AGREED)
    else:
        check_variant_names(variant, bwd_variant, deterministic)
        validate(q, k1, k2, v1, v2, w1, w2, sm_scale, form=form, cpu_reference=True)
        lens = check_lens(shard_lens, dist.get_world_size(group), rank, q.shape[1])
    opts = {"sm_scale": sm_scale, "variant": variant, "bwd_variant": bwd_variant, "form": form,
            "deterministic": deterministic}
    if len(lens) == 1 or q.shape[0] == 0:
        return attention(q, k1, k2, v1, v2, w1, w2, **opts)
    plan = halo_plan(lens, min(max(w1, w2) - 1, sum(lens)))
    return attend_extended(q, _Halo.apply(plan, rank, group, k1, k2, v1, v2), w1, w2, **opts)


def attend_extended(q, kv_ext, w1, w2, **opts):
    """`attention` of q [B, n, Hq, D] over kv_ext (k1, k2, v1, v2), each [B, h + n, Hk, D]: the
    h halo rows, then the shard's. Zero queries stand in the halo rows; their outputs are
    dropped, and their incoming gradients are 0. Returns out [B, n, Hq, D], lse [B, Hq, n]."""
    h = kv_ext[0].shape[1] - q.shape[1]
    q_ext = torch.cat([q.new_zeros(q.shape[0], h, *q.shape[2:]), q], 1) if h else q
    out, lse = attention(q_ext, *kv_ext, w1, w2, **opts)
    return out[:, h:].contiguous(), lse[:, :, h:].contiguous()


__all__ = ["context_parallel_attention", "halo_plan"]

"""Context parallelism: one sequence sharded along N across the ranks of a process group.

Rank r of a group of P holds the contiguous tokens [o_r, o_r + n_r) of every batch element
(o_r = n_0 + ... + n_{r-1}; shards may differ in length, or be empty). Triple attention passes a
state, S = S0 + c sum_n K1[n] (x) V[n] (x) K2[n], so a rank needs from the others only their
shard states S_r = c sum_{n in shard r} ... (Dq^2 Dv fp32 a head: 1 MiB at D 64), never their
tokens:

    non-causal  every token reads the whole state S0 + sum_r S_r: one all-reduce of the shard
                states; its backward all-reduces the state's gradient
    causal      rank r's tokens read S0 + sum_{r' < r} S_r' (the exclusive prefix) plus their own
                tokens' causal sums: an all-gather of the shard states and a local sum in rank
                order; its backward sums each rank's prefix gradient back to the earlier ranks
                (a reduce-scatter)

The final state, S0 + sum_r S_r, is returned on every rank (bitwise the same: each rank sums the
same numbers in the same order). How each path is built and what it costs: docs/perf-cp.md
("Triple attention").

Transport: altattn.distributed (NCCL for CUDA tensors, gloo for CPU ones; a group whose backend
has no NCCL takes CUDA tensors through host memory: tests on one GPU).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import agree, all_gather_stack, all_reduce_sum, check_lens, process_group
from .ops import attention, check_variant_names
from .pieces import read_state, shard_state
from .spec import REFERENCE_DTYPES, default_scale, validate

Tensor = torch.Tensor


def _fingerprint(state) -> list[float]:
    """Two numbers that differ, in practice, between two different initial states (a plain sum
    and a position-weighted one, NaN and inf mapped to finite stand-ins): every rank must pass
    the same S0, and comparing these costs one pass over it, not an exchange of it."""
    if state is None:
        return [0.0, 0.0, 0.0]
    s = torch.nan_to_num(state.detach().double(), nan=0.5, posinf=1.5, neginf=-1.5).flatten()
    w = torch.linspace(1.0, 2.0, s.numel(), dtype=torch.float64, device=s.device)
    return [1.0, *torch.stack([s.sum(), (s * w).sum()]).tolist()]


def _describe(q1, q2, k1, k2, v, scale, causal, initial_state, variant, bwd_variant,
              deterministic) -> tuple[list[float], Exception | None]:
    """This rank's call as numbers every rank compares (its shard length first), or the error
    its own checks raised (then the numbers say only that)."""
    try:
        check_variant_names(variant, bwd_variant, deterministic)
        spec = validate(q1, q2, k1, k2, v, scale, causal, initial_state, cpu_reference=True)
    except (TypeError, ValueError) as e:
        return [-1.0] * 13, e
    grad = torch.is_grad_enabled() and sum(
        t.requires_grad << i for i, t in enumerate((q1, q2, k1, k2, v, initial_state))
        if t is not None)
    return [float(spec.N), spec.B, spec.H, spec.Dq, spec.Dv, float(spec.causal),
            -1.0 if scale is None else spec.scale,
            REFERENCE_DTYPES.index(q1.dtype) + 100 * (q1.device.type == "cuda"), float(grad),
            float(bool(deterministic)), *_fingerprint(initial_state)], None


_AGREED = ("B", "H", "Dq", "Dv", "causal", "scale", "dtype and device type",
           "requires_grad of each input and of initial_state (and grad mode)", "deterministic",
           "initial_state (None or not)", "initial_state (its values)",
           "initial_state (its values)")


def context_parallel_attention(q1, q2, k1, k2, v, *, group=None, scale=None,
                               causal: bool = False, initial_state=None, variant: str = "auto",
                               bwd_variant: str = "auto", deterministic: bool = False,
                               shard_lens=None):
    """Triple attention of one sequence sharded along N over the ranks of `group`.

    Each rank passes its contiguous shard, in rank order: q1, q2, k1, k2 [B, n_r, H, Dq], v
    [B, n_r, H, Dv] (shards may differ in length, or be empty). Returns this shard's out
    [B, n_r, H, Dv], equal to those rows of `altattn.triple.attention` on the whole sequence,
    and the whole sequence's final state [B, H, Dq, Dv, Dq] (S0 included; the same on every
    rank), both differentiable. scale: c; None is 1/N with N the whole sequence's length (the
    sum of the shards'), refused with an initial_state, as `attention` refuses it.
    initial_state S0: the state of tokens before the whole sequence, the same tensor on every
    rank (every rank raises when they differ); each rank's S0.grad is that rank's share of the
    gradient (the sum over the ranks is the whole loss's), the convention of any tensor every
    rank holds (the layer's weights too). Likewise the final state's gradient: each rank's loss
    may read its copy, and the whole loss is the sum over the ranks. Every other argument, and
    the devices and dtypes, as `attention`'s; every rank must pass the same ones, or every rank
    raises ValueError. group: a ProcessGroup, a 1-D DeviceMesh (mesh["cp"]) or None (the
    default group). A collective: every rank of the group calls it, and every rank runs the
    backward through its outputs when gradients are needed.

    Each call first all-gathers every rank's shard length and arguments, to check them (a
    small collective and a host sync). shard_lens, every rank's shard length in rank order,
    skips it: the lengths and the other ranks' arguments are then trusted.
    """
    group = process_group(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if shard_lens is None:
        described, error = _describe(q1, q2, k1, k2, v, scale, causal, initial_state, variant,
                                     bwd_variant, deterministic)
        lens = agree(group, q1, described, error, _AGREED, op="triple context_parallel_attention")
    else:
        check_variant_names(variant, bwd_variant, deterministic)
        validate(q1, q2, k1, k2, v, scale, causal, initial_state, cpu_reference=True)
        lens = check_lens(shard_lens, world, rank, q1.shape[1])
    c = default_scale(sum(lens)) if scale is None else float(scale)
    opts = {"scale": c, "variant": variant, "bwd_variant": bwd_variant,
            "deterministic": deterministic}
    x = (q1, q2, k1, k2, v)
    if world == 1 or q1.shape[0] * q1.shape[2] == 0:  # one rank; or no heads: empty states
        return attention(*x, causal=causal, initial_state=initial_state, **opts)
    return sharded(x, group, causal, initial_state, opts)


def sharded(x, group, causal: bool, initial_state, opts: dict, composed: bool = False):
    """`context_parallel_attention` after its checks (P > 1, B H > 0; opts: `attention`'s
    scale, resolved, variant, bwd_variant, deterministic). This rank's shard state S_r, the
    states' sum over the ranks, then what the shard reads:
        non-causal  read_state(q1, q2, S0 + sum_r S_r)        (pieces.py: the op's kernels, cut)
        causal      attention(..., initial_state=S0 + sum_{r' < rank} S_r')
    S_r from pieces.shard_state (the op's `partials` and state kernel, no apply), so that
    non-causal costs one call of the op and causal one call plus a state.
    composed=True: the first version, built from calls of the op alone (what each costs:
    docs/perf-cp.md): S_r the state of a whole call on the shard, its out unused, and the
    non-causal read a second call from S0 + sum_r S_r - S_r (it adds S_r back)."""
    q1, q2, k1, k2, v = x
    kernels = {"variant": opts["variant"], "bwd_variant": opts["bwd_variant"]}
    if composed:
        _, own = attention(*x, causal=False, **opts)  # S_r: this shard's state, from 0
    else:
        own = shard_state(k1, k2, v, opts["scale"], **kernels)
    rank = dist.get_rank(group)
    if not causal:  # every token reads the whole state
        total = _sum_over_ranks(own, group, opts["deterministic"])
        if initial_state is not None:
            total = initial_state.to(own.dtype) + total
        if composed:  # the call adds its own S_r back
            return attention(*x, causal=False, initial_state=total - own, **opts)[0], total
        return read_state(q1, q2, total, **kernels), total
    every = all_gather_stack(own, group)
    prefix, total = _prefix_and_total(every, rank, initial_state)
    out, _ = attention(*x, causal=True, initial_state=prefix, **opts)
    # rank 0's out reads no other rank's state: tied to the gather, its backward still takes
    # part in the gather's (a rank whose loss reads only out would otherwise skip it, and the
    # others would wait for it)
    return _Tie.apply(out, every), total


class _Tie(torch.autograd.Function):
    """(out, t) -> out; backward: out's gradient, and zeros for t. Puts t's collective on the
    backward path of out on every rank."""

    @staticmethod
    def forward(ctx, out: Tensor, t: Tensor):
        ctx.t_shape, ctx.t_dtype = t.shape, t.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.new_zeros(ctx.t_shape, dtype=ctx.t_dtype)


def _sum_over_ranks(own: Tensor, group, deterministic: bool) -> Tensor:
    """sum_r S_r on every rank: an all-reduce; deterministic=True, an all-gather summed here in
    rank order (bitwise repeatable whatever the collective's algorithm)."""
    if not deterministic:
        return all_reduce_sum(own, group)
    every = all_gather_stack(own, group)
    total = every[0]
    for r in range(1, every.shape[0]):
        total = total + every[r]
    return total


def _prefix_and_total(every: Tensor, rank: int, initial_state):
    """(S0 + sum_{r' < rank} S_r', S0 + sum_r S_r) from every rank's S_r (stacked): the first
    None when it is a sum of nothing (rank 0, no S0). Every rank sums in rank order, so the
    totals are bitwise equal across ranks."""
    acc, prefix = None if initial_state is None else initial_state.to(every.dtype), None
    for r in range(every.shape[0]):
        if r == rank:
            prefix = acc
        acc = every[r] if acc is None else acc + every[r]
    return prefix, acc


__all__ = ["context_parallel_attention"]

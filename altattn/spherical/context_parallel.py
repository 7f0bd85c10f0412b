"""Context parallelism for spherical attention: one sequence sharded along N over a process group.

Spherical attention's normaliser is additive. Split a query row's keys into parts p, with
U_p = sum_{x in p} s v[x] and Z_p = sum_{x in p} s^2; then exactly

    out = sum_p U_p / (sqrt(sum_p Z_p) + eps),    r = sqrt(sum_p Z_p).

The op returns each part's (out_p, r_p), both differentiable, with out_p (r_p + eps_p) = U_p and
r_p^2 = Z_p: parts merge in plain differentiable PyTorch (`merge`, in fp32; fp64 for fp64), and
the op's own backward (which takes a gradient into r) does the rest. No max, no rescale.

    gather:       K and V of every rank, all-gathered (`altattn.distributed.gather_rows`: shards
                  of any length, padded to the longest); its backward reduce-scatters the key and
                  value gradients back to their owners. No ring: at the issue's shape the gather
                  is ~1 % of the attention (docs/perf-cp.md, spherical section).
    non-causal:   one call, this rank's queries over all N keys (the op takes Nk != N).
    causal:       for each contiguous piece [g, g + n) of the sequence this rank holds: the
                  piece's own diagonal block (causal) and the keys before it, [0, g) (non-causal),
                  merged. A piece at the sequence's start is one causal call.
    layout:       "contiguous": rank r holds tokens [o_r, o_r + n_r) (any lengths, empty too);
                  causal work grows with r (rank r sees (r + 1/2) n^2 pairs with equal shards:
                  the last rank bounds the step, efficiency P / (2P - 1)). "zigzag": the sequence
                  cut into 2P chunks (`zigzag_bounds`), rank r holding chunks r and 2P - 1 - r
                  (in that order): every rank sees the same number of pairs, to within one chunk's
                  rounding. `zigzag_shard` / `zigzag_unshard` cut and reassemble a sequence.

Every rank checks its own inputs and all-gathers a description of its call (`agree`): bad input
on one rank, or ranks that disagree, raise on every rank, never a hang.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import agree, check_lens, gather_rows, process_group
from .ops import attention, check_variant_names
from .spec import DEFAULT_EPS, REFERENCE_DTYPES, validate

Tensor = torch.Tensor
LAYOUTS = ("contiguous", "zigzag")


def zigzag_bounds(N: int, world: int) -> list[int]:
    """The 2·world + 1 boundaries of the zigzag cut: chunk i is tokens [b[i], b[i + 1]),
    b[i] = N·i // (2·world) (lengths differ by at most one; some empty when N < 2·world)."""
    return [N * i // (2 * world) for i in range(2 * world + 1)]


def _zigzag_chunks(rank: int, world: int) -> tuple[int, int]:
    return rank, 2 * world - 1 - rank


def zigzag_lens(N: int, world: int) -> list[int]:
    """Every rank's shard length in the zigzag layout of N tokens (`shard_lens` for it)."""
    b = zigzag_bounds(N, world)
    return [sum(b[c + 1] - b[c] for c in _zigzag_chunks(r, world)) for r in range(world)]


def zigzag_shard(x: Tensor, rank: int, world: int, dim: int = 1) -> Tensor:
    """Rank `rank`'s shard of the whole sequence x in the zigzag layout: chunks rank and
    2·world − 1 − rank of `zigzag_bounds(x.shape[dim], world)`, concatenated (a copy)."""
    b = zigzag_bounds(x.shape[dim], world)
    return torch.cat([x.narrow(dim, b[c], b[c + 1] - b[c]) for c in _zigzag_chunks(rank, world)],
                     dim)


def shard(x: Tensor, rank: int, lens: list[int], layout: str = "contiguous",
          dim: int = 1) -> Tensor:
    """Rank `rank`'s shard of the whole sequence x when the ranks hold `lens` tokens each in
    `layout`: contiguous, a view of rows [sum(lens[:rank]), + lens[rank]); zigzag,
    `zigzag_shard` (lens then `zigzag_lens(N, len(lens))`)."""
    if check_layout(layout) == "zigzag":
        return zigzag_shard(x, rank, len(lens), dim)
    return x.narrow(dim, sum(lens[:rank]), lens[rank])


def zigzag_unshard(shards: list[Tensor], dim: int = 1) -> Tensor:
    """The whole sequence from every rank's zigzag shard, in rank order (`zigzag_shard`'s
    inverse; works as well on outputs [B, n_r, H, D] as on r [B, H, n_r] with dim=2)."""
    world = len(shards)
    b = zigzag_bounds(sum(s.shape[dim] for s in shards), world)
    chunks = []
    for c in range(2 * world):
        r = c if c < world else 2 * world - 1 - c
        first = b[r + 1] - b[r]
        chunks.append(shards[r].narrow(dim, 0 if c < world else first, b[c + 1] - b[c]))
    return torch.cat(chunks, dim)


def pieces(lens: list[int], layout: str) -> list[list[tuple[int, int, int]]]:
    """Per rank, the contiguous pieces of the sequence it holds, in its shard's order, as
    (global start, local start, length). ValueError (the same on every rank, from the agreed
    lengths) when zigzag shards are not the zigzag cut's."""
    world, N = len(lens), sum(lens)
    if layout == "contiguous":
        o = [sum(lens[:r]) for r in range(world)]
        return [[(o[r], 0, n)] for r, n in enumerate(lens)]
    b = zigzag_bounds(N, world)
    out = []
    for r in range(world):
        c1, c2 = _zigzag_chunks(r, world)
        n1, n2 = b[c1 + 1] - b[c1], b[c2 + 1] - b[c2]
        out.append([(b[c1], 0, n1), (b[c2], n1, n2)])
    want = zigzag_lens(N, world)
    if want != list(lens):
        raise ValueError(f"layout='zigzag': the N = {N} tokens cut into {2 * world} chunks "
                         f"(zigzag_bounds) give the ranks {want} tokens (chunks r and "
                         f"{2 * world - 1} - r: zigzag_shard), but the shards hold {list(lens)}")
    return out


def merge(parts: list[tuple[Tensor, Tensor]], part_eps: float, eps: float, dtype: torch.dtype):
    """(out, r) of a row set from its parts' (out_p [B, n, Hq, D], r_p [B, Hq, n]), each computed
    with eps = part_eps: U_p = out_p (r_p + part_eps), r = sqrt(sum r_p^2),
    out = sum U_p / (r + eps). Differentiable; in fp32 (fp64 for fp64 parts); out in `dtype`."""
    acc = torch.promote_types(parts[0][1].dtype, torch.float32)
    u = sum(o.to(acc) * (r.to(acc) + part_eps).transpose(1, 2).unsqueeze(-1) for o, r in parts)
    # vector_norm's gradient is 0 where the norm is 0 (a row that sees only zero scores)
    r = torch.linalg.vector_norm(torch.stack([r.to(acc) for _, r in parts]), dim=0)
    return (u / (r + eps).transpose(1, 2).unsqueeze(-1)).to(dtype), r


def calls(mine: list[tuple[int, int, int]], causal: bool, N: int):
    """This rank's op calls, one list per group of calls whose results merge: each call is
    (first query row of the shard, query rows, first key row, end key row of the sequence,
    causal). `mine`: the rank's pieces (global start, local start, length). Non-causal (or no
    queries): one call over all N keys. Causal: per piece, its diagonal block, then the keys
    before it (none for a piece at the sequence's start). Every rank's calls read keys, so
    every rank's backward reaches the gather's."""
    n = sum(length for _, _, length in mine)
    if not causal or n == 0:
        return [[(0, n, 0, N, False)]]
    return [[(a, m, g, g + m, True)] + ([(a, m, 0, g, False)] if g else [])
            for g, a, m in mine if m]


def attend(q: Tensor, keys: dict, groups, eps: float, **opts):
    """This rank's (out, r) from its `calls` groups; keys[(first, end)]: the (k, v) rows
    [first, end) of the sequence. A group of one call is that call; of several, their parts
    merged (`merge`)."""
    part_eps = eps if eps > 0 else DEFAULT_EPS  # any eps_p > 0: U_p = out_p (r_p + eps_p) exact
    outs, rs = [], []
    for grp in groups:
        e = eps if len(grp) == 1 else part_eps
        parts = [attention(q[:, a:a + n], *keys[(ka, kb)], causal=c, eps=e, **opts)
                 for a, n, ka, kb, c in grp]
        o, r = parts[0] if len(parts) == 1 else merge(parts, part_eps, eps, q.dtype)
        outs.append(o)
        rs.append(r)
    if len(outs) == 1:
        return outs[0], rs[0]
    return torch.cat(outs, 1), torch.cat(rs, 2)


def check_layout(layout) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {LAYOUTS}, got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_local(q, k, v, causal, sm_scale, eps, layout, variant, bwd_variant, deterministic):
    """This rank's own checks (TypeError / ValueError naming the argument); its spec."""
    check_variant_names(variant, bwd_variant, deterministic)
    check_layout(layout)
    spec = validate(q, k, v, causal, sm_scale, eps, None, cpu_reference=True)
    if spec.Nk != spec.N:
        raise ValueError(f"k and v must hold this shard's tokens, as q does: N = {spec.N} rows "
                         f"(dim 1 of q), got Nk = {spec.Nk} (dim 1 of k)")
    return spec


def _describe(q, k, v, causal, sm_scale, eps, layout, *names) -> tuple[list[float],
                                                                      Exception | None]:
    """This rank's call as numbers every rank compares (its shard length first), or the error
    its own checks raised (then the numbers say only that)."""
    try:
        spec = _check_local(q, k, v, causal, sm_scale, eps, layout, *names)
    except (TypeError, ValueError) as e:
        return [-1.0] * 11, e
    grad = torch.is_grad_enabled() and sum(t.requires_grad << i for i, t in enumerate((q, k, v)))
    return [float(spec.N), spec.B, spec.Hq, spec.Hk, spec.D, float(spec.causal), spec.sm_scale,
            spec.eps, REFERENCE_DTYPES.index(q.dtype) + 100 * (q.device.type == "cuda"),
            float(grad), LAYOUTS.index(layout)], None


_AGREED = ("B", "Hq", "Hk", "D", "causal", "sm_scale", "eps", "dtype and device type",
           "requires_grad of each input (and grad mode)", "layout")


def context_parallel_attention(q, k, v, *, group=None, causal: bool = False, sm_scale=None,
                               eps: float = DEFAULT_EPS, variant: str = "auto",
                               bwd_variant: str = "auto", deterministic: bool = False,
                               shard_lens=None, layout: str = "contiguous"):
    """Spherical attention of one sequence sharded along N over the ranks of `group`.

    Each rank passes its shard: q [B, n_r, Hq, D], k and v [B, n_r, Hk, D] (GQA as in
    `attention`). layout="contiguous": rank r holds tokens [n_0 + ... + n_{r-1}, ... + n_r), any
    lengths (empty shards too). layout="zigzag" (balanced causal work): the sequence cut into 2P
    chunks (`zigzag_bounds`), rank r holding chunks r and 2P − 1 − r (`zigzag_shard` cuts a
    sequence so, `zigzag_unshard` reassembles outputs, `zigzag_lens` gives shard_lens). Returns this shard's out [B, n_r, Hq, D]
    and r [B, Hq, n_r], in the shard's row order, equal to those rows of `attention` on the whole
    sequence, both differentiable (the key and value gradients are returned to their owners).
    Other arguments, devices and dtypes as `altattn.spherical.attention`'s (no seqlens: one
    sequence per batch element); every rank must pass the same ones, or every rank raises
    ValueError. group: a ProcessGroup, a 1-D DeviceMesh (mesh["cp"]) or None (the default group);
    NCCL for CUDA tensors, gloo for CPU ones. A collective: every rank of the group calls it,
    and every rank runs the backward through its outputs when gradients are needed.

    Each call first all-gathers every rank's shard length and arguments, to check them (a small
    collective and a host sync). shard_lens, every rank's shard length in rank order, skips it:
    the lengths and the other ranks' arguments are then trusted.

    Non-causal: one call of the op over all N keys. Causal: per contiguous piece of the sequence,
    its diagonal block (causal) and the keys before it (non-causal), merged exactly in fp32
    (module docstring); out is rounded twice on the GPU (each part's bf16 out, then the merge's).
    """
    group = process_group(group)
    rank = dist.get_rank(group)
    args = (causal, sm_scale, eps, layout, variant, bwd_variant, deterministic)
    if shard_lens is None:
        described, error = _describe(q, k, v, *args)
        lens = agree(group, q, described, error, _AGREED, op="spherical context_parallel_attention")
    else:
        _check_local(q, k, v, *args)
        lens = check_lens(shard_lens, dist.get_world_size(group), rank, q.shape[1])
    spec = validate(q, k, v, causal, sm_scale, eps, None, cpu_reference=True)
    opts = {"sm_scale": sm_scale, "variant": variant, "bwd_variant": bwd_variant,
            "deterministic": deterministic}
    held = pieces(lens, layout)  # raises on every rank alike when zigzag shards are not the cut
    if len(lens) == 1 or spec.B == 0 or sum(lens) == 0:
        return attention(q, k, v, causal=spec.causal, eps=eps, **opts)
    order = sorted((g, s, a, a + n) for s, ps in enumerate(held) for g, a, n in ps if n)
    groups = calls(held[rank], spec.causal, sum(lens))
    ranges = sorted({(ka, kb) for grp in groups for _, _, ka, kb, _ in grp})
    kv = gather_rows(torch.stack([k, v]), lens, group, dim=2, slices=ranges,
                     order=[(s, a, b) for _, s, a, b in order])
    return attend(q, {key: (t[0], t[1]) for key, t in zip(ranges, kv)}, groups, eps, **opts)


__all__ = ["context_parallel_attention", "shard", "zigzag_bounds", "zigzag_lens", "zigzag_shard",
           "zigzag_unshard", "LAYOUTS"]

"""What context parallelism shares across families: the process group a call runs on, the
agreement every rank reaches before any collective that could hang, and batched point-to-point
exchange, and a differentiable all-gather of shards of unequal lengths (`gather_rows`).
`torch.distributed` itself: NCCL for CUDA tensors, gloo for CPU ones; a group whose backend has
no NCCL takes CUDA tensors through host memory (tests on one GPU)."""
from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def process_group(group):
    """`group` as a ProcessGroup: None is the default group; a DeviceMesh must be 1-D (pass
    mesh["cp"] for one dimension of a larger mesh). TypeError / ValueError naming `group`."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialized "
                           "(torch.distributed.init_process_group)")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    mesh_type = getattr(getattr(dist, "device_mesh", None), "DeviceMesh", None)
    if mesh_type is not None and isinstance(group, mesh_type):
        if group.ndim != 1:
            raise ValueError(f"group: a DeviceMesh of {group.ndim} dims; pass the sequence "
                             f"dimension's 1-D mesh, e.g. mesh['cp'] (dims: "
                             f"{group.mesh_dim_names})")
        return group.get_group()
    raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None, got "
                    f"{type(group).__name__}")


def agree(group, q, described: list[float], error: Exception | None, agreed: tuple[str, ...],
          op: str = "context_parallel_attention") -> list[int]:
    """All-gather every rank's description (its shard length, then one number per name of
    `agreed`, or -1s when its own checks raised `error`); raise on every rank (never a hang on
    the others) when one rank's checks failed or the ranks disagree. Returns the shard lengths."""
    backend = str(dist.get_backend(group)).lower()
    on_gpu = isinstance(q, Tensor) and q.device.type == "cuda" and "nccl" in backend
    device = q.device if on_gpu else torch.device("cpu")
    mine = torch.tensor(described, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rows = torch.stack(every).tolist()  # one copy to the host, not one per rank
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[0] < 0]
    if failed:
        raise ValueError(f"{op}: the inputs of rank(s) {failed} of the "
                         f"group were refused (their error names the argument)")
    for i, what in enumerate(agreed, start=1):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            raise ValueError(f"{op}: every rank of the group must pass the "
                             f"same {what}; by rank: {values}")
    return [int(row[0]) for row in rows]


def check_lens(shard_lens, world: int, rank: int, n: int) -> list[int]:
    """shard_lens as a list of `world` ints >= 0 whose entry `rank` is this shard's length n,
    else TypeError / ValueError naming shard_lens."""
    if not isinstance(shard_lens, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in shard_lens):
        raise TypeError(f"shard_lens must be a list of ints, got {shard_lens!r}")
    if len(shard_lens) != world or min(shard_lens, default=0) < 0:
        raise ValueError(f"shard_lens must hold {world} lengths >= 0 (one per rank of the "
                         f"group), got {list(shard_lens)}")
    if shard_lens[rank] != n:
        raise ValueError(f"shard_lens[{rank}] = {shard_lens[rank]} but this rank's shard has "
                         f"N = {n} tokens (dim 1 of q)")
    return list(shard_lens)


def _staged(t: Tensor, group) -> bool:
    """Does a CUDA tensor go through host memory (a group with no NCCL: gloo sends host tensors)?"""
    return t.device.type == "cuda" and "nccl" not in str(dist.get_backend(group)).lower()


def exchange(group, sends: list[tuple[int, Tensor]], recvs: list[tuple[int, Tensor]]) -> None:
    """Send each (peer, tensor) of `sends`, fill each buffer of `recvs` from its peer, in one
    batch of point-to-point operations. CUDA tensors go through host memory when the group's
    backend has no NCCL (gloo sends host tensors)."""
    if not sends and not recvs:
        return
    staged = _staged((sends or recvs)[0][1], group)
    ops, landed = [], []
    for peer, t in sends:
        ops.append(dist.P2POp(dist.isend, t.cpu() if staged else t.contiguous(),
                              dist.get_global_rank(group, peer), group))
    for peer, t in recvs:
        buf = torch.empty(t.shape, dtype=t.dtype) if staged else t
        ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, peer), group))
        landed.append((t, buf))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for t, buf in landed:
        if buf is not t:
            t.copy_(buf)


class _GatherRows(torch.autograd.Function):
    """Every rank's x (its `lens[rank]` rows along `dim`) -> the rows [a, b) of each of `slices`
    of the pieces `order` names, concatenated along `dim`, on every rank. Backward: the slices'
    gradients added in fp32 (or fp64) into each owner's rows, summed over ranks (a reduce-scatter
    in that dtype), rounded to x's dtype once. Shards are padded to the longest for the
    collectives."""

    @staticmethod
    def forward(ctx, group, lens, order, slices, dim, x):
        ctx.group, ctx.lens, ctx.order, ctx.slices, ctx.dim = group, lens, order, slices, dim
        ctx.device, ctx.dtype, ctx.staged = x.device, x.dtype, _staged(x, group)
        x = x.cpu() if ctx.staged else x
        m = max(lens)
        if x.shape[dim] == m:
            pad = x.contiguous()
        else:
            pad = x.new_zeros(*x.shape[:dim], m, *x.shape[dim + 1:])
            pad.narrow(dim, 0, x.shape[dim]).copy_(x)
        every = pad.new_empty(len(lens), *pad.shape)
        if "nccl" in str(dist.get_backend(group)).lower():
            dist.all_gather_into_tensor(every, pad, group=group)
        else:
            dist.all_gather(list(every.unbind(0)), pad, group=group)
        out = torch.cat([every[s].narrow(dim, a, b - a) for s, a, b in order], dim)
        out = out.to(ctx.device) if ctx.staged else out
        return tuple(out.narrow(dim, a, b - a) for a, b in slices)

    @staticmethod
    def backward(ctx, *grads):
        dim, lens, rank = ctx.dim, ctx.lens, dist.get_rank(ctx.group)
        acc = torch.promote_types(ctx.dtype, torch.float32)
        shape = list(next(g for g in grads if g is not None).shape)
        shape[dim] = max(lens)
        every = torch.zeros(len(lens), *shape, dtype=acc,
                            device="cpu" if ctx.staged else ctx.device)
        for (a, b), g in zip(ctx.slices, grads):
            if g is None:
                continue
            o = 0  # the slice's rows, piece by piece of `order`, added into their owner's rows
            for s, pa, pb in ctx.order:
                lo, hi = max(a, o), min(b, o + pb - pa)
                if lo < hi:
                    every[s].narrow(dim, pa + lo - o, hi - lo).add_(
                        g.narrow(dim, lo - a, hi - lo).to(every.device, acc))
                o += pb - pa
        if "nccl" in str(dist.get_backend(ctx.group)).lower():
            mine = every.new_empty(shape)
            dist.reduce_scatter_tensor(mine, every, group=ctx.group)
        else:  # gloo has no reduce-scatter: every rank sums every shard (tests: a few ranks)
            dist.all_reduce(every, group=ctx.group)
            mine = every[rank]
        mine = mine.narrow(dim, 0, lens[rank]).to(ctx.device, ctx.dtype)
        return None, None, None, None, None, mine.contiguous()


def gather_rows(x: Tensor, lens: list[int], group, *, dim: int = 1,
                order: list[tuple[int, int, int]] | None = None,
                slices: list[tuple[int, int]] | None = None):
    """Differentiable all-gather of shards of any lengths (empty ones too): rank r passes x
    holding lens[r] rows along `dim`; every rank receives the pieces (rank, a, b) of `order`
    (rows [a, b) of that rank's shard), concatenated along `dim` in that order (default: each
    rank's whole shard, in rank order), or with `slices`, a tuple of the rows [a, b) of that
    concatenation for each (a, b) (views; they may overlap). A piece must not appear twice in
    `order`. The backward returns to each rank the sum over ranks (and slices) of the gradients
    of its rows, accumulated in fp32 and rounded once (NCCL: one reduce-scatter; gloo: an
    all-reduce). A collective: every rank of `group` calls it, and runs its backward."""
    if order is None:
        order = [(s, 0, n) for s, n in enumerate(lens)]
    whole = slices is None
    slices = [(0, sum(b - a for _, a, b in order))] if whole else list(slices)
    out = _GatherRows.apply(group, list(lens), list(order), slices, dim, x)
    return out[0] if whole else out


def _all_reduce_(group, t: Tensor) -> Tensor:
    """Sum `t` (contiguous) over the ranks of `group`, in place (through host memory where
    _staged); returns t."""
    if _staged(t, group):
        host = t.cpu()
        dist.all_reduce(host, group=group)
        return t.copy_(host)
    dist.all_reduce(t, group=group)
    return t


class _AllReduce(torch.autograd.Function):
    """x -> the sum over the ranks of every rank's x, on every rank; backward: the same sum of
    the incoming gradients (each rank's loss reads the sum)."""

    @staticmethod
    def forward(ctx, group, x: Tensor):
        ctx.group = group
        return _all_reduce_(group, x.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return None, _all_reduce_(ctx.group, grad.clone(memory_format=torch.contiguous_format))


class _AllGather(torch.autograd.Function):
    """x -> [P, *x.shape], row r rank r's x, on every rank; backward: rank r's gradient is the
    sum over the ranks of their gradients' row r (a reduce-scatter on NCCL; an all-reduce of
    the whole stack elsewhere: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, group, x: Tensor):
        ctx.group = group
        x = x.contiguous()
        world = dist.get_world_size(group)
        staged = _staged(x, group)
        src = x.cpu() if staged else x
        every = src.new_empty(world, *x.shape)
        dist.all_gather(list(every.unbind(0)), src, group=group)
        return every.to(x.device) if staged else every

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        grad = grad.contiguous()
        if "nccl" in str(dist.get_backend(group)).lower():
            mine = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(mine, grad, group=group)
            return None, mine
        return None, _all_reduce_(group, grad.clone())[dist.get_rank(group)].clone()


def all_reduce_sum(x: Tensor, group) -> Tensor:
    """The sum over the ranks of `group` of every rank's `x` (same shape everywhere), on every
    rank; differentiable (its backward sums the incoming gradients the same way). A collective:
    every rank calls it, and every rank runs its backward when one does."""
    return _AllReduce.apply(group, x)


def all_gather_stack(x: Tensor, group) -> Tensor:
    """Every rank's `x` stacked in rank order, [P, *x.shape], on every rank; differentiable
    (rank r's gradient: the sum over the ranks of their gradients' row r). A collective, as
    all_reduce_sum."""
    return _AllGather.apply(group, x)

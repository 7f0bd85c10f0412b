"""What context parallelism shares across families: the process group a call runs on, the
agreement every rank reaches before any collective that could hang, and batched point-to-point
exchange. `torch.distributed` itself: NCCL for CUDA tensors, gloo for CPU ones; a group whose
backend has no NCCL takes CUDA tensors through host memory (tests on one GPU)."""
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


def exchange(group, sends: list[tuple[int, Tensor]], recvs: list[tuple[int, Tensor]]) -> None:
    """Send each (peer, tensor) of `sends`, fill each buffer of `recvs` from its peer, in one
    batch of point-to-point operations. CUDA tensors go through host memory when the group's
    backend has no NCCL (gloo sends host tensors)."""
    if not sends and not recvs:
        return
    device = (sends or recvs)[0][1].device
    staged = device.type == "cuda" and "nccl" not in str(dist.get_backend(group)).lower()
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


def _staged(group, t: Tensor) -> bool:
    """Whether CUDA tensor `t` goes through host memory on `group` (a backend with no NCCL)."""
    return t.device.type == "cuda" and "nccl" not in str(dist.get_backend(group)).lower()


def _all_reduce_(group, t: Tensor) -> Tensor:
    """Sum `t` (contiguous) over the ranks of `group`, in place (through host memory where
    _staged); returns t."""
    if _staged(group, t):
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
        staged = _staged(group, x)
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

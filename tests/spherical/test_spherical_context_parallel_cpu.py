"""Spherical attention's context parallelism on the CPU: P = 2, 3, 4 processes joined by gloo
(torch.multiprocessing), each holding a shard of one sequence, against the one-process
`attention` on the whole sequence in fp64: out, r and the gradients of q, k, v (a gradient
flowing into r too). Causal and not, GQA, odd and unequal shards, empty shards, B = 0, the
zigzag layout (N not a multiple of 2P, empty chunks), a zero query row, eps and sm_scale given;
the layer with cp_group (a ProcessGroup and a DeviceMesh); errors raised on every rank. The
zigzag helpers and the causal balance are also checked alone, with no processes."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, no_gpu_env, run_gloo_world

from altattn.spherical import SphericalAttention, attention, context_parallel_attention
from altattn.spherical.context_parallel import (
    pieces,
    shard,
    zigzag_lens,
    zigzag_shard,
    zigzag_unshard,
)
from altattn.spherical.spec import NAMES

# fp64 against fp64: the same sums, the parts' merged in another order
FP64_TOL = 1e-12


def _max_rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item() if b.numel() else 0.0


# (lens or N for zigzag, layout, causal, B, Hq, Hk, extra op arguments) by world size
CASES = {
    2: [([8, 8], "contiguous", False, 2, 4, 2, {}),
        ([9, 4], "contiguous", True, 1, 2, 1, {"eps": 1e-3}),
        (13, "zigzag", True, 1, 4, 1, {"sm_scale": 0.3}),
        (13, "zigzag", False, 2, 2, 2, {})],
    3: [([5, 0, 6], "contiguous", True, 1, 2, 2, {}),          # an empty shard, causal
        ([0, 6, 1], "contiguous", False, 2, 4, 1, {}),
        (5, "zigzag", True, 1, 2, 1, {})],                     # N < 2P: empty chunks
    4: [([3, 0, 5, 4], "contiguous", True, 1, 4, 2, {"eps": 0.5}),
        (17, "zigzag", True, 2, 2, 1, {}),
        ([1, 1, 1, 9], "contiguous", True, 1, 2, 2, {}),
        ([2, 3, 2, 3], "contiguous", True, 0, 2, 1, {})],      # B = 0
}


def _lens(spec, world, layout):
    if layout == "contiguous":
        return spec
    return zigzag_lens(spec, world)


def _check_case(rank, world, spec, layout, causal, B, Hq, Hk, extra, seed):
    g = torch.Generator().manual_seed(seed)  # the same whole sequence on every rank
    lens = _lens(spec, world, layout)
    N, D = sum(lens), 64
    full = [torch.randn(B, N, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hk, Hk)]
    if N > 2:
        full[0][:, N // 2] = 0  # a row whose scores are all 0: r = 0, finite gradients
    dout = torch.randn(B, N, Hq, D, generator=g, dtype=torch.float64)
    dr = torch.randn(B, Hq, N, generator=g, dtype=torch.float64)
    mine = [shard(t, rank, lens, layout).clone().requires_grad_() for t in full]
    out, r = context_parallel_attention(*mine, causal=causal, layout=layout, **extra)
    ((out * shard(dout, rank, lens, layout)).sum()
     + (r * shard(dr, rank, lens, layout, dim=2)).sum()).backward()
    whole = [t.clone().requires_grad_() for t in full]
    ro, rr = attention(*whole, causal=causal, **extra)
    ((ro * dout).sum() + (rr * dr).sum()).backward()
    case = (spec, layout, causal, B, Hq, Hk, extra, rank)
    n = lens[rank]
    assert out.shape == (B, n, Hq, D) and r.shape == (B, Hq, n), case
    assert out.dtype == ro.dtype and r.dtype == rr.dtype, case
    assert out.is_contiguous() and r.is_contiguous(), case
    assert _max_rel(out, shard(ro, rank, lens, layout)) <= FP64_TOL, case
    assert _max_rel(r, shard(rr, rank, lens, layout, dim=2)) <= FP64_TOL, case
    for name, m, w in zip(NAMES, mine, whole):
        assert torch.isfinite(m.grad).all(), (name, *case)
        assert _max_rel(m.grad, shard(w.grad, rank, lens, layout)) <= FP64_TOL, (name, *case)
    with torch.no_grad():  # the lengths given: no all-gather of the description, the same call
        trusted = context_parallel_attention(*mine, causal=causal, layout=layout,
                                             shard_lens=lens, **extra)
    assert torch.equal(trusted[0], out) and torch.equal(trusted[1], r), case
    if layout == "zigzag":  # the helper reassembles the outputs
        every = [None] * world  # shards of unequal lengths
        dist.all_gather_object(every, out.detach())
        assert _max_rel(zigzag_unshard(every), ro) <= FP64_TOL, case


def _layer_case(rank, world, seed):
    """The causal GQA layer on shards (a ProcessGroup, contiguous; a DeviceMesh, zigzag): its
    output rows, and its weights' gradients summed over the ranks, against the whole layer."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    N, dim = 11, 16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, N, dim, generator=g, dtype=torch.float64)
    gy = torch.randn(2, N, dim, generator=g, dtype=torch.float64)

    def make(**cp):
        torch.manual_seed(seed)
        return SphericalAttention(dim, 4, 2, 64, causal=True, **cp).double()

    whole = make()
    (whole(x) * gy).sum().backward()
    lens = [N * (r + 1) // world - N * r // world for r in range(world)]
    for layout, group in (("contiguous", dist.group.WORLD), ("zigzag", mesh["cp"])):
        layer = make(cp_group=group, cp_layout=layout)
        xs, gys = (shard(t, rank, lens if layout == "contiguous" else _lens(N, world, layout),
                          layout) for t in (x, gy))
        y = layer(xs)
        (y * gys).sum().backward()
        for (name, p), w in zip(layer.named_parameters(), whole.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            assert _max_rel(grad, w.grad) <= FP64_TOL, (layout, name, rank)
    with pytest.raises(ValueError, match="seqlens: padded or packed batches are not sharded"):
        layer(xs, seqlens=torch.tensor([1, 1], dtype=torch.int32))


def _error_cases(rank):
    """Bad input on one rank, or ranks that disagree: every rank raises (none hangs)."""
    q, k, v = (torch.randn(1, 4, h, 64, dtype=torch.float64) for h in (2, 1, 1))
    cp = context_parallel_attention
    bad_d = torch.randn(1, 4, 1, 63, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"D \(dim 3\) = 63" if rank == 1 else "rank.*1.*refused"):
        cp(q, *((bad_d, bad_d) if rank == 1 else (k, v)))
    with pytest.raises(ValueError, match="k and v must hold" if rank == 2 else "refused"):
        cp(q, k[:, :3] if rank == 2 else k, v[:, :3] if rank == 2 else v)
    with pytest.raises(ValueError, match=r"same causal; by rank: \[1.0, 0.0, 1.0\]"):
        cp(q, k, v, causal=rank != 1)
    with pytest.raises(ValueError, match="same layout"):
        cp(q, k, v, layout="zigzag" if rank else "contiguous")
    with pytest.raises(ValueError, match="same eps"):
        cp(q, k, v, eps=1e-6 * (rank + 1))
    with pytest.raises(ValueError, match="same Hq"):
        cp(q[:, :, : 1 + rank % 2], k, v)
    with pytest.raises(ValueError, match="requires_grad"):  # a backward one rank would skip
        cp(q.clone().requires_grad_(rank == 0), k, v)
    with pytest.raises(ValueError, match=r"layout='zigzag'.*\[5, 4, 4\].*\[4, 4, 5\]"):
        cp(*(torch.cat([t, t[:, :rank // 2]], 1) for t in (q, k, v)), layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        cp(q, k, v, layout="ring")
    with pytest.raises(ValueError, match=r"shard_lens\[\d\] = 5 but"):
        cp(q, k, v, shard_lens=[5, 5, 5])
    with pytest.raises(TypeError, match="group must be"):
        cp(q, k, v, group="world")


def _rank(rank, world, seed):
    for i, case in enumerate(CASES[world]):
        _check_case(rank, world, *case, seed=seed + i)
    if world == 3:
        _error_cases(rank)
    if world in (2, 4):
        _layer_case(rank, world, seed)


@pytest.mark.parametrize("world", sorted(CASES))
def test_shards_equal_one_process(world, seed):
    """Every case of CASES[world], then the errors (P = 3) and the layer (P = 2, 4): a failure
    on any rank fails the test with that rank's traceback."""
    run_gloo_world(_rank, world, seed)


def test_zigzag_helpers_and_balance():
    """zigzag_shard / zigzag_unshard invert each other for any N and P (empty chunks too);
    `pieces` tiles the sequence exactly once; with zigzag every rank sees the same number of
    causal pairs to within one chunk's rounding, while contiguous shards grow with the rank."""
    rng = random.Random(0)
    for _ in range(200):
        world, N = rng.randint(1, 6), rng.choice([0, 1, 5, 12, 37, 64])
        x = torch.arange(N).view(1, N)
        shards = [zigzag_shard(x, r, world) for r in range(world)]
        assert torch.equal(zigzag_unshard(shards), x), (world, N)
        lens = [s.shape[1] for s in shards]
        assert lens == zigzag_lens(N, world), (world, N)
        held = pieces(lens, "zigzag")
        rows = sorted(g + i for ps in held for g, _, n in ps for i in range(n))
        assert rows == list(range(N)), (world, N)
        for r, ps in enumerate(held):  # the local rows of a piece are its global tokens
            assert torch.equal(torch.cat([shards[r][:, a:a + n] for _, a, n in ps], 1),
                               torch.cat([x[:, g:g + n] for g, _, n in ps], 1))
    world, N = 4, 4096
    pairs = {lay: [sum(n * g + n * (n + 1) // 2 for g, _, n in ps)
                   for ps in pieces(_lens(N if lay == "zigzag" else [N // world] * world, world,
                                          lay), lay)] for lay in ("zigzag", "contiguous")}
    assert max(pairs["zigzag"]) - min(pairs["zigzag"]) <= 2 * N // (2 * world), pairs
    assert max(pairs["contiguous"]) / (sum(pairs["contiguous"]) / world) > 1.7, pairs


def test_needs_an_initialized_process_group():
    q, k = torch.randn(1, 4, 2, 64), torch.randn(1, 4, 1, 64)
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(q, k, k)


def test_bench_refuses_before_any_work():
    """bench/cp.py --family spherical (torchrun) exits 2 naming the problem, with no GPU."""
    done = subprocess.run([sys.executable, "-m", "bench.cp", "--family", "spherical"], cwd=ROOT,
                          env=no_gpu_env(), capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr, done.stderr

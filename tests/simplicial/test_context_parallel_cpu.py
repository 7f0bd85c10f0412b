"""Context parallelism on the CPU: P = 2, 3, 4 processes joined by gloo (torch.multiprocessing),
each holding a shard of one sequence, against the one-process `attention` on the whole sequence
in fp64: outputs, LSE and all five gradients. Shards of odd and unequal lengths, empty shards,
windows longer than a shard (halos from several ranks back) and than the sequence, GQA, form
"det", w1 > w2; the layer under FSDP2 (HSDP over a dp x cp mesh), DDP and torch.compile; errors
raised on every rank. The halo plan is also checked alone, with no processes."""
from __future__ import annotations

import itertools
import random
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, no_gpu_env, run_gloo_world

from altattn.simplicial import SimplicialAttention, attention, context_parallel_attention
from altattn.simplicial.context_parallel import halo_plan
from altattn.simplicial.spec import NAMES

# fp64 against fp64: the forward is the same sums; a gradient adds the halo rows' part last
FP64_TOL = 1e-12


def _max_rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item() if b.numel() else 0.0


# (lens, w1, w2, B, Hq, Hk, form) by world size
CASES = {
    2: [([8, 8], 3, 5, 2, 4, 2, "trilinear"),
        ([9, 4], 6, 13, 1, 2, 1, "det")],           # w2 > shard 1: its halo is all of rank 0
    3: [([5, 7, 6], 4, 9, 1, 4, 1, "trilinear"),     # w2 > shard 1: rank 2's halo from 0 and 1
        ([0, 6, 1], 20, 3, 2, 2, 2, "trilinear")],   # empty shard, w1 > w2, windows > N
    4: [([3, 0, 5, 4], 6, 2, 1, 2, 1, "trilinear"),
        ([1, 1, 1, 9], 100, 100, 1, 2, 1, "det"),    # halo from three ranks back
        ([2, 3, 2, 3], 4, 4, 0, 2, 1, "trilinear")],  # B = 0
}


def _shard(lens, rank, *tensors, dim=1):
    a = sum(lens[:rank])
    return [t.narrow(dim, a, lens[rank]) for t in tensors]


def _check_case(rank, lens, w1, w2, B, Hq, Hk, form, seed):
    g = torch.Generator().manual_seed(seed)  # the same whole sequence on every rank
    N, D = sum(lens), 64
    full = [torch.randn(B, N, h, D, generator=g, dtype=torch.float64)
            for h in (Hq, Hk, Hk, Hk, Hk)]
    dout = torch.randn(B, N, Hq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, Hq, N, generator=g, dtype=torch.float64)
    mine = [t.clone().requires_grad_() for t in _shard(lens, rank, *full)]
    out, lse = context_parallel_attention(*mine, w1, w2, form=form)
    ((out * _shard(lens, rank, dout)[0]).sum()
     + (lse * _shard(lens, rank, dlse, dim=2)[0]).sum()).backward()
    whole = [t.clone().requires_grad_() for t in full]
    ro, rl = attention(*whole, w1, w2, form=form)
    ((ro * dout).sum() + (rl * dlse).sum()).backward()
    case = (lens, w1, w2, form, rank)
    assert out.shape == (B, lens[rank], Hq, D) and lse.shape == (B, Hq, lens[rank]), case
    assert out.is_contiguous() and lse.is_contiguous()
    assert _max_rel(out, _shard(lens, rank, ro)[0]) <= FP64_TOL, case
    assert _max_rel(lse, _shard(lens, rank, rl, dim=2)[0]) <= FP64_TOL, case
    for name, m, w in zip(NAMES, mine, whole):
        assert _max_rel(m.grad, _shard(lens, rank, w.grad)[0]) <= FP64_TOL, (name, *case)
    with torch.no_grad():  # the lengths given: no all-gather, the same call
        trusted = context_parallel_attention(*mine, w1, w2, form=form, shard_lens=lens)
    assert torch.equal(trusted[0], out) and torch.equal(trusted[1], lse), case


def _layer_case(rank, seed):
    """P = 4 as a 2 x 2 (dp, cp) mesh: each rank one batch element's shard; FSDP2 over the
    whole mesh (replicated over dp, sharded over cp), then DDP: each rank's mean loss, averaged
    by the wrapper, gives the gradients of the one-process layer's loss over the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    d, c = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    lens, dim = [7, 6], 16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, sum(lens), dim, generator=g, dtype=torch.float64)
    gy = torch.randn(2, sum(lens), dim, generator=g, dtype=torch.float64)

    def make(cp_group):
        torch.manual_seed(seed)
        return SimplicialAttention(dim, 2, 1, 64, 3, 9, cp_group=cp_group).double()

    ref = make(None)
    (ref(x) * gy).sum().div(4).backward()  # four ranks' losses, averaged
    x_mine, gy_mine = (_shard(lens, c, t[d:d + 1])[0] for t in (x, gy))
    for wrap in ("fsdp", "ddp"):
        layer = make(mesh["cp"])
        if wrap == "fsdp":
            fully_shard(layer, mesh=mesh)
        else:
            layer = DistributedDataParallel(layer)
        (layer(x_mine) * gy_mine).sum().backward()
        for (name, p), r in zip(layer.named_parameters(), ref.parameters()):
            grad = p.grad.full_tensor() if wrap == "fsdp" else p.grad
            assert _max_rel(grad, r.grad) <= FP64_TOL, (wrap, name, rank)


def _compiled_layer_case(rank, seed):
    """torch.compile of the layer (graph breaks around the messages): eager's outputs and
    gradients, bitwise. aot_eager: the graphs without inductor's C++ build (slow on CI)."""
    torch.manual_seed(seed)
    layer = SimplicialAttention(16, 2, 1, 64, 3, 9, cp_group=dist.group.WORLD).double()
    x = torch.randn(1, 7 - rank, 16, dtype=torch.float64)
    runs = []
    for m in (layer, torch.compile(layer, backend="aot_eager")):
        layer.zero_grad()
        y = m(x)
        y.square().sum().backward()
        runs.append([y.detach(), *(p.grad.clone() for p in layer.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*runs)), rank


def _error_cases(rank):
    """Bad input on one rank, or ranks that disagree: every rank raises (none hangs)."""
    q, k1, k2, v1, v2 = (torch.randn(1, 4, h, 64, dtype=torch.float64) for h in (2, 1, 1, 1, 1))
    bad_d = torch.randn(1, 4, 1, 63, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"D \(dim 3\) = 63" if rank == 1 else "rank.*1.*refused"):
        context_parallel_attention(q, k1, bad_d if rank == 1 else k2, v1, v2, 3, 5)
    with pytest.raises(ValueError, match=r"same w1; by rank: \[3.0, 4.0, 5.0\]"):
        context_parallel_attention(q, k1, k2, v1, v2, 3 + rank, 5)
    with pytest.raises(ValueError, match="same Hq"):
        context_parallel_attention(q[:, :, : 1 + rank % 2], k1, k2, v1, v2, 3, 5)
    with pytest.raises(ValueError, match="requires_grad"):  # a backward one rank would skip
        context_parallel_attention(q.requires_grad_(rank == 0), k1, k2, v1, v2, 3, 5)
    with pytest.raises(ValueError, match=r"shard_lens\[\d\] = 5 but"):
        context_parallel_attention(q, k1, k2, v1, v2, 3, 5, shard_lens=[5, 5, 5])
    with pytest.raises(ValueError, match="3 lengths"):
        context_parallel_attention(q, k1, k2, v1, v2, 3, 5, shard_lens=[4, 4])
    with pytest.raises(TypeError, match="shard_lens must be a list of ints"):
        context_parallel_attention(q, k1, k2, v1, v2, 3, 5, shard_lens=torch.tensor([4, 4, 4]))
    with pytest.raises(TypeError, match="group must be"):
        context_parallel_attention(q, k1, k2, v1, v2, 3, 5, group="world")
    with pytest.raises(ValueError, match="cu_seqlens"):
        SimplicialAttention(16, 2, 1, 64, 3, 5, cp_group=dist.group.WORLD)(
            torch.randn(4, 16), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


def _rank(rank, world, seed):
    for i, case in enumerate(CASES[world]):
        _check_case(rank, *case, seed=seed + i)
    if world == 3:
        _error_cases(rank)
    if world == 2:
        _compiled_layer_case(rank, seed)
    if world == 4:
        _layer_case(rank, seed)


@pytest.mark.parametrize("world", sorted(CASES))
def test_shards_equal_one_process(world, seed):
    """Every case of CASES[world], then the compiled layer (P = 2), the errors (P = 3), the
    layer under FSDP2 and DDP (P = 4): a failure on any rank fails the test with that rank's
    traceback."""
    run_gloo_world(_rank, world, seed)


def test_halo_plan_covers_exactly_the_window_before_each_shard():
    """For random shard lengths (empty ones too) and halos: each non-empty shard receives, in
    order, exactly the tokens [max(0, o_r - halo), o_r); each message is sent by its owner."""
    rng = random.Random(0)
    for _ in range(500):
        lens = [rng.choice([0, 1, 2, 5, 17]) for _ in range(rng.randint(1, 6))]
        halo = rng.choice([0, 1, 3, 16, 100])
        plan = halo_plan(lens, halo)
        o = plan.offsets
        for r, n in enumerate(lens):
            got = list(itertools.chain.from_iterable(range(o[s] + a, o[s] + b)
                                                     for s, a, b in plan.recv[r]))
            assert got == (list(range(max(0, o[r] - halo), o[r])) if n else []), (lens, halo, r)
            assert all(s < r and lens[s] for s, _, _ in plan.recv[r])
        assert sorted((s, r, a, b) for s in range(len(lens)) for r, a, b in plan.send[s]) == \
            sorted((s, r, a, b) for r in range(len(lens)) for s, a, b in plan.recv[r])


def test_needs_an_initialized_process_group():
    q, k = torch.randn(1, 4, 2, 64), torch.randn(1, 4, 1, 64)
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(q, k, k, k, k, 3, 5)


@pytest.mark.parametrize("args, needle", [(["--tokens-per-rank", "100"], "--tokens-per-rank"),
                                          ([], "needs a CUDA GPU")])
def test_bench_refuses_before_any_work(args, needle):
    """bench/cp.py (torchrun) exits 2 naming the problem, with no GPU and no process group."""
    done = subprocess.run([sys.executable, "-m", "bench.cp", *args], cwd=ROOT, env=no_gpu_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and needle in done.stderr, done.stderr

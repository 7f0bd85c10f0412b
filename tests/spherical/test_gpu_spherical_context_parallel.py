"""Spherical attention's context parallelism on GPUs (skipped without one): P ranks, each holding
a shard of one sequence, in bf16, against one GPU's `attention` on the whole sequence and the
fp64 reference: out, r and the gradients of q, k, v (a gradient flowing into r too), within the
family's TOLERANCES; the layer's outputs and weight gradients. With one GPU two ranks share it
and talk through gloo (CUDA tensors staged through host memory); with two or more, one rank a
GPU over NCCL (P = 2)."""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from altattn.spherical import SphericalAttention, attention, context_parallel_attention
from altattn.spherical.context_parallel import shard, zigzag_lens, zigzag_shard
from altattn.spherical.family import TOLERANCES
from altattn.spherical.reference import reference, reference_backward
from altattn.spherical.spec import NAMES

pytestmark = pytest.mark.gpu

# (lens, or N for zigzag; layout, causal, Hq, Hk, D): odd, unequal and empty shards, GQA
CASES = [([1000, 1337], "contiguous", False, 16, 4, 128),
         ([777, 1500], "contiguous", True, 8, 8, 64),
         (2333, "zigzag", True, 16, 2, 128),
         ([0, 900], "contiguous", True, 4, 1, 128)]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _lens(spec, world, layout):
    if layout == "contiguous":
        return spec
    return zigzag_lens(spec, world)


def _check(rank, world, case, seed):
    spec, layout, causal, Hq, Hk, D = case
    lens = _lens(spec, world, layout)
    N, n = sum(lens), lens[rank]
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU, the same on every rank
    full = [torch.randn(1, N, h, D, generator=g).cuda().bfloat16() for h in (Hq, Hk, Hk)]
    dout = torch.randn(1, N, Hq, D, generator=g).cuda().bfloat16()
    dr = torch.randn(1, Hq, N, generator=g).cuda()
    mine = [shard(t, rank, lens, layout).clone().requires_grad_() for t in full]
    out, r = context_parallel_attention(*mine, causal=causal, layout=layout)
    ((out.float() * shard(dout, rank, lens, layout)).sum()
     + (r * shard(dr, rank, lens, layout, dim=2)).sum()).backward()
    whole = [t.clone().requires_grad_() for t in full]
    ro, rr = attention(*whole, causal=causal)
    ((ro.float() * dout).sum() + (rr * dr).sum()).backward()
    if not n:
        return
    x64 = [t.double() for t in full]
    fo, fr = reference(*x64, causal=causal)
    fg = reference_backward(*x64, dout.double(), dr.double(), causal=causal)
    sh = lambda t, dim=1: shard(t, rank, lens, layout, dim)  # noqa: E731
    errs = {"out": (_rel(out, sh(ro)), _rel(out, sh(fo)), _rel(sh(ro), sh(fo))),
            "r": (_rel(r, sh(rr, 2)), _rel(r, sh(fr, 2)), _rel(sh(rr, 2), sh(fr, 2))),
            **{k: (_rel(m.grad, sh(w.grad)), _rel(m.grad, sh(f)), _rel(sh(w.grad), sh(f)))
               for k, m, w, f in zip(NAMES, mine, whole, fg)}}
    print(f"cp {case} rank {rank}: (vs one GPU, vs fp64; one GPU vs fp64) "
          + ", ".join(f"{k} {a:.2e} {b:.2e}; {c:.2e}" for k, (a, b, c) in errs.items()),
          flush=True)  # pytest -s
    for name, (vs_one, vs_fp64, _) in errs.items():
        # (the parts' outputs and gradients are rounded to bf16 before they are summed: on the
        # CPU, with exact parts, that makes cp's error 1.4-1.8x one call's)
        tol = TOLERANCES[f"{name}_rel" if name in ("out", "r") else "grad_rel"]
        assert vs_one < tol and vs_fp64 < tol, (name, case, rank, vs_one, vs_fp64)


def _layer_case(rank, world, seed):
    """The causal GQA layer on zigzag shards: its output rows, and its weights' gradients summed
    over the ranks (each rank's part of the whole loss), against the layer on the whole sequence."""
    def make(cp_group):
        torch.manual_seed(seed)
        return SphericalAttention(512, 16, 4, 128, causal=True, cp_group=cp_group,
                                  cp_layout="zigzag").cuda()

    N = 1501
    x = torch.randn(1, N, 512, generator=torch.Generator().manual_seed(seed)).cuda()
    whole, sharded = make(None), make(dist.group.WORLD)
    y = whole(x)
    y.square().sum().backward()
    xs = zigzag_shard(x, rank, world)
    ys = sharded(xs)
    ys.square().sum().backward()
    assert _rel(ys, zigzag_shard(y, rank, world)) < TOLERANCES["out_rel"], rank
    for (name, p), w in zip(sharded.named_parameters(), whole.parameters()):
        grad = p.grad.cpu() if dist.get_backend() == "gloo" else p.grad.clone()
        dist.all_reduce(grad)
        assert _rel(grad.cuda(), w.grad) < TOLERANCES["grad_rel"], (name, rank)


def _worker(rank, world, path, backend, seed):
    torch.cuda.set_device(rank if backend == "nccl" else 0)
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for i, case in enumerate(CASES):
            _check(rank, world, case, seed + i)
        _layer_case(rank, world, seed)
    finally:
        dist.destroy_process_group()


def _run(world, backend, seed):
    with tempfile.NamedTemporaryFile() as f:
        mp.start_processes(_worker, args=(world, f.name + ".store", backend, seed),
                           nprocs=world, start_method="spawn")


def test_shards_on_one_gpu_equal_one_call(seed):
    """Two ranks share the one GPU (gloo): the kernels' path of context parallelism."""
    _run(2, "gloo", seed)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs (NCCL)")
def test_shards_on_two_gpus_equal_one_gpu(seed):
    """One rank per GPU, NCCL (P = 2): the transport a training run uses."""
    _run(2, "nccl", seed)

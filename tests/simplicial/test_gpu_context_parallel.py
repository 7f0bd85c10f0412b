"""Context parallelism on GPUs (skipped without one): P ranks, each holding a shard of one
sequence, against one GPU's `attention` on the whole sequence, in bf16: outputs, LSE and all
five gradients; the layer's outputs and weight gradients. With one GPU the ranks share it and talk through gloo (CUDA tensors staged
through host memory); with several, each rank has its own GPU and NCCL."""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from altattn.simplicial import SimplicialAttention, attention, context_parallel_attention
from altattn.simplicial.family import TOLERANCES
from altattn.simplicial.spec import NAMES

pytestmark = pytest.mark.gpu

# (lens, Hq, Hk, D, w1, w2): S*'s heads and windows with shards shorter than w2 (rank 2's halo
# from ranks 0 and 1), and G = 64, D = 64 (other kernels) with w1 > w2
CASES = [([700, 300, 1100], 128, 1, 128, 32, 512),
         ([333, 0, 900], 128, 2, 64, 200, 48)]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _worker(rank, world, path, backend, lens_of, seed):
    torch.cuda.set_device(rank if backend == "nccl" else 0)
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for i, (lens, Hq, Hk, D, w1, w2) in enumerate(CASES):
            lens = lens_of(lens, world)
            g = torch.Generator(device="cuda").manual_seed(seed + i)
            N, a = sum(lens), sum(lens[:rank])
            full = [torch.randn(1, N, h, D, generator=g, device="cuda").bfloat16()
                    for h in (Hq, Hk, Hk, Hk, Hk)]
            dout = torch.randn(1, N, Hq, D, generator=g, device="cuda").bfloat16()
            mine = [t[:, a:a + lens[rank]].clone().requires_grad_() for t in full]
            out, lse = context_parallel_attention(*mine, w1, w2)
            out.backward(dout[:, a:a + lens[rank]])
            whole = [t.clone().requires_grad_() for t in full]
            ro, rl = attention(*whole, w1, w2)
            ro.backward(dout)
            if not lens[rank]:
                continue
            case = (lens, Hq, Hk, D, w1, w2, rank)
            rel = {"out": _rel(out, ro[:, a:a + lens[rank]]),
                   **{n: _rel(m.grad, w.grad[:, a:a + lens[rank]])
                      for n, m, w in zip(NAMES, mine, whole)}}
            lse_err = (lse - rl[:, :, a:a + lens[rank]]).abs().max().item()
            print(f"cp vs one call {case}: lse {lse_err:.2e}, out bitwise "
                  f"{torch.equal(out, ro[:, a:a + lens[rank]])}, "
                  + ", ".join(f"{k} {v:.2e}" for k, v in rel.items()), flush=True)  # pytest -s
            assert lse_err < TOLERANCES["lse_abs"], case
            for name, r in rel.items():
                assert r < TOLERANCES[f"{name}_rel" if name == "out" else "grad_rel"], \
                    (name, *case)
        _layer_case(rank, lens_of([700, 300, 1100], world), seed)
    finally:
        dist.destroy_process_group()


def _layer_case(rank, lens, seed):
    """The layer on shards: its output rows, and its weights' gradients summed over the ranks
    (each rank's part of the whole loss), against the layer on the whole sequence."""
    def make(cp_group):
        torch.manual_seed(seed)
        return SimplicialAttention(256, 128, 1, 128, 32, 512, cp_group=cp_group).cuda()

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, sum(lens), 256, generator=g, device="cuda")
    a, n = sum(lens[:rank]), lens[rank]
    whole, sharded = make(None), make(dist.group.WORLD)
    y = whole(x)
    y.square().sum().backward()
    ys = sharded(x[:, a:a + n])
    ys.square().sum().backward()
    if n:
        assert _rel(ys, y[:, a:a + n]) < TOLERANCES["out_rel"], rank
    for (name, p), w in zip(sharded.named_parameters(), whole.parameters()):
        grad = p.grad.cpu() if dist.get_backend() == "gloo" else p.grad.clone()
        dist.all_reduce(grad)
        assert _rel(grad.cuda(), w.grad) < TOLERANCES["grad_rel"], (name, rank)


def _three(lens, world):
    return lens if world == 3 else [lens[0], lens[1] + lens[2]]


def _run(world, backend, lens_of, seed):
    with tempfile.NamedTemporaryFile() as f:
        mp.start_processes(_worker, args=(world, f.name + ".store", backend, lens_of, seed),
                           nprocs=world, start_method="spawn")


@pytest.mark.parametrize("world", [2, 3])
def test_shards_on_one_gpu_equal_one_call(world, seed):
    """World ranks share the one GPU (gloo): the kernels' path of context parallelism."""
    _run(world, "gloo", _three, seed)


def _split(lens, world):
    """The CASES sequence cut into `world` near-equal shards (shorter than w2 from 4 ranks)."""
    N = sum(lens)
    return [N * (r + 1) // world - N * r // world for r in range(world)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs (NCCL)")
def test_shards_on_several_gpus_equal_one_gpu(seed):
    """One rank per GPU (up to 8), NCCL: the transport a training run uses."""
    world = min(torch.cuda.device_count(), 8)
    _run(world, "nccl", _split, seed)

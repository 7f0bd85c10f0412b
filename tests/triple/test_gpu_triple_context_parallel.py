"""Triple attention's context parallelism on GPUs (skipped without one): P ranks, each holding a
shard of one sequence, against one GPU's `attention` on the whole sequence, in bf16: out, the final
state and the gradients of q1, q2, k1, k2, v and initial_state, causal and not, both kernel
variants; the layer's outputs and weight gradients; and the pieces (shard_state, read_state)
against the op in one process. With one GPU two ranks share it and talk through gloo (CUDA tensors
staged through host memory); with several, each rank has its own GPU and NCCL."""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from altattn.triple import TripleAttention, attention, context_parallel_attention
from altattn.triple.family import TOLERANCES
from altattn.triple.pieces import read_state, shard_state

pytestmark = pytest.mark.gpu
NAMES = ("q1", "q2", "k1", "k2", "v")

# (lens, H, Dq, Dv, causal, scale, with S0, variant): ragged shards (no multiple of a tile), an
# empty one, Dq != Dv both ways
CASES = [([3000, 5000], 4, 64, 64, False, None, False, "auto"),
         ([3000, 5000], 4, 64, 64, True, None, False, "auto"),
         ([2500, 0], 2, 32, 128, True, 1e-3, True, "triton"),
         ([1000, 3100], 2, 128, 64, False, 1e-3, True, "triton")]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _gathered_sum(t):
    """The sum over the ranks of t (a CUDA tensor), whatever the backend."""
    t = t.detach().clone()
    if dist.get_backend() == "nccl":
        dist.all_reduce(t)
        return t
    host = t.cpu()
    dist.all_reduce(host)
    return host.cuda()


def _worker(rank, world, path, backend, lens_of, seed):
    torch.cuda.set_device(rank if backend == "nccl" else 0)
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for i, (lens, H, Dq, Dv, causal, scale, with_state, variant) in enumerate(CASES):
            lens = lens_of(lens, world)
            g = torch.Generator(device="cuda").manual_seed(seed + i)
            N, a, n = sum(lens), sum(lens[:rank]), lens[rank]
            full = [torch.randn(1, N, H, d, generator=g, device="cuda").bfloat16()
                    for d in (Dq, Dq, Dq, Dq, Dv)]
            s0 = (0.05 * torch.randn(1, H, Dq, Dv, Dq, generator=g, device="cuda")
                  if with_state else None)
            dout = torch.randn(1, N, H, Dv, generator=g, device="cuda").bfloat16()
            dstates = torch.randn(world, 1, H, Dq, Dv, Dq, generator=g, device="cuda")
            opts = {"scale": scale, "causal": causal, "variant": variant, "bwd_variant": variant}
            mine = [t[:, a:a + n].clone().requires_grad_() for t in full]
            s0_mine = s0.clone().requires_grad_() if with_state else None
            out, state = context_parallel_attention(*mine, initial_state=s0_mine, **opts)
            torch.autograd.backward((out, state), (dout[:, a:a + n], dstates[rank]))
            whole = [t.clone().requires_grad_() for t in full]
            s0_whole = s0.clone().requires_grad_() if with_state else None
            ro, rs = attention(*whole, initial_state=s0_whole, **opts)
            torch.autograd.backward((ro, rs), (dout, dstates.sum(0)))
            case = (lens, H, Dq, Dv, causal, scale, with_state, variant, rank)
            rel = {"state": _rel(state, rs)}
            if n:
                rel["out"] = _rel(out, ro[:, a:a + n])
                rel.update({n_: _rel(m.grad, w.grad[:, a:a + n])
                            for n_, m, w in zip(NAMES, mine, whole)})
            if with_state:
                rel["initial_state"] = _rel(_gathered_sum(s0_mine.grad), s0_whole.grad)
            print(f"cp vs one GPU {case}: out bitwise "
                  f"{n > 0 and torch.equal(out, ro[:, a:a + n])}, "
                  + ", ".join(f"{k} {v:.2e}" for k, v in rel.items()), flush=True)  # pytest -s
            for name, r in rel.items():
                tol = TOLERANCES[f"{name}_rel" if name in ("out", "state") else "grad_rel"]
                assert r < tol, (name, r, *case)
        _layer_case(rank, lens_of([3000, 5000], world), seed)
    finally:
        dist.destroy_process_group()


def _layer_case(rank, lens, seed):
    """The causal layer on shards: its output rows, and its weights' gradients summed over the
    ranks (each rank's part of the whole loss), against the layer on the whole sequence."""
    def make(cp_group):
        torch.manual_seed(seed)
        return TripleAttention(256, 4, 64, causal=True, cp_group=cp_group).cuda()

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
        assert _rel(_gathered_sum(p.grad), w.grad) < TOLERANCES["grad_rel"], (name, rank)


def _two(lens, world):
    return lens


def _split(lens, world):
    """The case's sequence cut into `world` near-equal shards (an empty one stays empty)."""
    if 0 in lens:
        return [sum(lens)] + [0] * (world - 1)
    N = sum(lens)
    return [N * (r + 1) // world - N * r // world for r in range(world)]


def _run(world, backend, lens_of, seed):
    with tempfile.NamedTemporaryFile() as f:
        mp.start_processes(_worker, args=(world, f.name + ".store", backend, lens_of, seed),
                           nprocs=world, start_method="spawn")


def test_shards_on_one_gpu_equal_one_call(seed):
    """Two ranks share the one GPU (gloo): the kernels' path of context parallelism."""
    _run(2, "gloo", _two, seed)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs (NCCL)")
def test_shards_on_several_gpus_equal_one_gpu(seed):
    """One rank per GPU (up to 8), NCCL: the transport a training run uses."""
    _run(min(torch.cuda.device_count(), 8), "nccl", _split, seed)


@pytest.mark.parametrize("variant", ["tlx", "triton"])
@pytest.mark.parametrize("Dq, Dv", [(64, 64), (32, 128)])
def test_pieces_equal_the_op(variant, Dq, Dv, seed):
    """read_state(q1, q2, shard_state(k1, k2, v, c)) runs the non-causal op's kernels, cut at the
    state: out, the state and the five gradients as the op's (printed: whether bitwise)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = [torch.randn(2, 3001, 3, d, generator=g, device="cuda").bfloat16().requires_grad_()
         for d in (Dq, Dq, Dq, Dq, Dv)]
    dout = torch.randn(2, 3001, 3, Dv, generator=g, device="cuda").bfloat16()
    dstate = torch.randn(2, 3, Dq, Dv, Dq, generator=g, device="cuda")
    c = 1 / 3001
    state = shard_state(x[2], x[3], x[4], c, variant, variant)
    out = read_state(x[0], x[1], state, variant, variant)
    got = [out, state, *torch.autograd.grad((out, state), x, (dout, dstate))]
    ro, rs = attention(*x, scale=c, variant=variant, bwd_variant=variant)
    want = [ro, rs, *torch.autograd.grad((ro, rs), x, (dout, dstate))]
    for name, a, b in zip(("out", "state", *NAMES), got, want):
        print(name, "bitwise" if torch.equal(a, b) else f"rel {_rel(a, b):.2e}")
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _rel(a, b) < 1e-3, name

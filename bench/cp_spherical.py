"""Spherical attention's context parallelism: weak scaling of one sequence of P x
--tokens-per-rank tokens sharded over P GPUs, against one GPU, in the same run (docs/perf-cp.md).

    torchrun --nproc_per_node P -m bench.cp --family spherical [--tokens-per-rank 65536]
        [--heads 16] [--kv-heads 16] [--head-dim 128] [--mask none|causal|both]
        [--pass fwd|fwd+bwd] [--iters 5] [--backend nccl|gloo] [--json PATH]

One sequence (B 1), Hq --heads, Hk --kv-heads, D --head-dim; rank r holds n = --tokens-per-rank
tokens. Paths, each a step of --pass on every rank at once, taking turns step by step:
    alone      `attention` on the rank's n tokens as if they were a whole sequence (P = 1's work
               at the same tokens per GPU: the weak-scaling reference)
    whole      `attention` on all P n tokens on one GPU (each rank alone: the same FLOPs as the
               whole context-parallel step, on one GPU)
    cp         `context_parallel_attention`, layout "contiguous" (the arguments checked each call)
    cp_zigzag  the same, layout "zigzag" (causal balanced; no different from cp when not causal)
    nocomm     the zigzag step's attention and merges on K, V already gathered: a rank's compute
               under context parallelism without the messages (cp_zigzag - nocomm: their cost)
A step's time is the slowest rank's (CUDA events, max over ranks), the median of --iters steps
after two warm-up steps. TFLOPS per GPU: useful FLOPs (`altattn.spherical.shapes.pass_flops`:
4 Hq D per visible (query, key) pair forward, 2.5x that backward) over the step's time and the
GPUs that share it: alone's of n tokens on 1 GPU, whole's of P n tokens on 1 GPU, the cp paths'
of P n tokens on P GPUs. **Efficiency** (weak scaling): a path's TFLOPS per GPU over alone's;
"vs whole": over whole's (strong scaling at the same sequence). work max/mean: the busiest rank's
visible pairs over the mean (the causal imbalance of the layout; 1 is balanced). Peak memory: the
largest `torch.cuda.max_memory_allocated` of one step over the ranks, inputs included.
With --backend gloo (CUDA tensors through host memory) ranks may share one GPU: a test of the
script, not a measurement.
"""
from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.distributed as dist

from altattn.spherical import attention, context_parallel_attention
from altattn.spherical.context_parallel import attend, calls, pieces
from altattn.spherical.shapes import Shape, pass_flops
from bench.cp import _time
from profiling.common import report

PATHS = ("alone", "whole", "cp", "cp_zigzag", "nocomm")


def _randn(*shape, seed):
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU, then moved
    return torch.randn(*shape, generator=g).cuda().bfloat16()


def _step(path, t, causal, backward):
    for x in (*t["x"], *t["whole"], *t["full"]):
        x.grad = None
    q, k, v = t["x"]
    if path == "alone":
        out, _ = attention(q, k, v, causal=causal)
    elif path == "whole":
        out, _ = attention(*t["whole"], causal=causal)
    elif path == "nocomm":
        groups = t["groups"][causal]
        keys = {(a, b): (t["full"][0][:, a:b], t["full"][1][:, a:b])
                for grp in groups for _, _, a, b, _ in grp}
        out, _ = attend(q, keys, groups, 1e-6)
    else:
        out, _ = context_parallel_attention(q, k, v, causal=causal,
                                            layout="zigzag" if path == "cp_zigzag" else
                                            "contiguous")
    if backward:
        out.backward(t["dout_whole"] if path == "whole" else t["dout"])


def _imbalance(lens, layout, causal) -> float:
    """The busiest rank's visible (query, key) pairs over the mean."""
    N = sum(lens)
    pairs = [sum(n * g + n * (n + 1) // 2 if causal else n * N for g, _, n in ps)
             for ps in pieces(lens, layout)]
    return max(pairs) * len(pairs) / sum(pairs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="torchrun --nproc_per_node P -m bench.cp --family spherical",
                                description=__doc__.split("\n")[0])
    p.add_argument("--tokens-per-rank", type=int, default=65536)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    p.add_argument("--mask", choices=["none", "causal", "both"], default="both")
    p.add_argument("--pass", dest="pass_", choices=["fwd", "fwd+bwd"], default="fwd+bwd")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    p.add_argument("--json", help="write the rows (and the run's metadata) here")
    a = p.parse_args(argv)
    hq, d = a.heads, a.head_dim
    hk = a.kv_heads or hq
    if a.tokens_per_rank < 2 or a.tokens_per_rank % 2:
        p.error("--tokens-per-rank must be even and >= 2 (two zigzag chunks a rank)")
    if hq < 1 or hk < 1 or hq % hk:
        p.error("--heads must be a positive multiple of --kv-heads")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group(a.backend)
    P, rank, n = dist.get_world_size(), dist.get_rank(), a.tokens_per_rank
    N, lens = P * n, [n] * P
    seed = 1000 * rank
    t = {"x": [_randn(1, n, h, d, seed=seed + i).requires_grad_()
               for i, h in enumerate((hq, hk, hk))],
         "whole": [_randn(1, N, h, d, seed=seed + 3 + i).requires_grad_()
                   for i, h in enumerate((hq, hk, hk))],
         "full": [_randn(1, N, hk, d, seed=seed + 6 + i).requires_grad_() for i in range(2)],
         "dout": _randn(1, n, hq, d, seed=seed + 8),
         "dout_whole": _randn(1, N, hq, d, seed=seed + 9),
         "groups": {c: calls(pieces(lens, "zigzag")[rank], c, N) for c in (False, True)}}
    backward = a.pass_ == "fwd+bwd"
    scale = 3.5 if backward else 1.0  # forward + backward (2.5x)
    rows = []
    for causal in {"none": [False], "causal": [True], "both": [False, True]}[a.mask]:
        fl = {m: pass_flops(Shape(1, m, hq, hk, d, causal=causal)) * scale for m in (n, N)}
        useful = {"alone": fl[n], "whole": fl[N], **{q: fl[N] / P for q in PATHS[2:]}}
        timed = _time({q: functools.partial(_step, q, t, causal, backward) for q in PATHS},
                      a.iters)
        tf = {q: useful[q] / timed[q][0] / 1e9 for q in PATHS}
        work = {"cp": _imbalance(lens, "contiguous", causal),
                **dict.fromkeys(("cp_zigzag", "nocomm"), _imbalance(lens, "zigzag", causal))}
        rows += [{"path": q, "causal": causal, "P": P, "tokens_per_rank": n, "tokens": N,
                  "pass": a.pass_, "ms": round(timed[q][0], 3), "tflops_per_gpu": round(tf[q], 1),
                  "efficiency": round(tf[q] / tf["alone"], 3),
                  "vs_whole": round(tf[q] / tf["whole"], 3),
                  "work_max_over_mean": round(work.get(q, 1.0), 3),
                  "peak_gib_per_gpu": round(timed[q][1] / 2 ** 30, 2)} for q in PATHS]
    if rank == 0:
        report(rows, [("path", "path"), ("causal", "causal"), ("ms", "ms"),
                      ("tflops_per_gpu", "TFLOPS/GPU"), ("efficiency", "efficiency"),
                      ("vs_whole", "vs whole"), ("work_max_over_mean", "work max/mean"),
                      ("peak_gib_per_gpu", "peak GiB/GPU")], a.json,
               lambda meta: f"spherical, P {P} ({a.backend}), {n} tokens per rank ({N} in all), "
                            f"Hq {hq} Hk {hk} D {d}, {a.pass_}, {meta['gpu']}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

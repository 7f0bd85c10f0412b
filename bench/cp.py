"""Context parallelism's weak scaling: one sequence of P x --tokens-per-rank tokens sharded over
P GPUs, against each GPU running its shard alone, in the same run (docs/perf-cp.md).

    torchrun --nproc_per_node P -m bench.cp [--tokens-per-rank 131072] [--pass fwd|fwd+bwd]
                                             [--iters 5] [--backend nccl|gloo] [--json PATH]
    torchrun --nproc_per_node P -m bench.cp --family triple [--causal] [--tokens-per-rank 262144]
                                             [--heads 8] [--dq 64] [--dv 64] [...the same]
    torchrun --nproc_per_node P -m bench.cp --family spherical ...   (bench/cp_spherical.py)

2-simplicial (the default): one sequence, Hq 128, Hk 1, D 128, w 32 x 512 (S*'s heads and
windows); rank r holds tokens [r n, (r + 1) n). Four paths, each a step of --pass on every rank
at once:
    alone    `attention` on the rank's shard as if it were a whole sequence: P = 1's work
    halo     the shard with a halo of random rows prepended, no exchange (`attend_extended`):
             a rank's compute under context parallelism, without the messages
    cp       `context_parallel_attention`: the halo exchanged, the gradients sent back
    cp_lens  the same with shard_lens given: no all-gather of the call's arguments
A step's time is the slowest rank's (CUDA events, max over ranks), the median of --iters steps
after two warm-up steps; the paths take turns, step by step. TFLOPS per GPU: the useful FLOPs
(altattn.simplicial.flops; backward 2.5x) of the whole sequence for cp, of each shard as a
sequence for alone, of the shard's queries for halo, / P / time. Efficiency: a path's TFLOPS
per GPU over alone's. Peak memory: the largest `torch.cuda.max_memory_allocated` of one step
over the ranks, inputs included.

Triple (--family triple): one sequence, B 1, --heads H, Dq, Dv, causal or not, scale 1/N of the
whole sequence; rank r holds tokens [r n, (r + 1) n). Paths:
    alone        `attention` on the rank's shard as if it were a whole sequence: P = 1's work
    cp           `triple.context_parallel_attention`: the shard state (pieces.shard_state), the
                 states summed over the ranks, the read (non-causal) or the causal op
    cp_lens      the same with shard_lens given: no all-gather of the call's arguments
    cp_composed  the first version: the op called twice (its out and state, then the read)
Useful FLOPs 4 B H N Dq^2 Dv forward, backward 2x (altattn.triple.shapes.pass_flops, causal
counted the same), of the whole sequence / P for the cp paths, of the shard for alone: per
GPU the same, so efficiency (a path's TFLOPS per GPU over alone's) is alone's ms over the path's.

With --backend gloo (CUDA tensors through host memory) several ranks may share one GPU: a test
of the script, not a measurement.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics

import torch
import torch.distributed as dist

from altattn.simplicial import attention, context_parallel_attention, flops
from altattn.simplicial.context_parallel import attend_extended
from altattn.simplicial.shapes import make_inputs
from profiling.common import report

HQ, HK, D, W1, W2 = 128, 1, 128, 32, 512


def _step(path, x, halo, dout, backward):
    q, k1, k2, v1, v2 = x
    for t in x:
        t.grad = None
    if path.startswith("cp"):
        lens = [q.shape[1]] * dist.get_world_size() if path == "cp_lens" else None
        out, _ = context_parallel_attention(q, k1, k2, v1, v2, W1, W2, shard_lens=lens)
    elif path == "halo":
        out, _ = attend_extended(q, [torch.cat([h, t], 1) for h, t in zip(halo, x[1:])], W1, W2)
    else:
        out, _ = attention(q, k1, k2, v1, v2, W1, W2)
    if backward:
        out.backward(dout)


def _time(steps: dict, iters: int) -> dict:
    """path -> (median over iters of the slowest rank's ms, largest peak bytes of one step over
    the ranks). The paths take turns, step by step, so a drift of the clocks hits them alike."""
    for fn in steps.values():  # compile, warm
        fn()
        fn()
    times, peaks = {p: [] for p in steps}, dict.fromkeys(steps, 0)
    for _ in range(iters):
        for path, fn in steps.items():
            dist.barrier()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[path].append(start.elapsed_time(end))
            peaks[path] = max(peaks[path], torch.cuda.max_memory_allocated())
    stats = torch.tensor([*(t for p in steps for t in times[p]), *peaks.values()],
                         dtype=torch.float64)
    stats = stats.cuda() if dist.get_backend() == "nccl" else stats
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    stats = stats.tolist()
    return {p: (statistics.median(stats[i * iters:(i + 1) * iters]),
                int(stats[len(steps) * iters + i])) for i, p in enumerate(steps)}


def _triple_step(path, x, dout, backward, causal, scale):
    from altattn.triple import attention as triple_attention
    from altattn.triple import context_parallel_attention as triple_cp
    from altattn.triple.context_parallel import sharded
    for t in x:
        t.grad = None
    if path == "alone":
        out, _ = triple_attention(*x, scale=scale, causal=causal)
    elif path == "cp_composed":
        opts = {"scale": scale, "variant": "auto", "bwd_variant": "auto", "deterministic": False}
        out, _ = sharded(x, dist.group.WORLD, causal, None, opts, composed=True)
    else:
        lens = [x[0].shape[1]] * dist.get_world_size() if path == "cp_lens" else None
        out, _ = triple_cp(*x, scale=scale, causal=causal, shard_lens=lens)
    if backward:
        out.backward(dout)


def _triple(a, P: int, rank: int, n: int):
    """The triple paths' steps and each one's useful FLOPs per GPU, and the table's header."""
    from altattn.triple.shapes import Shape, pass_flops
    from altattn.triple.shapes import make_inputs as triple_inputs
    shape = Shape(1, n, a.heads, a.dq, a.dv, a.causal)
    x = [t.requires_grad_() for t in triple_inputs(shape, seed=rank)]
    dout = torch.randn_like(x[4])
    backward = a.pass_ == "fwd+bwd"
    per_gpu = pass_flops(shape, "fwd") + (pass_flops(shape, "bwd") if backward else 0)
    paths = ("alone", "cp", "cp_lens", "cp_composed")
    steps = {p: functools.partial(_triple_step, p, x, dout, backward, a.causal, 1 / (P * n))
             for p in paths}
    return steps, dict.fromkeys(paths, per_gpu), (
        f"triple, B 1 H {a.heads} Dq {a.dq} Dv {a.dv}{' causal' if a.causal else ''}")


def _simplicial(a, P: int, rank: int, n: int):
    """The 2-simplicial paths' steps and each one's useful FLOPs per GPU, and the header."""
    x = [t.requires_grad_() for t in make_inputs(1, n, HQ, HK, D, seed=rank)]
    halo = [t[:, -(W2 - 1):].detach() for t in make_inputs(1, W2, HQ, HK, D, seed=P + rank)[1:]]
    dout = torch.randn_like(x[0])
    backward = a.pass_ == "fwd+bwd"
    scale = 3.5 if backward else 1.0
    useful = {"alone": flops(1, n, HQ, D, W1, W2),
              "halo": flops(1, n + W2 - 1, HQ, D, W1, W2) - flops(1, W2 - 1, HQ, D, W1, W2),
              "cp": flops(1, P * n, HQ, D, W1, W2) / P}
    useful["cp_lens"] = useful["cp"]
    steps = {p: functools.partial(_step, p, x, halo, dout, backward) for p in useful}
    return steps, {p: scale * f for p, f in useful.items()}, (
        f"Hq {HQ} Hk {HK} D {D} w {W1}x{W2}")


def main(argv=None) -> int:
    family = argparse.ArgumentParser(add_help=False)
    family.add_argument("--family", choices=["simplicial", "spherical", "triple"],
                        default="simplicial")
    chosen, rest = family.parse_known_args(argv)
    if chosen.family == "spherical":
        from bench.cp_spherical import main as spherical
        return spherical(rest)
    p = argparse.ArgumentParser(prog="torchrun --nproc_per_node P -m bench.cp",
                                description=__doc__.split("\n")[0], parents=[family])
    p.add_argument("--tokens-per-rank", type=int,
                   help="tokens of each rank's shard (default 131072; triple 262144)")
    p.add_argument("--pass", dest="pass_", choices=["fwd", "fwd+bwd"], default="fwd+bwd")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    p.add_argument("--causal", action="store_true", help="triple: causal")
    p.add_argument("--heads", type=int, default=8, help="triple: heads H")
    p.add_argument("--dq", type=int, default=64, help="triple: query/key head dim")
    p.add_argument("--dv", type=int, default=64, help="triple: value head dim")
    p.add_argument("--json", help="write the rows (and the run's metadata) here")
    a = p.parse_args(argv)
    triple = a.family == "triple"
    n = a.tokens_per_rank or (262144 if triple else 131072)
    if not triple and n < W2:
        p.error(f"--tokens-per-rank must be >= w2 = {W2} (a halo from one rank)")
    if triple and (n < 1 or a.dq not in (32, 64, 128) or a.dv not in (32, 64, 128)):
        p.error("triple: --tokens-per-rank must be >= 1, --dq and --dv in {32, 64, 128}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group(a.backend)
    P, rank = dist.get_world_size(), dist.get_rank()
    steps, useful, what = (_triple if triple else _simplicial)(a, P, rank, n)
    timed = _time(steps, a.iters)
    rows = [{"path": p, "P": P, "tokens_per_rank": n, "tokens": P * n, "pass": a.pass_,
             "ms": round(timed[p][0], 3),
             "tflops_per_gpu": round(useful[p] / timed[p][0] / 1e9, 1),
             "peak_gib_per_gpu": round(timed[p][1] / 2 ** 30, 2)} for p in steps]
    for r in rows:
        r["efficiency"] = round(r["tflops_per_gpu"] / rows[0]["tflops_per_gpu"], 3)
    if rank == 0:
        report(rows, [("path", "path"), ("ms", "ms"), ("tflops_per_gpu", "TFLOPS/GPU"),
                      ("efficiency", "efficiency"), ("peak_gib_per_gpu", "peak GiB/GPU")], a.json,
               lambda meta: f"P {P} ({a.backend}), {n} tokens per rank ({P * n} in all), "
                            f"{what}, {a.pass_}, {meta['gpu']}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

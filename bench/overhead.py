"""What a call costs the host: microseconds per call of every family's op, pass (`forward`) and
op forward + backward (2-simplicial also in form "det" and at D 64, spherical also over packed
sequences), and of a decoding step, beside PyTorch's SDPA in the same run.

    python -m bench.overhead [--calls 300] [--rounds 6] [--json PATH] [--profile 20]

Shapes are tiny (128 tokens), so the GPU should finish each call's kernels before the host issues
the next, leaving the host's time ("graph us" checks it: the same calls replayed from a CUDA graph,
queued, is the GPU's own time a call; where it nears "queued", the GPU bounds the call). "host":
the host's own time a call, GPU excluded: --calls calls issued while the GPU is held busy by a
sleep kernel queued first, so no call waits on the GPU and the launch queue never fills (calls
are cut so their launches stay under its depth); the issue's "host cost". "queued":
--calls calls issued back to back, one synchronize at the end, wall time over the calls (how a
training step issues them); "synced": each call followed by torch.cuda.synchronize(), the median
call (how a latency-bound loop sees it). The decoding step (2-simplicial `attention_with_kvcache`,
B 64, 4096 cached tokens, one new token; bench/decode.py) is timed eager and replayed from a CUDA
graph: its GPU time is not negligible, and the ratio says what the host costs a serving loop that
does not capture graphs. "autograd floor": a no-op torch.autograd.Function (clone forward, identity
backward) called forward + backward: what `.backward()` costs any op. --profile K prints, after
the table, the K functions with the most own time in --calls calls of each (cProfile; it
inflates Python's share). "host" and "queued" are the best of --rounds rounds, every call's
rounds taking turns with the others' (rotated, every other round reversed): a host that slows
during the run slows every row alike. The decoding step's host time: best of 3 rounds of its own.
docs/perf-call.md has the numbers and what each step of the call path costs.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.everyday import balanced_order

N = 128  # tokens: the GPU work of a call stays far below its host cost


def queued_round(fn: Callable, calls: int) -> float:
    """Wall microseconds per call of `calls` calls issued back to back, one sync at the end."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def queued_us(fn: Callable, calls: int) -> float:
    """`queued_round`, best of 3 rounds after 3 warm-up calls."""
    for _ in range(3):
        fn()
    return min(queued_round(fn, calls) for _ in range(3))


QUEUE = 512  # launches: well under the CUDA launch queue's depth (1024), so issuing never blocks


def host_round(fn: Callable, calls: int, launches: int) -> float:
    """Host microseconds per call, the GPU excluded (module docstring): at most QUEUE // launches
    calls (`launches`: kernels a call queues) issued behind a sleep kernel that outlasts them."""
    calls = max(1, min(calls, QUEUE // max(launches, 1)))
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # ~0.1 s at 2 GHz: longer than the calls take to issue
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def host_us(fn: Callable, calls: int, launches: int) -> float:
    """`host_round`, best of 3 rounds after 3 warm-up calls."""
    for _ in range(3):
        fn()
    return min(host_round(fn, calls, launches) for _ in range(3))


def interleaved(jobs: list[Callable[[], float]], rounds: int) -> list[float]:
    """Each job (one timed round, returning µs) run `rounds` times, the jobs taking turns in
    bench.everyday's `balanced_order` (rotated, every other round reversed), so that a host
    slowing or speeding up during the run reaches every call alike; per job the best of its
    rounds."""
    best = [float("inf")] * len(jobs)
    for r in range(rounds):
        for j in balanced_order(len(jobs), r):
            best[j] = min(best[j], jobs[j]())
    return best


def launches_per_call(fn: Callable) -> int:
    """Kernels one call of fn queues (torch.profiler's CUDA kernel events)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def synced_us(fn: Callable, calls: int) -> float:
    """Median wall microseconds of one call followed by a synchronize."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _bf16(*shape: int, grad: bool = False, gen=None) -> torch.Tensor:
    t = torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
    return t.requires_grad_(grad)


def _simplicial_calls(D: int, form: str, gen, with_pass: bool = False) -> dict[str, Callable]:
    """2-simplicial attention's op (and, with_pass, `forward`) at Hq 64, Hk 1, head dim D, w 32 x
    256, in the logits' `form`."""
    import altattn
    from altattn import simplicial

    q = _bf16(1, N, 64, D, gen=gen)
    kv = [_bf16(1, N, 1, D, gen=gen) for _ in range(4)]
    qg, kvg = q.clone().requires_grad_(), [t.clone().requires_grad_() for t in kv]
    do = torch.randn_like(q)
    kw = {} if form == "trilinear" else {"form": form}  # the plain row's call as it always was
    calls = {"op fwd": lambda: altattn.simplicial_attention(q, *kv, 32, 256, **kw)}
    if with_pass:
        calls["forward"] = lambda: simplicial.forward(q, *kv, 32, 256, **kw)
    calls["op fwd+bwd"] = lambda: altattn.simplicial_attention(qg, *kvg, 32, 256,
                                                               **kw)[0].backward(do)
    return calls


def family_calls(gen) -> dict[str, dict[str, Callable]]:
    """{family: {call: fn}}: the op without grad, the pass, the op forward + backward."""
    import altattn
    from altattn import spherical, triple

    calls = {}
    q, k, v = (_bf16(1, N, 2, 64, gen=gen) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    calls["sdpa"] = _sdpa_calls(q, k, v, do)
    calls["autograd floor"] = {"op fwd+bwd": lambda: _NoOp.apply(qg).backward(do)}
    calls["spherical"] = {
        "op fwd": lambda: altattn.spherical_attention(q, k, v),
        "forward": lambda: spherical.forward(q, k, v),
        "op fwd+bwd": lambda: altattn.spherical_attention(qg, kg, vg)[0].backward(do)}
    calls["simplicial"] = _simplicial_calls(128, "trilinear", gen, with_pass=True)
    # form "det": the per-call packing of K1, K2 (and dK1, dK2); D 64: tlx_pairs' launches
    calls["simplicial det"] = _simplicial_calls(128, "det", gen)
    calls["simplicial D 64"] = _simplicial_calls(64, "trilinear", gen)
    # packed: two sequences of N / 2 tokens, [T, H, D] (the map and the offsets' checks per call)
    cu = torch.tensor([0, N // 2, N], dtype=torch.int32, device=q.device)
    pq, pk, pv, pqg, pkg, pvg, pdo = (t[0] for t in (q, k, v, qg, kg, vg, do))
    calls["spherical packed"] = {
        "op fwd": lambda: spherical.attention_varlen(pq, pk, pv, cu, cu, N // 2, N // 2),
        "op fwd+bwd": lambda: spherical.attention_varlen(pqg, pkg, pvg, cu, cu, N // 2,
                                                         N // 2)[0].backward(pdo)}
    x = [_bf16(1, N, 2, 64, gen=gen) for _ in range(5)]
    xg = [t.clone().requires_grad_() for t in x]
    dy = torch.randn_like(x[4])
    calls["triple"] = {
        "op fwd": lambda: altattn.triple_attention(*x),
        "forward": lambda: triple.forward(*x),
        "op fwd+bwd": lambda: altattn.triple_attention(*xg)[0].backward(dy)}
    return calls


class _NoOp(torch.autograd.Function):
    """The least an op with a backward costs through autograd: a clone forward, an identity
    backward (one copy kernel each way)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def _sdpa_calls(q, k, v, do) -> dict[str, Callable]:
    """SDPA on the spherical shape ([B, H, N, D] views, as a model passes them; the backend
    PyTorch picks)."""
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (qs, ks, vs))
    dos = do.transpose(1, 2)
    return {"op fwd": lambda: F.scaled_dot_product_attention(qs, ks, vs),
            "op fwd+bwd": lambda: F.scaled_dot_product_attention(qg, kg, vg).backward(dos)}


def decode_step(gen) -> Callable:
    """The decoding step (bench/decode.py's ring caches): B 64, 4096 cached, one new token."""
    from altattn.simplicial import attention_with_kvcache
    from bench.decode import HK, HQ, W1, W2

    B, P, D = 64, 4096, 128
    q = _bf16(B, 1, HQ, D, gen=gen)
    new = [_bf16(B, 1, HK, D, gen=gen) for _ in range(4)]
    lens = torch.full((B,), P, dtype=torch.int32, device="cuda")
    caches = [_bf16(B, w, HK, D, gen=gen) for w in (W1, W2, W1, W2)]

    def step():
        return attention_with_kvcache(q, *caches, lens, W1, W2, k1=new[0], k2=new[1],
                                      v1=new[2], v2=new[3])
    return step


def decode_rows(gen) -> list[dict]:
    """The decoding step eager and from a CUDA graph."""
    from profiling.timing import graphed, median_ms

    step = decode_step(gen)
    eager = median_ms(step, flush_l2=False)
    graph = median_ms(graphed(step), flush_l2=False)
    host = host_us(step, 100, launches_per_call(step))
    return [{"family": "simplicial", "call": "decode step eager", "us": round(eager * 1e3, 1),
             "host_us": round(host, 1),
             "vs_graph": round(graph / eager, 3)},
            {"family": "simplicial", "call": "decode step graph", "us": round(graph * 1e3, 1),
             "vs_graph": 1.0}]


def print_profile(name: str, fn: Callable, calls: int, top: int) -> None:
    """cProfile of `calls` calls of fn: the `top` functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"\n## {name}: {calls} calls, own time (tottime) first")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main(argv=None) -> int:
    from profiling.common import metadata_line, report
    from profiling.timing import graphed

    p = argparse.ArgumentParser(prog="python -m bench.overhead",
                                description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=300, help="calls per timing (default: 300)")
    p.add_argument("--rounds", type=int, default=6,
                   help="timed rounds per call, the calls taking turns (best of them; default 6)")
    p.add_argument("--json", help="write the rows (with run metadata) here")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="also print the K functions with the most own time of each call")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.calls < 1:
        p.error("--rounds and --calls must be at least 1")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, host_jobs, queued_jobs = [], [], []
    for family, calls in family_calls(gen).items():
        for call, fn in calls.items():
            mode = torch.no_grad if "bwd" not in call else torch.enable_grad
            with mode():
                for _ in range(3):  # warm-up: compile, plans, remembered calls
                    fn()
                launches = launches_per_call(fn)
                rows.append({"family": family, "call": call,
                             "synced_us": round(synced_us(fn, a.calls), 1),
                             "gpu_us": (None if "bwd" in call else
                                        round(queued_us(graphed(fn), a.calls), 1))})

            def in_mode(timer, fn=fn, mode=mode, launches=launches):
                def job():
                    with mode():
                        return (timer(fn, a.calls, launches) if timer is host_round
                                else timer(fn, a.calls))
                return job
            host_jobs.append(in_mode(host_round))
            queued_jobs.append(in_mode(queued_round))
    for r, h, q in zip(rows, interleaved(host_jobs, a.rounds), interleaved(queued_jobs, a.rounds)):
        r.update(host_us=round(h, 1), queued_us=round(q, 1))
    sdpa = {r["call"]: r for r in rows if r["family"] == "sdpa"}
    for r in rows:
        if r["call"] in sdpa:
            r["host_vs_sdpa"] = round(r["host_us"] / sdpa[r["call"]]["host_us"], 2)
            r["vs_sdpa"] = round(r["queued_us"] / sdpa[r["call"]]["queued_us"], 2)
    rows += decode_rows(gen)
    report(rows, [("family", "family"), ("call", "call"), ("host_us", "host us"),
                  ("host_vs_sdpa", "host x SDPA"), ("queued_us", "queued us"),
                  ("synced_us", "synced us"), ("gpu_us", "graph us"), ("vs_sdpa", "x SDPA"),
                  ("us", "us"),
                  ("vs_graph", "graph/eager")], a.json,
           lambda meta: f"{metadata_line(meta)}\n{N} tokens a call; queued: {a.calls} calls, "
                        f"one sync (best of {a.rounds} rounds, the calls taking turns)")
    if a.profile:
        for family, calls in family_calls(gen).items():
            for call, fn in calls.items():
                with torch.no_grad() if "bwd" not in call else torch.enable_grad():
                    print_profile(f"{family} {call}", fn, a.calls, a.profile)
        with torch.no_grad():
            print_profile("simplicial decode step", decode_step(gen), a.calls, a.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Everyday shapes through the op, the way a training step calls it, beside SDPA in the same run.

    python -m bench.everyday [--family spherical triple simplicial] [--causal] [--json PATH]
                             [--plot PNG]

The grid: B*N in {16384, 32768} tokens x N in {1024, 2048, 4096}; spherical at H 16 (Hq = Hk),
D 64 and 128; triple at H 16, Dq = Dv = 64 (both non-causal, or causal with --causal);
2-simplicial at Hq 64, Hk 1, D 128,
w 32 x 256. Each call is timed three ways, each as calls issued back to back between two CUDA
events (no cache flush: a model's step does not flush either), ms per call the median of 6 rounds,
the three ways interleaved round by round in a balanced order (`balanced_order`: a drift of the
GPU's clocks or of the host's speed during a point reaches all three alike, and no way always
follows the same other one):
- "op": the op called eagerly (`altattn.<family>_attention`), forward under no_grad, and forward
  + backward (`torch.autograd.grad` of the output against a fixed incoming gradient);
- "graph": the same call captured in a CUDA graph and replayed: what the GPU spends, no host cost
  (kernel-only; op / graph is what the call path costs);
- "sdpa" (spherical and triple): F.scaled_dot_product_attention on the same B, H, N, D called
  eagerly (causal with --causal; for triple on (q1, k1, v): the softmax layer it would replace).
TFLOPS: useful FLOPs (spherical and SDPA 4 B H N^2 D forward, the visible pairs when causal,
2.5x backward; triple 4 B H N Dq^2 Dv, 2x, causal counted as non-causal; 2-simplicial
`altattn.simplicial.flops`, 2.5x) over the time; op/SDPA is SDPA's time over the op's.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from profiling.timing import graphed

TOKENS = (16384, 32768)
LENGTHS = (1024, 2048, 4096)


def balanced_order(n: int, r: int) -> list[int]:
    """Round r's order of n ways, a Williams design: row r mod n of 0, 1, n-1, 2, n-2, ... shifted
    by r, and for odd n the next n rows mirrored. Over n rounds (2n for odd n) each way is first
    equally often and follows each other way equally often (n = 3: 012, 120, 201, 210, 021, 102)."""
    base = [0] + [(i + 1) // 2 if i % 2 else n - i // 2 for i in range(1, n)]
    r %= n if n % 2 == 0 else 2 * n
    row = [(b + r) % n for b in base]
    return row[::-1] if r >= n else row


def interleaved_ms(fns: list, rounds: int = 6, min_ms: float = 20.0) -> list[float]:
    """Per fn, the median over `rounds` of (event time of k back-to-back calls) / k, k for >=
    min_ms; each round times every fn in turn, in `balanced_order`, so the fns see the same
    drift and no fn always runs after the same other one."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn, k: int) -> float:
        start.record()
        for _ in range(k):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / k

    ks = []
    for fn in fns:
        for _ in range(3):
            fn()
        ks.append(max(5, int(min_ms / max(timed(fn, 1), 1e-3))))
    times = [[] for _ in fns]
    for r in range(rounds):
        for j in balanced_order(len(fns), r):
            times[j].append(timed(fns[j], ks[j]))
    return [statistics.median(t) for t in times]


def _rand(gen, *shape, grad=False):
    return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(grad)


def problems(family: str, gen, causal: bool = False):
    """(shape words, useful forward FLOPs, backward / forward FLOP ratio, the op's call, inputs
    needing grad, SDPA's inputs or None, SDPA's forward FLOPs) over the grid."""
    import altattn
    from altattn.simplicial import flops as simplicial_flops

    def sdpa_flops(b, n, d):  # 4 B H N^2 D, the visible pairs when causal
        return 4 * b * 16 * d * (n * (n + 1) // 2 if causal else n * n)

    for tokens in TOKENS:
        for n in LENGTHS:
            b = tokens // n
            if family == "spherical":
                for d in (64, 128):
                    x = [_rand(gen, b, n, 16, d, grad=True) for _ in range(3)]
                    yield (dict(B=b, N=n, H=16, D=d), sdpa_flops(b, n, d), 2.5,
                           lambda x=x: altattn.spherical_attention(*x, causal=causal)[0], x,
                           [t.detach().transpose(1, 2).requires_grad_() for t in x],
                           sdpa_flops(b, n, d))
            elif family == "triple":  # SDPA on (q1, k1, v): the softmax layer it would replace
                x = [_rand(gen, b, n, 16, 64, grad=True) for _ in range(5)]
                yield (dict(B=b, N=n, H=16, D=64), 4 * b * 16 * n * 64 ** 3, 2.0,
                       lambda x=x: altattn.triple_attention(*x, causal=causal)[0], x,
                       [x[i].detach().transpose(1, 2).requires_grad_() for i in (0, 2, 4)],
                       sdpa_flops(b, n, 64))
            else:
                x = [_rand(gen, b, n, 64, 128, grad=True)]
                x += [_rand(gen, b, n, 1, 128, grad=True) for _ in range(4)]
                yield (dict(B=b, N=n, Hq=64, Hk=1, D=128, w="32x256"),
                       simplicial_flops(b, n, 64, 128, 32, 256), 2.5,
                       lambda x=x: altattn.simplicial_attention(*x, 32, 256)[0], x, None, 0)


def fwd_bwd(call, inputs, grad_out):
    """A training step's attention: forward, then the input gradients of `grad_out`."""
    def step():
        out = call()
        return torch.autograd.grad(out, inputs, grad_out)
    return step


def time_family(family: str, gen, causal: bool = False) -> list[dict]:
    rows = []
    for shape, flops, bwd_ratio, call, inputs, sdpa_in, sdpa_f in problems(family, gen, causal):
        with torch.no_grad():
            out = call()
        dout = torch.randn_like(out)
        passes = {"fwd": (flops, torch.no_grad, call),
                  "fwd+bwd": (flops * (1 + bwd_ratio), torch.enable_grad,
                              fwd_bwd(call, inputs, dout))}
        for pass_, (f, mode, fn) in passes.items():
            row = {"family": family, "causal": causal, **shape, "pass": pass_}
            fns = [fn]
            if sdpa_in is not None:
                dos = dout.transpose(1, 2)
                def sdpa(x=sdpa_in):
                    return F.scaled_dot_product_attention(*x, is_causal=causal)
                fns.append(sdpa if pass_ == "fwd" else fwd_bwd(sdpa, sdpa_in, dos))
            with mode():
                op, graph, *s = interleaved_ms([fns[0], graphed(fn), *fns[1:]])
            row.update(op_ms=round(op, 4), graph_ms=round(graph, 4),
                       op_tflops=round(f / op / 1e9, 1), graph_tflops=round(f / graph / 1e9, 1),
                       op_vs_graph=round(graph / op, 3))
            if s:
                sf = sdpa_f * (1 if pass_ == "fwd" else 3.5)  # SDPA's backward: 2.5x
                row.update(sdpa_ms=round(s[0], 4), sdpa_tflops=round(sf / s[0] / 1e9, 1),
                           op_vs_sdpa=round(s[0] / op, 3))
            rows.append(row)
            print(row, flush=True)
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Spherical: TFLOPS against N, op / graph / SDPA, a panel per (pass, D, tokens)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["family"] == "spherical"]
    keys = sorted({(r["pass"], r["D"], r["B"] * r["N"]) for r in rows})
    if not keys:
        return
    fig, axes = plt.subplots(2, len(keys) // 2, figsize=(4 * len(keys) // 2, 7), squeeze=False)
    for ax, (pass_, d, tokens) in zip(axes.flat, keys):
        sel = sorted((r for r in rows if (r["pass"], r["D"], r["B"] * r["N"]) ==
                      (pass_, d, tokens)), key=lambda r: r["N"])
        for col, label in (("op_tflops", "op (eager)"), ("graph_tflops", "op in a CUDA graph"),
                           ("sdpa_tflops", "SDPA (eager)")):
            ax.plot([r["N"] for r in sel], [r[col] for r in sel], marker="o", label=label)
        ax.set_title(f"{pass_} D{d} {tokens // 1024}k tokens H16", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N")
        ax.set_ylabel("TFLOPS")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    causal = " (causal)" if rows[0]["causal"] else ""
    fig.suptitle(f"spherical attention{causal} through the op, {torch.cuda.get_device_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    from profiling.common import report

    p = argparse.ArgumentParser(prog="python -m bench.everyday",
                                description=__doc__.split("\n")[0])
    p.add_argument("--family", nargs="+", default=["spherical", "triple", "simplicial"],
                   choices=["spherical", "triple", "simplicial"])
    p.add_argument("--causal", action="store_true",
                   help="causal spherical and triple calls (and SDPA's); 2-simplicial as is")
    p.add_argument("--json", help="write the rows (with run metadata) here")
    p.add_argument("--plot", help="write the spherical plot (PNG) here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [r for fam in a.family for r in time_family(fam, gen, a.causal)]
    report(rows, [("family", "family"), ("causal", "causal"), ("B", "B"), ("N", "N"), ("D", "D"),
                  ("pass", "pass"),
                  ("op_tflops", "op TFLOPS"), ("graph_tflops", "graph TFLOPS"),
                  ("sdpa_tflops", "SDPA TFLOPS"), ("op_vs_graph", "op/graph"),
                  ("op_vs_sdpa", "op/SDPA")], a.json)
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

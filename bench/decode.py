"""Decoding with KV caches beside the S* prefill, same run (H200 numbers: docs/perf-varlen.md).

    python -m bench.decode [--batch 64 8] [--context 4096] [--tokens 1] [--json PATH]

Times one `attention_with_kvcache` call (the new keys written into their slots, the forward
reading the caches, the merge of its split shares: three launches), eager and replayed from a
CUDA graph (a serving loop's way: no host work per step), for --tokens new tokens of each of
--batch sequences with --context tokens cached (Hq 128, Hk 1, D 128, w 32 x 512), in ring
caches of w + T - 1 slots and in linear caches, and the dense forward ("auto") on S* (B 4,
N 16384). TFLOPS: useful FLOPs (4 Hq D min(p+1, w1) min(p+1, w2)
per token at position p) over the median time (profiling.timing.median_ms); tokens/s: B * T
over it.
"""
from __future__ import annotations

import argparse
import json

import torch

from altattn.simplicial import attention_with_kvcache, flops, forward
from altattn.simplicial.kvcache import _split
from altattn.simplicial.shapes import make_inputs
from profiling.timing import graphed, median_ms

HQ, HK, D, W1, W2 = 128, 1, 128, 32, 512


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 8])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    T, P = a.tokens, a.context
    x = make_inputs(4, 16384, HQ, HK, D)
    ms = median_ms(lambda: forward(*x, W1, W2))
    star = flops(4, 16384, HQ, D, W1, W2) / ms / 1e9
    del x
    rows = [{"path": "prefill S*", "B": 4, "ms": round(ms, 3), "tflops": round(star, 1)}]
    per_token = [flops(1, p + 1, HQ, D, W1, W2) - flops(1, p, HQ, D, W1, W2)
                 for p in range(P, P + T)]
    for B in a.batch:
        g = torch.Generator(device="cuda").manual_seed(B)
        q = torch.randn(B, T, HQ, D, generator=g, device="cuda").bfloat16()
        new = [torch.randn(B, T, HK, D, generator=g, device="cuda").bfloat16() for _ in range(4)]
        lens = torch.full((B,), P, dtype=torch.int32, device="cuda")
        paths = []
        for cache in ("ring", "linear"):
            caches = [torch.randn(B, w + T - 1 if cache == "ring" else P + T, HK, D, generator=g,
                                  device="cuda").bfloat16() for w in (W1, W2, W1, W2)]

            def step(caches=caches):
                return attention_with_kvcache(q, *caches, lens, W1, W2, k1=new[0], k2=new[1],
                                              v1=new[2], v2=new[3])
            if cache == "ring":
                paths.append(("ring eager", step))
            paths.append((f"{cache} graph", graphed(step)))
        for path, fn in paths:
            ms = median_ms(fn)
            tf = B * sum(per_token) / ms / 1e9
            rows.append({"path": path, "B": B, "T": T, "context": P, "ms": round(ms, 4),
                         "tokens_per_s": round(B * T / ms * 1e3), "tflops": round(tf, 1),
                         "vs_prefill": round(tf / star, 3),
                         "n_split": _split(B * T * HK, W1, q.device)})
    print(f"Hq {HQ} Hk {HK} D {D} w {W1}x{W2}, T = {T} new token(s) a sequence, {P} cached, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'path':<14}{'B':>4}{'split':>7}{'ms':>10}{'tokens/s':>11}{'TFLOPS':>9}"
          f"{'vs S*':>8}")
    for r in rows:
        print(f"{r['path']:<14}{r['B']:>4}{r.get('n_split', ''):>7}{r['ms']:>10}"
              f"{r.get('tokens_per_s', ''):>11}{r['tflops']:>9}{r.get('vs_prefill', ''):>8}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

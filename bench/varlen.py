"""Packed variable-length sequences against the dense batch path, same run (H200 numbers:
docs/perf-varlen.md).

    python -m bench.varlen [--family simplicial|spherical|triple] [--docs 64] [--min N]
                           [--max N] [--causal] [--seed 0] [--json PATH]

2-simplicial (default): times `forward_varlen` and `backward_varlen` ("auto") on --docs
documents of random lengths in [--min, --max] (default 256..4096) packed into one sequence
(Hq 128, Hk 1, D 128, w 32 x 512), and the dense `forward` / `backward` ("auto") on S* (B 4,
N 16384) and on a batch of the same token count (B = --docs, N = the mean length).
Spherical (bench/varlen_spherical.py): --docs sequences of lengths in [--min, --max] (default
200..16000), H 16, D 128: packed against the dense batch of the same tokens and the padded
`seqlens` batch of the same sequences. TFLOPS: useful FLOPs (summed over the documents;
backward 2.5x) over the median time (profiling.timing.median_ms).
Triple (bench/varlen_triple.py; --min/--max default 1024/16384, --h 8, --d 64): the packed
forward and forward + backward (altattn.triple.varlen's forward_varlen, backward_varlen: the
kernels, no autograd, no host check of cu_seqlens), each sequence its own 1/length, against the
dense batch of the same token count (B = --docs, N = the mean length: the dense passes),
non-causal and causal; FLOPs 4 H T Dq^2 Dv forward, 3x that forward + backward.
"""
from __future__ import annotations

import argparse
import json
import random

import torch

from altattn.simplicial import backward, flops, forward
from altattn.simplicial.shapes import make_inputs
from altattn.simplicial.varlen import backward_varlen, forward_varlen
from profiling.timing import median_ms

HQ, HK, D, W1, W2 = 128, 1, 128, 32, 512


def _row(name, pass_, useful, ms, tokens):
    return {"path": name, "pass": pass_, "tokens": tokens, "ms": round(ms, 3),
            "tflops": round(useful / ms / 1e9, 1)}


def _time(fwd, bwd, useful, name, tokens):
    out = fwd()
    dout = torch.randn_like(out[0])
    rows = [_row(name, "fwd", useful, median_ms(fwd), tokens)]
    rows.append(_row(name, "bwd", 2.5 * useful, median_ms(lambda: bwd(dout, *out)), tokens))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.varlen", description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=("simplicial", "spherical", "triple"),
                   default="simplicial")
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--min", type=int, default=None,
                   help="256 (simplicial), 200 (spherical), 1024 (triple)")
    p.add_argument("--max", type=int, default=None,
                   help="4096 (simplicial), 16000 (spherical), 16384 (triple)")
    p.add_argument("--causal", action="store_true", help="spherical: causal attention")
    p.add_argument("--bwd-variant", default="auto", help="spherical: the packed backward's")
    p.add_argument("--h", type=int, default=8, help="triple: heads")
    p.add_argument("--d", type=int, default=64, help="triple: Dq = Dv")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    if a.family == "triple":
        from bench.varlen_triple import run
        return run(a)
    if a.family == "spherical":
        from bench.varlen_spherical import run
        return run(a)
    a.min, a.max = a.min or 256, a.max or 4096
    rng = random.Random(a.seed)
    lens = [rng.randint(a.min, a.max) for _ in range(a.docs)]
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    q, k1, k2, v1, v2 = (t[0] for t in make_inputs(1, T, HQ, HK, D, seed=a.seed))
    useful = sum(flops(1, n, HQ, D, W1, W2) for n in lens)
    rows = _time(lambda: forward_varlen(q, k1, k2, v1, v2, cu, W1, W2),
                 lambda do, o, lse: backward_varlen(do, None, q, k1, k2, v1, v2, o, lse, cu,
                                                    W1, W2), useful, "packed", T)
    for name, B, N in (("dense S*", 4, 16384), ("dense same tokens", a.docs, T // a.docs)):
        x = make_inputs(B, N, HQ, HK, D, seed=a.seed)
        rows += _time(lambda: forward(*x, W1, W2),
                      lambda do, o, lse: backward(do, None, *x, o, lse, W1, W2),
                      flops(B, N, HQ, D, W1, W2), name, B * N)
        del x
    dense = {r["pass"]: r["tflops"] for r in rows if r["path"] == "dense same tokens"}
    for r in rows:
        r["vs_dense_same_tokens"] = round(r["tflops"] / dense[r["pass"]], 3)
    print(f"{a.docs} documents, {T} tokens (lengths {min(lens)}..{max(lens)}), Hq {HQ} Hk {HK} "
          f"D {D} w {W1}x{W2}, {torch.cuda.get_device_name()}")
    print(f"{'path':<20}{'pass':<6}{'tokens':>9}{'ms':>10}{'TFLOPS':>9}{'vs dense':>10}")
    for r in rows:
        print(f"{r['path']:<20}{r['pass']:<6}{r['tokens']:>9}{r['ms']:>10}{r['tflops']:>9}"
              f"{r['vs_dense_same_tokens']:>10}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"lengths": lens, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

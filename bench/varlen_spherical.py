"""Spherical attention over packed sequences (`python -m bench.varlen --family spherical`):
`forward_varlen` / `backward_varlen` ("auto") on --docs sequences of random lengths in
[--min, --max] (default 200..16000; H 16, D 128) packed into one [T, H, D] tensor, against the
dense `forward` / `backward` ("auto") on a batch of the same token count (B = --docs, N = the
mean length) and on the padded batch of the same sequences (B = --docs, N = the longest, the
real lengths as `seqlens`). TFLOPS: useful FLOPs, 4 H D per visible (query, key) pair of each
sequence (causal: its lower triangle), backward 2.5x, over the median time
(profiling.timing.median_ms); "fwd+bwd" is both passes' FLOPs over both times. The JSON holds
the lengths, the rows, and the device and versions.
"""
from __future__ import annotations

import json
import random

import torch

from altattn.spherical import backward, backward_varlen, forward, forward_varlen
from profiling.common import metadata_line, run_metadata
from profiling.timing import median_ms

H, D = 16, 128


def useful(lens, causal: bool) -> float:
    """Forward FLOPs that count: 4 H D per visible pair, summed over the sequences."""
    return 4.0 * H * D * sum(n * (n + 1) // 2 if causal else n * n for n in lens)


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)


def _time(name, fwd, bwd, flops, tokens) -> list[dict]:
    """fwd() -> (out, r); bwd(dout, out, r): rows for fwd, bwd and fwd+bwd."""
    out, r = fwd()
    dout = torch.randn_like(out)
    t_f = median_ms(fwd)
    t_b = median_ms(lambda: bwd(dout, out, r))
    rows = []
    for pass_, ms, f in (("fwd", t_f, flops), ("bwd", t_b, 2.5 * flops),
                         ("fwd+bwd", t_f + t_b, 3.5 * flops)):
        rows.append({"path": name, "pass": pass_, "tokens": tokens, "ms": round(ms, 3),
                     "tflops": round(f / ms / 1e9, 1)})
    return rows


def run(a) -> int:
    lo, hi = a.min or 200, a.max or 16000
    rng = random.Random(a.seed)
    lens = [rng.randint(lo, hi) for _ in range(a.docs)]
    T, causal = sum(lens), a.causal
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    q, k, v = (_randn(gen, T, H, D) for _ in range(3))
    rows = _time("packed", lambda: forward_varlen(q, k, v, cu, cu, causal=causal),
                 lambda do, o, r: backward_varlen(do, None, q, k, v, o, r, cu, cu,
                                                  causal=causal, variant=a.bwd_variant),
                 useful(lens, causal), T)
    del q, k, v
    N = T // a.docs
    x = [_randn(gen, a.docs, N, H, D) for _ in range(3)]
    rows += _time("dense same tokens", lambda: forward(*x, causal=causal),
                  lambda do, o, r: backward(do, None, *x, o, r, causal=causal),
                  useful([N] * a.docs, causal), a.docs * N)
    del x
    L = max(lens)
    x = [_randn(gen, a.docs, L, H, D) for _ in range(3)]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    rows += _time("padded seqlens", lambda: forward(*x, causal=causal, seqlens=seqlens),
                  lambda do, o, r: backward(do, None, *x, o, r, causal=causal,
                                            seqlens=seqlens),
                  useful(lens, causal), T)
    del x
    by = {(r["path"], r["pass"]): r["tflops"] for r in rows}
    for r in rows:
        r["vs_dense"] = round(r["tflops"] / by[("dense same tokens", r["pass"])], 3)
        r["vs_padded"] = round(r["tflops"] / by[("padded seqlens", r["pass"])], 3)
    meta = run_metadata()
    print(f"spherical, {a.docs} sequences, {T} tokens (lengths {min(lens)}..{max(lens)}), "
          f"H {H} D {D}{' causal' if causal else ''}; padded to {L}\n{metadata_line(meta)}")
    print(f"{'path':<20}{'pass':<9}{'tokens':>9}{'ms':>10}{'TFLOPS':>9}{'vs dense':>10}"
          f"{'vs padded':>11}")
    for r in rows:
        print(f"{r['path']:<20}{r['pass']:<9}{r['tokens']:>9}{r['ms']:>10}{r['tflops']:>9}"
              f"{r['vs_dense']:>10}{r['vs_padded']:>11}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"family": "spherical", "causal": causal, "lengths": lens, "rows": rows,
                       "meta": meta}, f, indent=1)
    return 0

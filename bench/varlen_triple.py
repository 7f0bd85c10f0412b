"""Triple attention over packed documents against a dense batch of the same tokens, same run
(`python -m bench.varlen --family triple`; bench/varlen.py's docstring; numbers:
docs/perf-varlen.md).

Rows: for non-causal and causal, the packed forward and forward + backward (the kernels through
altattn.triple.varlen's forward_varlen / backward_varlen, scale None: each document's own
1/length) and the same two on the dense batch B = docs, N = T / docs (altattn.triple.forward /
backward, scale 1/N), "auto" variants, medians of profiling.timing.median_ms (L2 flushed).
TFLOPS: 4 H T Dq^2 Dv forward, 3x that forward + backward (shapes.pass_flops, summed), over the
time; vs_dense: packed TFLOPS over the dense batch's of the same pass and mode.
"""
from __future__ import annotations

import json
import random

import torch

from altattn.triple import backward, forward
from altattn.triple.shapes import Shape, make_inputs, pass_flops
from altattn.triple.varlen import backward_varlen, forward_varlen
from profiling.timing import median_ms


def _time(fwd, bwd) -> dict:
    out, state = fwd()
    dout = torch.randn_like(out)

    def both():
        o, s = fwd()
        bwd(dout, o, s)
    return {"fwd": median_ms(fwd), "fwd+bwd": median_ms(both)}


def run(a) -> int:
    rng = random.Random(a.seed)
    lens = [rng.randint(a.min or 1024, a.max or 16384) for _ in range(a.docs)]
    T, H, D = sum(lens), a.h, a.d
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    B, N = a.docs, T // a.docs
    x = [t[0] for t in make_inputs(Shape(1, T, H, D, D), seed=a.seed)]
    rows = []
    for causal in (False, True):
        useful = pass_flops(Shape(1, T, H, D, D, causal))
        packed = _time(lambda: forward_varlen(*x, cu, causal=causal),
                       lambda do, o, s: backward_varlen(do, None, *x, s, cu, causal=causal))
        xd = [t[:B * N].view(B, N, H, -1) for t in x]
        dense = _time(lambda: forward(*xd, causal=causal),
                      lambda do, o, s: backward(do.view(B, N, H, -1), None, *xd, s,
                                                causal=causal))
        for pass_, mult in (("fwd", 1), ("fwd+bwd", 3)):
            tf = {k: mult * useful * (tokens / T) / ms / 1e9 for k, ms, tokens in
                  (("packed", packed[pass_], T), ("dense", dense[pass_], B * N))}
            for path, ms in (("packed", packed[pass_]), ("dense same tokens", dense[pass_])):
                t = tf["packed" if path == "packed" else "dense"]
                rows.append({"path": path, "causal": causal, "pass": pass_,
                             "tokens": T if path == "packed" else B * N, "ms": round(ms, 3),
                             "tflops": round(t, 1),
                             "vs_dense": round(t / tf["dense"], 3)})
    print(f"triple: {a.docs} documents, {T} tokens (lengths {min(lens)}..{max(lens)}), H {H} "
          f"Dq = Dv = {D}; dense B {B} N {N}; {torch.cuda.get_device_name()}")
    print(f"{'path':<20}{'causal':<8}{'pass':<9}{'tokens':>9}{'ms':>10}{'TFLOPS':>9}"
          f"{'vs dense':>10}")
    for r in rows:
        print(f"{r['path']:<20}{str(r['causal']):<8}{r['pass']:<9}{r['tokens']:>9}{r['ms']:>10}"
              f"{r['tflops']:>9}{r['vs_dense']:>10}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"family": "triple", "lengths": lens, "H": H, "D": D, "rows": rows}, f,
                      indent=1)
    return 0

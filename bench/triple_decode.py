"""Triple attention's decoding step against the HBM bandwidth, in the same run.

    python -m bench.triple_decode [--batch 64] [--heads 8] [--dq 64] [--dv 64] [--tokens 1]
                                  [--json PATH]

Times `altattn.triple.step` (T new tokens of each of B sequences: the state [B, H, Dq, Dv, Dq]
fp32 read and written once per launch of at most 8 tokens, in place), replayed from a CUDA graph
(a serving loop's way) and eager, beside a copy of as many bytes (`copy_` of an fp32 tensor of
half of them: it reads and writes them, the bandwidth a memory-bound kernel can reach on this
GPU). GB/s: the state's bytes read and written (2 B H Dq^2 Dv 4 per launch) over the median
time; "of copy": that over the copy's GB/s; tokens/s: B T over the time. No L2 flush (the state
dwarfs it, and a decode loop does not).
"""
from __future__ import annotations

import argparse

import torch

from profiling.common import metadata_line, report
from profiling.timing import graphed, median_ms


def state_bytes(B: int, H: int, Dq: int, Dv: int, T: int = 1) -> int:
    """Bytes a step of T tokens moves: the fp32 state read and written once per launch."""
    from kernels_triton.triple.step import MAX_T
    return 2 * B * H * Dq * Dq * Dv * 4 * -(-T // MAX_T)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.triple_decode",
                                description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dq", type=int, default=64)
    p.add_argument("--dv", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--json", help="write the rows (with run metadata) here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    from altattn.triple import step

    B, H, Dq, Dv, T = a.batch, a.heads, a.dq, a.dv, a.tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = [torch.randn(B, T, H, d, device="cuda", generator=gen).to(torch.bfloat16)
         for d in (Dq, Dq, Dq, Dq, Dv)]
    state = torch.zeros(B, H, Dq, Dv, Dq, device="cuda")
    moved = state_bytes(B, H, Dq, Dv, T)
    source = torch.zeros(moved // 8, device="cuda")  # fp32: copy_ reads and writes moved / 2
    other = torch.empty_like(source)
    c = 1e-3
    with torch.no_grad():
        times = {"step (graph)": median_ms(graphed(lambda: step(*x, state, scale=c)),
                                          flush_l2=False),
                 "step (eager)": median_ms(lambda: step(*x, state, scale=c), flush_l2=False),
                 "copy of as many bytes": median_ms(lambda: other.copy_(source), flush_l2=False)}
    copy_gbs = moved / times["copy of as many bytes"] / 1e6
    rows = [{"call": name, "ms": round(ms, 4), "GB/s": round(moved / ms / 1e6, 1),
             "of copy": round(moved / ms / 1e6 / copy_gbs, 3),
             "tokens/s": round(B * T / ms * 1e3) if name.startswith("step") else None}
            for name, ms in times.items()]
    report(rows, [("call", "call"), ("ms", "ms"), ("GB/s", "GB/s"), ("of copy", "of copy"),
                  ("tokens/s", "tokens/s")], a.json,
           lambda meta: f"{metadata_line(meta)}\nB {B}, H {H}, Dq {Dq}, Dv {Dv}, T {T}: "
                        f"{moved / 1e6:.1f} MB moved a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

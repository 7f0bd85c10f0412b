"""Read bandwidth of the GPU's L2 cache and of HBM, for the traffic model in docs/perf.md.

    python3 tools/l2_bandwidth.py

A Triton kernel streams a buffer REPS times with L2-only loads (cache modifier .cg: L1 bypassed),
every program reading a disjoint strided subset. A buffer well inside L2 measures L2 -> SM
bandwidth; a 2 GiB buffer measures HBM. Bytes counted: buffer size x REPS (reads only). Timed with
profiling.timing.median_ms WITHOUT an L2 flush (a flush would make the first pass come from HBM).

Exit status: 0 done; 2 bad arguments or no CUDA GPU.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from profiling.common import print_table  # noqa: E402
from profiling.timing import median_ms  # noqa: E402

BUFFERS = ((4, 256), (8, 128), (16, 64), (32, 32), (2048, 2))  # (MiB, reads of the whole buffer)


@triton.jit
def _read_kernel(X, Out, n_vec, REPS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK * 8], tl.float32)
    offs = tl.arange(0, BLOCK * 8)  # 8 bf16 = one 16-byte vector per thread and step
    for _ in range(REPS):
        for v in range(pid * BLOCK, n_vec, step):
            base = tl.multiple_of(v * 8, BLOCK * 8)
            acc += tl.load(X + base + offs, cache_modifier=".cg").to(tl.float32)
    tl.store(Out + pid * BLOCK * 8 + offs, acc)


def read_bandwidth(nbytes: int, reps: int) -> tuple[float, float]:
    """(ms, TB/s) for reading an nbytes bf16 buffer `reps` times."""
    block = 256
    n_vec = nbytes // 16
    x = torch.randn(n_vec * 8, device="cuda", dtype=torch.bfloat16)
    programs = torch.cuda.get_device_properties(0).multi_processor_count * 8
    out = torch.empty(programs * block * 8, device="cuda", dtype=torch.float32)
    def run():
        _read_kernel[(programs,)](x, out, n_vec, REPS=reps, BLOCK=block, num_warps=8)

    ms = median_ms(run, flush_l2=False)  # the warm-up brings the buffer into L2 when it fits
    return ms, nbytes * reps / ms / 1e9


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="tools/l2_bandwidth.py",
        description="Read bandwidth of the GPU's L2 cache and of HBM (needs a CUDA GPU): "
                    "buffers of " + ", ".join(f"{mib} MiB" for mib, _ in BUFFERS)
                    + ", each read several times.",
        epilog="Exit status: 0 ok, 2 bad arguments or no GPU.").parse_args(argv)
    if not torch.cuda.is_available():
        print("tools/l2_bandwidth.py: no CUDA GPU found; this benchmark needs one", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 0)
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB")
    rows = []
    for mib, reps in BUFFERS:
        ms, tbs = read_bandwidth(mib << 20, reps)
        rows.append({"buffer": f"{mib} MiB", "reps": reps, "ms": round(ms, 3),
                     "tbs": round(tbs, 2), "level": "HBM" if (mib << 20) > l2 else "L2"})
    print_table(rows, [("buffer", "buffer"), ("reps", "reads"), ("ms", "ms"), ("tbs", "TB/s"),
                       ("level", "served by")])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one timing routine of the repo (bench/, profiling/), and throughput from its times."""
from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

# dense bf16 tensor-core peaks (datasheets, TFLOP/s) by what the device's name contains, the more
# specific names first; "% of peak" columns use the GPU's own (peak_tflops)
BF16_DENSE_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0),
                          ("H100", 989.0), ("H200", 989.0), ("H800", 989.0))
L2_FLUSH_BYTES = 256 * 1024 * 1024  # what do_bench writes before every timed call (> any L2)


def median_ms(fn: Callable[[], object], warmup_ms: float = 100.0, rep_ms: float = 1000.0,
              flush_l2: bool = True) -> float:
    """Median wall time of `fn()` on the GPU, in milliseconds.

    flush_l2=True (every kernel benchmark): `triton.testing.do_bench(fn, warmup=warmup_ms,
    rep=rep_ms, return_mode="median")`: one call plus a 5-call estimate, then about warmup_ms of
    warm-up calls and rep_ms of timed calls, each timed with CUDA events. do_bench clears the L2
    cache (writes L2_FLUSH_BYTES) before every timed call, so each call starts cold and repeated
    calls on one input set do not measure a warm cache. The defaults give at least ~5 timed calls
    for a 175 ms kernel (the `star` shape).
    flush_l2=False (a cache's own bandwidth, tools/l2_bandwidth.py): the same call counts, each
    timed call between CUDA events with no flush, so what the previous call left in L2 stays.
    """
    if flush_l2:
        import triton.testing  # imported here: needs a GPU driver only when called

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                             return_mode="median"))
    import torch

    def timed() -> float:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    timed()  # compile and warm
    estimate = max(statistics.fmean(timed() for _ in range(5)), 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    return float(statistics.median(timed() for _ in range(max(1, int(rep_ms / estimate)))))


def tflops(flop_count: float, ms: float) -> float:
    """Throughput in TFLOP/s of `flop_count` operations done in `ms` milliseconds."""
    return flop_count / (ms * 1e-3) / 1e12


def peak_for(name: str) -> float | None:
    """The dense bf16 peak of the GPU called `name` (BF16_DENSE_PEAK_TFLOPS), None if unknown."""
    return next((tf for key, tf in BF16_DENSE_PEAK_TFLOPS if key in name), None)


@functools.cache
def peak_tflops() -> float | None:
    """The current GPU's dense bf16 peak, None without a GPU or for one not in the table."""
    import torch

    return peak_for(torch.cuda.get_device_name()) if torch.cuda.is_available() else None


def pct_of_peak(tf: float, peak: float | None = None) -> float | None:
    """`tf` TFLOP/s as a percentage of `peak` (default: this GPU's, peak_tflops); None when the
    peak is unknown."""
    peak = peak or peak_tflops()
    return 100.0 * tf / peak if peak else None


def peak_words() -> str:
    """The peak "% of peak" columns divide by, in words (a table's caption)."""
    peak = peak_tflops()
    return f"% of peak: of {peak:.0f} TFLOPS, the GPU's dense bf16 datasheet peak" if peak else \
        "% of peak: this GPU's peak is not in profiling/timing.py's table"


def captured(fn: Callable[[], object]):
    """(graph, outputs): `fn` warmed up on a side stream, then captured in a CUDA graph;
    graph.replay() reruns it, writing into the same outputs (no host work per replay)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """`fn` captured in a CUDA graph (`captured`); the returned function replays it."""
    return captured(fn)[0].replay

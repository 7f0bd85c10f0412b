"""The warp-specialization probe: a TLX kernel with the task layout of our TLX kernels and no shared
memory of its own, so that a sanitizer finding in it belongs to the compiler's warp-specialization
code, not to our rings (docs/sanitizers.md#the-warp-specialization-dispatch).

`ws_probe_kernel` has what `kernels_tlx/simplicial/bwd_ws.py` and `kernels_tlx/simplicial/ws.py`
have around their work:
`tlx.async_tasks()` with a "default" task (the launch's 4 warps) and one task of 4 warps,
`registers=232`, `replicate=2` (12 warps, setmaxnreg), and one value loaded from global memory
before the tasks and used in all of them (the compiler passes such a value to the other warp
groups through shared memory, as it does in the forward `tlx_ws`). Each task then spins
`(task + 1) * iters` steps of a 32-bit LCG and writes its own 128-int32 slice of `out`: global
memory only; no local_alloc, barrier or TMA.

What shared memory the compiled kernel touches is then the compiler's own: the per-warp dispatch
bytes (written by the default warp group at its start and, with the exit code, at its end; read by
the other warps after `barrier.sync 1`) and the captured value. tools/ws_dispatch.py lists those
instructions in SASS and checks that barrier 1 orders them, for the probe and for each of our
warp-specialized kernels (tests/tools/test_ws_dispatch.py compares the two).

    python3 -m tools.ws_probe            # the probe's dispatch, checked (sm_90a, no GPU)
    python3 -m tools.ws_probe --run      # one launch on the GPU, checked against the host
tools/sanitize.py runs it under the sanitizers with `--pass probe`.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from altattn.registry import CompileConfig

KERNEL_NAME = "ws_probe_kernel"
LANES = 128             # one int32 per thread of a 4-warp task
TASKS = 3               # default + 2 replicas
CONSUMER_REGS = 232     # as the tlx_ws backward's consumers (the forward's take 240)
GRID = 264              # two CTAs per SM of an H100 SXM (132 SMs): two waves
ITERS = 2048            # LCG steps of the default task; replica r spins (r + 2) * ITERS
LCG_A, LCG_C = 1664525, 1013904223


@triton.jit
def _spin(x, n):
    for _ in range(n):
        x = x * 1664525 + 1013904223
    return x


@triton.jit
def ws_probe_kernel(Out, Seed, iters, CONSUMER_REGS: tl.constexpr,
                    PARTITION_BARRIERS: tl.constexpr = 0):
    pid = tl.program_id(0)
    seed = tl.load(Seed + pid)  # not recomputable in a task: passed to them through shared memory
    with tlx.async_tasks():
        with tlx.async_task("default"):
            lanes = tl.arange(0, 128)
            x = _spin(seed + lanes, iters)
            if PARTITION_BARRIERS > 0:  # bar.sync of this warp group alone, as in our kernels
                tl.debug_barrier()
            tl.store(Out + (pid * 3) * 128 + lanes, x)
        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=2):
            r = tlx.async_task_replica_id()
            lanes = tl.arange(0, 128)
            x = _spin(seed + lanes + 1000 * (r + 1), iters * (r + 2))
            if PARTITION_BARRIERS > 0:
                tl.debug_barrier()
            if PARTITION_BARRIERS > 1 and r == 1:  # 2: replica 1 syncs its warp group twice
                tl.debug_barrier()
            tl.store(Out + (pid * 3 + 1 + r) * 128 + lanes, x)


def compile_config() -> CompileConfig:
    """The probe as tools.resources compiles our kernels (sm_90a, no GPU)."""
    return CompileConfig(name="ws_probe", fn=ws_probe_kernel,
                         signature={"Out": "*i32", "Seed": "*i32", "iters": "i32",
                                    "CONSUMER_REGS": "constexpr",
                                    "PARTITION_BARRIERS": "constexpr"},
                         constexprs={"CONSUMER_REGS": CONSUMER_REGS, "PARTITION_BARRIERS": 0},
                         num_warps=4, num_stages=1)


# ---------------------------------------------------------------------------------------------
# Expected values (host) and one launch (GPU)


def expected(seeds: Sequence[int], iters: int):
    """[cta, task, lane] int32 tensor (CPU) of what the kernel writes for these CTAs' seeds,
    computed on the host with the same 32-bit wrap-around."""
    import torch

    seed = torch.tensor(list(seeds), dtype=torch.int64)[:, None]
    lanes = torch.arange(LANES, dtype=torch.int64)[None, :]
    out = []
    for task in range(TASKS):
        x = (seed + lanes + 1000 * task) & 0xFFFFFFFF
        for _ in range(iters * (task + 1)):
            x = (x * LCG_A + LCG_C) & 0xFFFFFFFF
        out.append(torch.where(x >= 2**31, x - 2**32, x))
    return torch.stack(out, dim=1).to(torch.int32)


def run(grid: int = GRID, iters: int = ITERS, check: int = 4,
        partition_barriers: int = 0) -> None:
    """One launch of the probe on the GPU; the first and last `check` CTAs' slices checked against
    `expected` (AssertionError naming the first wrong one). partition_barriers: 1, each task also
    runs a barrier of its own warp group (`bar.sync id, 128`, as the compiler emits in our
    kernels' tasks) before its store; 2, replica 1 runs two (the tasks then pass different counts
    of barriers, as our consumers do when their trip counts differ)."""
    import torch

    seeds = torch.arange(grid, dtype=torch.int32, device="cuda") * 7919 + 11
    out = torch.zeros(grid, TASKS, LANES, dtype=torch.int32, device="cuda")
    ws_probe_kernel[(grid,)](out, seeds, iters, CONSUMER_REGS=CONSUMER_REGS,
                             PARTITION_BARRIERS=partition_barriers, num_warps=4, num_stages=1)
    torch.cuda.synchronize()
    ctas = sorted({*range(min(check, grid)), *range(max(grid - check, 0), grid)})
    want = expected(seeds[ctas].tolist(), iters)
    got = out[ctas].cpu()
    for i, c in enumerate(ctas):
        for t in range(TASKS):
            assert torch.equal(got[i, t], want[i, t]), f"{KERNEL_NAME}: CTA {c} task {t}: wrong"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.ws_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="store_true",
                   help="launch the probe once on the GPU and check its output")
    p.add_argument("--partition-barriers", type=int, choices=(0, 1, 2), default=0, metavar="K",
                   help="with --run: 1, each task also syncs its own warp group (bar.sync id, "
                        "128); 2, one task twice (default 0)")
    args = p.parse_args(argv)
    if args.run:
        from profiling.common import gpu_problem
        problem = gpu_problem("python3 -m tools.ws_probe")
        if problem is not None:
            return problem
        run(partition_barriers=args.partition_barriers)
        print(f"{KERNEL_NAME}: {GRID} CTAs, output checked")
        return 0
    from tools import ws_dispatch
    return ws_dispatch.main(["--pass", "probe", "--listing"])


if __name__ == "__main__":
    sys.exit(main())

"""TLX `apply` for Dx = Dy = Do = 32 (T1's output and input gradients): kernels_triton/triple/
core.py's contraction with the whole state slab resident in shared memory.

    Out[n, o] = c * sum_p sum_x (X[n, x] Y[n, p]) W[p, x, o]

At 32 the slab W [32, 32, 32] bf16 is 64 KB: each CTA TMA-loads its head's once and walks token
tiles of that head (a persistent grid, CTAS_PER_HEAD programs a head), so the mainloop waits on
no state load. Per tile, each of two consumer warp groups (64 rows) loads its X and Y rows once
into registers in the wgmma A-fragment layout; the A operand of step p, X scaled row-wise by
Y[:, p], is built by one inline-asm block: the thread's two values Y[r, p] and Y[r + 8, p] come
from the quad lane holding column p (two shfl), are doubled into bf16x2 (prmt) and multiply its
eight X registers (mul.bf16x2). Then acc += A_p @ W[p] (wgmma, W[p] from shared memory), one
step in flight while the next is built.

Warp groups: producer ("default") TMA-loads W once, then each tile's X and Y halves into rings
of NUM_BUFFERS slots; two consumers (64 rows each) build, multiply, and store bf16 rows (< N).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from altattn.registry import CompileConfig
from kernels_triton.launch import Desc, Kernel, meta, sm_count
from kernels_triton.triple import host as triton_host
from kernels_triton.proton import enter, leave
from kernels_tlx.consumers import NUM_CONSUMERS
from kernels_tlx.ring import empty_phase, full_phase

D = tl.constexpr(32)        # Dx = Dy = Do
ROWS = tl.constexpr(64)     # token rows per consumer
BF16 = tl.constexpr(2)
# The wgmma A-fragment layout of a [64, 32] bf16 tile (flat offset row * 32 + column): lane bits
# 0-1 -> columns 2, 4; lane bits 2-4 -> rows 1, 2, 4; warp bits -> rows 16, 32; register bits ->
# column 1, row 8, columns 8, 16. Word w of a thread (elements 2w, 2w + 1) is row r + 8 (w & 1),
# columns 8 (w >> 1) + 2 (lane % 4) + {0, 1}.
A32 = tlx.layout(shape=((4, 8, 4), (2, 2, 4)), stride=((2, 32, 512), (1, 256, 8)))


def _row_scale_asm(p: int) -> str:
    """PTX of step p: out word w = X word w * (Y[r + 8 (w & 1), p] doubled). Y[., p] sits in word
    2 (p // 8) + (w & 1), half p % 2, of quad lane (p % 8) // 2."""
    m, q, half = p // 8, (p % 8) // 2, p % 2
    sel = "0x3232" if half else "0x1010"
    muls = "\n".join(f"mul.rn.bf16x2 ${w}, ${8 + w}, f{w & 1};" for w in range(8))
    return f"""
    {{
    .reg .b32 src, y0, y1, f0, f1;
    mov.u32 src, %laneid;
    and.b32 src, src, 0xfffffffc;
    or.b32 src, src, {q};
    shfl.sync.idx.b32 y0, ${16 + 2 * m}, src, 0x1f, 0xffffffff;
    shfl.sync.idx.b32 y1, ${16 + 2 * m + 1}, src, 0x1f, 0xffffffff;
    prmt.b32 f0, y0, y0, {sel};
    prmt.b32 f1, y1, y1, {sel};
    {muls}
    }}
    """


ROW_SCALE = tl.constexpr(tuple(_row_scale_asm(p) for p in range(32)))


@triton.jit
def _step(xa, ya, p: tl.constexpr):
    """The A operand of step p: xa scaled row-wise by column p of ya (both [64, 32] in A32)."""
    return tl.inline_asm_elementwise(ROW_SCALE[p], "=r," * 8 + "r," * 15 + "r", [xa, ya],
                                     dtype=tl.bfloat16, is_pure=True, pack=16)


@triton.jit
def apply_resident_kernel(Xd, Yd, Wd, Out, N, c, w_head, tiles_per_head,
                          H: tl.constexpr, NUM_BUFFERS: tl.constexpr,
                          CONSUMER_REGS: tl.constexpr, PROFILE: tl.constexpr = False):
    BM: tl.constexpr = NUM_CONSUMERS * ROWS
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    first = tl.program_id(0)
    step = tl.num_programs(0)
    n_tiles = tl.cdiv(tl.maximum(tiles_per_head - first, 0), step)  # this program's tiles

    w_tiles = tlx.local_alloc((D, D), tl.bfloat16, D)
    x_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, NUM_BUFFERS * NUM_CONSUMERS)
    y_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, NUM_BUFFERS * NUM_CONSUMERS)
    w_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)
    fulls = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    empties = tlx.alloc_warp_barrier(num_barriers=NUM_BUFFERS, num_warps=4 * NUM_CONSUMERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):
            enter("load", PROFILE)
            wf = tlx.local_view(w_full, 0)
            tlx.barrier_expect_bytes(wf, D * D * D * BF16)
            for p in tl.static_range(D):
                tlx.async_descriptor_load(Wd, tlx.local_view(w_tiles, p), [bh * w_head + p * D, 0],
                                          wf)
            leave("load", PROFILE)
            for t in range(n_tiles):
                enter("load", PROFILE)
                buf = t % NUM_BUFFERS
                tlx.barrier_wait(tlx.local_view(empties, buf), empty_phase(t, NUM_BUFFERS))
                full = tlx.local_view(fulls, buf)
                tlx.barrier_expect_bytes(full, 2 * BM * D * BF16)
                n0 = (first + t * step) * BM
                for cc in tl.static_range(NUM_CONSUMERS):
                    slot = buf * NUM_CONSUMERS + cc
                    tlx.async_descriptor_load(Xd, tlx.local_view(x_tiles, slot),
                                              [b, n0 + cc * ROWS, h * D], full)
                    tlx.async_descriptor_load(Yd, tlx.local_view(y_tiles, slot),
                                              [b, n0 + cc * ROWS, h * D], full)
                leave("load", PROFILE)
        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid: tl.constexpr = tlx.async_task_replica_id()
            enter("wait", PROFILE)
            tlx.barrier_wait(tlx.local_view(w_full, 0), 0)
            leave("wait", PROFILE)
            rows = tl.arange(0, ROWS)
            cols = tl.arange(0, D)
            for t in range(n_tiles):
                buf = t % NUM_BUFFERS
                enter("wait", PROFILE)
                tlx.barrier_wait(tlx.local_view(fulls, buf), full_phase(t, NUM_BUFFERS))
                leave("wait", PROFILE)
                enter("build", PROFILE)
                slot = buf * NUM_CONSUMERS + cid
                xa = tlx.local_load(tlx.local_view(x_tiles, slot), layout=A32)
                ya = tlx.local_load(tlx.local_view(y_tiles, slot), layout=A32)
                tlx.barrier_arrive(tlx.local_view(empties, buf), 1)
                leave("build", PROFILE)
                enter("gemm", PROFILE)
                acc = tl.zeros([ROWS, D], tl.float32)
                for p in tl.static_range(D):
                    acc = tlx.async_dot(_step(xa, ya, p), tlx.local_view(w_tiles, p), acc)
                    acc = tlx.async_dot_wait(1, acc)  # step p - 1 done: its A registers free
                acc = tlx.async_dot_wait(0, acc)
                leave("gemm", PROFILE)
                enter("epilogue", PROFILE)
                n = (first + t * step) * BM + cid * ROWS + rows
                orow = ((b.to(tl.int64) * N + n) * H + h) * D
                tl.store(Out + orow[:, None] + cols[None, :], (acc * c).to(Out.dtype.element_ty),
                         mask=(n < N)[:, None])
                leave("epilogue", PROFILE)


# ---- host side ---------------------------------------------------------------------------------

CONFIG = {"NUM_BUFFERS": 2, "CONSUMER_REGS": 240, "num_warps": 4, "num_stages": 1}


def takes(dx: int, dy: int, do: int, chunk: int) -> bool:
    """The widths, and the non-causal form (one slab a head, chunk 0), this kernel computes."""
    return (dx, dy, do) == (32, 32, 32) and not chunk


def prepare_apply(B: int, N: int, H: int, c: float, profile: bool = False):
    """kernels_triton.triple.host.prepare_apply's launch at Dx = Dy = Do = 32, chunk 0, made
    once: run(x, y, w, out), w [B, H, 32, 32, 32] bf16 contiguous, out bf16. The grid: each
    head's token tiles over min(tiles, multiprocessors of the current GPU / (B * H)) CTAs."""
    d, bm = int(D), int(NUM_CONSUMERS) * int(ROWS)
    tiles = triton.cdiv(N, bm)
    per_head = max(1, min(tiles, sm_count() // max(B * H, 1)))
    rows = Desc([B, N, H * d], [N * H * d, H * d, 1], [1, int(ROWS), d])
    w_layout = Desc([B * H * d * d, d], [d, 1], [d, d])
    kernel = Kernel(apply_resident_kernel, (per_head, B * H), H=H, PROFILE=bool(profile),
                    **{k: v for k, v in CONFIG.items() if k.isupper()},
                    num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"])
    c = float(c)
    empty = B * H == 0 or N == 0

    def run(x, y, w, out) -> None:
        if not empty:
            kernel(rows(x), rows(y), w_layout(w), out, N, c, d * d, tiles)

    return run


def apply(x, y, w, out, c: float) -> None:
    """kernels_triton.triple.host.apply's contract at Dx = Dy = Do = 32, chunk 0, bf16 out:
    `prepare_apply` of these tensors' shapes, run once on them (tests)."""
    assert w.is_contiguous() and w.dtype == torch.bfloat16
    B, N, H, _ = x.shape
    prepare_apply(B, N, H, c)(x, y, w, out)


def compile_configs() -> list[CompileConfig]:
    """The kernel's launch (recorded on meta tensors)."""
    N, H, d = triton_host.COMPILE_N, triton_host.COMPILE_H, int(D)
    x = triton_host.tokens(d)
    return [triton_host.recorded_config("apply_resident_D32", apply_resident_kernel,
                                        lambda: prepare_apply(1, N, H, 1.0), x, x,
                                        meta(1, H, d, d, d), x)]

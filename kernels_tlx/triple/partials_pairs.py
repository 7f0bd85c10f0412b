"""TLX `partials` for Y 32 wide (Dv = 32: T1's state and dS): partials.py's kernel with the rows
of each wgmma A operand being (i, j) for two values of i.

A wgmma A operand has 64 rows and Y^T only 32, so a copier warp group writes each Y tile twice,
side by side, into a [BN, 64] slot (ldmatrix reads shared memory, and a TMA box cannot land in
half of a swizzled row): rows 0-31 of the loaded Y^T are j, rows 32-63 j again. The column factor
(partials.column_factor) gives warps 0-1 (rows 0-31) X1[:, i] and warps 2-3 (rows 32-63)
X1[:, i + 1]. Accumulator a of consumer c then holds P rows (i0 + 2a, j) and (i0 + 2a + 1, j),
i.e. 64 consecutive rows of P[s, (i, j), k].

Warp groups: producer ("default", 4 warps) TMA-loads Y [BN, 32] and X2 [BN, D2]; copier (4 warps)
turns each Y tile into the doubled slot; two consumers of ACC accumulators [64, D2]. Rings of
NUM_BUFFERS slots: Y and X2 loaded (full, vfull), Y doubled (copied: every copier thread
arrives), slot read (empty: every consumer thread arrives).
"""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from kernels_tlx.consumers import NUM_CONSUMERS
from kernels_triton.proton import enter, leave
from kernels_triton.triple.core import split_program
from kernels_tlx.ring import empty_phase
from kernels_tlx.triple.partials import (A_LAYOUT, BF16, BN, ROWS, prefetch_x1, step_gemms,
                                         store_accs)

DY = tl.constexpr(32)


@triton.jit
def partials_pairs_kernel(X1P, Yd, X2d, P, N, NP, split_len, n_splits,
                          H: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                          BI: tl.constexpr, ACC: tl.constexpr, NUM_BUFFERS: tl.constexpr,
                          COPIER_REGS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
                          PROFILE: tl.constexpr = False, Splits=None):
    tl.static_assert(BI == NUM_CONSUMERS * ACC * 2, "two values of i per accumulator")
    tl.static_assert(ACC <= 4, "at most four accumulators")
    ib, s, bh, b, h, start, end, pstart = split_program(N, split_len, n_splits, H, D1 // BI,
                                                        Splits)
    n_steps = tl.cdiv(tl.maximum(end - start, 0), BN)

    v_tiles = tlx.local_alloc((BN, DY), tl.bfloat16, NUM_BUFFERS)
    y_tiles = tlx.local_alloc((BN, 2 * DY), tl.bfloat16, NUM_BUFFERS)
    x2_tiles = tlx.local_alloc((BN, D2), tl.bfloat16, NUM_BUFFERS)
    fulls = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    vfulls = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    copied = tlx.alloc_warp_barrier(num_barriers=NUM_BUFFERS, num_warps=4)
    empties = tlx.alloc_warp_barrier(num_barriers=NUM_BUFFERS, num_warps=4 * NUM_CONSUMERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):
            for t in range(n_steps):
                enter("load", PROFILE)
                buf = t % NUM_BUFFERS
                tlx.barrier_wait(tlx.local_view(empties, buf), empty_phase(t, NUM_BUFFERS))
                n0 = start + t * BN
                full = tlx.local_view(fulls, buf)
                tlx.barrier_expect_bytes(full, BN * D2 * BF16)
                tlx.async_descriptor_load(X2d, tlx.local_view(x2_tiles, buf), [b, n0, h * D2],
                                          full)
                prefetch_x1(X1P, bh, D1, ib * BI, BI, NP, pstart + t * BN)
                vfull = tlx.local_view(vfulls, buf)
                tlx.barrier_expect_bytes(vfull, BN * DY * BF16)
                tlx.async_descriptor_load(Yd, tlx.local_view(v_tiles, buf), [b, n0, h * DY],
                                          vfull)
                leave("load", PROFILE)
        with tlx.async_task(num_warps=4, registers=COPIER_REGS):
            for t in range(n_steps):
                enter("build", PROFILE)
                buf = t % NUM_BUFFERS
                phase = (t // NUM_BUFFERS) & 1
                tlx.barrier_wait(tlx.local_view(vfulls, buf), phase)
                # the producer waited for this slot's consumers before loading Y into it
                v = tlx.local_load(tlx.local_view(v_tiles, buf))
                both = tl.reshape(tl.permute(tl.join(v, v), (0, 2, 1)), (BN, 2 * DY))
                tlx.local_store(tlx.local_view(y_tiles, buf), both)
                tlx.barrier_arrive(tlx.local_view(copied, buf), 1)
                leave("build", PROFILE)
        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid: tl.constexpr = tlx.async_task_replica_id()
            i0: tl.constexpr = cid * ACC * 2
            acc0 = tl.zeros([ROWS, D2], tl.float32)
            acc1 = tl.zeros([ROWS, D2], tl.float32)
            acc2 = tl.zeros([ROWS, D2], tl.float32)
            acc3 = tl.zeros([ROWS, D2], tl.float32)
            pair = NP.to(tl.int64) * BF16   # bytes from one value of i's row of X1P to the next
            for t in range(n_steps):
                buf = t % NUM_BUFFERS
                phase = (t // NUM_BUFFERS) & 1
                enter("wait", PROFILE)
                tlx.barrier_wait(tlx.local_view(fulls, buf), phase)
                tlx.barrier_wait(tlx.local_view(copied, buf), phase)
                leave("wait", PROFILE)
                enter("build", PROFILE)
                vt = tlx.local_load(tlx.local_trans(tlx.local_view(y_tiles, buf)), layout=A_LAYOUT)
                x1p = X1P + ((bh.to(tl.int64) * D1 + ib * BI + i0) * NP + pstart + t * BN)
                leave("build", PROFILE)
                enter("gemm", PROFILE)
                acc0, acc1, acc2, acc3 = step_gemms(vt, x1p, 2 * NP, pair,
                                                    tlx.local_view(x2_tiles, buf),
                                                    acc0, acc1, acc2, acc3, ACC)
                leave("gemm", PROFILE)
                tlx.barrier_arrive(tlx.local_view(empties, buf), 1)
            # P[b, h, s, (i, j), k]: accumulator a is rows (i0 + 2a) * 32 + r, r < 64
            offs = tl.arange(0, ROWS)[:, None] * D2 + tl.arange(0, D2)[None, :]
            base = ((bh.to(tl.int64) * n_splits + s) * D1 + ib * BI + i0) * (DY * D2)
            enter("epilogue", PROFILE)
            store_accs(P + base + offs, 2 * DY * D2, acc0, acc1, acc2, acc3, ACC)
            leave("epilogue", PROFILE)

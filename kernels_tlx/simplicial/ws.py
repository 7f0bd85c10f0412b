"""`tlx_ws`: warp-specialized TLX forward (the seeds' Kernel-1).

Warp groups:
- producer ("default", 4 warps, registers given away): TMA-loads the tile's Q once (`q_full`);
  then, per chunk of WINDOW rows of the w1 window, bulk-copies (`cp.async.bulk`, the TMA engine)
  the rows K1[j] and V1[j] of the chunk into the window (`win_full`; `win_empty`, one arrival per
  consumer, says both are done with the previous chunk), and walks the tile's K2/V2 blocks in
  the order of `kernels_triton.simplicial.tiling.key_block`, TMA-loading each into a ring of NUM_BUFFERS
  shared-memory slots; `fulls[i]` (1 arrival + transaction bytes) says a slot is loaded,
  `empties[i]` (one arrival per consumer) says both consumers are done with it. A window of up
  to WINDOW rows (w1 + T - 1, T tokens per tile) is one chunk, so Q, K1 and V1 cross into shared
  memory once per tile; a longer one streams the K2/V2 blocks once per chunk.
- Two consumer warp groups (4 warps each) on one 64-row tile (heads x neighbouring tokens, see
  kernels_triton/simplicial/tiling.py). They share every K2/V2 slot, so a block crosses L2 -> shared memory
  once per tile (per chunk), and the tile's Q. They split the w1 window: consumer c takes
  j = j_first + c, j_first + c + 2, ... and at the end consumer 1 hands (acc, m, l) to consumer 0,
  which merges the two softmax states (common.merge_and_store).
Each consumer first takes Q through the tensor cores once, Q @ I, so that Q sits in its registers in
the wgmma accumulator layout. Per step (one K2/V2 slot, one j):
    A = Q * K1[j]                 in registers, in that layout (no shared memory)
    S = A @ K2^T                  RS-wgmma
    online softmax in exp2
    acc = acc * alpha + (P @ V2) * V1[j]   RS-wgmma; V1 multiplies the GEMM output (V1 * V2 is
                                  never built in shared memory)
K1[j] and V1[j] are read from the window in the accumulator's column layout (`v1_layout`); nothing
is written to shared memory inside the loop, so the step has no barrier.
`PINGPONG` (the `tlx_pingpong` variant: this module with switches, `variant`; the seeds'
Kernel-3) makes the two consumers take turns on the tensor cores: every wgmma issue (QK and PV)
of consumer c waits on named barrier TURN_BARRIER + c and, once issued, arrives on the other's
(common.take_turn / pass_turn), so the issues strictly alternate (c0 QK, c1 QK, c0 PV, c1 PV, ...)
and one consumer's softmax runs while the other's GEMM owns the tensor cores. Consumer 1 arrives
once at the start so consumer 0 goes first; with an odd w1 window consumer 1 runs one extra, fully
masked step per block, so both issue as many wgmma. Off (`tlx_ws`), each consumer runs on its own.
Supports any B, N, Hk, w1 <= w2, D in {64, 128}, G in {16, 32, 64, 128} (`supports`).
Differs from `triton`: TMA producer + mbarrier ring, two consumer groups sharing each K2/V2 slot
and splitting the window, Q resident in registers and A formed there.
"""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from kernels_tlx.simplicial.common import (NUM_CONSUMERS, merge_and_store, opaque, pass_turn, produce_kv,
                                release_layout, take_turn, v1_layout)
from kernels_triton.simplicial.host import entry_points
from kernels_triton.simplicial.tiling import (BF16_BYTES, M_START, enter, key_block, leave, mask_scores,
                                   row_coords, softmax_step, tile_setup)
from kernels_triton.simplicial.tiling import supports as tiling_supports
from altattn.simplicial.spec import ProblemSpec
from kernels_tlx.ring import empty_phase, full_phase


@triton.jit
def produce_q(Q, q_smem, q_full, b, g, i0, h0, N, HQ: tl.constexpr, G: tl.constexpr,
              D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Producer: TMA-load the tile's Q, one box per token (its q_rows heads), into q_smem."""
    HPT: tl.constexpr = BLOCK_M if G > BLOCK_M else G
    tlx.barrier_expect_bytes(q_full, BLOCK_M * D * BF16_BYTES)
    for t in tl.static_range(BLOCK_M // HPT):
        tlx.async_descriptor_load(Q, tlx.local_slice(q_smem, [t * HPT, 0], [HPT, D]),
                                  [(b * N + i0 + t) * HQ + g * G + h0, 0], q_full)


@triton.jit
def produce_window(K1, V1, k1_rows, v1_rows, k1_flat, v1_flat, win_full, win_empty, ch, j0, i_hi,
                   kv_base, N, HK: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr):
    """Producer: once both consumers are done with chunk ch - 1, bulk-copy (TMA engine,
    `cp.async.bulk`) the chunk's rows K1[j] and V1[j], j = j0 .. j0 + L - 1, into window rows
    0 .. L - 1, and a copy of row L - 1 into row L (pingpong's masked extra step reads it);
    win_full counts WINDOW rows of bytes."""
    tlx.barrier_wait(win_empty, empty_phase(ch, 1))
    tlx.barrier_expect_bytes(win_full, 2 * WINDOW * D * BF16_BYTES)  # K1 and V1 rows
    L = tl.minimum(i_hi - j0 + 1, WINDOW)
    if j0 + WINDOW <= N:
        # rows 0 .. n - 1 as they are (one copy each when the rows are contiguous, Hk = 1) ...
        n = tl.minimum(L, WINDOW - 1)
        if HK == 1:
            off = kv_base + j0.to(tl.int64) * D
            size = n * (D * BF16_BYTES)
            tlx.async_load(K1 + off, k1_flat, bulk=True, bulk_size=size, barrier=win_full)
            tlx.async_load(V1 + off, v1_flat, bulk=True, bulk_size=size, barrier=win_full)
        else:
            for r in range(0, n):
                off = kv_base + (j0 + r).to(tl.int64) * (HK * D)
                tlx.async_load(K1 + off, tlx.local_view(k1_rows, r), bulk=True, barrier=win_full)
                tlx.async_load(V1 + off, tlx.local_view(v1_rows, r), bulk=True, barrier=win_full)
        # ... then rows n .. WINDOW - 1 in one copy (through row n's view, on past its end) that
        # starts at row L - 1 of the chunk: what follows that row in memory lands in rows that are
        # never read, and it stays inside the batch
        off = kv_base + (j0 + L - 1).to(tl.int64) * (HK * D)
        size = (WINDOW - n) * (D * BF16_BYTES)
        tlx.async_load(K1 + off, tlx.local_view(k1_rows, n), bulk=True, bulk_size=size,
                       barrier=win_full)
        tlx.async_load(V1 + off, tlx.local_view(v1_rows, n), bulk=True, bulk_size=size,
                       barrier=win_full)
    else:  # the batch ends within WINDOW rows: a copy per row, past L - 1 a copy of row L - 1
        for r in range(0, WINDOW):
            off = kv_base + (j0 + tl.minimum(r, L - 1)).to(tl.int64) * (HK * D)
            tlx.async_load(K1 + off, tlx.local_view(k1_rows, r), bulk=True, barrier=win_full)
            tlx.async_load(V1 + off, tlx.local_view(v1_rows, r), bulk=True, barrier=win_full)


@triton.jit
def row(rows, r, D: tl.constexpr):
    """Window row r (K1[j] or V1[j]) in the accumulator's column layout."""
    return release_layout(tlx.local_load(tlx.local_view(rows, r),
                                         layout=v1_layout(D))).to(tl.float32)


@triton.jit
def consume_block(acc, m_i, l_i, q, k1_rows, v1_rows, k2_tile, v2_tile, kb, j_start, j_hi,
                  n_st, r0, cid, tok, w1, w2, qk_scale, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASK_J: tl.constexpr, MASK_K: tl.constexpr,
                  PINGPONG: tl.constexpr, PROFILE: tl.constexpr):
    """One consumer warp group: one K2/V2 slot against n_st steps, j = j_start, j_start + 2, ...
    (every NUM_CONSUMERS-th j), whose K1[j] and V1[j] wait in window rows r0, r0 + 2, ..."""
    offs_n = tl.arange(0, BLOCK_N)
    k2t = tlx.local_trans(k2_tile)
    for st in range(0, n_st):
        j = j_start + NUM_CONSUMERS * st
        r = r0 + NUM_CONSUMERS * st
        enter("qk_gemm", PROFILE)
        take_turn(cid, PINGPONG)
        # A = Q * K1[j], formed in fp32 and rounded: it stays in the accumulator layout of q and
        # becomes the register operand of the wgmma with no shared-memory round trip
        a = (q.to(tl.float32) * row(k1_rows, r, D)[None, :]).to(tl.bfloat16)
        s = tlx.async_dot(a, k2t)
        pass_turn(cid, PINGPONG)
        s = tlx.async_dot_wait(0, s)
        leave("qk_gemm", PROFILE)
        enter("softmax", PROFILE)
        s = mask_scores(s, j, kb, tok, offs_n, w1, w2, MASK_J, MASK_K)
        if PINGPONG and not MASK_J:  # (MASK_J already drops j > every row's token)
            # both consumers run the same step count: a j past the window scores -inf (a select,
            # not a branch: this ptxas crashes on the branch form next to the folded softmax)
            s = s + tl.where(j > j_hi, float("-inf"), 0.0)
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale)
        leave("softmax", PROFILE)
        enter("pv_gemm", PROFILE)
        take_turn(cid, PINGPONG)
        pv = tlx.async_dot(p.to(tl.bfloat16), v2_tile)
        pass_turn(cid, PINGPONG)
        pv = tlx.async_dot_wait(0, pv)
        leave("pv_gemm", PROFILE)
        enter("v1_mul", PROFILE)
        acc = acc * alpha[:, None] + pv * row(v1_rows, r, D)[None, :]
        leave("v1_mul", PROFILE)
    return acc, m_i, l_i


@triton.jit
def simplicial_fwd_ws_kernel(Q, K1, K2, V1, V2, Out, Lse, N, w1, w2, qk_scale,
                             HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr,
                             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             NUM_BUFFERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
                             WINDOW: tl.constexpr, PINGPONG: tl.constexpr = False,
                             PROFILE: tl.constexpr = False):
    T: tl.constexpr = BLOCK_M // (BLOCK_M if G > BLOCK_M else G)
    b, g, i0, h0, i_hi, k_lo, n_lo, n_hi, n_blocks = tile_setup(N, w2, HK, G, BLOCK_M, BLOCK_N)

    q_tile = tlx.local_alloc((BLOCK_M, D), tl.bfloat16, 1)
    # the window: rows K1[j] and V1[j] for j = j_first + WINDOW * ch + r, r < WINDOW (consumer c
    # reads r = c, c + 2, ...); plain 1-D rows, read one at a time
    k1_rows = tlx.local_alloc((D,), tl.bfloat16, WINDOW)
    v1_rows = tlx.local_alloc((D,), tl.bfloat16, WINDOW)
    k1_flat = tlx.local_view(tlx.local_alloc((WINDOW * D,), tl.bfloat16, 1, reuse=k1_rows), 0)
    v1_flat = tlx.local_view(tlx.local_alloc((WINDOW * D,), tl.bfloat16, 1, reuse=v1_rows), 0)
    # the identity I (first D rows) that puts Q in the accumulator layout (Q @ I), and later the
    # split-j merge buffer of one fp32 [BLOCK_M, D] accumulator
    i_tiles = tlx.local_alloc((2 * BLOCK_M, D), tl.bfloat16, 1)
    k2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_BUFFERS)
    v2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_BUFFERS)
    merge_m = tlx.local_alloc((BLOCK_M,), tl.float32, 2)  # consumer 1's (m, l); acc: the I tile
    fulls = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    empties = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=NUM_CONSUMERS)
    q_full = tlx.local_view(tlx.alloc_barriers(num_barriers=1, arrive_count=1), 0)
    # consumer 0 has stored I (i_ready), and its Q @ I has read it (i_free: consumer 1 may then
    # overwrite the tile with its accumulator). mbarriers, not named barriers that the two
    # consumers would reach at two different bar.sync instructions (docs/sanitizers.md)
    i_ready = tlx.local_view(tlx.alloc_barriers(num_barriers=1, arrive_count=1), 0)
    i_free = tlx.local_view(tlx.alloc_barriers(num_barriers=1, arrive_count=1), 0)
    win_full = tlx.local_view(tlx.alloc_barriers(num_barriers=1, arrive_count=1), 0)
    win_empty = tlx.local_view(tlx.alloc_barriers(num_barriers=1, arrive_count=NUM_CONSUMERS), 0)
    q_smem = tlx.local_view(q_tile, 0)
    j_first = tl.maximum(i0 - w1 + 1, 0)
    n_chunks = tl.cdiv(i_hi - j_first + 1, WINDOW)  # the producer's and both consumers' count
    kv_base = b.to(tl.int64) * N * (HK * D) + g * D

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: Q, then per chunk the window and the K2/V2 ring
            enter("load_kv", PROFILE)
            produce_q(Q, q_smem, q_full, b, g, i0, h0, N, HQ, G, D, BLOCK_M)
            leave("load_kv", PROFILE)
            for ch in range(0, n_chunks):
                enter("load_kv", PROFILE)
                produce_window(K1, V1, k1_rows, v1_rows, k1_flat, v1_flat, win_full, win_empty, ch,
                               j_first + WINDOW * ch, i_hi, kv_base, N, HK, D, WINDOW)
                leave("load_kv", PROFILE)
                produce_kv(K2, V2, k2_tiles, v2_tiles, fulls, empties, ch * n_blocks, n_blocks,
                           n_blocks, k_lo, n_lo, n_hi, b, g, N, D, BLOCK_N, NUM_BUFFERS, PROFILE)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid = tlx.async_task_replica_id()
            tok = row_coords(i0, h0, tl.arange(0, BLOCK_M), G, BLOCK_M)[0]
            i_view = tlx.local_view(i_tiles, 0)
            i_tile = tlx.local_slice(i_view, [0, 0], [D, D])
            if cid == 0:
                offs_i = tl.arange(0, D)
                tlx.local_store(i_tile, tl.where(offs_i[:, None] == offs_i[None, :], 1.0,
                                                 0.0).to(tl.bfloat16))
                tlx.fence_async_shared()
                tlx.barrier_arrive(i_ready, 1)
            tlx.barrier_wait(i_ready, 0)
            tlx.barrier_wait(q_full, 0)
            # Q in the wgmma accumulator layout, kept in registers: Q @ I is exact (one product per
            # output). A local_load of Q in that layout is not enough: the compiler moves the
            # product Q * K1[j] to a blocked layout and back through shared memory.
            q = tlx.async_dot(q_smem, i_tile)
            q = tlx.async_dot_wait(0, q).to(tl.bfloat16)
            if cid == 0:
                tlx.barrier_arrive(i_free, 1)

            j_lo = j_first + cid
            # pingpong: both consumers issue the same number of wgmma (consumer 1's extra step of
            # an odd window is masked); otherwise each runs its own j
            n_steps = tl.cdiv(i_hi - (j_first if PINGPONG else j_lo) + 1, NUM_CONSUMERS)
            # (opaque: otherwise LLVM computes both consumers' row addresses before the split into
            # replicas, and ptxas spills them)
            r0 = opaque(cid)
            if PINGPONG:
                if cid == 1:
                    pass_turn(cid, PINGPONG)  # consumer 0 issues first
            m_i = tl.full([BLOCK_M], M_START, tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            n_int = n_hi - n_lo
            for ch in range(0, n_chunks):
                j_start = j_lo + WINDOW * ch
                n_st = tl.minimum(n_steps - (WINDOW // NUM_CONSUMERS) * ch,
                                  WINDOW // NUM_CONSUMERS)
                tlx.barrier_wait(win_full, ch & 1)
                for t in range(0, n_blocks):
                    u = ch * n_blocks + t
                    buf = u % NUM_BUFFERS
                    kb, _ = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
                    enter("wait_kv", PROFILE)
                    tlx.barrier_wait(tlx.local_view(fulls, buf), full_phase(u, NUM_BUFFERS))
                    leave("wait_kv", PROFILE)
                    k2_tile = tlx.local_view(k2_tiles, buf)
                    v2_tile = tlx.local_view(v2_tiles, buf)
                    if t < n_int:
                        acc, m_i, l_i = consume_block(
                            acc, m_i, l_i, q, k1_rows, v1_rows, k2_tile, v2_tile, kb, j_start,
                            i_hi, n_st, r0, cid, tok, w1, w2, qk_scale, D, BLOCK_N, T > 1,
                            False, PINGPONG, PROFILE)
                    else:
                        acc, m_i, l_i = consume_block(
                            acc, m_i, l_i, q, k1_rows, v1_rows, k2_tile, v2_tile, kb, j_start,
                            i_hi, n_st, r0, cid, tok, w1, w2, qk_scale, D, BLOCK_N, T > 1,
                            True, PINGPONG, PROFILE)
                    tlx.barrier_arrive(tlx.local_view(empties, buf), 1)
                tlx.barrier_arrive(win_empty, 1)
            enter("epilogue", PROFILE)
            if cid == 1:  # consumer 0 is past its Q @ I: the I tile carries this accumulator
                tlx.barrier_wait(i_free, 0)
            merge_acc = tlx.local_reinterpret(i_view, tl.float32, [BLOCK_M, D])
            # the output rows' coordinates, recomputed from an opaque copy of the row index:
            # otherwise LLVM keeps the Q load's row offsets alive across the loop (spills)
            tok, head = row_coords(i0, h0, opaque(tl.arange(0, BLOCK_M)), G, BLOCK_M)
            merge_and_store(acc, m_i, l_i, cid, merge_acc, merge_m, Out, Lse, b, g, tok, head, N,
                            HQ, G, D)
            leave("epilogue", PROFILE)


def supports(spec: ProblemSpec) -> str | None:
    why = tiling_supports(spec)
    if why is None and spec.G < 16:
        why = (f"G = Hq/Hk = {spec.G} < 16: a 64-row tile packs {64 // spec.G} tokens, and their "
               "per-row masks do not fit this kernel's registers; use `triton` (faster there)")
    return why


def config(spec: ProblemSpec, pingpong: bool = False) -> dict:
    """One 64-row tile (one token at G = 64: no mask; 2 or 4 neighbouring tokens packed when
    G < 64; a 64-head half of a token when G = 128) and 128-key blocks for every shape. The window
    buffer holds 64 rows (both consumers'): a window of up to 64 rows (w1 + T - 1) is one chunk."""
    return dict(BLOCK_M=64, BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, WINDOW=64,
                PINGPONG=pingpong, num_warps=4, num_stages=1)


prepare, launch, compile_configs = entry_points(simplicial_fwd_ws_kernel, config, supports,
                                               q_tma=True)


def variant(pingpong: bool) -> dict:
    """`tlx_pingpong` (altattn/registry.py: Variant.switches): this kernel with PINGPONG."""
    def variant_config(spec: ProblemSpec) -> dict:
        return config(spec, pingpong)

    prepare, launch, compile_configs = entry_points(simplicial_fwd_ws_kernel, variant_config,
                                                    supports, q_tma=True)
    return dict(supports=supports, config=variant_config, prepare=prepare, launch=launch,
                compile_configs=compile_configs)

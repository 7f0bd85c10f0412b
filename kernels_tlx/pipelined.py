"""`tlx_pipelined`: warp-specialized TLX forward with the w1 window as the OUTER loop.

Differs from `tlx_ws` (kernels_tlx/ws.py) in the loop order and what it buys:
- For each j of the window, A = Q * K1[j] is built once (into shared memory: SS-wgmma), and the PV wgmma accumulates P @ V2 straight
  into one register tile `acc_j` across the whole key window (rescaled by alpha like FlashAttention);
  (* V1[j]) and the hand-over into `acc` happen once per j instead of once per (block, j).
- Within a j, the PV wgmma of block t-1 is issued right after the QK wgmma of block t, to be left
  running while the softmax of block t executes (FlashAttention-3 style intra-warp-group overlap;
  P of the previous block is carried in registers). In the compiled code ptxas waits for it
  before the softmax ("ex2 under wgmma" = 0 in `python -m profiling.resources`), as in
  `tlx_pipelined_kv`.
- The cost: the K2/V2 window is streamed once per j (the producer repeats the block sequence w1
  times); both consumer groups share every slot.
Warp groups and masks as in tlx_ws; tile geometry: G > 64: two consumers on the two 64-head
halves of 128 rows; G <= 64: one 64-row tile, consumers take alternate j and merge at the end.
"""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from kernels_tlx.common import merge_and_store, produce_kv, tlx_entry_points
from kernels_triton.tiling import (enter, key_block, leave, load_q, mask_scores, row_coords,
                                   softmax_step, store_rows, tile_setup)
from kernels_triton.tiling import supports as tiling_supports
from simplicial_attn.spec import ProblemSpec


@triton.jit
def _wait_slot(fulls, c, NUM_BUFFERS: tl.constexpr, PROFILE: tl.constexpr):
    """Wait until the ring slot of block counter c is loaded; returns the slot index."""
    buf = c % NUM_BUFFERS
    enter("wait_kv", PROFILE)
    tlx.barrier_wait(tlx.local_view(fulls, buf), (c // NUM_BUFFERS) & 1)
    leave("wait_kv", PROFILE)
    return buf


@triton.jit
def _scores_softmax(s, t, n_int, j, i_hi, k_lo, n_lo, n_hi, tok, offs_n, w1, w2, qk_scale, m_i,
                    l_i, T: tl.constexpr, BLOCK_N: tl.constexpr):
    """Mask (edge blocks, T > 1, or no j for this consumer) and one online-softmax step."""
    kb, _ = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
    if t < n_int:
        s = mask_scores(s, j, kb, tok, offs_n, w1, w2, T > 1, False)
    else:
        s = mask_scores(s, j, kb, tok, offs_n, w1, w2, T > 1, True)
    if j > i_hi:  # SPLIT_J with an odd window: this consumer has no j this round
        s = s + float("-inf")
    return softmax_step(s, m_i, l_i, qk_scale)


@triton.jit
def simplicial_fwd_pipelined_kernel(Q, K1, K2, V1, V2, Out, Lse, N, w1, w2, qk_scale,
                                    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr,
                                    D: tl.constexpr, BLOCK_M: tl.constexpr,
                                    BLOCK_N: tl.constexpr, NUM_BUFFERS: tl.constexpr,
                                    CONSUMER_REGS: tl.constexpr, SPLIT_J: tl.constexpr,
                                    PROFILE: tl.constexpr = False):
    ROWS: tl.constexpr = BLOCK_M if SPLIT_J else BLOCK_M // 2
    T: tl.constexpr = BLOCK_M // (BLOCK_M if G > BLOCK_M else G)
    J_PER_ROUND: tl.constexpr = 2 if SPLIT_J else 1
    b, g, i0, h0, i_hi, k_lo, n_lo, n_hi, n_blocks = tile_setup(N, w2, HK, G, BLOCK_M, BLOCK_N)
    j_first = tl.maximum(i0 - w1 + 1, 0)
    n_rounds = tl.cdiv(i_hi - j_first + 1, J_PER_ROUND)

    q_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, 2)
    a_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, 2)  # Q * K1[j] per consumer, for SS-wgmma
    k2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_BUFFERS)
    v2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_BUFFERS)
    if SPLIT_J:  # consumer 1 hands (acc, m, l) to consumer 0
        merge_acc = tlx.local_alloc((ROWS, D), tl.float32, 1)
        merge_m = tlx.local_alloc((ROWS,), tl.float32, 2)
    fulls = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    empties = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=2)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: the block sequence once per round of j
            produce_kv(K2, V2, k2_tiles, v2_tiles, fulls, empties, 0, n_rounds * n_blocks, n_blocks,
                       k_lo, n_lo, n_hi, b, g, N, D, BLOCK_N, NUM_BUFFERS, PROFILE)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=2):
            cid = tlx.async_task_replica_id()
            first_row = 0 if SPLIT_J else cid * ROWS
            tok, head = row_coords(i0, h0, first_row + tl.arange(0, ROWS), G, BLOCK_M)
            q_smem = tlx.local_view(q_tiles, cid)
            tlx.local_store(q_smem, load_q(Q, b, g, tok, head, N, HQ, G, D))
            kv_base = b.to(tl.int64) * N * (HK * D) + g * D
            offs_n = tl.arange(0, BLOCK_N)
            offs_d = tl.arange(0, D)
            n_int = n_hi - n_lo
            m_i = tl.full([ROWS], -1.0e30, tl.float32)  # running max (log2 units) of all scores
            m_acc = tl.full([ROWS], -1.0e30, tl.float32)  # the max `acc` is expressed against
            l_i = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, D], tl.float32)
            for r in range(0, n_rounds):
                j = j_first + r * J_PER_ROUND + (cid if SPLIT_J else 0)
                jr = tl.minimum(j, i_hi).to(tl.int64) * (HK * D) + offs_d
                k1j = tl.load(K1 + kv_base + jr)
                a = tlx.local_view(a_tiles, cid)  # A lives in shared memory: 32 registers saved
                tlx.local_store(a, tlx.local_load(q_smem) * k1j[None, :])
                tlx.fence_async_shared()
                c0 = r * n_blocks
                # block 0 (peeled): QK, softmax
                buf = _wait_slot(fulls, c0, NUM_BUFFERS, PROFILE)
                enter("qk_gemm", PROFILE)
                s = tlx.async_dot(a, tlx.local_trans(tlx.local_view(k2_tiles, buf)))
                s = tlx.async_dot_wait(0, s)
                leave("qk_gemm", PROFILE)
                enter("softmax", PROFILE)
                p, alpha, m_i, l_i = _scores_softmax(s, 0, n_int, j, i_hi, k_lo, n_lo, n_hi, tok,
                                                     offs_n, w1, w2, qk_scale, m_i, l_i, T,
                                                     BLOCK_N)
                leave("softmax", PROFILE)
                acc_j = tl.zeros([ROWS, D], tl.float32)
                p_prev = p.to(tl.bfloat16)
                buf_prev = buf
                for t in range(1, n_blocks):
                    c = c0 + t
                    buf = _wait_slot(fulls, c, NUM_BUFFERS, PROFILE)
                    enter("qk_gemm", PROFILE)
                    s = tlx.async_dot(a, tlx.local_trans(tlx.local_view(k2_tiles, buf)))  # QK(t)
                    acc_j = tlx.async_dot(p_prev, tlx.local_view(v2_tiles, buf_prev), acc_j)
                    s = tlx.async_dot_wait(1, s)                             # PV(t-1) runs on
                    leave("qk_gemm", PROFILE)
                    enter("softmax", PROFILE)
                    p, alpha, m_i, l_i = _scores_softmax(s, t, n_int, j, i_hi, k_lo, n_lo, n_hi,
                                                         tok, offs_n, w1, w2, qk_scale, m_i, l_i,
                                                         T, BLOCK_N)
                    leave("softmax", PROFILE)
                    enter("pv_gemm", PROFILE)
                    acc_j = tlx.async_dot_wait(0, acc_j)
                    tlx.barrier_arrive(tlx.local_view(empties, buf_prev), 1)
                    leave("pv_gemm", PROFILE)
                    acc_j = acc_j * alpha[:, None]
                    p_prev = p.to(tl.bfloat16)
                    buf_prev = buf
                enter("pv_gemm", PROFILE)
                acc_j = tlx.async_dot(p_prev, tlx.local_view(v2_tiles, buf_prev), acc_j)
                acc_j = tlx.async_dot_wait(0, acc_j)
                tlx.barrier_arrive(tlx.local_view(empties, buf_prev), 1)
                leave("pv_gemm", PROFILE)
                enter("v1_mul", PROFILE)
                beta = tl.math.exp2(m_acc - m_i)
                v1j = tl.load(V1 + kv_base + jr).to(tl.float32)  # loaded here: no registers held
                acc = acc * beta[:, None] + acc_j * v1j[None, :]
                m_acc = m_i
                leave("v1_mul", PROFILE)

            enter("epilogue", PROFILE)
            if SPLIT_J:
                merge_and_store(acc, m_i, l_i, cid, tlx.local_view(merge_acc, 0), merge_m, Out,
                                Lse, b, g, tok, head, N, HQ, G, D)
            else:
                store_rows(Out, Lse, acc, m_i, l_i, b, g, tok, head, N, HQ, G, D)
            leave("epilogue", PROFILE)


def supports(spec: ProblemSpec) -> str | None:
    why = tiling_supports(spec)
    if why is None and spec.D == 128 and spec.G < 64:
        why = ("G < 64 with D = 128 (packed tokens, masked tiles) spills registers in this "
               "variant")
    return why


def _config(spec: ProblemSpec) -> dict:
    split = spec.G <= 64
    return dict(BLOCK_M=64 if split else 128, BLOCK_N=64, NUM_BUFFERS=2, CONSUMER_REGS=240,
                SPLIT_J=split, num_warps=4, num_stages=1)


launch, compile_configs = tlx_entry_points(simplicial_fwd_pipelined_kernel, _config, supports)

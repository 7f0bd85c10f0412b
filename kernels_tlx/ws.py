"""`tlx_ws`: warp-specialized TLX forward (the seeds' Kernel-1).

Warp groups:
- producer ("default", 4 warps, registers given away): walks the tile's K2/V2 blocks in the order of
  `kernels_triton.tiling.key_block` and TMA-loads each into a ring of NUM_BUFFERS shared-memory
  slots; `fulls[i]` (1 arrival + transaction bytes) says a slot is loaded, `empties[i]` (one arrival
  per consumer) says both consumers are done with it.
- Two consumer warp groups (4 warps, 64 rows each) share every K2/V2 slot, so each
  block crosses L2 -> shared memory once per 128 rows. Each keeps its Q rows in shared memory and,
  for every j of the w1 window: A = Q * K1[j] in registers -> RS-wgmma with K2^T -> online softmax
  in exp2 -> wgmma P @ V2 -> acc = acc * alpha + (P @ V2) * V1[j] (V1 multiplies the GEMM output;
  V1 * V2 is never built in shared memory). K1[j]/V1[j] are D-vectors read through L1/L2, issued
  one step ahead so their latency hides behind step j's GEMMs.
Tile geometry (heads x neighbouring tokens, interior/edge blocks, masks) is the plain Triton
kernel's (kernels_triton/tiling.py). Supports any B, N, Hk, w1 <= w2, D in {64, 128}, G a power of
two up to 128 (G = 128: the consumers take the two 64-head halves of one token; G <= 64: one
64-row tile, neighbouring tokens packed when G < 64, the consumers split the w1 window).
Differs from `triton`: TMA producer + mbarrier ring, two consumer groups sharing each K2/V2 slot.
"""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from kernels_tlx.common import (MERGE_BARRIER, launch_tlx, merge_and_store, produce_kv,
                                tlx_compile_configs)
from kernels_triton.tiling import (enter, key_block, leave, load_q, mask_scores, row_coords,
                                   softmax_step, store_rows, tile_setup)
from kernels_triton.tiling import supports  # noqa: F401  (this variant's registry `supports`)
from simplicial_attn.registry import CompileConfig
from simplicial_attn.spec import ProblemSpec



@triton.jit
def consume_block(acc, m_i, l_i, q_smem, k2_tile, v2_tile, k1_base, v1_base, kb, j_lo, j_hi,
                  j_step, tok, w1, w2, qk_scale, HK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK_J: tl.constexpr, MASK_K: tl.constexpr, PROFILE: tl.constexpr):
    """One consumer warp group: one K2/V2 slot against every j of the window."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k2t = tlx.local_trans(k2_tile)
    row = tl.minimum(j_lo, j_hi).to(tl.int64) * (HK * D) + offs_d
    k1n = tl.load(k1_base + row)
    v1n = tl.load(v1_base + row)
    for j in range(j_lo, j_hi + 1, j_step):
        enter("qk_gemm", PROFILE)
        k1j = k1n
        v1j = v1n.to(tl.float32)
        row = tl.minimum(j + j_step, j_hi).to(tl.int64) * (HK * D) + offs_d  # prefetch next j
        k1n = tl.load(k1_base + row)
        v1n = tl.load(v1_base + row)
        a = tlx.local_load(q_smem) * k1j[None, :]
        s = tlx.async_dot(a, k2t)
        s = tlx.async_dot_wait(0, s) * qk_scale
        leave("qk_gemm", PROFILE)
        enter("softmax", PROFILE)
        s = mask_scores(s, j, kb, tok, offs_n, w1, w2, MASK_J, MASK_K)
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        leave("softmax", PROFILE)
        enter("pv_gemm", PROFILE)
        pv = tlx.async_dot(p.to(tl.bfloat16), v2_tile)
        pv = tlx.async_dot_wait(0, pv)
        leave("pv_gemm", PROFILE)
        enter("v1_mul", PROFILE)
        acc = acc * alpha[:, None] + pv * v1j[None, :]
        leave("v1_mul", PROFILE)
    return acc, m_i, l_i


@triton.jit
def simplicial_fwd_ws_kernel(Q, K1, K2, V1, V2, Out, Lse, N, w1, w2, qk_scale,
                             HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr,
                             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             NUM_BUFFERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
                             SPLIT_J: tl.constexpr, PROFILE: tl.constexpr = False):
    # SPLIT_J: both consumers own the same BLOCK_M = 64 rows and take alternate j of the window;
    # else each owns half of BLOCK_M = 128 rows and runs the whole window.
    ROWS: tl.constexpr = BLOCK_M if SPLIT_J else BLOCK_M // 2  # rows per consumer warp group
    T: tl.constexpr = BLOCK_M // (BLOCK_M if G > BLOCK_M else G)
    b, g, i0, h0, i_hi, k_lo, n_lo, n_hi, n_blocks = tile_setup(N, w2, HK, G, BLOCK_M, BLOCK_N)

    q_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, 2)
    k2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_BUFFERS)
    v2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_BUFFERS)
    if SPLIT_J:  # consumer 1 hands (m, l) to consumer 0 here, acc through an idle K2 ring slot
        merge_m = tlx.local_alloc((ROWS,), tl.float32, 2)
    fulls = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    empties = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=2)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA ring of K2/V2 blocks, each once
            produce_kv(K2, V2, k2_tiles, v2_tiles, fulls, empties, n_blocks, n_blocks, k_lo, n_lo,
                       n_hi, b, g, N, D, BLOCK_N, NUM_BUFFERS, PROFILE)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=2):
            cid = tlx.async_task_replica_id()
            first_row = 0 if SPLIT_J else cid * ROWS
            tok, head = row_coords(i0, h0, first_row + tl.arange(0, ROWS), G, BLOCK_M)
            q_smem = tlx.local_view(q_tiles, cid)
            tlx.local_store(q_smem, load_q(Q, b, g, tok, head, N, HQ, G, D))
            kv_base = b.to(tl.int64) * N * (HK * D) + g * D
            j_lo = tl.maximum(i0 - w1 + 1, 0)
            j_step = 2 if SPLIT_J else 1
            if SPLIT_J:
                j_lo = j_lo + cid
            m_i = tl.full([ROWS], -1.0e30, tl.float32)
            l_i = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, D], tl.float32)
            n_int = n_hi - n_lo
            for t in range(0, n_blocks):
                buf = t % NUM_BUFFERS
                kb, masked = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
                enter("wait_kv", PROFILE)
                tlx.barrier_wait(tlx.local_view(fulls, buf), (t // NUM_BUFFERS) & 1)
                leave("wait_kv", PROFILE)
                k2_tile = tlx.local_view(k2_tiles, buf)
                v2_tile = tlx.local_view(v2_tiles, buf)
                if t < n_int:
                    acc, m_i, l_i = consume_block(acc, m_i, l_i, q_smem, k2_tile, v2_tile,
                                                  K1 + kv_base, V1 + kv_base, kb, j_lo, i_hi,
                                                  j_step, tok, w1, w2, qk_scale, HK, D, BLOCK_N,
                                                  T > 1, False, PROFILE)
                else:
                    acc, m_i, l_i = consume_block(acc, m_i, l_i, q_smem, k2_tile, v2_tile,
                                                  K1 + kv_base, V1 + kv_base, kb, j_lo, i_hi,
                                                  j_step, tok, w1, w2, qk_scale, HK, D, BLOCK_N,
                                                  T > 1, True, PROFILE)
                tlx.barrier_arrive(tlx.local_view(empties, buf), 1)
            enter("epilogue", PROFILE)
            if SPLIT_J:
                tl.static_assert(BLOCK_N * 2 == ROWS * 4, "a K2 slot must hold one fp32 acc tile")
                # both consumers are past their last block, so no TMA write or wgmma read is left
                # on the ring: K2 slot 0 can carry consumer 1's accumulator
                tlx.named_barrier_wait(MERGE_BARRIER, 256)
                merge_acc = tlx.local_reinterpret(tlx.local_view(k2_tiles, 0), tl.float32, [ROWS, D])
                merge_and_store(acc, m_i, l_i, cid, merge_acc, merge_m, Out, Lse, b, g, tok, head,
                                N, HQ, G, D)
            else:
                store_rows(Out, Lse, acc, m_i, l_i, b, g, tok, head, N, HQ, G, D)
            leave("epilogue", PROFILE)


def _config(spec: ProblemSpec) -> dict:
    """G > 64: two consumers on the two 64-head halves of 128 rows. G <= 64: 64 rows (one token at
    G = 64: no mask) shared by both consumers, which split the w1 window (SPLIT_J)."""
    split = spec.G <= 64
    return dict(BLOCK_M=64 if split else 128, BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240,
                SPLIT_J=split, num_warps=4, num_stages=1)


def launch(spec: ProblemSpec, q, k1, k2, v1, v2, out, lse, profile: bool = False) -> None:
    launch_tlx(simplicial_fwd_ws_kernel, _config(spec), spec, q, k1, k2, v1, v2, out, lse, profile)


def compile_configs() -> list[CompileConfig]:
    return tlx_compile_configs(simplicial_fwd_ws_kernel, _config, supports)

"""`tlx_ws_keys`: `tlx_ws` with the Hadamard product moved to the keys side and built by the
producer.

    S = Q @ (K1[j] * K2)^T         instead of   S = (Q * K1[j]) @ K2^T

B_j = K1[j] * K2 (a key block scaled by one K1 row) does not depend on the query rows, so one build
serves every row of the tile. The tile is one token's 128 query heads (G = 128), 64 rows per
consumer warp group, and both consumers walk the same j; the producer warp group, idle in tlx_ws
between TMA loads, builds each B_j into a ring of NUM_B shared-memory slots, and the consumers only
run GEMMs and the softmax.

Warp groups:
- producer ("default", 4 warps): per K2/V2 block, TMA-loads V2 into one of two slots (`kv_fulls` /
  `kv_empties`, one arrival per consumer) and K2 into a single slot that only it reads; then for
  each j of the window: waits for B slot `c % NUM_B` to be free (`b_empties`), writes
  B_j = K1[j] * K2 (in CH-row chunks) and the row V1[j] into that slot, fences, arrives on
  `b_fulls`.
- Two consumer warp groups (4 warps each), rows 64c .. 64c + 63 of the tile, Q resident in
  shared memory. Per step (one K2/V2 block, one j):
      S = Q @ B_j^T                          SS-wgmma, no operand built by the consumer
      V1[j] read from the B slot, slot released
      online softmax in exp2
      acc = acc * alpha + (P @ V2) * V1[j]   RS-wgmma; V1 multiplies the GEMM output
  V1[j] is read from shared memory straight into the layout of the accumulator's columns
  (`v1_layout`), so no step converts a layout through scratch memory.
Supports G = Hq/Hk = 128 (the paper's ratio at Hq = 128), D in {64, 128}, any B, N, Hk, w1 <= w2.
Differs from `tlx_ws`: no A = Q * K1[j] per consumer and step (the cost measured in
docs/perf.md), a 128-row tile on one j instead of a 64-row tile split over j (no merge).
"""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from kernels_tlx.simplicial.common import NUM_CONSUMERS, release_layout, v1_layout
from kernels_tlx.simplicial.hadamard import build, row_tile, start_consumer, supports, token_tile
from kernels_triton.simplicial.host import entry_points
from kernels_triton.simplicial.tiling import (BF16_BYTES, enter, key_block, leave, mask_scores,
                                   softmax_step, store_rows)
from altattn.simplicial.spec import ProblemSpec
from kernels_tlx.ring import empty_phase, full_phase


@triton.jit
def consume_block(acc, m_i, l_i, q_smem, b_tiles, v1_slots, b_fulls, b_empties, v2_tile, c0,
                  j_first, n_j, kb, tok, w1, w2, qk_scale, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, NUM_B: tl.constexpr, MASK_K: tl.constexpr,
                  PROFILE: tl.constexpr):
    """One consumer warp group: one V2 block against every j of the window; step c = c0 + jj
    finds B_j and V1[j] in slot c % NUM_B."""
    offs_n = tl.arange(0, BLOCK_N)
    for jj in range(0, n_j):
        c = c0 + jj
        bs = c % NUM_B
        enter("qk_gemm", PROFILE)
        tlx.barrier_wait(tlx.local_view(b_fulls, bs), full_phase(c, NUM_B))
        s = tlx.async_dot(q_smem, tlx.local_trans(tlx.local_view(b_tiles, bs)))
        s = tlx.async_dot_wait(0, s)
        v1 = release_layout(tlx.local_load(tlx.local_view(v1_slots, bs), layout=v1_layout(D)))
        tlx.barrier_arrive(tlx.local_view(b_empties, bs), 1)
        leave("qk_gemm", PROFILE)
        enter("softmax", PROFILE)
        s = mask_scores(s, j_first + jj, kb, tok, offs_n, w1, w2, False, MASK_K)
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale)
        leave("softmax", PROFILE)
        enter("pv_gemm", PROFILE)
        pv = tlx.async_dot(p.to(tl.bfloat16), v2_tile)
        pv = tlx.async_dot_wait(0, pv)
        leave("pv_gemm", PROFILE)
        enter("v1_mul", PROFILE)
        acc = acc * alpha[:, None] + pv * v1.to(tl.float32)[None, :]
        leave("v1_mul", PROFILE)
    return acc, m_i, l_i


@triton.jit
def simplicial_fwd_ws_keys_kernel(Q, K1, K2, V1, V2, Out, Lse, N, w1, w2, qk_scale,
                                  HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr,
                                  D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  NUM_B: tl.constexpr, CH: tl.constexpr,
                                  CONSUMER_REGS: tl.constexpr, PROFILE: tl.constexpr = False):
    HALF: tl.constexpr = BLOCK_M // NUM_CONSUMERS
    b, g, i0, h0, k_lo, n_lo, n_hi, n_blocks, j_first, n_j, kv_base, _split, _kpos = token_tile(
        N, w1, w2, HK, G, D, BLOCK_M, BLOCK_N)

    q_tiles = tlx.local_alloc((HALF, D), tl.bfloat16, NUM_CONSUMERS)  # consumer c's rows
    k2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, 1)   # read by the producer only
    v2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, 2)
    b_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_B)
    v1_slots = tlx.local_alloc((D,), tl.bfloat16, NUM_B)
    k_full = tlx.alloc_barriers(num_barriers=1, arrive_count=1)
    kv_fulls = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    # warp barriers: every thread arrives after its own shared-memory accesses, no warp-group
    # barrier before one thread's arrive (docs/sanitizers.md)
    kv_empties = tlx.alloc_warp_barrier(num_barriers=2, num_warps=4 * NUM_CONSUMERS)
    b_fulls = tlx.alloc_warp_barrier(num_barriers=NUM_B, num_warps=4)
    b_empties = tlx.alloc_warp_barrier(num_barriers=NUM_B, num_warps=4 * NUM_CONSUMERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA K2/V2, then B_j = K1[j] * K2 per j
            k2_tile = tlx.local_view(k2_tiles, 0)
            kf = tlx.local_view(k_full, 0)
            for t in range(0, n_blocks):
                slot = t % 2
                kb, _ = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
                enter("load_kv", PROFILE)
                tlx.barrier_wait(tlx.local_view(kv_empties, slot), empty_phase(t, 2))
                full = tlx.local_view(kv_fulls, slot)
                tlx.barrier_expect_bytes(full, BLOCK_N * D * BF16_BYTES)
                tlx.async_descriptor_load(V2, tlx.local_view(v2_tiles, slot), [b, kb, g * D],
                                          full)
                # the single K2 slot is free: this warp group's last build read it before
                tlx.barrier_expect_bytes(kf, BLOCK_N * D * BF16_BYTES)
                tlx.async_descriptor_load(K2, k2_tile, [b, kb, g * D], kf)
                tlx.barrier_wait(kf, t & 1)
                leave("load_kv", PROFILE)
                for jj in range(0, n_j):
                    c = t * n_j + jj
                    bs = c % NUM_B
                    enter("build_b", PROFILE)
                    kv_row = kv_base + (j_first + jj).to(tl.int64) * (HK * D)
                    k1 = row_tile(K1, kv_row, D, CH)
                    v1 = tl.load(V1 + kv_row + tl.arange(0, D))
                    tlx.barrier_wait(tlx.local_view(b_empties, bs), empty_phase(c, NUM_B))
                    # V1[j] beside B_j, for the consumers' multiply of the PV output
                    tlx.local_store(tlx.local_view(v1_slots, bs), v1)
                    build(k1, k2_tile, tlx.local_view(b_tiles, bs), D, BLOCK_N, CH)
                    tlx.barrier_arrive(tlx.local_view(b_fulls, bs), 1)
                    leave("build_b", PROFILE)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid = tlx.async_task_replica_id()
            q_smem = tlx.local_view(q_tiles, cid)
            tok, head, m_i, l_i, acc = start_consumer(Q, q_smem, cid, b, g, i0, h0, N, HQ, G, D,
                                                      BLOCK_M)
            n_int = n_hi - n_lo
            for t in range(0, n_blocks):
                slot = t % 2
                kb, _ = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
                enter("wait_kv", PROFILE)
                tlx.barrier_wait(tlx.local_view(kv_fulls, slot), full_phase(t, 2))
                leave("wait_kv", PROFILE)
                v2_tile = tlx.local_view(v2_tiles, slot)
                if t < n_int:
                    acc, m_i, l_i = consume_block(
                        acc, m_i, l_i, q_smem, b_tiles, v1_slots, b_fulls, b_empties, v2_tile,
                        t * n_j, j_first, n_j, kb, tok, w1, w2, qk_scale, D, BLOCK_N, NUM_B,
                        False, PROFILE)
                else:
                    acc, m_i, l_i = consume_block(
                        acc, m_i, l_i, q_smem, b_tiles, v1_slots, b_fulls, b_empties, v2_tile,
                        t * n_j, j_first, n_j, kb, tok, w1, w2, qk_scale, D, BLOCK_N, NUM_B,
                        True, PROFILE)
                tlx.barrier_arrive(tlx.local_view(kv_empties, slot), 1)
            enter("epilogue", PROFILE)
            store_rows(Out, Lse, acc, m_i, l_i, b, g, tok, head, N, HQ, G, D)
            leave("epilogue", PROFILE)


def config(spec: ProblemSpec) -> dict:
    """Every shape: 128-row tile, 128-key blocks, two B slots (two more would not fit in shared
    memory at D = 128), the producer's build in 8-row chunks (16 spill its 24 registers) and the
    consumers at 240 registers (232 measured 2-3% slower)."""
    return dict(BLOCK_M=128, BLOCK_N=128, NUM_B=2, CH=8, CONSUMER_REGS=240, num_warps=4,
                num_stages=1)


prepare, launch, compile_configs = entry_points(simplicial_fwd_ws_keys_kernel, config,
                                               supports)

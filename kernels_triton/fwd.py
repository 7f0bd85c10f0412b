"""`triton`: the plain-Triton 2-simplicial attention forward.

Tile: HPT = min(G, BLOCK_M) query heads of one KV head (G = Hq/Hk), times T = BLOCK_M // HPT
neighbouring tokens, form the BLOCK_M rows (row r = token i0 + r // HPT, head h0 + r % HPT). When
G > BLOCK_M the G heads are split over G // BLOCK_M neighbouring programs, which read the same
K2/V2 window while it is hot in L2. Every row of a tile shares one K1/K2/V1/V2 head.

Loop order: K2/V2 blocks outside, the w1 window of K1/V1 inside. A K2/V2 block is loaded once per
tile by TMA (a tensor descriptor: straight into shared memory, no register staging) and stays
in shared memory while all (T + w1 - 1) rows j of K1/V1 pass over it:
    A  = Q * K1[j]              (CUDA cores, registers)     [BLOCK_M, D]
    S  = A @ K2[blk]^T          (tensor cores)              [BLOCK_M, BLOCK_N]
    online softmax in exp2 over all (j, k) seen so far
    acc = acc * alpha + (P @ V2[blk]) * V1[j]
The key range of a tile is cut into unmasked blocks (every row sees every key) and the few edge
blocks that need a mask (partial last block; with T > 1 the first/last T - 1 keys); j needs a mask
only when T > 1. Supports any B, N, Hk, w1 <= w2 (the launcher swaps), D in {64, 128}, G a power of
two up to 128.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels_triton.host import entry_points
from kernels_triton.tiling import (M_START, enter, key_block, leave, load_q, mask_scores,
                                   row_coords, softmax_step, store_rows, supports, tile_setup)
from simplicial_attn.spec import ProblemSpec


@triton.jit
def _block(acc, m_i, l_i, q, k2, v2, k1_base, v1_base, kb, j_lo, j_hi, tok, offs_n, offs_d,
           w1, w2, qk_scale, HK: tl.constexpr, D: tl.constexpr, MASK_J: tl.constexpr,
           MASK_K: tl.constexpr, PROFILE: tl.constexpr):
    """One K2/V2 block against every j of the tile's K1/V1 window."""
    k2t = tl.trans(k2)
    for j in range(j_lo, j_hi + 1):
        enter("qk_gemm", PROFILE)
        k1j = tl.load(k1_base + j.to(tl.int64) * (HK * D) + offs_d)
        v1j = tl.load(v1_base + j.to(tl.int64) * (HK * D) + offs_d).to(tl.float32)
        a = q * k1j[None, :]
        s = tl.dot(a, k2t)
        leave("qk_gemm", PROFILE)
        enter("softmax", PROFILE)
        s = mask_scores(s, j, kb, tok, offs_n, w1, w2, MASK_J, MASK_K)
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale)
        leave("softmax", PROFILE)
        enter("pv_gemm", PROFILE)
        pv = tl.dot(p.to(tl.bfloat16), v2)
        leave("pv_gemm", PROFILE)
        enter("v1_mul", PROFILE)
        acc = acc * alpha[:, None] + pv * v1j[None, :]
        leave("v1_mul", PROFILE)
    return acc, m_i, l_i


@triton.jit
def simplicial_fwd_kernel(Q, K1, K2, V1, V2, Out, Lse, N, w1, w2, qk_scale,
                          HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          PROFILE: tl.constexpr = False):
    T: tl.constexpr = BLOCK_M // (BLOCK_M if G > BLOCK_M else G)  # tokens per tile
    b, g, i0, h0, i_hi, k_lo, n_lo, n_hi, n_blocks = tile_setup(N, w2, HK, G, BLOCK_M, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    tok, head = row_coords(i0, h0, tl.arange(0, BLOCK_M), G, BLOCK_M)
    q = load_q(Q, b, g, tok, head, N, HQ, G, D)

    kv_base = b.to(tl.int64) * N * (HK * D) + g * D  # token 0 of this (batch, KV head)
    k1_base = K1 + kv_base
    v1_base = V1 + kv_base
    j_lo = tl.maximum(i0 - w1 + 1, 0)
    m_i = tl.full([BLOCK_M], M_START, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    n_int = n_hi - n_lo
    for t in range(0, n_int):  # interior blocks: every row sees every key
        kb, _ = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
        enter("load_kv", PROFILE)
        k2 = K2.load([b, kb, g * D]).reshape(BLOCK_N, D)
        v2 = V2.load([b, kb, g * D]).reshape(BLOCK_N, D)
        leave("load_kv", PROFILE)
        acc, m_i, l_i = _block(acc, m_i, l_i, q, k2, v2, k1_base, v1_base, kb, j_lo, i_hi, tok,
                               offs_n, offs_d, w1, w2, qk_scale, HK, D, T > 1, False, PROFILE)
    for t in range(n_int, n_blocks):  # edge blocks: masked per (row, key)
        kb, _ = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
        enter("load_kv", PROFILE)
        k2 = K2.load([b, kb, g * D]).reshape(BLOCK_N, D)  # rows past N arrive as zeros (host.py)
        v2 = V2.load([b, kb, g * D]).reshape(BLOCK_N, D)
        leave("load_kv", PROFILE)
        acc, m_i, l_i = _block(acc, m_i, l_i, q, k2, v2, k1_base, v1_base, kb, j_lo, i_hi, tok,
                               offs_n, offs_d, w1, w2, qk_scale, HK, D, T > 1, True, PROFILE)
    enter("epilogue", PROFILE)
    store_rows(Out, Lse, acc, m_i, l_i, b, g, tok, head, N, HQ, G, D)
    leave("epilogue", PROFILE)


def _config(spec: ProblemSpec) -> dict:
    """Tile shape: 64 rows (one warp group) x 128 keys; measured best at G = 64 (docs/perf.md)."""
    return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=1)


launch, compile_configs = entry_points(simplicial_fwd_kernel, _config, supports)

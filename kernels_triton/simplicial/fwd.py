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

Form "det" (constexpr DET = +1, or -1 when the launcher swapped the pairs): A is the chunkwise
cross product instead, A = Q x3 K1[j], built as kernels_triton/simplicial/det.py states: two Q tiles loaded
once per tile with permuted columns (Qa, Qb), K1's two rotations packed by the host (det_keys, two
contiguous rows per j), and A = fma(Qa, K1a, Qb * K1b) in bf16 (two roundings: the product
Qb * K1b, then the FMA). Everything else, tensor-core work included, is the trilinear kernel's;
DET = 0 compiles to the same SASS.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels_triton.simplicial.det import det_keys, det_of, load_q_det
from kernels_triton.simplicial.host import entry_points
from kernels_triton.simplicial.tiling import (M_START, enter, key_block, leave, load_q, mask_scores,
                                   row_coords, softmax_step, store_rows, supports, tile_setup)
from altattn.simplicial.spec import ProblemSpec


@triton.jit
def _block(acc, m_i, l_i, q, qb, k2, v2, k1_base, v1_base, kb, j_lo, j_hi, tok, offs_n, offs_d,
           w1, w2, qk_scale, HK: tl.constexpr, D: tl.constexpr,
           MASK_J: tl.constexpr, MASK_K: tl.constexpr, DET: tl.constexpr,
           PROFILE: tl.constexpr):
    """One K2/V2 block against every j of the tile's K1/V1 window. DET = 0: A = Q * K1[j];
    DET = +-1: A = fma(q, K1a[j], qb * K1b[j]), q = Qa and qb = Qb of the module docstring, K1 the
    packed [B, N, HK, 2, D] of det_keys."""
    K1_ROW: tl.constexpr = 2 * HK * D if DET else HK * D  # elements from K1[j] to K1[j + 1]
    k2t = tl.trans(k2)
    for j in range(j_lo, j_hi + 1):
        enter("qk_gemm", PROFILE)
        k1_row = k1_base + j.to(tl.int64) * K1_ROW
        if not DET:
            k1j = tl.load(k1_row + offs_d)
        else:  # K1[j] with its columns permuted by the host (det_keys): two contiguous rows
            k1a = tl.load(k1_row + offs_d)
            k1b = tl.load(k1_row + D + offs_d)
        v1j = tl.load(v1_base + j.to(tl.int64) * (HK * D) + offs_d).to(tl.float32)
        if not DET:
            a = q * k1j[None, :]
        else:  # the chunkwise cross product: bf16 Qb*K1b, then one bf16 FMA (HMUL2, HFMA2)
            a = tl.fma(q, k1a[None, :], qb * k1b[None, :])
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
                          PROFILE: tl.constexpr = False, DET: tl.constexpr = 0):
    T: tl.constexpr = BLOCK_M // (BLOCK_M if G > BLOCK_M else G)  # tokens per tile
    b, g, i0, h0, i_hi, k_lo, n_lo, n_hi, n_blocks = tile_setup(N, w2, HK, G, BLOCK_M, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    tok, head = row_coords(i0, h0, tl.arange(0, BLOCK_M), G, BLOCK_M)
    if not DET:
        q = load_q(Q, b, g, tok, head, N, HQ, G, D)
        qb = q
    else:  # q = Qa, qb = Qb (kernels_triton/simplicial/det.py)
        q, qb = load_q_det(Q, b, g, tok, head, N, offs_d, HQ, G, D, DET)

    kv_base = b.to(tl.int64) * N * (HK * D) + g * D  # token 0 of this (batch, KV head)
    if not DET:
        k1_base = K1 + kv_base
    else:  # K1 is det_keys' [B, N, HK, 2, D]
        k1_base = K1 + 2 * kv_base
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
        acc, m_i, l_i = _block(acc, m_i, l_i, q, qb, k2, v2, k1_base, v1_base, kb, j_lo, i_hi,
                               tok, offs_n, offs_d, w1, w2, qk_scale, HK, D,
                               T > 1, False, DET, PROFILE)
    for t in range(n_int, n_blocks):  # edge blocks: masked per (row, key)
        kb, _ = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
        enter("load_kv", PROFILE)
        k2 = K2.load([b, kb, g * D]).reshape(BLOCK_N, D)  # rows past N arrive as zeros (host.py)
        v2 = V2.load([b, kb, g * D]).reshape(BLOCK_N, D)
        leave("load_kv", PROFILE)
        acc, m_i, l_i = _block(acc, m_i, l_i, q, qb, k2, v2, k1_base, v1_base, kb, j_lo, i_hi,
                               tok, offs_n, offs_d, w1, w2, qk_scale, HK, D,
                               T > 1, True, DET, PROFILE)
    enter("epilogue", PROFILE)
    store_rows(Out, Lse, acc, m_i, l_i, b, g, tok, head, N, HQ, G, D)
    leave("epilogue", PROFILE)


FORMS = ("trilinear", "det")  # the forms it computes (its registry record's `forms`)


def _config(spec: ProblemSpec) -> dict:
    """Tile shape: 64 rows (one warp group) x 128 keys; measured best at G = 64 (docs/perf.md).
    Form "det" adds DET: +1, or -1 when the launcher has swapped the pairs (the determinants
    change sign; the leftover dims' trilinear term does not)."""
    cfg = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=1)
    if spec.form == "det":
        cfg["DET"] = det_of(spec)
    return cfg


prepare, launch, compile_configs = entry_points(
    simplicial_fwd_kernel, _config, supports, forms=FORMS,
    det_pack=lambda k1, k2, det: (det_keys(k1, det), k2))

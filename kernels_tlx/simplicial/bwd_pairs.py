"""`tlx_pairs` backward: one warp-specialized TLX kernel that owns (j, key block) pairs and runs
the 5 GEMMs of FlashAttention's backward, with dQ, dK2 and dV2 reduce-added (not deterministic).

For a fixed j, the pairs (j, k) are the keys of an ordinary attention: B_jk = K1[j] * K2[k] and
C_jk = V1[j] * V2[k] (the keys-side form, ../shared/docs/BACKWARD.md section 1), seen by the
tokens i in [j, j + w1) whose w2 window holds k. A program owns j and 128 consecutive keys k (a
key block) and visits each of those tokens' tiles (64 rows: 64 query heads of one token, or at
G < 64 all G heads of 64 / G consecutive tokens):
    S^T  = B Q^T        dP^T = C dO^T                        (SS-wgmma, 64 keys x 64 rows)
    P^T  = exp2(S^T c log2e - LSE log2e) where k is in the row's token's w2 window (and the
           token sees j: below min(j + w1, N)), else 0
    dS^T = P^T (dP^T - Delta)
    dC  += P^T dO       dB  += dS^T Q                        (RS-wgmma, fp32 [64 keys, D])
    dQ_tile = dS B                                           (SS-wgmma; reduce-added)
and at its end
    dK1[j] += sum_k K2[k] * dB[k]      dK2[k] += K1[j] * dB[k]      (c = sm_scale at the finish)
    dV1[j] += sum_k V2[k] * dC[k]      dV2[k] += V1[j] * dC[k]
5 GEMMs for the 5 useful ones (the 8-GEMM split of `triton` / `tlx_ws` recomputes S and dP
in a second owner); the price is the reduce-adds: dQ in fp32 (B*N*Hq*D*4 bytes of scratch),
each tile's [64, D] partial added by TMA (`cp.reduce.async.bulk`), and dK1/dK2/dV1/dV2 in fp32
by atomics once per program. The order of the adds is the hardware's: not bitwise repeatable
(`tlx_ws` is).

Warp groups:
- producer ("default", 4 warps): TMA-loads the block's K2 and V2 (64 keys per consumer) into the
  row ring, builds B and C from there (bf16 products, the rounding of the keys-side forwards),
  arrives on `bc_full`; then TMA-loads each tile's Q and dO rows, LSE and Delta into a ring of
  NUM_Q slots
  (`q_fulls`, `q_empties`): one box per token of the tile; a token past N loads token N - 1's
  rows again (masked), so no value of another batch element is read.
- Two consumers, 64 keys each (fp32 dB, dC: 128 registers per thread). A consumer whose keys
  the token does not see skips the tile's GEMMs (and writes a zero dS). dQ needs dS over both
  consumers' keys: each stores its dS^T (bf16) in a ring of two slots (`ds_fulls`, `ds_empties`,
  both consumers' warps), then each computes half of dQ's columns from both, stages it in fp32
  and reduce-adds it by TMA (a box per token of the tile that sees j).
Supports D = 128 with G = Hq/Hk >= 16 (`supports`; a token's rows are one TMA box of >= 16).
Measured (docs/perf-bwd.md, H100): 410 useful TFLOPS at S*, against 300 for `tlx_ws`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels_tlx.simplicial.common import EPILOGUE_BARRIER, NUM_CONSUMERS, opaque
from kernels_tlx.simplicial.hadamard import build, row_tile
from kernels_triton.simplicial.bwd_common import (compile_specs, kernel_config, kv_rows,
                                                  launch_delta, launch_sum_parts)
from kernels_triton.simplicial.host import kv_descriptor, q_descriptor
from kernels_triton.simplicial.tiling import BF16_BYTES, LOG2E, enter, leave
from kernels_triton.simplicial.tiling import supports as tiling_supports
from altattn.registry import CompileConfig
from altattn.simplicial.spec import ProblemSpec

ROWS = tl.constexpr(64)  # rows per tile (64 heads of one token, or all G heads of 64 / G tokens)
KEYS = 64  # keys per consumer
BLOCK_N = NUM_CONSUMERS.value * KEYS  # keys per program
EXECUTED_FLOPS_PER_F = 2.5  # 5 GEMMs of F / 2 each (edge waste not counted)


@triton.constexpr_function
def tile_tokens(G):
    """Tokens per 64-row tile: 64 / G at G < 64 (every head of each), else 1."""
    return max(64 // G, 1)


@triton.constexpr_function
def token_tiles(G):
    """Tiles per token: G / 64 at G >= 64 (64 heads each), else 1."""
    return max(G // 64, 1)


@triton.constexpr_function
def epilogue_rows(G):
    """Rows per chunk of the end's dB/dC pass: 16, or 8 at G < 64 (16 spills 8 bytes there)."""
    return 16 if G >= 64 else 8


@triton.constexpr_function
def row_width(G):
    """Columns of the per-token LSE/Delta rows in shared memory: min(G, 64), at least 32 (128
    bytes)."""
    return max(min(G, 64), 32)


@triton.constexpr_function
def box_rows(G):
    """Rows of one token in a tile, a TMA box: min(G, 64)."""
    return min(G, 64)


@triton.jit
def pair_program(pid, N, w1, w2, n_kb, HK: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                 Seq=None, VARLEN: tl.constexpr = False):
    """This program's batch b, KV head g, j, first key kb, kv_base (token 0 of (b, g) in a
    [B, N, HK, D] tensor), its tile count (over the tokens j .. min(j + w1, N) - 1: token_tiles
    tiles per token, or tile_tokens tokens per tile) and whether it has keys at all. pid is
    tl.program_id(0), or an opaque copy of it (what is derived from it is then not held in
    registers across a loop before). Grid: key blocks fastest, then j, then B * HK; j's keys
    are max(j - w2 + 1, 0) .. min(j + w1 - 1, N - 1), in blocks of 128 from the first,
    n_kb = cdiv(w1 + w2 - 1, 128) per j (`key_blocks`; a kernel argument, which ptxas reloads
    where it is needed instead of holding it). Last: the end of j's sequence (N; VARLEN,
    packed sequences: Seq [N, 2] int32 holds each token's sequence start and end, which bound
    its keys and tokens as 0 and N bound a batch element's)."""
    m = pid % n_kb
    j = (pid // n_kb) % N
    bg = pid // n_kb // N
    b = bg // HK
    g = bg % HK
    if VARLEN:
        t_end = tl.load(Seq + 2 * j + 1)
        k_lo = tl.maximum(j - w2 + 1, tl.load(Seq + 2 * j))
    else:
        t_end = N
        k_lo = tl.maximum(j + 1, w2) - w2
    k_hi = tl.minimum(j + w1, t_end) - 1
    kb = k_lo + m * (2 * 64)
    n_tiles = tl.cdiv(tl.minimum(j + w1, t_end) - j, tile_tokens(G)) * token_tiles(G)
    return b, g, j, kb, b.to(tl.int64) * N * (HK * D) + g * D, n_tiles, kb <= k_hi, t_end


@triton.jit
def active_tiles(j, k0, n_tiles, w2, G: tl.constexpr):
    """The tiles u_lo .. u_hi - 1 (`first_token`) one of whose tokens sees one of keys
    k0 .. k0 + 63: tokens from k0 to k0 + 62 + w2."""
    T: tl.constexpr = tile_tokens(G)
    u_lo = tl.minimum(tl.cdiv(tl.maximum(k0 - T + 1 - j, 0), T) * token_tiles(G), n_tiles)
    u_hi = tl.minimum(tl.cdiv(tl.maximum(k0 + 63 + w2 - j, 0), T) * token_tiles(G), n_tiles)
    return u_lo, u_hi


@triton.jit
def first_token(j, u, G: tl.constexpr):
    """Tile u's first token (j's tiles from token j on) and its first head among the KV head's
    G."""
    return j + (u // token_tiles(G)) * tile_tokens(G), (u % token_tiles(G)) * 64


@triton.jit
def load_rows(Q, DO, Lse2, Delta, q_tiles, do_tiles, lse_tiles, delta_tiles, s, full, row0,
              t: tl.constexpr, R: tl.constexpr, D: tl.constexpr):
    """Producer: TMA-load the R rows of the tile's token t, Q and dO from row0 (of [B*N*HQ, D])
    into rows t * R .. of ring slot s, its LSE and Delta into row t of the slot's [tokens, >= 32]
    tiles (a TMA destination starts on 128 bytes); the whole slot at R = ROWS."""
    q_tile = tlx.local_view(q_tiles, s)
    do_tile = tlx.local_view(do_tiles, s)
    lse_tile = tlx.local_view(lse_tiles, s)
    delta_tile = tlx.local_view(delta_tiles, s)
    if R < ROWS:
        q_tile = tlx.local_slice(q_tile, [t * R, 0], [R, D])
        do_tile = tlx.local_slice(do_tile, [t * R, 0], [R, D])
        lse_tile = tlx.local_slice(lse_tile, [t, 0], [1, R])
        delta_tile = tlx.local_slice(delta_tile, [t, 0], [1, R])
    tlx.async_descriptor_load(Q, q_tile, [row0, 0], full)
    tlx.async_descriptor_load(DO, do_tile, [row0, 0], full)
    tlx.async_descriptor_load(Lse2, lse_tile, [row0 // R, 0], full)
    tlx.async_descriptor_load(Delta, delta_tile, [row0 // R, 0], full)


@triton.jit
def row_values(tiles, s, G: tl.constexpr):
    """Slot s's LSE or Delta of the tile's ROWS rows as a [1, ROWS] row (token-major)."""
    if tile_tokens(G) == 1:
        return tlx.local_load(tlx.local_view(tiles, s))
    else:
        x = tlx.local_load(tlx.local_slice(tlx.local_view(tiles, s), [0, 0],
                                           [tile_tokens(G), box_rows(G)]))
        return tl.reshape(x, [1, ROWS])


@triton.jit
def probabilities(st, lse2, qk_scale, kpos, i0, i_end, w2, G: tl.constexpr):
    """P^T = exp2(S^T c log2e - LSE log2e) [64 keys, ROWS] where key kpos is in the w2 window of
    the row's token, else 0; the row's token is one of the tile's from i0 below i_end (at G >= 64
    one token, i0 < i_end)."""
    if tile_tokens(G) == 1:
        ok = ((kpos <= i0) & (kpos > i0 - w2))[:, None]
        return tl.where(ok, tl.math.exp2(st * qk_scale - lse2), 0.0)
    else:
        tok = i0 + tl.arange(0, ROWS) // G
        ok = ((kpos[:, None] <= tok[None, :]) & (kpos[:, None] > tok[None, :] - w2)
              & (tok < i_end)[None, :])
        return tl.where(ok, tl.math.exp2(st * qk_scale - lse2), 0.0)


@triton.jit
def dq_columns(ds_tiles, b_tiles, d, COL: tl.constexpr, DH: tl.constexpr):
    """Columns COL .. COL + DH - 1 of a tile's dQ share, dS B over both consumers' keys: the
    dS^T of ds ring slot d (one [64 keys, ROWS] tile per consumer) against the same columns of
    each consumer's B tile. Waits for every wgmma of the warp group."""
    dq = tl.zeros([ROWS, DH], tl.float32)
    for c in tl.static_range(NUM_CONSUMERS):
        dq = tlx.async_dot(tlx.local_trans(tlx.local_view(ds_tiles, d * NUM_CONSUMERS + c)),
                           tlx.local_slice(tlx.local_view(b_tiles, c), [0, COL], [64, DH]), dq)
    return tlx.async_dot_wait(0, dq)


@triton.jit
def dq_share(ds_tiles, b_tiles, ds_fulls, u, cid, DH: tl.constexpr):
    """Consumer cid's columns of tile u's dQ share, once both consumers' dS^T of u are in ring
    slot u % 2."""
    d = u % 2
    tlx.barrier_wait(tlx.local_view(ds_fulls, d), (u // 2) & 1)
    if cid == 0:
        dq = dq_columns(ds_tiles, b_tiles, d, 0, DH)
    else:
        dq = dq_columns(ds_tiles, b_tiles, d, DH, DH)
    return dq


@triton.jit
def add_dq(dq, dq_stage, DQacc, b, g, j, u, N, i_end, cid, HQ: tl.constexpr, G: tl.constexpr,
           DH: tl.constexpr):
    """Reduce-add consumer cid's columns of tile u's dQ share into the fp32 dQ through its staging
    tile, once the previous add has read it: one TMA box per token of the tile below i_end."""
    R: tl.constexpr = box_rows(G)
    i0, h0 = first_token(j, u, G)
    stage = tlx.local_view(dq_stage, cid)
    tlx.async_descriptor_store_wait(0)
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
    tlx.local_store(stage, dq)
    tlx.fence_async_shared()
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
    if tile_tokens(G) == 1:
        tlx.async_descriptor_store(DQacc, stage, [(b * N + i0) * HQ + g * G + h0, cid * DH],
                                   store_reduce="add")
    else:
        for t in tl.static_range(tile_tokens(G)):
            if i0 + t < i_end:
                tlx.async_descriptor_store(DQacc, tlx.local_slice(stage, [t * R, 0], [R, DH]),
                                           [(b * N + i0 + t) * HQ + g * G, cid * DH],
                                           store_reduce="add")


@triton.jit
def scale_add_rows(acc, stage, row, X, kv_base, k0, N, DST, DSUM, j_off, cid,
                   HK: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr):
    """One consumer's end: DST[k] += row * acc[k] for its keys k0 .. k0 + 63 (< N), and
    DSUM[j] += sum_k X[k] * acc[k] (fp32 atomics), acc ([64, D] fp32) passing through `stage` to
    meet X's rows in a coalesced layout, CHUNK rows at a time."""
    tlx.local_store(stage, acc)
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
    col = tl.zeros([D], tl.float32)
    for c in tl.static_range(64 // CHUNK):
        x = tlx.local_load(tlx.local_slice(stage, [c * CHUNK, 0], [CHUNK, D]))
        kpos = k0 + c * CHUNK + tl.arange(0, CHUNK)
        offs = kv_rows(kv_base, kpos, HK, D)
        ok = (kpos < N)[:, None]
        xk = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        col += tl.sum(xk * x, 0)
        tl.atomic_add(DST + offs, x * row[None, :], mask=ok, sem="relaxed")
    tl.atomic_add(DSUM + j_off + tl.arange(0, D), col, sem="relaxed")
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)  # every chunk read: stage is free


@triton.jit
def _pairs_kernel(Q, K1, K2, V1, V2, DO, Lse2, Delta, K2rows, V2rows, DQacc, DK1acc, DK2acc,
                  DV1acc, DV2acc, N, w1, w2, n_kb, qk_scale, HQ: tl.constexpr,
                  HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_Q: tl.constexpr,
                  CH: tl.constexpr, CONSUMER_REGS: tl.constexpr, PROFILE: tl.constexpr = False,
                  Seq=None, VARLEN: tl.constexpr = False):
    R: tl.constexpr = box_rows(G)  # rows of one token in a tile
    tl.static_assert(NUM_Q == NUM_CONSUMERS, "the row ring holds the raw K2/V2 halves first")
    DH: tl.constexpr = D // NUM_CONSUMERS  # dQ columns per consumer
    b_tiles = tlx.local_alloc((64, D), tl.bfloat16, NUM_CONSUMERS)
    c_tiles = tlx.local_alloc((64, D), tl.bfloat16, NUM_CONSUMERS)
    # consumer 0's fp32 staging tile at its end is the Q row ring's bytes, consumer 1's the dO
    # ring's: free once both consumers have waited for the last tile's dS (they have then read
    # its Q and dO)
    rows_q = tlx.storage_alias_spec()
    rows_do = tlx.storage_alias_spec()
    q_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, NUM_Q, reuse=rows_q)
    do_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, NUM_Q, reuse=rows_do)
    stage_q = tlx.local_alloc((64, D), tl.float32, 1, reuse=rows_q)
    stage_do = tlx.local_alloc((64, D), tl.float32, 1, reuse=rows_do)
    ds_tiles = tlx.local_alloc((64, ROWS), tl.bfloat16, 2 * NUM_CONSUMERS)  # [slot * 2 + c]
    dq_stage = tlx.local_alloc((ROWS, DH), tl.float32, NUM_CONSUMERS)
    # beside each Q/dO slot: a row of R values per token (`load_rows`)
    lse_tiles = tlx.local_alloc((tile_tokens(G), row_width(G)), tl.float32, NUM_Q)
    delta_tiles = tlx.local_alloc((tile_tokens(G), row_width(G)), tl.float32, NUM_Q)
    kv_full = tlx.local_view(tlx.alloc_barriers(num_barriers=1, arrive_count=1), 0)
    bc_full = tlx.local_view(tlx.alloc_warp_barrier(num_barriers=1, num_warps=4), 0)
    q_fulls = tlx.alloc_barriers(num_barriers=NUM_Q, arrive_count=1)
    q_empties = tlx.alloc_warp_barrier(num_barriers=NUM_Q, num_warps=4 * NUM_CONSUMERS)
    ds_fulls = tlx.alloc_warp_barrier(num_barriers=2, num_warps=4 * NUM_CONSUMERS)
    ds_empties = tlx.alloc_warp_barrier(num_barriers=2, num_warps=4 * NUM_CONSUMERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: K2/V2 -> B, C; then Q, dO per tile
            b, g, j, kb, kv_base, n_tiles, live, t_end = pair_program(
                tl.program_id(0), N, w1, w2, n_kb, HK, D, G, Seq, VARLEN)
            if live:
                # K2 and V2 (64 keys per consumer) land in the row ring, free until the first
                # tile's rows; B and C are built from there
                enter("load_kv", PROFILE)
                tlx.barrier_expect_bytes(kv_full, 2 * NUM_CONSUMERS * 64 * D * BF16_BYTES)
                for c in tl.static_range(NUM_CONSUMERS):
                    tlx.async_descriptor_load(K2, tlx.local_view(q_tiles, c),
                                              [b, kb + c * 64, g * D], kv_full)
                    tlx.async_descriptor_load(V2, tlx.local_view(do_tiles, c),
                                              [b, kb + c * 64, g * D], kv_full)
                tlx.barrier_wait(kv_full, 0)
                leave("load_kv", PROFILE)
                enter("build_a", PROFILE)
                kv_row = kv_base + j.to(tl.int64) * (HK * D)
                k1 = row_tile(K1, kv_row, D, CH)
                v1 = row_tile(V1, kv_row, D, CH)
                for c in tl.static_range(NUM_CONSUMERS):
                    # (packed: the keys from the next sequence's on build as zeros)
                    n_rows = tl.minimum(j + w1, t_end) - (kb + c * 64)
                    build(k1, tlx.local_view(q_tiles, c), tlx.local_view(b_tiles, c), D, 64, CH,
                          MASK_ROWS=VARLEN, n_rows=n_rows)
                    build(v1, tlx.local_view(do_tiles, c), tlx.local_view(c_tiles, c), D, 64, CH,
                          MASK_ROWS=VARLEN, n_rows=n_rows)
                tlx.barrier_arrive(bc_full, 1)
                tlx.barrier_wait(bc_full, 0)  # every producer thread has read the ring
                leave("build_a", PROFILE)
                for u in range(0, n_tiles):
                    s = u % NUM_Q
                    enter("load_kv", PROFILE)
                    tlx.barrier_wait(tlx.local_view(q_empties, s), ((u // NUM_Q) & 1) ^ 1)
                    i0, h0 = first_token(j, u, G)
                    qf = tlx.local_view(q_fulls, s)
                    tlx.barrier_expect_bytes(qf, 2 * ROWS * D * BF16_BYTES + 2 * ROWS * 4)
                    for t in tl.static_range(tile_tokens(G)):
                        # a token past N: token N - 1's rows again (finite, masked: no value of
                        # another batch element is read)
                        row0 = (b * N + tl.minimum(i0 + t, t_end - 1)) * HQ + g * G + h0
                        load_rows(Q, DO, Lse2, Delta, q_tiles, do_tiles, lse_tiles, delta_tiles, s,
                                  qf, row0, t, R, D)
                    leave("load_kv", PROFILE)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid = tlx.async_task_replica_id()
            b, g, j, kb, kv_base, n_tiles, live, t_end = pair_program(
                tl.program_id(0), N, w1, w2, n_kb, HK, D, G, Seq, VARLEN)
            if live:
                k0 = kb + cid * 64
                u_lo, u_hi = active_tiles(j, k0, n_tiles, w2, G)
                i_end = tl.minimum(j + w1, t_end)  # the tokens past it do not see j
                b_tile = tlx.local_view(b_tiles, cid)
                c_tile = tlx.local_view(c_tiles, cid)
                kpos = k0 + tl.arange(0, 64)
                dk = tl.zeros([64, D], tl.float32)
                dv = tl.zeros([64, D], tl.float32)
                tlx.barrier_wait(bc_full, 0)
                # tile u's GEMMs, then tile u - 1's dQ: the two consumers meet at the dS of the
                # tile before, not of this one, so either may run up to a tile ahead
                for u in range(0, n_tiles):
                    s = u % NUM_Q
                    d = u % 2
                    i0, _ = first_token(j, u, G)
                    tlx.barrier_wait(tlx.local_view(q_fulls, s), (u // NUM_Q) & 1)
                    q_tile = tlx.local_view(q_tiles, s)
                    do_tile = tlx.local_view(do_tiles, s)
                    ds_tile = tlx.local_view(ds_tiles, d * NUM_CONSUMERS + cid)
                    tlx.barrier_wait(tlx.local_view(ds_empties, d), ((u // 2) & 1) ^ 1)
                    if (u >= u_lo) & (u < u_hi):
                        enter("qk_gemm", PROFILE)
                        st = tlx.async_dot(b_tile, tlx.local_trans(q_tile))
                        dpt = tlx.async_dot(c_tile, tlx.local_trans(do_tile))
                        lse2 = row_values(lse_tiles, s, G)  # [1, ROWS], log2 units
                        st = tlx.async_dot_wait(1, st)  # dP^T still in flight under the exp2
                        leave("qk_gemm", PROFILE)
                        enter("softmax", PROFILE)
                        pt = probabilities(st, lse2, qk_scale, kpos, i0, i_end, w2, G)
                        delta = row_values(delta_tiles, s, G)
                        dpt = tlx.async_dot_wait(0, dpt)
                        dst = (pt * (dpt - delta)).to(tl.bfloat16)
                        leave("softmax", PROFILE)
                        enter("pv_gemm", PROFILE)
                        dv = tlx.async_dot(pt.to(tl.bfloat16), do_tile, dv)
                        dk = tlx.async_dot(dst, q_tile, dk)
                        tlx.local_store(ds_tile, dst)
                        dv = tlx.async_dot_wait(0, dv)
                        dk = tlx.async_dot_wait(0, dk)
                        leave("pv_gemm", PROFILE)
                    else:
                        tlx.local_store(ds_tile, tl.zeros([64, ROWS], tl.bfloat16))
                    tlx.fence_async_shared()
                    tlx.barrier_arrive(tlx.local_view(ds_fulls, d), 1)
                    tlx.barrier_arrive(tlx.local_view(q_empties, s), 1)
                    if u > 0:
                        enter("epilogue", PROFILE)
                        dq = dq_share(ds_tiles, b_tiles, ds_fulls, u - 1, cid, DH)
                        tlx.barrier_arrive(tlx.local_view(ds_empties, 1 - d), 1)
                        add_dq(dq, dq_stage, DQacc, b, g, j, u - 1, N, i_end, cid, HQ, G, DH)
                        leave("epilogue", PROFILE)
                # the coordinates again, from an opaque program id (held over the loop they spill)
                b, g, j, kb, kv_base, n_tiles, _, t_end = pair_program(
                    opaque(tl.program_id(0)), N, w1, w2, n_kb, HK, D, G, Seq, VARLEN)
                k0 = kb + cid * 64
                u_lo, u_hi = active_tiles(j, k0, n_tiles, w2, G)
                enter("epilogue", PROFILE)
                dq = dq_share(ds_tiles, b_tiles, ds_fulls, n_tiles - 1, cid, DH)
                add_dq(dq, dq_stage, DQacc, b, g, j, n_tiles - 1, N, tl.minimum(j + w1, t_end),
                       cid, HQ, G, DH)
                tlx.async_descriptor_store_wait(0)
                if u_lo < u_hi:  # dB and dC are zero otherwise
                    if cid == 0:
                        stage = tlx.local_view(stage_q, 0)
                    else:
                        stage = tlx.local_view(stage_do, 0)
                    kv_row = kv_base + j.to(tl.int64) * (HK * D)
                    offs_d = tl.arange(0, D)
                    k1 = tl.load(K1 + kv_row + offs_d).to(tl.float32)
                    scale_add_rows(dk, stage, k1, K2rows, kv_base, k0, t_end, DK2acc, DK1acc,
                                   kv_row, cid, HK, D, epilogue_rows(G))
                    v1 = tl.load(V1 + kv_row + offs_d).to(tl.float32)
                    scale_add_rows(dv, stage, v1, V2rows, kv_base, k0, t_end, DV2acc, DV1acc,
                                   kv_row, cid, HK, D, epilogue_rows(G))
                leave("epilogue", PROFILE)


@triton.jit
def _finish_kernel(ACC, OUT, numel, scale, BLOCK: tl.constexpr):
    """OUT = bf16(scale * ACC), fp32 -> bf16 (dQ; dK/dV go through `launch_sum_parts`)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    tl.store(OUT + i, (tl.load(ACC + i, mask=ok, other=0.0) * scale).to(tl.bfloat16), mask=ok)


FINISH_BLOCK = 2048


def supports(spec: ProblemSpec) -> str | None:
    why = tiling_supports(spec)
    if why is None and spec.form != "trilinear":
        why = f"form {spec.form!r}: the trilinear form only"
    if why is None and (spec.G < 16 or spec.D != 128):
        why = (f"G = Hq/Hk = {spec.G}, D = {spec.D}: G >= 16 and D = 128 only (a tile is 64 "
               "heads of one token or all G heads of 64 / G tokens, a TMA box of >= 16 rows per "
               "token; each consumer takes half of dQ's 128 columns)")
    if why is None and spec.B * spec.N * spec.Hq >= 2 ** 31:
        why = (f"B*N*Hq = {spec.B * spec.N * spec.Hq} rows: its TMA boxes take int32 row "
               "coordinates (fewer than 2**31 rows)")
    return why


def config(spec: ProblemSpec) -> dict:
    """Two Q/dO slots, the producer's build in 8-row chunks, the consumers at 232 registers."""
    return dict(NUM_Q=2, CH=8, CONSUMER_REGS=232, num_warps=4, num_stages=1)


def key_blocks(spec: ProblemSpec) -> int:
    """Key blocks (programs) per j: j's keys span w1 + w2 - 1 tokens."""
    return triton.cdiv(spec.w1 + spec.w2 - 1, BLOCK_N)


def row_descriptor(t, spec: ProblemSpec) -> TensorDescriptor:
    """TMA view of a contiguous fp32 [B, N, Hq] tensor as rows of R = min(G, 64) values, a box
    per token of a tile (the LSE or Delta of its heads there)."""
    r = min(spec.G, ROWS.value)
    return TensorDescriptor(t, shape=[t.numel() // r, r], strides=[r, 1], block_shape=[1, r])


def launch(spec: ProblemSpec, q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2,
           profile: bool | str = False, packed=None) -> None:
    """Delta (`launch_delta`), `_pairs_kernel` into zeroed fp32 accumulators (profile: True or
    "pairs" runs its Proton-scoped copy), then the bf16 gradients (dQ, dK1, dK2 scaled by
    sm_scale) by `_finish_kernel` and `_sum_parts_kernel` (launch_sum_parts). Scratch: fp32
    copies of the five gradients (B*N*Hq*D*4 bytes for dQ: 4.3 GB at S*) and [B, N, Hq] copies
    of LSE (log2) and Delta (two small passes per call: `_delta_kernel` writes [B, Hq, N]).
    packed (spec.varlen, altattn/simplicial/varlen.py's Packed): its `bounds`, each token's
    sequence start and end."""
    if isinstance(profile, str) and profile != "pairs":
        raise ValueError(f"profile={profile!r}: this backward's scoped kernel is 'pairs'")
    delta = launch_delta(spec, out, dout, dlse)
    lse2d, deltad = (row_descriptor(t.transpose(1, 2).contiguous(), spec)  # [B, N, Hq]
                     for t in (lse * LOG2E, delta))
    dq_acc = torch.zeros(dq.shape, dtype=torch.float32, device=q.device)
    dk1_acc, dk2_acc, dv1_acc, dv2_acc = torch.zeros((4, *dk1.shape), dtype=torch.float32,
                                                     device=q.device)
    k2d, v2d = (kv_descriptor(t, spec, KEYS) for t in (k2, v2))
    qd, dod = (q_descriptor(t, spec, ROWS.value) for t in (q, dout))
    dqd = TensorDescriptor(dq_acc, shape=[spec.B * spec.N * spec.Hq, spec.D],
                           strides=[spec.D, 1],
                           block_shape=[min(spec.G, ROWS.value), spec.D // 2])
    _pairs_kernel[(spec.B * spec.Hk * spec.N * key_blocks(spec),)](
        qd, k1, k2d, v1, v2d, dod, lse2d, deltad, k2, v2, dqd, dk1_acc, dk2_acc, dv1_acc,
        dv2_acc, spec.N, spec.w1, spec.w2, key_blocks(spec), spec.sm_scale * LOG2E, HQ=spec.Hq,
        HK=spec.Hk, G=spec.G, D=spec.D, PROFILE=bool(profile), **config(spec),
        **({} if packed is None else dict(Seq=packed.bounds, VARLEN=True)))
    _finish_kernel[(triton.cdiv(dq.numel(), FINISH_BLOCK),)](
        dq_acc, dq, dq.numel(), spec.sm_scale, BLOCK=FINISH_BLOCK, num_warps=4)
    for dk_acc, dv_acc, dk, dv in ((dk1_acc, dv1_acc, dk1, dv1), (dk2_acc, dv2_acc, dk2, dv2)):
        # dK = sm_scale * its sum, dV its sum, in bf16: the k-owner's sum of one part
        launch_sum_parts(dk_acc, dv_acc, dk, dv, spec.sm_scale, parts=1)


def profiled_kernels(spec: ProblemSpec) -> dict[str, int]:
    """The one Proton-scoped kernel, "pairs": a producer and NUM_CONSUMERS consumer warp groups."""
    return {"pairs": config(spec)["num_warps"] * (1 + NUM_CONSUMERS.value)}


def compile_configs() -> list[CompileConfig]:
    """The kernel at every compile shape it supports."""
    out = []
    for spec, packed in [(s, False) for s in compile_specs()] + [(compile_specs()[0], True)]:
        if supports(spec) is not None:
            continue
        r = min(spec.G, ROWS.value)  # a token's rows in a tile
        kv = f"tensordesc<bf16[1,{KEYS},{spec.D}]>"
        rows = f"tensordesc<bf16[{r},{spec.D}]>"
        row = f"tensordesc<fp32[1,{r}]>"
        cfg, more = config(spec), {}
        if packed:  # packed sequences: the token bounds (`launch`'s packed)
            cfg, more = dict(cfg, VARLEN=True), {"Seq": "*i32"}
        out.append(kernel_config("pairs_packed" if packed else "pairs", _pairs_kernel, spec, cfg, {**more,
            "Q": rows, "K1": "*bf16", "K2": kv, "V1": "*bf16", "V2": kv, "DO": rows, "Lse2": row,
            "Delta": row, "K2rows": "*bf16", "V2rows": "*bf16",
            "DQacc": f"tensordesc<fp32[{r},{spec.D // 2}]>", "DK1acc": "*fp32",
            "DK2acc": "*fp32", "DV1acc": "*fp32", "DV2acc": "*fp32", "N": "i32", "w1": "i32",
            "w2": "i32", "n_kb": "i32", "qk_scale": "fp32"}))
    return out

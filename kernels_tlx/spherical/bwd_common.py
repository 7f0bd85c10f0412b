"""What the TLX spherical backwards (`tlx_ws`: bwd_ws.py, `tlx_ws_det`: bwd_ws_det.py) share: the
key-block kernel `_dkv_kernel` in FlashAttention-3's shape, its host side (descriptors, config,
grid, compile configs) and the fp32 -> bf16 dQ convert.

`_dkv_kernel`: one program per (batch b, KV head g, block of BLOCK_N = 128 keys), blocks of one head
adjacent in the grid (they stream the same Q and dO rows through L2). No exp anywhere:
    P^T  = A S^T                      S^T = K Q^T,  dP^T = V dO^T      (t unscaled, per column)
    dS^T = A dP^T + Bt S^T            (A, Bt: kernels_triton/spherical/bwd_common.row_coeffs)
    dV  += P^T dO      dK += dS^T Q   dQ += dS K (WITH_DQ)
Warp groups:
- producer ("default", 4 warps): TMA-loads the block's K and V once (a 64-key half per consumer,
  `kv_full`), then streams 64-row Q and dO tiles over the query blocks and the G query heads of
  head g through a ring of NUM_STAGES slots (`q_fulls`; `q_empties`, one arrival per consumer
  thread, frees a slot).
- two consumers (4 warps each, setmaxnreg CONSUMER_REGS): consumer c owns keys kb + 64c .. + 63
  and their fp32 dK, dV (64 x D each) in registers. Per tile: S^T, dP^T (SS-wgmma, 64 keys x 64
  rows), P^T and dV's RS-wgmma while dP^T is in flight, dS^T, dK's RS-wgmma. WITH_DQ: dS^T goes to
  shared memory (two slots by tile parity), the consumers meet at an mbarrier of that parity
  that every thread of both arrives on (both halves of dS in place; a named barrier's `bar.sync`
  reached at two instructions, one per replica, fails synccheck), and each computes dQ's columns c*D/2 .. (D = 128: trans(dS) [64 rows x 128 keys]
  @ K[:, cols]) or, at D = 64, consumer (tile % 2) all 64 columns; the fp32 result goes through
  a staging tile to a TMA reduce-add into the fp32 scratch [B, N, Hq*D] (zeroed by the launch).
Masks: keys >= Lk and (causal) x > y give P = dS = 0; rows >= Lq have A = Bt = 0 (row_coeffs) and
rows >= N read A = Bt = 0 and zero Q/dO (TMA). Causal programs start at their diagonal query block;
key blocks at or past Lk run no mainloop and write zero dK, dV.
PACKED (packed sequences, kernels_triton/spherical/host.py): a program per row of a key-tile map
(a KV head's block of 128 keys of one sequence; a sequence's blocks head by head, the sequences by
work, largest first: altattn.packing.tile_map): the programs running at once read one head's
Q and dO, which stay in L2 while its key blocks pass over them. Coordinates are local to the
sequence, offset by its first row and key at each TMA load. A and R come by the producer's TMA
as in a batch, from row_coeffs' slots layout (kernels_triton/spherical/bwd_common.py: each
sequence's rows from a 64-row-aligned slot on, zeros to its last tile's end; a 1-D bulk copy
from a sequence's own, unaligned, first row is an illegal instruction, seen on the H200). So the
rows past a sequence's end that a tile reads (the next sequence's Q and dO) meet A = R = 0: they
add nothing and their dQ reduce-adds add exact zeros; dK, dV stores are masked to the sequence's
keys.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import tlx

from altattn.registry import CompileConfig
from kernels_tlx.ring import empty_phase, full_phase
from kernels_triton.launch import Desc, Kernel, compile_configs
from kernels_triton.proton import BF16_BYTES, enter, leave
from kernels_triton.spherical.bwd_common import coeff_row0, padded_rows, slot_row0
from kernels_triton.spherical.host import (MAP_K_START, MAP_SEQ, PerGrid, map_field, meta_args,
                                          packed_map, packed_tile)

BLOCK_N = 128         # keys per program (64 per consumer)
BLOCK_M = 64          # query rows per streamed tile
HALF = tl.constexpr(64)
NUM_CONSUMERS = tl.constexpr(2)
STAGE_BARRIER = tl.constexpr(13)  # 13 + c: consumer c's dQ staging tile written (128 threads)
CONVERT_BLOCK = 2048


@triton.jit
def seq_bounds(Seqlens, b, N, Nk, VARLEN: tl.constexpr):
    """(Lq, Lk): the rows and keys of sequence b that count (clamp(seqlens[b]) with VARLEN)."""
    if VARLEN:
        L = tl.maximum(tl.load(Seqlens + b), 0)
        return tl.minimum(L, N), tl.minimum(L, Nk)
    return N + 0 * b, Nk + 0 * b


@triton.jit
def key_program(N, Nk, Seqlens, HK: tl.constexpr, G: tl.constexpr, CAUSAL: tl.constexpr,
                VARLEN: tl.constexpr, PACKED: tl.constexpr):
    """This program's b, g, first key kb, Lk, first query block m_lo, query blocks per head n_m
    and tile count (G heads x n_m blocks; 0 for a block at or past Lk), and its sequence's first
    row and key q_base, k_base and Lq (PACKED: Seqlens is the key-tile map; else 0, 0, N).
    Computed in each warp group (nothing crosses the partitions in registers)."""
    pid = tl.program_id(0)
    if PACKED:
        g, q_base, k_base, Lq, Lk, kb = packed_tile(Seqlens, pid)
        kb = kb & -128  # the map's first key is a multiple of 128: said to the compiler
        b = 0
    else:
        n_kb = tl.cdiv(Nk, 128)
        kb = (pid % n_kb) * 128
        bg = pid // n_kb
        b = bg // HK
        g = bg % HK
        Lq, Lk = seq_bounds(Seqlens, b, N, Nk, VARLEN)
        q_base = 0
        k_base = 0
    m_lo = 0
    if CAUSAL:
        m_lo = kb // 64
    n_m = tl.maximum(tl.cdiv(Lq, 64) - m_lo, 0)
    n_tiles = tl.where(kb < Lk, G * n_m, 0)
    return b, g, kb, Lk, m_lo, n_m, n_tiles, q_base, k_base, Lq


@triton.jit
def masked(x, k_first, q0, Lk, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
           EVERY_TILE: tl.constexpr = False):
    """x [64 keys from k_first, 64 rows from q0] with 0 at invisible pairs: keys >= Lk (VARLEN;
    keys past Nk read as zeros) and, causal, key > row (only tiles that cross the diagonal
    compare; EVERY_TILE: every tile, an identity off the diagonal, where the branch makes ptxas
    spill). Rows >= Lq need no mask: A = 0 there, and past N Q, dO are 0."""
    if VARLEN:  # noqa: SIM102 (a constexpr, then a runtime test)
        if k_first + 64 > Lk:
            x = tl.where((k_first + tl.arange(0, 64) < Lk)[:, None], x, 0.0)
    if CAUSAL:
        if EVERY_TILE:
            x = _causal(x, k_first, q0)
        elif q0 < k_first + 63:
            x = _causal(x, k_first, q0)
    return x


@triton.jit
def _causal(x, k_first, q0):
    """x with 0 where the key (k_first + row of x) is past the row (q0 + column of x)."""
    return tl.where(tl.arange(0, 64)[:, None] <= (q0 - k_first) + tl.arange(0, 64)[None, :], x,
                    0.0)


@triton.jit
def dq_gemm(ds_tiles, par, k_tiles, COL: tl.constexpr, COLS: tl.constexpr):
    """Issue dQ[:, COL .. COL + COLS) = trans(dS^T) K[:, COL ..] over both key halves (the dS^T
    tiles of parity `par`): two SS-wgmmas of K = 64 keys."""
    dq = tlx.async_dot(tlx.local_trans(tlx.local_view(ds_tiles, par)),
                       tlx.local_slice(tlx.local_view(k_tiles, 0), [0, COL], [HALF, COLS]))
    return tlx.async_dot(tlx.local_trans(tlx.local_view(ds_tiles, par + 1)),
                         tlx.local_slice(tlx.local_view(k_tiles, 1), [0, COL], [HALF, COLS]), dq)


@triton.jit
def reduce_dq(DQd, stage, dq, b, q0, col, cid, PROFILE: tl.constexpr):
    """One consumer: its fp32 dQ tile (64 rows x cols) through `stage` to a TMA reduce-add at
    [b, q0, col] of the scratch (rows past N clipped). The caller has waited for the previous
    reduce-add to read `stage` (async_descriptor_store_wait) before its last barrier."""
    enter("epilogue", PROFILE)
    tlx.local_store(stage, dq)
    tlx.fence_async_shared()
    tlx.named_barrier_wait(STAGE_BARRIER + cid, 128)  # every thread's part is in `stage`
    tlx.async_descriptor_store(DQd, stage, [b, q0, col], store_reduce="add")
    leave("epilogue", PROFILE)


@triton.jit
def _dkv_kernel(Qd, Kd, Vd, DOd, Ad, Rd, Seqlens, NA, DK, DV, DQd, N, Nk, HQ: tl.constexpr,
                HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
                VARLEN: tl.constexpr, WITH_DQ: tl.constexpr, NUM_STAGES: tl.constexpr,
                CONSUMER_REGS: tl.constexpr, PACKED: tl.constexpr = False,
                PROFILE: tl.constexpr = False):
    # PACKED: Seqlens is the key-tile map, VARLEN set (keys >= Lk masked); module docstring
    DQ_COLS: tl.constexpr = D // 2 if D == 128 else D  # dQ columns per consumer (per tile)
    k_tiles = tlx.local_alloc((HALF, D), tl.bfloat16, NUM_CONSUMERS)
    v_tiles = tlx.local_alloc((HALF, D), tl.bfloat16, NUM_CONSUMERS)
    q_tiles = tlx.local_alloc((64, D), tl.bfloat16, NUM_STAGES)
    do_tiles = tlx.local_alloc((64, D), tl.bfloat16, NUM_STAGES)
    a_tiles = tlx.local_alloc((64,), tl.float32, NUM_STAGES)   # A, R = Bt / A of the tile's 64 rows
    r_tiles = tlx.local_alloc((64,), tl.float32, NUM_STAGES)
    if WITH_DQ:
        ds_tiles = tlx.local_alloc((HALF, 64), tl.bfloat16, 2 * NUM_CONSUMERS)  # [parity][half]
        stage_tiles = tlx.local_alloc((64, DQ_COLS), tl.float32, NUM_CONSUMERS)
        # per parity: both consumers' dS^T halves stored (every thread of both arrives: each
        # replica reaches it at its own instruction, which a `bar.sync` must not see)
        ds_fulls = tlx.alloc_warp_barrier(num_barriers=2, num_warps=4 * NUM_CONSUMERS)
    kv_full = tlx.local_view(tlx.alloc_barriers(num_barriers=1, arrive_count=1), 0)
    q_fulls = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    q_empties = tlx.alloc_warp_barrier(num_barriers=NUM_STAGES, num_warps=4 * NUM_CONSUMERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: K, V once; Q, dO per tile
            b, g, kb, Lk, m_lo, n_m, n_tiles, q_base, k_base, _ = key_program(
                N, Nk, Seqlens, HK, G, CAUSAL, VARLEN, PACKED)
            if n_tiles > 0:
                enter("load_kv", PROFILE)
                tlx.barrier_expect_bytes(kv_full, 2 * 128 * D * BF16_BYTES)
                for c in tl.static_range(NUM_CONSUMERS):
                    tlx.async_descriptor_load(Kd, tlx.local_view(k_tiles, c),
                                              [b, k_base + kb + c * HALF, g * D], kv_full)
                    tlx.async_descriptor_load(Vd, tlx.local_view(v_tiles, c),
                                              [b, k_base + kb + c * HALF, g * D], kv_full)
                leave("load_kv", PROFILE)
            q_first = q_base + m_lo * 64  # the first query block's row in q (one register)
            if PACKED:  # the first query block's slot in A and R (row_coeffs' slots layout)
                seq = map_field(Seqlens, tl.program_id(0), MAP_SEQ)
                a_first = slot_row0(q_base, seq) + m_lo * 64
            for it in range(n_tiles):
                s = it % NUM_STAGES
                h = g * G + it // n_m
                q0 = q_first + (it % n_m) * 64
                enter("load_kv", PROFILE)
                tlx.barrier_wait(tlx.local_view(q_empties, s), empty_phase(it, NUM_STAGES))
                full = tlx.local_view(q_fulls, s)
                tlx.barrier_expect_bytes(full, 2 * 64 * D * BF16_BYTES + 2 * 64 * 4)
                tlx.async_descriptor_load(Qd, tlx.local_view(q_tiles, s), [b, q0, h * D], full)
                tlx.async_descriptor_load(DOd, tlx.local_view(do_tiles, s), [b, q0, h * D], full)
                # A, R as flat runs of rows padded to 16 bytes (zeros past N; past NP the next
                # head's values, met by zero Q, dO rows): a run's start is 16-byte aligned, as
                # the 1-D bulk copy needs. Packed: [Hq, NA] slots, zeros past a sequence's end
                # (the next sequence's Q, dO rows that a tile reads meet A = R = 0)
                if PACKED:
                    row = (h * NA + a_first + (it % n_m) * 64).to(tl.int32)
                else:
                    row = coeff_row0(b, h, N, HQ).to(tl.int32) + q0
                tlx.async_descriptor_load(Ad, tlx.local_view(a_tiles, s), [row], full)
                tlx.async_descriptor_load(Rd, tlx.local_view(r_tiles, s), [row], full)
                leave("load_kv", PROFILE)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid = tlx.async_task_replica_id()
            b, g, kb, Lk, m_lo, n_m, n_tiles, q_base, _, Lq = key_program(
                N, Nk, Seqlens, HK, G, CAUSAL, VARLEN, PACKED)
            k_tile = tlx.local_view(k_tiles, cid)
            v_tile = tlx.local_view(v_tiles, cid)
            k_first = kb + cid * HALF
            dk = tl.zeros([HALF, D], tl.float32)
            dv = tl.zeros([HALF, D], tl.float32)
            if n_tiles > 0:
                enter("wait_kv", PROFILE)
                tlx.barrier_wait(kv_full, 0)
                leave("wait_kv", PROFILE)
            for it in range(n_tiles):
                s = it % NUM_STAGES
                h = g * G + it // n_m
                q0 = (m_lo + it % n_m) * 64
                enter("wait_kv", PROFILE)
                tlx.barrier_wait(tlx.local_view(q_fulls, s), full_phase(it, NUM_STAGES))
                leave("wait_kv", PROFILE)
                q_tile = tlx.local_view(q_tiles, s)
                do_tile = tlx.local_view(do_tiles, s)
                enter("qk_gemm", PROFILE)
                st = tlx.async_dot(k_tile, tlx.local_trans(q_tile))
                st = tlx.async_dot_wait(0, st)
                leave("qk_gemm", PROFILE)
                enter("square", PROFILE)
                a = tlx.local_load(tlx.local_view(a_tiles, s))
                # packed: S^T's causal select on every tile (its branch: 44 spill bytes, D 128)
                st = masked(st, k_first, q0, Lk, CAUSAL, VARLEN, EVERY_TILE=PACKED)
                pt = (st * a[None, :]).to(tl.bfloat16)
                # dP^T accumulates onto R S^T (R = Bt / A): dS^T = A (dP^T + R S^T), and S^T's
                # registers are the accumulator's (S^T and dP^T are never live apart)
                st = st * tlx.local_load(tlx.local_view(r_tiles, s))[None, :]
                leave("square", PROFILE)
                enter("qk_gemm", PROFILE)
                dpt = tlx.async_dot(v_tile, tlx.local_trans(do_tile), st)
                leave("qk_gemm", PROFILE)
                enter("pv_gemm", PROFILE)
                dv = tlx.async_dot(pt, do_tile, dv)
                dpt = tlx.async_dot_wait(1, dpt)  # dV in flight under the dS line
                leave("pv_gemm", PROFILE)
                enter("square", PROFILE)
                dst = (masked(dpt, k_first, q0, Lk, CAUSAL, VARLEN) * a[None, :]).to(tl.bfloat16)
                leave("square", PROFILE)
                enter("pv_gemm", PROFILE)
                dk = tlx.async_dot(dst, q_tile, dk)
                if WITH_DQ:
                    par = (it % 2) * NUM_CONSUMERS
                    tlx.local_store(tlx.local_view(ds_tiles, par + cid), dst)
                    tlx.fence_async_shared()
                    stage = tlx.local_view(stage_tiles, cid)
                    tlx.async_descriptor_store_wait(0)  # the last reduce-add has read `stage`
                    ds_full = tlx.local_view(ds_fulls, it % 2)
                    tlx.barrier_arrive(ds_full, 1)  # this thread's share of dS^T is stored
                    tlx.barrier_wait(ds_full, full_phase(it, 2))  # both halves of dS^T stored
                    if D == 128:  # columns cid * 64 .. of dQ, over both key halves
                        if cid == 0:
                            dq = dq_gemm(ds_tiles, par, k_tiles, 0, DQ_COLS)
                        else:
                            dq = dq_gemm(ds_tiles, par, k_tiles, DQ_COLS, DQ_COLS)
                        dq = tlx.async_dot_wait(0, dq)
                        dk = tlx.async_dot_wait(0, dk)
                        dv = tlx.async_dot_wait(0, dv)
                        tlx.barrier_arrive(tlx.local_view(q_empties, s), 1)
                        leave("pv_gemm", PROFILE)
                        reduce_dq(DQd, stage, dq, b, q_base + q0, h * D + cid * DQ_COLS, cid,
                                  PROFILE)
                    else:  # D = 64: consumer it % 2 takes the whole tile's dQ
                        dk = tlx.async_dot_wait(0, dk)
                        dv = tlx.async_dot_wait(0, dv)
                        tlx.barrier_arrive(tlx.local_view(q_empties, s), 1)
                        if cid == it % 2:
                            dq = tlx.async_dot_wait(0, dq_gemm(ds_tiles, par, k_tiles, 0, D))
                            leave("pv_gemm", PROFILE)
                            reduce_dq(DQd, stage, dq, b, q_base + q0, h * D, cid, PROFILE)
                        else:
                            leave("pv_gemm", PROFILE)
                else:
                    dk = tlx.async_dot_wait(0, dk)
                    dv = tlx.async_dot_wait(0, dv)
                    tlx.barrier_arrive(tlx.local_view(q_empties, s), 1)
                    leave("pv_gemm", PROFILE)
            enter("epilogue", PROFILE)
            if WITH_DQ:
                tlx.async_descriptor_store_wait(0)
            kpos = k_first + tl.arange(0, HALF)
            if PACKED:  # the sequence's own keys (its first key read again: not held in the loop)
                live = (kpos < Lk)[:, None]
                k_base = map_field(Seqlens, tl.program_id(0), MAP_K_START)
            else:
                live = (kpos < Nk)[:, None]
                k_base = 0
            tok = (b * Nk + k_base + kpos).to(tl.int64)
            out = (tok * HK + g)[:, None] * D + tl.arange(0, D)[None, :]
            tl.store(DK + out, dk.to(tl.bfloat16), mask=live)
            tl.store(DV + out, dv.to(tl.bfloat16), mask=live)
            leave("epilogue", PROFILE)


@triton.jit
def _convert_kernel(Src, Dst, n, BLOCK: tl.constexpr):
    """Dst[i] = bf16(Src[i]) (the dQ scratch to dq)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Dst + i, tl.load(Src + i, mask=i < n).to(tl.bfloat16), mask=i < n)


# ---------------------------------------------------------------- host side

def supports(spec) -> str | None:
    """Every spec the family validates (D 64 or 128, any B, N, Nk, G, causal, seqlens), except
    rows whose stride is not 16-byte aligned for TMA (never at D 64/128) and grids past 2^31."""
    if spec.D not in (64, 128):
        return f"D = {spec.D}: only 64 and 128"
    if triton.cdiv(spec.Nk, BLOCK_N) * spec.B * spec.Hk >= 2 ** 31:
        return "too many key blocks for one grid"
    return None


def config(spec, with_dq: bool) -> dict:
    """Two Q/dO stages; consumers at 240 registers (FA3's split: producer 24). (with_dq only
    names which kernel; the config is the same.)"""
    return {"NUM_STAGES": 2, "CONSUMER_REGS": 240, "num_warps": 4, "num_stages": 1}


def rows_layout(B: int, rows: int, cols: int, block_rows: int, block_cols: int) -> Desc:
    """TMA view of a contiguous [B, rows, H, D] tensor as [B, rows, H*D = cols] (a box
    [1, block_rows, block_cols] at [b, row0, h*D + col0]); rows past `rows` read as zeros, stores
    there clip."""
    return Desc([B, rows, cols], [rows * cols, cols, 1], [1, block_rows, block_cols])


def dq_cols(D: int) -> int:
    return D // 2 if D == 128 else D


def prepare_dkv(spec, with_dq: bool, profile: bool = False):
    """The key-block kernel's launch of `spec`, made once: run(q, k, v, dout, A, R, seqlens, dk,
    dv, dq_acc) writes dk, dv (and, with_dq, reduce-adds dQ into the fp32 [B, N, Hq, D] dq_acc,
    zeroed); A and R = Bt / A fp32 [B, Hq, NP] (row_coeffs(..., ratio=True): rows padded to 16
    bytes; spec.packed: [Hq, NA], row_coeffs(..., slots=True)); seqlens int32 [B] or None
    (spec.packed: altattn.packing.PackedSeqs, B = 1)."""
    cfg = config(spec, with_dq)
    D = spec.D
    rows = rows_layout(spec.B, spec.N, spec.Hq * D, BLOCK_M, D)
    keys = rows_layout(spec.B, spec.Nk, spec.Hk * D, BLOCK_N // 2, D)
    dq_rows = rows_layout(spec.B, spec.N, spec.Hq * D, BLOCK_M, dq_cols(D)) if with_dq else None
    n = spec.B * spec.Hq * padded_rows(spec.N)
    coeffs = Desc([n], [1], [BLOCK_M])
    grid = (triton.cdiv(spec.Nk, BLOCK_N) * spec.B * spec.Hk,)
    opts = dict(HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=D, CAUSAL=spec.causal,
                VARLEN=spec.varlen or spec.packed, WITH_DQ=with_dq, PROFILE=profile, **cfg)
    N, Nk = spec.N, spec.Nk
    if spec.packed:  # a program per key-tile map row (KV heads x key tiles)
        per_grid = PerGrid(_dkv_kernel, lambda n: (spec.Hk * n,), PACKED=True, **opts)

        @functools.cache  # NA (a function of T and the number of sequences) -> A, R's layout
        def flat(NA: int) -> Desc:
            return Desc([spec.Hq * NA], [1], [BLOCK_M])

        def run_packed(q, k, v, dout, A, R, seqs, dk, dv, dq_acc) -> None:
            tiles, n = packed_map(seqs, Nk, BLOCK_N, spec.causal, spec.Hk, keys=True)
            if n:
                NA = A.shape[-1]  # A, R [Hq, NA]: row_coeffs(..., slots=True)
                if spec.Hq * NA >= 2 ** 31:  # the TMA coordinate h * NA + row is an int32
                    raise ValueError(f"cu_seqlens_q: {seqs.cu_q.numel() - 1} sequences of {N} "
                                     f"rows at Hq = {spec.Hq} make more coefficient rows than "
                                     f"int32 indexes (the tlx_ws backward's slots layout)")
                per_grid(n)(rows(q), keys(k), keys(v), rows(dout), flat(NA)(A.view(-1)),
                            flat(NA)(R.view(-1)), tiles, NA, dk, dv,
                            dq_rows(dq_acc) if with_dq else A, N, Nk)

        return run_packed
    kernel = Kernel(_dkv_kernel, grid, **opts)

    def run(q, k, v, dout, A, R, seqlens, dk, dv, dq_acc) -> None:
        kernel(rows(q), keys(k), keys(v), rows(dout), coeffs(A.view(-1)), coeffs(R.view(-1)),
               A if seqlens is None else seqlens, 0, dk, dv,
               dq_rows(dq_acc) if with_dq else A, N, Nk)

    return run


def prepare_convert(n: int):
    """run(src, dst): dst = bf16(src), n elements (the dQ scratch to dq)."""
    kernel = Kernel(_convert_kernel, (triton.cdiv(n, CONVERT_BLOCK),), BLOCK=CONVERT_BLOCK,
                    num_warps=4)

    def run(src: torch.Tensor, dst: torch.Tensor) -> None:
        if n:
            kernel(src, dst, n)

    return run


def compile_specs():
    """The compile shapes: D 64 and 128, causal and not, varlen and not, G 1 and 8; packed (G 8,
    causal and not)."""
    from altattn.spherical.spec import SphericalSpec
    out = []
    for d in (64, 128):
        for hq, hk in ((8, 8), (16, 2)):
            for causal, varlen in ((False, False), (True, False), (False, True)):
                out.append(SphericalSpec(B=1, N=4096, Nk=4096, Hq=hq, Hk=hk, D=d, causal=causal,
                                         sm_scale=d ** -0.5, varlen=varlen))
        for causal in (False, True):
            out.append(SphericalSpec(B=1, N=4096, Nk=4096, Hq=16, Hk=2, D=d, causal=causal,
                                     sm_scale=d ** -0.5, packed=True))
    return out


def spec_name(spec) -> str:
    return (f"G{spec.G}_Hk{spec.Hk}_D{spec.D}" + ("_causal" if spec.causal else "")
            + ("_varlen" if spec.varlen else "") + ("_packed" if spec.packed else ""))


def build_compile_configs(prepare, kernels: dict, supports_fn=supports) -> list[CompileConfig]:
    """The launches `prepare(spec)` makes (recorded on meta tensors) at every compile spec that
    `supports_fn` takes, of the kernels in `kernels` (kernel -> name; the key-block kernel's
    gains "_dq" where it accumulates dQ)."""
    out = []
    for spec in compile_specs():
        if supports_fn(spec) is not None:
            continue

        def name(launch, tag=spec_name(spec)):
            prefix = kernels.get(launch.fn)
            if prefix is None:
                return None
            return f"{prefix}{'_dq' if launch.constexprs.get('WITH_DQ') else ''}_{tag}"
        out += compile_configs(lambda s=spec: prepare(s), meta_args(spec, "bwd"), name)
    return out

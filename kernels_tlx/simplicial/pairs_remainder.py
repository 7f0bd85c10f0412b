"""Remainder programs of the `tlx_pairs` backward (kernels_tlx/simplicial/bwd_pairs.py, PACK > 0).

j's keys span w1 + w2 - 1 tokens, in blocks of 128: at S* (w 32 x 512) four full blocks and a
last one of 31 keys. Given a program of its own, that last block is one consumer's work (the
other has no keys) at about two thirds of a full program's time (docs/perf-bwd.md). A remainder
program packs the last blocks of PACK consecutive j, BLOCK_N / PACK rows (pairs) each, into its
128 rows: each row is a pair (j, k) with its own j, so B's rows are K1[j] * K2[k] of several j,
the masks are per row (`remainder_rows`), and the end sums dK1[j] and dV1[j] per slot. Its
tokens are those of all PACK j (w1 + PACK - 1 of them); dQ is unchanged (dS B sums over the
rows, whatever their j)."""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from kernels_tlx.simplicial.common import opaque
from kernels_tlx.simplicial.hadamard import build, row_tile
from kernels_tlx.simplicial.pairs_parts import remainder_keys, scale_add_rows, slot_rows


@triton.constexpr_function
def slot_chunk(CHUNK, PACK):
    """Rows per chunk of a slot's end: `epilogue_rows`' CHUNK, at most a slot."""
    return min(CHUNK, slot_rows(PACK))


@triton.jit
def load_remainder_kv(K2, V2, k2_tiles, v2_tiles, k2b_tiles, full, b, g, j0, N, w1, w2, n_kb,
                      D: tl.constexpr, PACK: tl.constexpr, DET: tl.constexpr = False, Seq=None,
                      VARLEN: tl.constexpr = False):
    """Producer: each slot's K2 and V2 rows (its j's last key block; descriptors of
    slot_rows(PACK) rows) into the consumers' halves of the row ring, on `full`; form "det":
    K2a there, K2b into k2b_tiles (K2 packed, det_keys_side)."""
    for a in tl.static_range(PACK):
        _, k_first, _, _ = remainder_keys(j0 + a, N, w1, w2, n_kb, Seq, VARLEN)
        load_slot(K2, k2_tiles, full, [b, k_first, (1 + DET) * g * D], a, PACK, D)
        if DET:
            load_slot(K2, k2b_tiles, full, [b, k_first, (2 * g + 1) * D], a, PACK, D)
        load_slot(V2, v2_tiles, full, [b, k_first, g * D], a, PACK, D)


@triton.jit
def load_slot(X, tiles, full, coords, a: tl.constexpr, PACK: tl.constexpr, D: tl.constexpr):
    """Slot a's rows of X at `coords` (a slot's rows lie in one consumer's 64)."""
    SLOT: tl.constexpr = slot_rows(PACK)
    c: tl.constexpr = a // (64 // SLOT)
    r: tl.constexpr = a % (64 // SLOT) * SLOT
    tlx.async_descriptor_load(X, tlx.local_slice(tlx.local_view(tiles, c), [r, 0], [SLOT, D]),
                              coords, full)


@triton.jit
def build_remainder(K1, V1, k2_tiles, v2_tiles, k2b_tiles, b_tiles, c_tiles, kv_base, j0, N, w1,
                    w2, n_kb, HK: tl.constexpr, D: tl.constexpr, CH: tl.constexpr,
                    PACK: tl.constexpr, DET: tl.constexpr = False, Seq=None,
                    VARLEN: tl.constexpr = False):
    """Producer: each slot's B = K1[j] * K2 (form "det": K1a[j] * K2a + K1b[j] * K2b) and
    C = V1[j] * V2, its rows past the block's keys (and every row of a j past N) zeros. (Each
    slot's keys found again from an opaque j0: else the loads' are held through the builds,
    and spill.)"""
    j0 = opaque(j0)
    for a in tl.static_range(PACK):
        jc, _, count, _ = remainder_keys(j0 + a, N, w1, w2, n_kb, Seq, VARLEN)
        kv_row = kv_base + jc.to(tl.int64) * (HK * D)
        if DET:
            build_slot(row_tile(K1, 2 * kv_row, D, CH), k2_tiles, b_tiles, count, a, PACK, D,
                       CH, DET, row_tile(K1, 2 * kv_row + D, D, CH), k2b_tiles)
        else:
            build_slot(row_tile(K1, kv_row, D, CH), k2_tiles, b_tiles, count, a, PACK, D, CH)
        build_slot(row_tile(V1, kv_row, D, CH), v2_tiles, c_tiles, count, a, PACK, D, CH)


@triton.jit
def build_slot(row, src_tiles, dst_tiles, count, a: tl.constexpr, PACK: tl.constexpr,
               D: tl.constexpr, CH: tl.constexpr, DET: tl.constexpr = False, row_b=None,
               src_b_tiles=None):
    """Slot a's rows of dst = row * src (DET: + row_b * src_b), rows count on zeros (`build`)."""
    SLOT: tl.constexpr = slot_rows(PACK)
    c: tl.constexpr = a // (64 // SLOT)
    r: tl.constexpr = a % (64 // SLOT) * SLOT
    if DET:
        build(row, tlx.local_view(src_tiles, c), tlx.local_view(dst_tiles, c), D, SLOT, CH, DET,
              row_b, tlx.local_view(src_b_tiles, c), MASK_ROWS=True, n_rows=count, ROW0=r)
    else:
        build(row, tlx.local_view(src_tiles, c), tlx.local_view(dst_tiles, c), D, SLOT, CH,
              MASK_ROWS=True, n_rows=count, ROW0=r)


@triton.jit
def remainder_end(stage, X1, X2rows, DST, DSUM, j0, kv_base, cid, N, w1, w2, n_kb,
                  HK: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, PACK: tl.constexpr,
                  Seq=None, VARLEN: tl.constexpr = False, SL: tl.constexpr = 1, col=0,
                  Scale=None):
    """A consumer's end in a remainder program, for its staged dB (X = K) or dC (X = V): per
    slot of its 64 rows (consumer cid's slots), DST[k] += X1[j] * acc[k] and DSUM[j] += sum_k
    X2[k] * acc[k] (`scale_add_rows`; acc the staged rows). Form "det" (SL = 2: K1, K2 and
    their sums in det_keys_side's packing): the columns from `col` (0, then D for the b slot).
    Scale: int64 sums (`scale_add_rows`)."""
    SLOT: tl.constexpr = slot_rows(PACK)
    for s in tl.static_range(64 // SLOT):
        jc, k_first, count, _ = remainder_keys(j0 + cid * (64 // SLOT) + s, N, w1, w2, n_kb, Seq,
                                               VARLEN)
        if count > 0:
            kv_row = SL * (kv_base + jc.to(tl.int64) * (HK * D)) + col
            x1 = tl.load(X1 + kv_row + tl.arange(0, D)).to(tl.float32)
            scale_add_rows(stage, x1, X2rows, SL * kv_base + col, k_first, k_first + count,
                           DST, DSUM, kv_row, SL * HK, D, slot_chunk(CHUNK, PACK), ROW0=s * SLOT,
                           N_ROWS=SLOT, Scale=Scale)

"""Which tile a program of the TLX spherical forward (fwd_common.py) owns: its (b, head, rows),
its sequence's bounds and its key blocks, for batches (with seqlens) and packed sequences (a row
of the tile map, kernels_triton/spherical/host.py). The producer and both consumers compute it
(nothing crosses the warp groups in registers)."""
from __future__ import annotations

import triton
import triton.language as tl

from kernels_triton.spherical.host import packed_tile


@triton.jit
def tile_coords(tile, n_m, HQ: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
                CAUSAL: tl.constexpr):
    """(b, h, g, m0) of tile `tile`: (b, g) outermost, query block next (descending when causal),
    the G heads of kv head g innermost."""
    HK: tl.constexpr = HQ // G
    hh = tile % G
    rest = tile // G
    mi = rest % n_m
    bg = rest // n_m
    if CAUSAL:
        mi = n_m - 1 - mi
    g = bg % HK
    return bg // HK, g * G + hh, g, mi * BLOCK_M


@triton.jit
def tile_keys(b, m0, Seqlens, N, NK, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(Lq, Lk, n_blocks): the tile's real query and key lengths and its key blocks to load
    (none when no row of the tile is below Lq)."""
    Lq = N
    Lk = NK
    if VARLEN:
        L = tl.load(Seqlens + b)
        Lq = tl.minimum(tl.maximum(L, 0), N)
        Lk = tl.minimum(tl.maximum(L, 0), NK)
    hi = Lk
    if CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M)
    hi = tl.where(m0 < Lq, hi, 0)
    return Lq, Lk, tl.cdiv(hi, BLOCK_N)


@triton.jit
def tile_info(tile, n_m, Seqlens, N, NK, HQ: tl.constexpr, G: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              VARLEN: tl.constexpr, PACKED: tl.constexpr):
    """(b, h, g, m0, q0, k0, Lq, Lk, n_blocks) of tile `tile`: the rows m0 .. of (b, h) and its
    key blocks, rows and keys counted from q0 and k0 (PACKED: Seqlens is the tile map, `tile` its
    row; else 0, tile_coords and tile_keys)."""
    if PACKED:
        h, q0, k0, Lq, Lk, m0 = packed_tile(Seqlens, tile)
        hi = Lk
        if CAUSAL:
            hi = tl.minimum(hi, m0 + BLOCK_M)
        n_blocks = tl.cdiv(tl.where(m0 < Lq, hi, 0), BLOCK_N)
        b = 0
        g = h // G
    else:
        b, h, g, m0 = tile_coords(tile, n_m, HQ, G, BLOCK_M, CAUSAL)
        Lq, Lk, n_blocks = tile_keys(b, m0, Seqlens, N, NK, CAUSAL, VARLEN, BLOCK_M, BLOCK_N)
        q0 = 0
        k0 = 0
    return b, h, g, m0, q0, k0, Lq, Lk, n_blocks

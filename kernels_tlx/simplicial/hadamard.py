"""Pieces of the G = 128 kernels whose producers build a Hadamard product (tlx_ws_keys, tlx_ws_kv
and the variants that run its kernel): the tile of one token's 128 query heads, its consumers'
start, and the producer's build of a key or value block scaled by one K1 or V1 row."""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from kernels_tlx.simplicial.common import NUM_CONSUMERS
from kernels_triton.simplicial.tiling import M_START, key_blocks, load_q, row_coords, tile_setup
from kernels_triton.simplicial.tiling import supports as tiling_supports
from altattn.simplicial.spec import ProblemSpec


def supports(spec: ProblemSpec) -> str | None:
    """The tiling's shapes with G = Hq/Hk = 128: one token's heads fill the 128-row tile."""
    why = tiling_supports(spec)
    if why is not None:
        return why
    if spec.G != 128:
        return f"G = Hq/Hk = {spec.G}, not 128 (one token's heads fill the 128-row tile)"
    return None


@triton.jit
def row_tile(X, kv_row, D: tl.constexpr, CH: tl.constexpr):
    """Producer: the row X[j] as a [CH, D] tile (every row the same address, so it arrives in the
    layout of a K2/V2 chunk); kv_row is j's offset in X."""
    offs_d = tl.arange(0, D)
    return tl.load(X + kv_row + (0 * tl.arange(0, CH))[:, None] + offs_d[None, :])


@triton.jit
def mul_bf16x2(x, y):
    """x * y for bf16 tensors, two elements per instruction (the compiler's own bf16 multiply is
    one scalar mul.bf16 per element, plus the moves that unpack and repack the pairs)."""
    return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [x, y],
                                     dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def fma_bf16x2(x, y, z):
    """x * y + z for bf16 tensors, rounded once, two elements per instruction."""
    return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [x, y, z],
                                     dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def build_chunks(row, src_tile, dst_tile, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 CH: tl.constexpr, DET: tl.constexpr, row_b, src_b, MASK: tl.constexpr, n_rows,
                 ROW0: tl.constexpr = 0):
    """`build`'s loop; MASK: rows n_rows .. BLOCK_N - 1 of dst are zeros, whatever src holds."""
    for ch in tl.static_range(BLOCK_N // CH):
        if DET and MASK:  # bf16(row_b * src_b) through dst first: fewer registers at once
            dst = tlx.local_slice(dst_tile, [ROW0 + ch * CH, 0], [CH, D])
            xb = tlx.local_load(tlx.local_slice(src_b, [ROW0 + ch * CH, 0], [CH, D]))
            tlx.local_store(dst, mul_bf16x2(xb, row_b))
            x = tlx.local_load(tlx.local_slice(src_tile, [ROW0 + ch * CH, 0], [CH, D]))
            y = fma_bf16x2(x, row, tlx.local_load(dst))
        elif DET:
            x = tlx.local_load(tlx.local_slice(src_tile, [ROW0 + ch * CH, 0], [CH, D]))
            xb = tlx.local_load(tlx.local_slice(src_b, [ROW0 + ch * CH, 0], [CH, D]))
            y = fma_bf16x2(x, row, mul_bf16x2(xb, row_b))
        else:
            x = tlx.local_load(tlx.local_slice(src_tile, [ROW0 + ch * CH, 0], [CH, D]))
            y = mul_bf16x2(x, row)
        if MASK:
            y = tl.where((ch * CH + tl.arange(0, CH) < n_rows)[:, None], y, tl.zeros_like(y))
        tlx.local_store(tlx.local_slice(dst_tile, [ROW0 + ch * CH, 0], [CH, D]), y)


@triton.jit
def build(row, src_tile, dst_tile, D: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr,
          DET: tl.constexpr = 0, row_b=None, src_b=None, MASK_ROWS: tl.constexpr = False,
          n_rows=0, ROW0: tl.constexpr = 0):
    """Producer: dst = row * src (a [BLOCK_N, D] block scaled by one row), CH rows at a time, then
    the proxy fence that makes it visible to the consumers' wgmma. DET (form "det", K1[j]'s and
    K2's rotations, kernels_triton/simplicial/det.py: det_keys_side): dst = bf16(row * src + bf16(row_b *
    src_b)), one more block scaled by one more row. MASK_ROWS (packed sequences): rows n_rows
    on are zeros, so that a key block that runs into the next sequence carries none of its
    values (not even inf or NaN, which a zero softmax weight would not cancel) into a wgmma.
    ROW0: the block is rows ROW0 .. ROW0 + BLOCK_N - 1 of src and dst (tlx_pairs' remainder
    slots)."""
    if MASK_ROWS:
        if n_rows < BLOCK_N:
            build_chunks(row, src_tile, dst_tile, D, BLOCK_N, CH, DET, row_b, src_b, True,
                         n_rows, ROW0)
        else:
            build_chunks(row, src_tile, dst_tile, D, BLOCK_N, CH, DET, row_b, src_b, False, 0,
                         ROW0)
    else:
        build_chunks(row, src_tile, dst_tile, D, BLOCK_N, CH, DET, row_b, src_b, False, 0, ROW0)
    tlx.fence_async_shared()


@triton.jit
def token_tile(N, w1, w2, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Seq=None, n_split=1,
               VARLEN: tl.constexpr = False, CACHE: tl.constexpr = False, T_new=1, shift=0,
               R1=1, R2=1):
    """This program's tile, one token's G = BLOCK_M heads: batch b, KV head g, token i0, first
    head h0, its key blocks (k_lo, n_lo, n_hi, n_blocks; see tiling.key_blocks), its w1 window
    (first j, count), kv_base, the offset of (b, g) in K1/V1, and the query token's split and
    key position (i0 and 0 in a dense batch).

    VARLEN (packed sequences, altattn/simplicial/varlen.py): b = 0, the grid is
    N query tokens x n_split x HK; Seq [N, 2] int32 holds each query token's key position (its
    row in the packed keys) and its sequence's first key row. Split s of n_split takes the
    s-th share of the token's j window (flash-decoding: a few tokens still fill the GPU); a
    share with no j has no key blocks.

    CACHE (decoding, with VARLEN): the keys are caches, `cache_tile`; k_lo, n_lo, n_hi are then
    its a0, len1, len2 (`cache_block`), j_first a slot and b the token's sequence (0 for Q, Out
    and Lse)."""
    tl.static_assert(G == BLOCK_M, "one token's heads fill the tile")
    if CACHE:
        b, g, i0, k_lo, n_lo, n_hi, n_blocks, j_first, n_j, kv_base, split, kpos = cache_tile(
            tl.program_id(0), N, w1, w2, HK, D, BLOCK_N, Seq, n_split, T_new, shift, R1, R2)
        h0 = 0
    elif VARLEN:
        pid = tl.program_id(0)
        i0 = pid % N
        split = (pid // N) % n_split
        g = pid // N // n_split
        b = pid * 0
        h0 = 0
        kpos = tl.load(Seq + 2 * i0)
        k_min = tl.load(Seq + 2 * i0 + 1)
        k_lo, n_lo, n_hi, n_blocks = key_blocks(kpos, kpos, w2, 1, BLOCK_N, k_min)
        j_first, n_j = j_share(kpos, tl.maximum(kpos - w1 + 1, k_min), split, n_split)
        n_blocks = tl.where(n_j > 0, n_blocks, 0)
        kv_base = (g * D).to(tl.int64)
    else:
        b, g, i0, h0, _, k_lo, n_lo, n_hi, n_blocks = tile_setup(N, w2, HK, G, BLOCK_M, BLOCK_N)
        j_first = tl.maximum(i0 - w1 + 1, 0)
        n_j = i0 - j_first + 1
        kv_base = b.to(tl.int64) * N * (HK * D) + g * D
        split = 0
        kpos = i0
    return b, g, i0, h0, k_lo, n_lo, n_hi, n_blocks, j_first, n_j, kv_base, split, kpos


@triton.jit
def j_share(p, j_lo, split, n_split):
    """Share `split` of n_split of the j window j_lo .. p (flash-decoding): its first j and its
    count (0 for a share past the window's end)."""
    share = tl.cdiv(p - j_lo + 1, n_split)
    j_first = j_lo + split * share
    return j_first, tl.maximum(tl.minimum(share, p + 1 - j_first), 0)


@triton.jit
def cache_tile(pid, N, w1, w2, HK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, Lens,
               n_split, T_new, shift, R1, R2):
    """`token_tile` of a decoding launch (altattn/simplicial/kvcache.py): the grid is N = B * T_new
    query tokens x n_split x HK, token i0 = b * T_new + t at position p = Lens[b] + shift + t of
    sequence b, whose keys live in caches [B, R, HK, D], position x in slot x mod R (R1 slots for
    K1/V1, R2 for K2/V2). Its k window (p - w2, p] (from 0) is a cyclic run of n_k slots of K2/V2
    from slot s0 = first mod R2, walked in at most two runs (`cache_block`): a0 = 0 when the run
    is the whole ring (every slot in the window: aligned blocks, none masked when R2 is a multiple
    of BLOCK_N), else a0 = s0; the first run the len1 slots from a0 up to the ring's end, the
    second the len2 = n_k - len1 from slot 0. The j window splits as token_tile's; its first j
    is returned as its slot (j mod R1, the K1/V1 row the producers read; n_j <= R1). A cache
    shorter than its window (which the host refuses where it can read cache_seqlens) is read as
    a full ring. pid: the program id (opaque where the bounds are found again)."""
    i0 = pid % N
    split = (pid // N) % n_split
    g = pid // N // n_split
    b = i0 // T_new
    p = tl.load(Lens + b) + shift + i0 % T_new
    k_first = tl.maximum(p - w2 + 1, 0)
    n_k = tl.maximum(tl.minimum(p - k_first + 1, R2), 0)
    a0 = tl.where(n_k == R2, 0, k_first % R2)
    len1 = tl.minimum(n_k, R2 - a0)
    len2 = n_k - len1
    j_first, n_j = j_share(p, tl.maximum(p - w1 + 1, tl.maximum(p + 1 - R1, 0)), split, n_split)
    n_blocks = tl.where(n_j > 0, tl.cdiv(len1, BLOCK_N) + tl.cdiv(len2, BLOCK_N), 0)
    kv_base = (b.to(tl.int64) * R1 * HK + g) * D
    return b, g, i0, a0, len1, len2, n_blocks, j_first % R1, n_j, kv_base, split, p


@triton.jit
def cache_block(t, a0, len1, len2, BLOCK_N: tl.constexpr):
    """A decoding tile's t-th key block (`cache_tile`): its first slot, and how many of its rows
    (from the first) are in the window; the others are masked in the scores and built as zeros
    in C_j (stale or never-written slots; past the ring's end, TMA's zeros). Order: the whole
    blocks of run 1, those of run 2, then run 1's partial block and run 2's (the masked ones
    last: the consumers run them apart, ws_kv.consume_masked)."""
    f1 = len1 // BLOCK_N
    f2 = len2 // BLOCK_N
    in1 = (t < f1) | ((t == f1 + f2) & (len1 > f1 * BLOCK_N))
    k = tl.where(t < f1, t, tl.where(t < f1 + f2, t - f1, tl.where(in1, f1, f2)))
    kb = tl.where(in1, a0, 0) + k * BLOCK_N
    return kb, tl.minimum(tl.where(in1, len1, len2) - k * BLOCK_N, BLOCK_N)


@triton.jit
def start_consumer(Q, q_smem, cid, b, g, i0, h0, N, HQ: tl.constexpr, G: tl.constexpr,
                   D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Consumer cid (rows 64 cid .. 64 cid + 63): its rows' tokens and heads, their Q stored in
    `q_smem` (fenced for the wgmma), and an empty online-softmax state (m, l, acc)."""
    HALF: tl.constexpr = BLOCK_M // NUM_CONSUMERS
    tok, head = row_coords(i0, h0, cid * HALF + tl.arange(0, HALF), G, BLOCK_M)
    tlx.local_store(q_smem, load_q(Q, b, g, tok, head, N, HQ, G, D))
    tlx.fence_async_shared()
    m_i = tl.full([HALF], M_START, tl.float32)
    return tok, head, m_i, tl.zeros([HALF], tl.float32), tl.zeros([HALF, D], tl.float32)

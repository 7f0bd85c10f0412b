"""The device pieces of the `tlx_pairs` backward (kernels_tlx/simplicial/bwd_pairs.py, whose
docstring states the algorithm): a program's coordinates (`pair_program`, `active_tiles`,
`first_token`; a remainder program's, `remainder_keys`, `remainder_program`, `remainder_rows`,
`remainder_tiles`), the producer's build and row loads (`build_keys_values`, `load_rows`), a
consumer's tile (`pair_step`): its probabilities and row values, the dQ share and its reduce-add
(`dq_issue`, `dq_share`, `add_dq`), and the end's dK/dV sums (`scale_add_rows`). The kernel and
its host side are in bwd_pairs.py; a remainder program's own steps in pairs_remainder.py."""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from triton.language.extra.cuda import libdevice

from kernels_tlx.simplicial.common import EPILOGUE_BARRIER, NUM_CONSUMERS
from kernels_tlx.simplicial.hadamard import build, row_tile
from kernels_tlx.simplicial.pairs_order import acquire_at, box_flag, release, visit
from kernels_triton.simplicial.bwd_common import kv_rows
from kernels_triton.simplicial.tiling import enter, leave
from kernels_tlx.ring import empty_phase, full_phase

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
def epilogue_rows(G, D):
    """Rows per chunk of the end's dB/dC pass: 16, or 8 at G < 64 (16 spills 8 bytes there),
    64 at D = 64 (16 spilled 80-624 bytes, 32 still 16-32 in form det)."""
    if D == 64:
        return 64
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
                 Seq=None, VARLEN: tl.constexpr = False, ORDERED: tl.constexpr = False):
    """This program's batch b, KV head g, j, first key kb, kv_base (token 0 of (b, g) in a
    [B, N, HK, D] tensor), its tile count (over the tokens j .. min(j + w1, N) - 1: token_tiles
    tiles per token, or tile_tokens tokens per tile) and whether it has keys at all. pid is
    tl.program_id(0), or an opaque copy of it (what is derived from it is then not held in
    registers across a loop before). Grid: key blocks fastest, then j, then B * HK; j's keys
    are max(j - w2 + 1, 0) .. min(j + w1 - 1, N - 1), in blocks of 128 from the first,
    n_kb per j (`key_blocks`, less the last where remainder programs take it; a kernel
    argument, which ptxas reloads where it is needed instead of holding it). Last: the end of j's
    sequence (N; VARLEN, packed sequences: Seq [N, 2] int32 holds each token's sequence start
    and end, which bound its keys and tokens as 0 and N bound a batch element's). ORDERED
    (pairs_order.py): j fastest, then key blocks, then B * HK."""
    if ORDERED:
        j = pid % N
        m = (pid // N) % n_kb
    else:
        m = pid % n_kb
        j = (pid // n_kb) % N
    bg = pid // n_kb // N
    b = bg // HK
    g = bg % HK
    k_lo, t_end = first_key(j, N, w2, Seq, VARLEN)
    k_hi = tl.minimum(j + w1, t_end) - 1
    kb = k_lo + m * (2 * 64)
    n_tiles = tl.cdiv(tl.minimum(j + w1, t_end) - j, tile_tokens(G)) * token_tiles(G)
    return b, g, j, kb, b.to(tl.int64) * N * (HK * D) + g * D, n_tiles, kb <= k_hi, t_end


@triton.jit
def first_key(j, N, w2, Seq=None, VARLEN: tl.constexpr = False):
    """j's first key, max(j - w2 + 1, the start of j's sequence), and the end of j's sequence
    (N; VARLEN: Seq [N, 2] holds each token's sequence start and end)."""
    if VARLEN:
        t_end = tl.load(Seq + 2 * j + 1)
        k_lo = tl.maximum(j - w2 + 1, tl.load(Seq + 2 * j))
    else:
        t_end = N
        k_lo = tl.maximum(j + 1, w2) - w2
    return k_lo, t_end


@triton.jit
def program_of(pid, N, w1, w2, n_kb, HK: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
               PACK: tl.constexpr, Seq=None, VARLEN: tl.constexpr = False,
               ORDERED: tl.constexpr = False):
    """`pair_program`'s coordinates, or (PACK) a remainder program's, kb 0 there (unused) and
    live j0 < N, always true (not n_tiles > 0: the tile loop under it then spills)."""
    if PACK:
        b, g, j, kv_base, n_tiles, t_end = remainder_program(pid, N, w1, w2, n_kb, HK, D, G,
                                                             PACK, Seq, VARLEN)
        kb = 0 * j
        live = j < N
    else:
        b, g, j, kb, kv_base, n_tiles, live, t_end = pair_program(pid, N, w1, w2, n_kb, HK, D,
                                                                  G, Seq, VARLEN, ORDERED)
    return b, g, j, kb, kv_base, n_tiles, live, t_end


@triton.jit
def remainder_keys(j, N, w1, w2, n_kb, Seq=None, VARLEN: tl.constexpr = False):
    """j's last key block, the keys after its n_kb full blocks of 128 (`pair_program`'s, one of
    a remainder program's slots; j a scalar or a vector): j clamped below N, the block's first
    key, its key count (<= 0: none; 0 for j >= N) and the end of j's tokens, min(j + w1, the
    end of j's sequence)."""
    jc = tl.minimum(j, N - 1)
    k_lo, t_end = first_key(jc, N, w2, Seq, VARLEN)
    k_first = k_lo + n_kb * (NUM_CONSUMERS * 64)
    i_end = tl.minimum(jc + w1, t_end)
    return jc, k_first, tl.where(j < N, i_end - k_first, 0), i_end


@triton.constexpr_function
def slot_rows(PACK):
    """Rows (pairs) per slot of a remainder program that packs PACK j's last key blocks."""
    return BLOCK_N // PACK


@triton.jit
def remainder_program(pid, N, w1, w2, n_kb, HK: tl.constexpr, D: tl.constexpr,
                      G: tl.constexpr, PACK: tl.constexpr, Seq=None, VARLEN: tl.constexpr = False):
    """A remainder program (grid: groups of PACK consecutive j fastest, then B * HK): the last
    key blocks of j0 .. j0 + PACK - 1, BLOCK_N / PACK rows (pairs) each, over the tokens j0 ..
    tok_end - 1 that see any of them. Its batch b, KV head g, j0, kv_base (`pair_program`'s),
    tile count and tok_end (the last j's token end: they do not decrease with j)."""
    n_groups = tl.cdiv(N, PACK)
    j0 = (pid % n_groups) * PACK
    b = pid // n_groups // HK
    g = pid // n_groups % HK
    _, _, _, tok_end = remainder_keys(tl.minimum(j0 + PACK - 1, N - 1), N, w1, w2, n_kb, Seq,
                                      VARLEN)
    n_tiles = tl.cdiv(tok_end - j0, tile_tokens(G)) * token_tiles(G)
    return b, g, j0, b.to(tl.int64) * N * (HK * D) + g * D, n_tiles, tok_end


@triton.jit
def remainder_rows(j0, cid, N, w1, w2, n_kb, PACK: tl.constexpr, Seq=None,
                   VARLEN: tl.constexpr = False):
    """Consumer cid's 64 rows of a remainder program: for each row's pair (j, k), the tokens
    [lo, hi) that see it (j <= i < j + w1, k <= i < k + w2, inside j's sequence; empty where
    the row holds no pair), packed as `probabilities` takes them: (lo - j0) | (hi - j0) << 16
    (`remainder_pack` keeps w1 + PACK below 2**15)."""
    r = tl.arange(0, 64)
    j = j0 + cid * (64 // slot_rows(PACK)) + r // slot_rows(PACK)
    _, k_first, count, i_end = remainder_keys(j, N, w1, w2, n_kb, Seq, VARLEN)
    k = k_first + r % slot_rows(PACK)
    lo = tl.maximum(k, j)
    hi = tl.where(r % slot_rows(PACK) < count, tl.minimum(k + w2, i_end), lo)
    return (lo - j0) | ((hi - j0) << 16)


@triton.jit
def active_tiles(j, k0, n_tiles, w2, G: tl.constexpr):
    """The tiles u_lo .. u_hi - 1 (`first_token`) one of whose tokens sees one of keys
    k0 .. k0 + 63: tokens from k0 to k0 + 62 + w2."""
    T: tl.constexpr = tile_tokens(G)
    u_lo = tl.minimum(tl.cdiv(tl.maximum(k0 - T + 1 - j, 0), T) * token_tiles(G), n_tiles)
    u_hi = tl.minimum(tl.cdiv(tl.maximum(k0 + 63 + w2 - j, 0), T) * token_tiles(G), n_tiles)
    return u_lo, u_hi


@triton.jit
def remainder_tiles(j0, cid, n_tiles, w1, t_end, G: tl.constexpr, PACK: tl.constexpr):
    """`active_tiles` of a remainder program's consumer: the tiles with a token from its first
    slot's j to its last slot's j + w1 - 1 (below t_end; the rows' masks do the rest)."""
    T: tl.constexpr = tile_tokens(G)
    first = cid * (64 // slot_rows(PACK))  # j - j0 of its first slot
    last = tl.minimum(j0 + first + 64 // slot_rows(PACK) - 1 + w1, t_end) - j0
    return first // T * token_tiles(G), tl.minimum(tl.cdiv(last, T) * token_tiles(G), n_tiles)


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
def probabilities(st, lse2, qk_scale, keys, i0, i_end, j, w2, G: tl.constexpr,
                  PACKED: tl.constexpr = False):
    """P^T = exp2(S^T c log2e - LSE log2e) [64 keys, ROWS] where the row's token sees the key's
    row, else 0: keys is each row's key (kpos; the token sees it if kpos is in its w2 window),
    or, PACKED (a remainder program's rows, `remainder_rows`), each row's token bounds packed
    relative to j. The row's token is one of the tile's from i0 below i_end (at G >= 64 one
    token, i0 < i_end)."""
    if tile_tokens(G) == 1:
        if PACKED:
            ok = (in_bounds(keys, (i0 - j) + 0 * keys) != 0)[:, None]
        else:
            ok = ((keys <= i0) & (keys > i0 - w2))[:, None]
        return tl.where(ok, tl.math.exp2(st * qk_scale - lse2), 0.0)
    else:
        tok = i0 + tl.arange(0, ROWS) // G
        if PACKED:  # each of the tile's tokens against the rows' bounds, then spread
            ok = tl.zeros([64, ROWS], tl.int1)
            for t in tl.static_range(tile_tokens(G)):
                seen = in_bounds(keys, (i0 + t - j) + 0 * keys) != 0
                ok = ok | (seen[:, None] & (tl.arange(0, ROWS) // G == t)[None, :])
            ok = ok & (tok < i_end)[None, :]
        else:
            ok = ((keys[:, None] <= tok[None, :]) & (keys[:, None] > tok[None, :] - w2)
                  & (tok < i_end)[None, :])
        return tl.where(ok, tl.math.exp2(st * qk_scale - lse2), 0.0)


@triton.jit
def in_bounds(bounds, t):
    """lo <= t < hi for bounds = lo | hi << 16 (0 <= lo <= hi < 2**16; int32 tensors of one
    shape), as 0 or -1, in one inline asm: the compiler cannot hoist the unpacked lo and hi out
    of the tile loop and hold them (4 registers a consumer thread more: spills)."""
    return tl.inline_asm_elementwise(
        "{ .reg .u32 lo, n, d; and.b32 lo, $1, 65535; shr.u32 n, $1, 16; sub.u32 n, n, lo; "
        "sub.u32 d, $2, lo; set.lt.u32.u32 $0, d, n; }",
        "=r,r,r", [bounds, t], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def dq_issue(ds_tiles, b_tiles, ds_fulls, u, cid: tl.constexpr, DH: tl.constexpr):
    """`dq_share`'s GEMMs issued, not waited for (the caller's wait takes them with the wgmma
    before them)."""
    d = u % 2
    tlx.barrier_wait(tlx.local_view(ds_fulls, d), full_phase(u, 2))
    if cid == 0:
        dq = dq_columns_issued(ds_tiles, b_tiles, d, 0, DH)
    else:
        dq = dq_columns_issued(ds_tiles, b_tiles, d, DH, DH)
    return dq


@triton.jit
def dq_columns_issued(ds_tiles, b_tiles, d, COL: tl.constexpr, DH: tl.constexpr):
    """Columns COL .. COL + DH - 1 of a tile's dQ share, dS B over both consumers' keys: the
    dS^T of ds ring slot d (one [64 keys, ROWS] tile per consumer) against the same columns of
    each consumer's B tile; the GEMMs issued, not waited for."""
    dq = tl.zeros([ROWS, DH], tl.float32)
    for c in tl.static_range(NUM_CONSUMERS):
        dq = tlx.async_dot(tlx.local_trans(tlx.local_view(ds_tiles, d * NUM_CONSUMERS + c)),
                           tlx.local_slice(tlx.local_view(b_tiles, c), [0, COL], [64, DH]), dq)
    return dq


@triton.jit
def dq_share(ds_tiles, b_tiles, ds_fulls, u, cid: tl.constexpr, DH: tl.constexpr):
    """Consumer cid's columns of tile u's dQ share, once both consumers' dS^T of u are in ring
    slot u % 2."""
    return tlx.async_dot_wait(0, dq_issue(ds_tiles, b_tiles, ds_fulls, u, cid, DH))


@triton.jit
def add_dq(dq, dq_stage, DQacc, b, g, j, u, N, i_end, cid, HQ: tl.constexpr, G: tl.constexpr,
           DH: tl.constexpr, n_tiles=0, Flags=None, Base=None, Off=None, n_kb=0,
           PACK: tl.constexpr = 0, ORDERED: tl.constexpr = False, LAST: tl.constexpr = False):
    """Reduce-add consumer cid's columns of the dQ share of the u-th tile taken (`visit`) into the
    fp32 dQ through its staging tile, once the previous add has read it: one TMA box per token of
    the tile below i_end. ORDERED (pairs_order.py; G >= 64): after the programs before it at the
    box (`acquire_at`), then the box of the tile taken before counted up, its add landed (LAST:
    this one's too)."""
    R: tl.constexpr = box_rows(G)
    i0, h0 = first_token(j, visit(u, n_tiles, ORDERED), G)
    stage = tlx.local_view(dq_stage, cid)
    tlx.async_descriptor_store_wait(0)
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
    tlx.local_store(stage, dq)
    tlx.fence_async_shared()
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
    if ORDERED:
        row = (b * N + i0) * HQ + g * G + h0
        acquire_at(Flags, row, cid, Base, Off, j, i0, N, n_kb, PACK)
        tlx.async_descriptor_store(DQacc, stage, [row, cid * DH], store_reduce="add")
        if u >= 1:
            i1, h1 = first_token(j, visit(u - 1, n_tiles, ORDERED), G)
            release(box_flag(Flags, (b * N + i1) * HQ + g * G + h1, cid), 1)
        if LAST:
            release(box_flag(Flags, row, cid), 0)
    elif tile_tokens(G) == 1:
        tlx.async_descriptor_store(DQacc, stage, [(b * N + i0) * HQ + g * G + h0, cid * DH],
                                   store_reduce="add")
    else:
        for t in tl.static_range(tile_tokens(G)):
            if i0 + t < i_end:
                tlx.async_descriptor_store(DQacc, tlx.local_slice(stage, [t * R, 0], [R, DH]),
                                           [(b * N + i0 + t) * HQ + g * G, cid * DH],
                                           store_reduce="add")


@triton.jit
def scale_add_rows(stage, row, X, kv_base, k0, N, DST, DSUM, j_off, HK: tl.constexpr,
                   D: tl.constexpr, CHUNK: tl.constexpr, ROW0: tl.constexpr = 0,
                   N_ROWS: tl.constexpr = 64, EACH: tl.constexpr = False, Scale=None):
    """One consumer's end, from its staged dB or dC (acc: `stage`, [64, D] fp32, rows ROW0 ..
    ROW0 + N_ROWS - 1, keys k0 .. (< N)): DST[k] += row * acc[k] and DSUM[j] += sum_k X[k] *
    acc[k] (fp32 atomics), CHUNK rows at a time, the staged rows meeting X's in a coalesced
    layout.
    The sum over the keys crosses the warps (a barrier): taken once, after the last chunk
    (+2.7-2.9% at S* in the whole backward against once a chunk, docs/perf-bwd-end.md), or EACH
    chunk (the end of bwd_pairs' ONE_STAGE, where the other spills). Scale (a pointer to a power
    of two s, pairs_order.py's `end_scale`; not with EACH): int64 atomics of llrint(s * value)
    instead, which commute."""
    tl.static_assert(Scale is None or not EACH, "fixed-point sums: not with EACH")
    if EACH:
        col = tl.zeros([D], tl.float32)
        for c in tl.static_range(N_ROWS // CHUNK):
            x = tlx.local_load(tlx.local_slice(stage, [ROW0 + c * CHUNK, 0], [CHUNK, D]))
            kpos = k0 + c * CHUNK + tl.arange(0, CHUNK)
            offs = kv_rows(kv_base, kpos, HK, D)
            ok = (kpos < N)[:, None]
            xk = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
            col += tl.sum(xk * x, 0)
            tl.atomic_add(DST + offs, x * row[None, :], mask=ok, sem="relaxed")
        tl.atomic_add(DSUM + j_off + tl.arange(0, D), col, sem="relaxed")
    else:
        col = tl.zeros([CHUNK, D], tl.float32)
        for c in tl.static_range(N_ROWS // CHUNK):
            kpos = k0 + c * CHUNK + tl.arange(0, CHUNK)
            x = tlx.local_load(tlx.local_slice(stage, [ROW0 + c * CHUNK, 0], [CHUNK, D]))
            xk = tl.load(X + kv_rows(kv_base, kpos, HK, D), mask=(kpos < N)[:, None], other=0.0)
            col += xk.to(tl.float32) * x
            if Scale is None:
                tl.atomic_add(DST + kv_rows(kv_base, kpos, HK, D), x * row[None, :],
                              mask=(kpos < N)[:, None], sem="relaxed")
            else:
                tl.atomic_add(DST + kv_rows(kv_base, kpos, HK, D),
                              libdevice.llrint(x * (row * tl.load(Scale))[None, :]),
                              mask=(kpos < N)[:, None], sem="relaxed")
        if Scale is None:
            tl.atomic_add(DSUM + j_off + tl.arange(0, D), tl.sum(col, 0), sem="relaxed")
        else:
            tl.atomic_add(DSUM + j_off + tl.arange(0, D),
                          libdevice.llrint(tl.sum(col, 0) * tl.load(Scale)), sem="relaxed")


@triton.jit
def build_keys_values(K1, V1, k2_tiles, v2_tiles, k2b_tiles, b_tiles, c_tiles, kv_row, n_rows,
                      D: tl.constexpr, CH: tl.constexpr, DET: tl.constexpr,
                      VARLEN: tl.constexpr):
    """Producer: each consumer's B = K1[j] * K2 and C = V1[j] * V2 from the K2 and V2 halves in
    k2_tiles and v2_tiles (form "det": B = K1a[j] * K2a + K1b[j] * K2b, K2b's halves in
    k2b_tiles, K1 packed); kv_row is j's row offset in V1 (K1's times 2 when packed); rows
    from n_rows on (of the 128) build as zeros (VARLEN)."""
    if DET:  # B for both consumers, then C: two K1 rows held, not three (they spilled)
        k1 = row_tile(K1, 2 * kv_row, D, CH)
        k1b = row_tile(K1, 2 * kv_row + D, D, CH)
        for c in tl.static_range(NUM_CONSUMERS):
            build(k1, tlx.local_view(k2_tiles, c), tlx.local_view(b_tiles, c), D, 64, CH, DET,
                  k1b, tlx.local_view(k2b_tiles, c), MASK_ROWS=VARLEN, n_rows=n_rows - c * 64)
        v1 = row_tile(V1, kv_row, D, CH)
        for c in tl.static_range(NUM_CONSUMERS):
            build(v1, tlx.local_view(v2_tiles, c), tlx.local_view(c_tiles, c), D, 64, CH,
                  MASK_ROWS=VARLEN, n_rows=n_rows - c * 64)
    else:
        k1 = row_tile(K1, kv_row, D, CH)
        v1 = row_tile(V1, kv_row, D, CH)
        for c in tl.static_range(NUM_CONSUMERS):
            build(k1, tlx.local_view(k2_tiles, c), tlx.local_view(b_tiles, c), D, 64, CH,
                  MASK_ROWS=VARLEN, n_rows=n_rows - c * 64)
            build(v1, tlx.local_view(v2_tiles, c), tlx.local_view(c_tiles, c), D, 64, CH,
                  MASK_ROWS=VARLEN, n_rows=n_rows - c * 64)


@triton.jit
def pair_step(u, dk, dv, active, HAS_PREV: tl.constexpr, b_tile, c_tile, q_tiles, do_tiles,
              ds_tiles, b_tiles, lse_tiles, delta_tiles, q_fulls, q_empties, ds_fulls,
              ds_empties, dq_stage, DQacc, b, g, j, i_end, keys, qk_scale, w2, N, cid: tl.constexpr,
              NUM_Q: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, DH: tl.constexpr,
              PROFILE: tl.constexpr, PACKED: tl.constexpr = False, n_tiles=0, Flags=None,
              Base=None, Off=None, n_kb=0, PACK: tl.constexpr = 0, ORDERED: tl.constexpr = False):
    """One consumer's tile u: its GEMMs where `active` (its keys seen by a token of the tile),
    its dS^T into ring slot u % 2, then (HAS_PREV) tile u - 1's dQ share issued behind dC and dB
    and waited with them, and reduce-added. The u-th tile taken is `visit`'s (ORDERED: from the
    last down; `add_dq`'s order)."""
    s = u % NUM_Q
    d = u % 2
    i0, _ = first_token(j, visit(u, n_tiles, ORDERED), G)
    tlx.barrier_wait(tlx.local_view(q_fulls, s), full_phase(u, NUM_Q))
    q_tile = tlx.local_view(q_tiles, s)
    do_tile = tlx.local_view(do_tiles, s)
    ds_tile = tlx.local_view(ds_tiles, d * NUM_CONSUMERS + cid)
    tlx.barrier_wait(tlx.local_view(ds_empties, d), empty_phase(u, 2))
    if active:
        enter("qk_gemm", PROFILE)
        st = tlx.async_dot(b_tile, tlx.local_trans(q_tile))
        dpt = tlx.async_dot(c_tile, tlx.local_trans(do_tile))
        lse2 = row_values(lse_tiles, s, G)  # [1, ROWS], log2 units
        st = tlx.async_dot_wait(1, st)  # dP^T still in flight under the exp2
        leave("qk_gemm", PROFILE)
        enter("softmax", PROFILE)
        pt = probabilities(st, lse2, qk_scale, keys, i0, i_end, j, w2, G, PACKED)
        delta = row_values(delta_tiles, s, G)
        dpt = tlx.async_dot_wait(0, dpt)
        dst = (pt * (dpt - delta)).to(tl.bfloat16)
        leave("softmax", PROFILE)
        enter("pv_gemm", PROFILE)
        dv = tlx.async_dot(pt.to(tl.bfloat16), do_tile, dv)
        dk = tlx.async_dot(dst, q_tile, dk)
        tlx.local_store(ds_tile, dst)
        if HAS_PREV:
            dq = dq_issue(ds_tiles, b_tiles, ds_fulls, u - 1, cid, DH)
            dq = tlx.async_dot_wait(0, dq)
        dv = tlx.async_dot_wait(0, dv)
        dk = tlx.async_dot_wait(0, dk)
        leave("pv_gemm", PROFILE)
    else:
        tlx.local_store(ds_tile, tl.zeros([64, ROWS], tl.bfloat16))
        if HAS_PREV:
            dq = dq_issue(ds_tiles, b_tiles, ds_fulls, u - 1, cid, DH)
            dq = tlx.async_dot_wait(0, dq)
    # dS^T announced only after this tile's dC and dB are done: past the last tile's ds_full the
    # other consumer writes its end's staging tiles, which are the Q and dO rings' bytes and
    # (consumer 1) the C tiles'
    tlx.fence_async_shared()
    tlx.barrier_arrive(tlx.local_view(ds_fulls, d), 1)
    tlx.barrier_arrive(tlx.local_view(q_empties, s), 1)
    if HAS_PREV:
        enter("epilogue", PROFILE)
        tlx.barrier_arrive(tlx.local_view(ds_empties, 1 - d), 1)
        add_dq(dq, dq_stage, DQacc, b, g, j, u - 1, N, i_end, cid, HQ, G, DH, n_tiles, Flags, Base,
               Off, n_kb, PACK, ORDERED)
        leave("epilogue", PROFILE)
    return dk, dv

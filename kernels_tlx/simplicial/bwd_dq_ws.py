"""The `tlx_ws` backward's row-owner (dQ and the dK1/dV1 partials), warp-specialized in TLX.

It replaces `kernels_triton/simplicial/bwd.py`'s `_dq_kernel` at G = 128 and G = 64 and writes
dK1/dV1 partial slices (one per consumer, chunks of L tokens) that the shared `_dkv1_kernel`
(kernels_triton/simplicial/bwd_common.py, with `Scratch` and the compile-config helpers) sums.
One program per (batch, KV head, chunk of L tokens); the two consumer warp groups own 64 rows
each: at G = 128 a tile is one token's 128 query heads (a head half per consumer), at G = 64 two
tokens t, t + 1 (one per consumer). Both consumers read the same key blocks: at G = 64 the tile's
window covers both tokens' keys (one block more at w2 = 512) and its j range both tokens' j's (one
more), each consumer masking the keys and j's its token does not see.

Warp groups:
- producer ("default", 4 warps): per (tile, j) builds A_j = Q * K1[j] and dO_j = dO * V1[j] for
  both consumers' rows (bf16 products, the roundings of `triton`; Q and dO read from global
  memory, where the tile's rows stay cached) into slot c % NUM_A of a ring (`a_fulls`;
  `a_empties`, one arrival per consumer, frees a slot), then TMA-loads the tile's key blocks (64
  keys of K2 and V2) into a ring of NUM_KV stages (`kv_fulls` / `kv_empties`), the same blocks
  for every j.
- Two consumers, 64 rows each. Per j, X_j and Z_j (64 x D fp32 each) are
  register accumulators over the key blocks:
      S  = A_j K2^T          dP = dO_j V2^T                          (SS-wgmma, 64 rows x 64 keys)
      P  = exp2(S c log2e - LSE log2e) for keys in the token's w2 window, else 0
      dS = P (dP - Delta)    (the exp2 runs while dP is still in flight)
      X_j += dS K2           Z_j += P V2                             (RS-wgmma, 64 rows x D)
  then the epilogue (`epilogue`): the consumer's fp32 dQ scratch tile += K1[j] * X_j through a
  TMA reduce-add from its slot (the tile would not fit in registers beside X_j and Z_j), and row
  j of its dK1/dV1 partial slice gets sum_r q * X_j and sum_r dO * Z_j (read-add-write in
  program order). At the tile's last j the tile is read back and stored to dQ, scaled by
  sm_scale, in bf16.
Deterministic: every sum has a fixed order (the reduce-adds into a tile are issued one at a time,
each after the previous one has landed).
Executed tensor-core work: the 4 GEMMs of `_dq_kernel`, with 64-key blocks (wgmma N = 64) instead
of 32, and little edge waste: a token's key blocks start at its first key (only its last block
is partial).
Scratch (`scratch`): at S* the two dK1/dV1 partial buffers 132 MB each and the fp32 dQ tiles
134 MB (a 64 x D tile per consumer and program), `_dq_kernel`'s sizes; at G = 64 twice
`_dq_kernel`'s (a slice and a tile per consumer, where it has one 64-row tile per token).
Supports D in {64, 128} at G in {64, 128} (`supports`).
"""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from kernels_tlx.simplicial.common import (EPILOGUE_BARRIER, NUM_CONSUMERS, bulk_wait,
                                           dot_pair_release)
from kernels_tlx.simplicial.hadamard import mul_bf16x2, row_tile
from kernels_triton.launch import Desc, Kernel, sm_count
from kernels_triton.simplicial.bwd_common import Scratch, fresh_rows, prepare_dkv1, scalars
from kernels_triton.simplicial.host import kv_layout
from kernels_triton.simplicial.tiling import BF16_BYTES, LOG2E_JIT, enter, leave
from kernels_triton.simplicial.tiling import supports as tiling_supports
from altattn.simplicial.spec import ProblemSpec
from kernels_tlx.ring import empty_phase, full_phase

ROWS = tl.constexpr(64)  # rows per consumer: 64 heads of one token
SPLIT = tl.constexpr(2)  # dK1/dV1 partial slices per chunk: one per consumer


@triton.jit
def dq_program(pid, N, n_chunks, L, HK: tl.constexpr, D: tl.constexpr):
    """Program pid's batch b, KV head g, chunk, its tokens [t0, t_end) and kv_base (token 0 of
    (b, g) in a [B, N, HK, D] tensor). Grid: chunks fastest, then B * HK."""
    chunk = pid % n_chunks
    bg = pid // n_chunks
    b = bg // HK
    g = bg % HK
    t0 = chunk * L
    return b, g, bg, chunk, t0, tl.minimum(t0 + L, N), b.to(tl.int64) * N * (HK * D) + g * D


@triton.jit
def _load(ptr, ok, MASKED: tl.constexpr):
    """tl.load(ptr), masked to 0 where not ok when MASKED (G = 64: a token may be past N); at
    G = 128 no mask, so that kernel's code is the one measured."""
    if MASKED:
        return tl.load(ptr, mask=ok, other=0.0)
    return tl.load(ptr)


@triton.jit
def build_rows(row, X, row0, ok, j, dst_tile, dst_row: tl.constexpr, D: tl.constexpr,
               CH: tl.constexpr, MASKED: tl.constexpr):
    """Producer: rows dst_row .. dst_row + ROWS - 1 of dst = row * X[row0 .. row0 + ROWS - 1]
    (rows of a [*, D] tensor in global memory), CH rows at a time. The addresses are made from
    an opaque function of j, the loop variable (held across the loops, they spill)."""
    offs = fresh_rows(j, CH)[:, None] * D + tl.arange(0, D)[None, :]
    for ch in tl.static_range(ROWS // CH):
        x = _load(X + (row0 + ch * CH) * D + offs, ok, MASKED)  # ok: a token < N
        tlx.local_store(tlx.local_slice(dst_tile, [dst_row + ch * CH, 0], [CH, D]),
                        mul_bf16x2(x, row))


@triton.jit
def _row_offsets(r, D: tl.constexpr):
    """Offsets of rows r of a row-major [*, D] tile."""
    return r[:, None] * D + tl.arange(0, D)[None, :]


@triton.jit
def fresh_program_id(v):
    """tl.program_id(0), recomputed where it is used (an opaque function of v, a loop variable):
    what is derived from it is not held in registers across the loop."""
    return fresh_rows(v, 1).sum(0) + tl.program_id(0)


@triton.jit
def window_starts(t, w1, w2):
    """Token t's first key and first j, max(t - w + 1, 0), written as max(t + 1, w) - w: the
    obvious form gives LLVM a loop invariant 1 - w, which ptxas computes once before the warp
    groups split and then spills across their register reallocation."""
    return tl.maximum(t + 1, w2) - w2, tl.maximum(t + 1, w1) - w1


@triton.jit
def epilogue(x, z, ep, a_empty, Q, K1, DO, DQ, DQacc, DQtma, PK1, PV1, N, w1, L, n_chunks, tc,
             ok, j, j_first, j_last, sm_scale, cid, HQ: tl.constexpr, HK: tl.constexpr,
             G: tl.constexpr, D: tl.constexpr, PROFILE: tl.constexpr):
    MASKED: tl.constexpr = G < NUM_CONSUMERS * ROWS  # two tokens per tile: one may be past N
    """One consumer after the key loop of j (its wgmmas done, so its slot is free), X_j and Z_j
    (ROWS x D fp32) in registers:
      dQ scratch tile (rows tile_row ..) += K1[j] * X_j    a TMA store at j = j_first, a TMA
                                                          reduce-add after it, in j order
      PK1[slot] += sum_r q * X_j      PV1[slot] += sum_r dO * Z_j      (read-add-write)
    X_j and Z_j pass through `ep` (the slot as fp32) to meet q and dO rows loaded in a coalesced
    layout; K1[j] * X_j is written over X_j in place, for the TMA. The global loads are issued
    before the shared-memory traffic they wait on. At j = j_last (the tile's last j) the scratch
    tile, once its last reduce-add has landed, is read back and stored to dQ, scaled, in bf16.
    The slot goes back to the producer (`a_empty`) once the TMA has read it."""
    enter("epilogue", PROFILE)
    # coordinates and addresses made here from an opaque program id, not held over the key loop
    # (there ptxas spills them)
    pid = fresh_program_id(j)
    b, g, bg, chunk, _, _, kv_base = dq_program(pid, N, n_chunks, L, HK, D)
    # this consumer's rows of Q, dO, dQ: token tc (< N where ok), heads (cid % HALVES) * ROWS ..
    rows = ((b.to(tl.int64) * N + tc) * HQ + g * G + (cid % (G // ROWS)) * ROWS) * D
    slot = ((bg * SPLIT + cid).to(tl.int64) * n_chunks + chunk) * (L + w1 - 1) * D \
        + (j - chunk * L + w1 - 1) * D  # row j of this consumer's dK1/dV1 partial slice
    tile_row = (pid * SPLIT + cid) * ROWS  # this consumer's dQ scratch tile
    tile = _row_offsets(fresh_rows(j, ROWS), D)
    offs_d = fresh_rows(j, D)
    q = _load(Q + rows + tile, ok, MASKED)
    k1 = tl.load(K1 + kv_base + j.to(tl.int64) * (HK * D) + offs_d).to(tl.float32)
    pk1 = tl.load(PK1 + slot + offs_d)
    pv1 = tl.load(PV1 + slot + offs_d)
    tlx.local_store(ep, x)
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
    xs = tlx.local_load(ep)
    pk1 += tl.sum(q.to(tl.float32) * xs, 0)
    tlx.local_store(ep, xs * k1[None, :])  # each thread over the elements it read
    tlx.fence_async_shared()
    do = _load(DO + rows + tile, ok, MASKED)
    bulk_wait()  # j - 1's reduce-add has landed (in every thread that issued a part of it)
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)  # so the tile's adds are in j order
    if j == j_first:
        tlx.async_descriptor_store(DQtma, ep, [tile_row, 0])
    else:
        tlx.async_descriptor_store(DQtma, ep, [tile_row, 0], store_reduce="add")
    tl.store(PK1 + slot + offs_d, pk1)
    tlx.async_descriptor_store_wait(0)  # the TMA has read ep: Z_j may go there
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
    tlx.local_store(ep, z)
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
    pv1 += tl.sum(do.to(tl.float32) * tlx.local_load(ep), 0)
    tl.store(PV1 + slot + offs_d, pv1)
    tlx.barrier_arrive(a_empty, 1)  # this thread has read ep
    if j == j_last:
        bulk_wait()
        tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)  # the tile's last add has landed
        # read from L2 (.cg): the TMA writes went there, and L1 may hold the last token's tile
        acc = tl.load(DQacc + tile_row.to(tl.int64) * D + tile, cache_modifier=".cg")
        if MASKED:
            tl.store(DQ + rows + tile, (acc * sm_scale).to(tl.bfloat16), mask=ok)
        else:
            tl.store(DQ + rows + tile, (acc * sm_scale).to(tl.bfloat16))
    leave("epilogue", PROFILE)


@triton.jit
def _dq_ws_kernel(Q, K1, K2, V1, V2, DO, Lse, Delta, DQ, DQacc, DQtma, PK1, PV1, N, w1, w2,
                  qk_scale, sm_scale, L, n_chunks, HQ: tl.constexpr, HK: tl.constexpr,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_A: tl.constexpr,
                  NUM_KV: tl.constexpr, CH: tl.constexpr, CONSUMER_REGS: tl.constexpr,
                  PROFILE: tl.constexpr = False):
    HALVES: tl.constexpr = G // ROWS          # consumers per token: 2 at G = 128, 1 at G = 64
    T: tl.constexpr = NUM_CONSUMERS // HALVES  # tokens per tile: 1 at G = 128, 2 at G = 64
    tl.static_assert(HALVES * T == NUM_CONSUMERS, "G = 64 or 128")
    # a slot per consumer: A_j (rows 0 .. 63) over dO_j (rows 64 .. 127); after the consumer's
    # key loop of j the same bytes are `ep_tiles`, an fp32 [ROWS, D] tile in the layout of the
    # dQ scratch's TMA boxes, for the epilogue
    slots = tlx.storage_alias_spec()
    ad_tiles = tlx.local_alloc((2 * ROWS, D), tl.bfloat16, NUM_A * NUM_CONSUMERS, reuse=slots)
    ep_tiles = tlx.local_alloc((ROWS, D), tl.float32, NUM_A * NUM_CONSUMERS, reuse=slots)
    k2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_KV)
    v2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_KV)
    # hand-overs after shared-memory accesses of a whole warp group: every thread arrives after
    # its own accesses (warp barriers), no warp-group barrier before one thread's arrive
    a_fulls = tlx.alloc_warp_barrier(num_barriers=NUM_A, num_warps=4)
    a_empties = tlx.alloc_warp_barrier(num_barriers=NUM_A, num_warps=4 * NUM_CONSUMERS)
    kv_fulls = tlx.alloc_barriers(num_barriers=NUM_KV, arrive_count=1)
    kv_empties = tlx.alloc_warp_barrier(num_barriers=NUM_KV, num_warps=4 * NUM_CONSUMERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: A_j, dO_j per (token, j), then its key blocks
            t = dq_program(tl.program_id(0), N, n_chunks, L, HK, D)[4]
            acnt = 0
            kcnt = 0
            more = True
            # the tokens t0 .. t_end - 1 (t0 < N), with only t and the ring counters carried
            # from token to token (at the producer's 40 registers more would spill): the loop
            # ends at the chunk's end or N, and (b, g) is recomputed per token
            while more:
                b, g, _, _, _, _, kv_base = dq_program(fresh_program_id(t), N, n_chunks, L, HK, D)
                # the tile's T tokens t .. t_last share its key blocks and its j range (a token
                # outside a j or key of the range masks it)
                k_lo, j_first = window_starts(t, w1, w2)
                t_last = t
                if T > 1:
                    t_last = tl.minimum(t + T - 1, N - 1)
                n_blocks = tl.cdiv(t_last - k_lo + 1, BLOCK_N)
                for j in range(j_first, t_last + 1):
                    sa = acnt % NUM_A
                    enter("build_a", PROFILE)
                    kv_row = kv_base + j.to(tl.int64) * (HK * D)
                    k1 = row_tile(K1, kv_row, D, CH)
                    v1 = row_tile(V1, kv_row, D, CH)
                    tlx.barrier_wait(tlx.local_view(a_empties, sa), empty_phase(acnt, NUM_A))
                    for c in tl.static_range(NUM_CONSUMERS):
                        ad = tlx.local_view(ad_tiles, sa * NUM_CONSUMERS + c)
                        tc = t + c // HALVES  # consumer c's token and first head
                        row0 = (b.to(tl.int64) * N + tc) * HQ + g * G + (c % HALVES) * ROWS
                        build_rows(k1, Q, row0, tc < N, j, ad, 0, D, CH, T > 1)
                        build_rows(v1, DO, row0, tc < N, j, ad, ROWS, D, CH, T > 1)
                    tlx.fence_async_shared()
                    tlx.barrier_arrive(tlx.local_view(a_fulls, sa), 1)
                    leave("build_a", PROFILE)
                    acnt += 1
                    for n in range(0, n_blocks):
                        sk = kcnt % NUM_KV
                        enter("load_kv", PROFILE)
                        tlx.barrier_wait(tlx.local_view(kv_empties, sk), empty_phase(kcnt, NUM_KV))
                        full = tlx.local_view(kv_fulls, sk)
                        tlx.barrier_expect_bytes(full, 2 * BLOCK_N * D * BF16_BYTES)
                        kb = k_lo + n * BLOCK_N  # past N: zeros (host.kv_layout)
                        tlx.async_descriptor_load(K2, tlx.local_view(k2_tiles, sk), [b, kb, g * D],
                                                  full)
                        tlx.async_descriptor_load(V2, tlx.local_view(v2_tiles, sk), [b, kb, g * D],
                                                  full)
                        leave("load_kv", PROFILE)
                        kcnt += 1
                t += T
                more = (t % L != 0) & (t < N)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid = tlx.async_task_replica_id()
            t = dq_program(tl.program_id(0), N, n_chunks, L, HK, D)[4]
            acnt = 0
            kcnt = 0
            more = True
            while more:  # tokens t0 .. t_end - 1, as the producer's
                b, g, _, _, _, _, _ = dq_program(fresh_program_id(t), N, n_chunks, L, HK, D)
                k_lo, j_first = window_starts(t, w1, w2)  # the tile's, as the producer's
                t_last = t
                if T > 1:
                    t_last = tl.minimum(t + T - 1, N - 1)
                n_blocks = tl.cdiv(t_last - k_lo + 1, BLOCK_N)
                tc = t + cid // HALVES  # this consumer's token (at G = 64 past N in a last tile
                ok = tc < N             # of one token: then every score is masked)
                head = g * G + (cid % HALVES) * ROWS + fresh_rows(t, ROWS)
                row_off = (b.to(tl.int64) * HQ + head) * N + tc
                lse2 = _load(Lse + row_off, ok, T > 1) * LOG2E_JIT  # LSE in log2 units
                delta = _load(Delta + row_off, ok, T > 1)
                for j in range(j_first, t_last + 1):
                    sees_j = ok & (j <= tc) & (j > tc - w1)  # (at G = 128 always true)
                    sa = acnt % NUM_A
                    tlx.barrier_wait(tlx.local_view(a_fulls, sa), full_phase(acnt, NUM_A))
                    ad = tlx.local_view(ad_tiles, sa * NUM_CONSUMERS + cid)
                    a_tile = tlx.local_slice(ad, [0, 0], [ROWS, D])
                    doj_tile = tlx.local_slice(ad, [ROWS, 0], [ROWS, D])
                    x = tl.zeros([ROWS, D], tl.float32)
                    z = tl.zeros([ROWS, D], tl.float32)
                    for n in range(0, n_blocks):
                        sk = kcnt % NUM_KV
                        enter("qk_gemm", PROFILE)
                        tlx.barrier_wait(tlx.local_view(kv_fulls, sk), full_phase(kcnt, NUM_KV))
                        k2_tile = tlx.local_view(k2_tiles, sk)
                        v2_tile = tlx.local_view(v2_tiles, sk)
                        s = tlx.async_dot(a_tile, tlx.local_trans(k2_tile))
                        dp = tlx.async_dot(doj_tile, tlx.local_trans(v2_tile))
                        s = tlx.async_dot_wait(1, s)  # dP still in flight under the exp2
                        leave("qk_gemm", PROFILE)
                        enter("softmax", PROFILE)
                        kpos = k_lo + n * BLOCK_N + tl.arange(0, BLOCK_N)
                        if T > 1:
                            kok = (kpos <= tc) & (kpos > tc - w2) & sees_j
                        else:  # one token: the blocks start at its first key
                            kok = kpos <= tc
                        p = tl.where(kok[None, :], tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
                        dp = tlx.async_dot_wait(0, dp)
                        ds = p * (dp - delta[:, None])
                        leave("softmax", PROFILE)
                        x, z = dot_pair_release(ds, k2_tile, x, p, v2_tile, z,
                                                tlx.local_view(kv_empties, sk), PROFILE)
                        kcnt += 1
                    epilogue(x, z, tlx.local_view(ep_tiles, sa * NUM_CONSUMERS + cid),
                             tlx.local_view(a_empties, sa), Q, K1, DO, DQ, DQacc, DQtma, PK1, PV1,
                             N, w1, L, n_chunks, tc, ok, j, j_first, t_last, sm_scale, cid, HQ,
                             HK, G, D, PROFILE)
                    acnt += 1
                t += T
                more = (t % L != 0) & (t < N)


def supports(spec: ProblemSpec) -> str | None:
    """G = 128 (a tile is one token, a head half per consumer) or G = 64 (two tokens, one per
    consumer); the rest of `triton`'s shapes."""
    why = tiling_supports(spec)
    if why is None and spec.G not in (64, 128):
        why = f"G = Hq/Hk = {spec.G}, not 64 or 128 (a consumer's 64 rows are heads of one token)"
    return why


def config(spec: ProblemSpec) -> dict:
    """64-key blocks in two stages, two A_j/dO_j slots (both halves: 64 KB each), the producer's
    build in 8-row chunks; the consumers at 232 registers (as the k-owner's)."""
    return dict(BLOCK_N=64, NUM_A=2, NUM_KV=2, CH=8, CONSUMER_REGS=232, num_warps=4,
                num_stages=1)


def chunk_tokens(spec: ProblemSpec, n_sm: int = 132) -> int:
    """L, tokens per program: the w1 window (so each j's dK1/dV1 sum has <= 2 partials per slice,
    `_dkv1_kernel`'s rule), fewer when that leaves under four programs per SM; whole tiles (even
    at G = 64)."""
    per_tile = NUM_CONSUMERS.value * ROWS.value // spec.G  # tokens per tile: 1 or 2
    L = max(1, min(spec.w1, spec.B * spec.Hk * spec.N // (4 * n_sm)))
    return per_tile * triton.cdiv(L, per_tile)  # whole tiles


def scratch(spec: ProblemSpec, n_sm: int = 132) -> Scratch:
    """This row-owner's grid and scratch sizes (elements), in `Scratch`'s terms."""
    L = chunk_tokens(spec, n_sm)
    n_chunks = triton.cdiv(spec.N, L)
    n_programs = spec.B * spec.Hk * n_chunks
    return Scratch(L, n_chunks, n_programs,
                   n_programs * SPLIT.value * (L + spec.w1 - 1) * spec.D,
                   n_programs * SPLIT.value * ROWS.value * spec.D)


def prepare_dq(spec: ProblemSpec, profile: bool = False):
    """`_dq_ws_kernel` then the shared `_dkv1_kernel` (prepare_dkv1), made once (scratch sized
    for the current GPU): run(q, k1, k2, v1, v2, dout, lse, delta, dq, dk1, dv1) writes dq, and
    dk1/dv1 through the partials (kernels_triton.simplicial.bwd.prepare_dq's signature)."""
    cfg = config(spec)
    sc = scratch(spec, sm_count())
    if sc.n_programs * SPLIT.value * ROWS.value >= 2 ** 31:  # the scratch tiles' int32 TMA rows
        raise ValueError(f"{spec}: too many row-owner programs ({sc.n_programs}) for int32 rows")
    keys = kv_layout(spec, cfg["BLOCK_N"])
    # the fp32 dQ scratch as [tiles * ROWS, D], a box per consumer's tile
    tiles = Desc([sc.dq_tiles // spec.D, spec.D], [spec.D, 1], [ROWS.value, spec.D])
    kernel = Kernel(_dq_ws_kernel, (sc.n_programs,), HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=spec.D,
                    PROFILE=profile, **cfg)
    dkv1 = prepare_dkv1(spec, sc.L, sc.n_chunks, SPLIT.value)
    args = (*scalars(spec), sc.L, sc.n_chunks)

    def run(q, k1, k2, v1, v2, dout, lse, delta, dq, dk1, dv1) -> None:
        pk1, pv1, dq_acc = sc.buffers(q.device)
        kernel(q, k1, keys(k2), v1, keys(v2), dout, lse, delta, dq, dq_acc, tiles(dq_acc), pk1,
               pv1, *args)
        dkv1(pk1, pv1, dk1, dv1)

    return run

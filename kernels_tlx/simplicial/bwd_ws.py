"""`tlx_ws` backward: the `triton` backward with its k-owner (dK2, dV2) warp-specialized in TLX,
and its row-owner too (kernels_tlx/simplicial/bwd_dq_ws.py).

The split is `kernels_triton/simplicial/bwd.py`'s (Delta, k-owner, row-owner, reduce; 8 GEMMs, no
atomics, bitwise deterministic); this file replaces its `_dkv2_kernel`, half of its time at S*. One
program per (batch, KV head, block of 128 keys); a tile is 64 rows, 64 heads of one token (G >= 64;
G = 128 has two tiles per token), and every tile whose token's w2 window reaches the block is
visited with every j of the token's w1 window.

Warp groups:
- producer ("default", 4 warps): TMA-loads the block's K2 and V2 once (a 64-key half per
  consumer, `kv_full`); per tile, TMA-loads its Q and dO rows one tile ahead into a ring of two
  slots (`q_fulls`; it is their only reader), and per j builds A_j = Q * K1[j] and
  dO_j = dO * V1[j] (bf16 products, the roundings of `triton`) into ring slot c % NUM_A, fences
  and arrives on `a_fulls`; `a_empties` (one arrival per consumer) frees a slot.
- Two consumer warp groups (4 warps each); consumer c owns keys 64c .. 64c + 63 of the block and
  their fp32 dK2, dV2 accumulators (64 x D each). Per (tile, j):
      S^T  = K2_c A_j^T            dP^T = V2_c dO_j^T          (SS-wgmma, 64 keys x 64 rows)
      P^T  = exp2(S^T c log2e - LSE log2e) where the key is in the token's w2 window, else 0
      dS^T = P^T (dP^T - Delta)    (the exp2 runs while dP^T is still in flight)
      dV2 += P^T dO_j              dK2 += dS^T A_j             (RS-wgmma)
  The tiles whose token sees none of a consumer's keys (the first 64 tokens for consumer 1, the
  last 64 for consumer 0) it only releases: the other consumer has the tensor cores to itself
  there, which takes the block's edge waste from 20% (128 keys per token at the window's ends)
  to about 10% at S*.
dK2 is scaled by sm_scale once, at the store.
Supports the shapes of `triton` with G = Hq/Hk in {64, 128} (`supports`); `auto` takes `triton`
elsewhere.
Differs from `triton`: A_j and dO_j are built once per (tile, j) by a producer warp group into
shared memory for both consumers (the `triton` kernel builds them in every warp, in registers),
two consumers of 64 keys each instead of one 8-warp program on 128 keys, 64-row tiles instead of
32, and the per-consumer skip of edge tiles.
Small grids (`key_block_parts`): at G = 128, when twice the key blocks fit in one wave of the
SMs (N = 2048 at B = 4: 64 blocks on 132 SMs), each block is two programs, one per head half
(PARTIAL), that write fp32 partials of dK2/dV2; `_sum_parts_kernel` (prepare_sum_parts) adds
the two in a fixed order. Deterministic, but not bitwise the one-program sums (a different fp32
order).
What this and the other TLX backwards share with `triton` (Delta, the reduce, `_sum_parts_kernel`,
the row and key-block helpers, the compile-config helpers) is in kernels_triton/simplicial/
bwd_common.py; `triton`'s `prepare` and `profiled_kernels` run the rest of the split.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from kernels_tlx.simplicial import bwd_dq_ws
from kernels_tlx.simplicial.common import EPILOGUE_BARRIER, NUM_CONSUMERS, dot_pair_release, opaque
from kernels_tlx.simplicial.hadamard import build, row_tile
from kernels_triton.launch import Kernel, sm_count
from kernels_triton.simplicial import bwd as triton_bwd
from kernels_triton.simplicial.bwd_common import (build_compile_configs, compile_specs,
                                                  key_block_program, kv_rows, prepare_sum_parts,
                                                  scalars)
from kernels_triton.simplicial.host import kv_layout, q_layout
from kernels_triton.simplicial.tiling import BF16_BYTES, LOG2E_JIT, enter, leave
from kernels_triton.simplicial.tiling import supports as tiling_supports
from altattn.registry import CompileConfig
from altattn.simplicial.spec import ProblemSpec
from kernels_tlx.ring import empty_phase, full_phase

EXECUTED_FLOPS_PER_F = triton_bwd.EXECUTED_FLOPS_PER_F
ROWS = 64  # rows per tile: 64 heads of one token


@triton.jit
def consume_tile(dk2, dv2, k2_tile, v2_tile, a_tiles, doj_tiles, a_fulls, a_empties, cnt, n_j,
                 lse2, delta, k_first, i0, w2, N, qk_scale, NUM_A: tl.constexpr,
                 PROFILE: tl.constexpr):
    """One consumer, one tile: the n_j steps c = cnt .. cnt + n_j - 1 (A_j, dO_j in ring slot
    c % NUM_A). P is zero for keys outside the token's w2 window or past N (one select per score;
    a mask-free copy of this loop for whole-window tiles spills 904 bytes)."""
    kpos = k_first + tl.arange(0, 64)
    kok = (kpos <= i0) & (kpos > i0 - w2) & (kpos < N)
    for _ in range(0, n_j):
        s = cnt % NUM_A
        enter("qk_gemm", PROFILE)
        tlx.barrier_wait(tlx.local_view(a_fulls, s), full_phase(cnt, NUM_A))
        a_tile = tlx.local_view(a_tiles, s)
        doj_tile = tlx.local_view(doj_tiles, s)
        st = tlx.async_dot(k2_tile, tlx.local_trans(a_tile))
        dpt = tlx.async_dot(v2_tile, tlx.local_trans(doj_tile))
        st = tlx.async_dot_wait(1, st)  # dP^T still in flight under the exp2
        leave("qk_gemm", PROFILE)
        enter("softmax", PROFILE)
        pt = tl.where(kok[:, None], tl.math.exp2(st * qk_scale - lse2[None, :]), 0.0)
        dpt = tlx.async_dot_wait(0, dpt)
        dst = pt * (dpt - delta[None, :])
        leave("softmax", PROFILE)
        dv2, dk2 = dot_pair_release(pt, doj_tile, dv2, dst, a_tile, dk2,
                                    tlx.local_view(a_empties, s), PROFILE)
        cnt += 1
    return dk2, dv2, cnt


@triton.jit
def key_block_coords(N, w2, HK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                     SPLIT: tl.constexpr):
    """This program's batch b, KV head g, first key kb, the offset of (b, g) in a [B, N, HK, D]
    tensor, and its tile count: SPLIT head halves of every token from kb to the last one whose
    window sees the block. Computed in each warp group (not passed into the partitions through
    shared memory, where ptxas kept one of them spilled across the consumer's loops)."""
    b, g, kb, kv_base = key_block_program(N, HK, D, BLOCK_N)
    t_hi = tl.minimum(N - 1, kb + BLOCK_N + w2 - 2)
    return b, g, kb, kv_base, (t_hi - kb + 1) * SPLIT


@triton.jit
def load_rows(Q, DO, q_tiles, do_tiles, q_fulls, slot, b, g, kb, u, N, HQ: tl.constexpr,
              G: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
    """Producer: TMA-load tile u's 64 rows of Q and dO (token kb + u // SPLIT, head half
    u % SPLIT) into `slot` of the row ring."""
    row0 = (b * N + kb + u // SPLIT) * HQ + g * G + (u % SPLIT) * 64
    qf = tlx.local_view(q_fulls, slot)
    tlx.barrier_expect_bytes(qf, 2 * 64 * D * BF16_BYTES)
    tlx.async_descriptor_load(Q, tlx.local_view(q_tiles, slot), [row0, 0], qf)
    tlx.async_descriptor_load(DO, tlx.local_view(do_tiles, slot), [row0, 0], qf)


@triton.jit
def skip_tiles(a_fulls, a_empties, cnt, u_lo, u_hi, kb, w1, SPLIT: tl.constexpr,
               NUM_A: tl.constexpr, STEP: tl.constexpr = 1):
    """One consumer passes over tiles u_lo, u_lo + STEP, .. < u_hi (none sees its keys): it
    releases each of their ring slots once the slot is full (an early release would count toward
    the slot's previous use). Returns the step count after them."""
    for u in range(u_lo, u_hi, STEP):
        i0 = kb + u // SPLIT
        for _ in range(0, i0 + 1 - tl.maximum(i0 - w1 + 1, 0)):
            s = cnt % NUM_A
            tlx.barrier_wait(tlx.local_view(a_fulls, s), full_phase(cnt, NUM_A))
            tlx.barrier_arrive(tlx.local_view(a_empties, s), 1)
            cnt += 1
    return cnt


@triton.jit
def part_first(PARTIAL: tl.constexpr):
    """This program's first tile: 0, or (PARTIAL) its head half, tl.program_id(1); a part visits
    every SPLIT-th tile from there (tile u is head half u % SPLIT of token kb + u // SPLIT)."""
    if PARTIAL:
        return tl.program_id(1)
    return 0


@triton.jit
def store_staged(base, kv_base, k_first, N, x, stage, cid, HK: tl.constexpr, D: tl.constexpr,
                 R: tl.constexpr, CHUNK: tl.constexpr):
    """One consumer stores its fp32 [R, D] accumulator x (keys k_first .. k_first + R - 1, those
    < N) to rows of a [*, N, HK, D] tensor at base (token 0 of its (b, g) at kv_base), through
    `stage` (an fp32 [R, D] shared-memory tile): x goes there as it lies in registers and comes
    back in a coalesced layout, CHUNK rows at a time. (The compiler's own conversion of the whole
    tile would take another 32 KB of shared memory per consumer, which the rings leave no room
    for, and spilled registers.)"""
    tlx.local_store(stage, x)
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
    for c in tl.static_range(R // CHUNK):
        chunk = tlx.local_load(tlx.local_slice(stage, [c * CHUNK, 0], [CHUNK, D]))
        kpos = k_first + c * CHUNK + tl.arange(0, CHUNK)
        tl.store(base + kv_rows(kv_base, kpos, HK, D), chunk, mask=(kpos < N)[:, None])
    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)  # every chunk read: stage is free


@triton.jit
def _dkv2_ws_kernel(Q, K1, K2, V1, V2, DO, Lse, Delta, DK2, DV2, N, w1, w2, qk_scale, sm_scale,
                    HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                    BLOCK_N: tl.constexpr, NUM_A: tl.constexpr, CH: tl.constexpr,
                    CONSUMER_REGS: tl.constexpr, PROFILE: tl.constexpr = False,
                    PARTIAL: tl.constexpr = False):
    """PARTIAL (G = 128): the grid's second axis splits each key block's tiles into its two head
    halves (`part_first`), and DK2/DV2 are fp32 partials [2, B, N, HK, D] (unscaled) that
    `_sum_parts_kernel` adds up; otherwise one part, and DK2/DV2 the bf16 gradients."""
    HALF: tl.constexpr = BLOCK_N // NUM_CONSUMERS
    SPLIT: tl.constexpr = G // 64
    STEP: tl.constexpr = SPLIT if PARTIAL else 1  # PARTIAL: a part is one head half's tiles
    tl.static_assert(STEP == 2 or not PARTIAL, "PARTIAL splits the two head halves of G = 128")

    k2_tiles = tlx.local_alloc((HALF, D), tl.bfloat16, NUM_CONSUMERS)
    v2_tiles = tlx.local_alloc((HALF, D), tl.bfloat16, NUM_CONSUMERS)
    if PARTIAL:
        # consumer 0's fp32 staging tile is the Q row ring's bytes and consumer 1's the dO row
        # ring's (2 x 16 KB each): only the producer reads them, and a consumer past its last
        # step has seen the producer's last build, so they are free then
        rows_q = tlx.storage_alias_spec()
        rows_do = tlx.storage_alias_spec()
        q_tiles = tlx.local_alloc((64, D), tl.bfloat16, 2, reuse=rows_q)
        do_tiles = tlx.local_alloc((64, D), tl.bfloat16, 2, reuse=rows_do)
        stage_q = tlx.local_alloc((HALF, D), tl.float32, 1, reuse=rows_q)
        stage_do = tlx.local_alloc((HALF, D), tl.float32, 1, reuse=rows_do)
    else:
        q_tiles = tlx.local_alloc((64, D), tl.bfloat16, 2)
        do_tiles = tlx.local_alloc((64, D), tl.bfloat16, 2)
    a_tiles = tlx.local_alloc((64, D), tl.bfloat16, NUM_A)
    doj_tiles = tlx.local_alloc((64, D), tl.bfloat16, NUM_A)
    kv_full = tlx.local_view(tlx.alloc_barriers(num_barriers=1, arrive_count=1), 0)
    q_fulls = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    # every thread arrives after its own shared-memory accesses (warp barriers): no warp-group
    # barrier before one thread's arrive
    a_fulls = tlx.alloc_warp_barrier(num_barriers=NUM_A, num_warps=4)
    a_empties = tlx.alloc_warp_barrier(num_barriers=NUM_A, num_warps=4 * NUM_CONSUMERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA loads, then A_j and dO_j per (tile, j)
            b, g, kb, kv_base, n_tiles = key_block_coords(N, w2, HK, D, BLOCK_N, SPLIT)
            enter("load_kv", PROFILE)
            tlx.barrier_expect_bytes(kv_full, 2 * BLOCK_N * D * BF16_BYTES)
            for c in tl.static_range(NUM_CONSUMERS):
                tlx.async_descriptor_load(K2, tlx.local_view(k2_tiles, c), [b, kb + c * HALF,
                                                                            g * D], kv_full)
                tlx.async_descriptor_load(V2, tlx.local_view(v2_tiles, c), [b, kb + c * HALF,
                                                                            g * D], kv_full)
            leave("load_kv", PROFILE)
            u0 = part_first(PARTIAL)
            load_rows(Q, DO, q_tiles, do_tiles, q_fulls, 0, b, g, kb, u0, N, HQ, G, D, SPLIT)
            cnt = 0
            for u in range(u0, n_tiles, STEP):
                i0 = kb + u // SPLIT
                qs = (u // STEP) % 2  # this part's tile count so far (u0 < STEP), mod 2
                enter("load_kv", PROFILE)
                if u + STEP < n_tiles:  # the next tile's rows, into the slot tile u - STEP's
                    # builds read
                    load_rows(Q, DO, q_tiles, do_tiles, q_fulls, 1 - qs, b, g, kb, u + STEP, N, HQ,
                              G, D, SPLIT)
                tlx.barrier_wait(tlx.local_view(q_fulls, qs), full_phase(u // STEP, 2))
                leave("load_kv", PROFILE)
                q_tile = tlx.local_view(q_tiles, qs)
                do_tile = tlx.local_view(do_tiles, qs)
                j_lo = tl.maximum(i0 - w1 + 1, 0)
                for j in range(j_lo, i0 + 1):
                    s = cnt % NUM_A
                    enter("build_a", PROFILE)
                    kv_row = kv_base + j.to(tl.int64) * (HK * D)
                    k1 = row_tile(K1, kv_row, D, CH)
                    tlx.barrier_wait(tlx.local_view(a_empties, s), empty_phase(cnt, NUM_A))
                    build(k1, q_tile, tlx.local_view(a_tiles, s), D, 64, CH)
                    v1 = row_tile(V1, kv_row, D, CH)
                    build(v1, do_tile, tlx.local_view(doj_tiles, s), D, 64, CH)
                    tlx.barrier_arrive(tlx.local_view(a_fulls, s), 1)
                    leave("build_a", PROFILE)
                    cnt += 1

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid = tlx.async_task_replica_id()
            b, g, kb, kv_base, n_tiles = key_block_coords(N, w2, HK, D, BLOCK_N, SPLIT)
            k2_tile = tlx.local_view(k2_tiles, cid)
            v2_tile = tlx.local_view(v2_tiles, cid)
            offs_h = tl.arange(0, 64)
            dk2 = tl.zeros([HALF, D], tl.float32)
            dv2 = tl.zeros([HALF, D], tl.float32)
            tlx.barrier_wait(kv_full, 0)
            # The tiles whose token sees none of this consumer's keys are a prefix (consumer 1:
            # tokens before its first key) and a suffix (consumer 0: tokens past its last key's
            # w2 window) of the tile sequence: the consumer only releases their ring slots, and
            # the other consumer has the tensor cores to itself there.
            k_first = kb + cid * HALF
            u_lo = tl.minimum((k_first - kb) * SPLIT, n_tiles)
            u_hi = tl.minimum((k_first + HALF - 1 + w2 - kb) * SPLIT, n_tiles)
            u0 = part_first(PARTIAL)  # u_lo, u_hi and n_tiles are multiples of SPLIT
            cnt = skip_tiles(a_fulls, a_empties, u_lo * 0, u0, u_lo + u0, kb, w1, SPLIT, NUM_A,
                             STEP)
            split = opaque(tl.full([], SPLIT, tl.int32))
            for u in range(u_lo + u0, u_hi, STEP):
                i0 = kb + u // split
                head = g * G + (u % split) * 64 + offs_h
                row_off = (b.to(tl.int64) * HQ + head) * N + i0
                lse2 = tl.load(Lse + row_off) * LOG2E_JIT  # LSE in log2 units
                delta = tl.load(Delta + row_off)
                n_j = i0 + 1 - tl.maximum(i0 - w1 + 1, 0)
                dk2, dv2, cnt = consume_tile(dk2, dv2, k2_tile, v2_tile, a_tiles, doj_tiles,
                                             a_fulls, a_empties, cnt, n_j, lse2, delta, k_first,
                                             i0, w2, N, qk_scale, NUM_A, PROFILE)
            skip_tiles(a_fulls, a_empties, cnt, u_hi + u0, n_tiles, kb, w1, SPLIT, NUM_A, STEP)
            enter("epilogue", PROFILE)
            if PARTIAL:  # fp32 partials: part p's [B, N, HK, D] slice, staged in the row
                # ring of Q (consumer 0) or dO (consumer 1)
                plane = (tl.num_programs(0) // tl.cdiv(N, BLOCK_N)) * N * D  # B * N * HK * D
                part = tl.program_id(1).to(tl.int64) * plane
                if cid == 0:
                    stage = tlx.local_view(stage_q, 0)
                else:
                    stage = tlx.local_view(stage_do, 0)
                store_staged(DK2 + part, kv_base, k_first, N, dk2, stage, cid, HK, D, HALF, 16)
                store_staged(DV2 + part, kv_base, k_first, N, dv2, stage, cid, HK, D, HALF, 16)
            else:
                kpos = k_first + tl.arange(0, HALF)
                out = kv_rows(kv_base, kpos, HK, D)
                tl.store(DK2 + out, (dk2 * sm_scale).to(tl.bfloat16), mask=(kpos < N)[:, None])
                tl.store(DV2 + out, dv2.to(tl.bfloat16), mask=(kpos < N)[:, None])
            leave("epilogue", PROFILE)


def supports(spec: ProblemSpec) -> str | None:
    why = tiling_supports(spec)
    if why is None and spec.G < 64:
        why = (f"G = Hq/Hk = {spec.G} < 64: this kernel's 64-row tile is 64 heads of one token; "
               "use `triton`")
    return why


def config(spec: ProblemSpec) -> dict:
    """128 keys (64 per consumer), two A_j/dO_j slots, the producer's build in 8-row chunks; the
    consumers at 232 registers (at 240 the producer's 24 spill 68 bytes)."""
    return dict(BLOCK_N=128, NUM_A=2, CH=8, CONSUMER_REGS=232, num_warps=4, num_stages=1)


def key_block_parts(spec: ProblemSpec, n_sm: int = 132) -> int:
    """Programs per key block: 2 (a head half each) at G = 128 when twice the key blocks
    (cdiv(N, 128) * B * Hk) still fit in one wave of the SMs, else 1. At N = 2048, B = 4 the 64
    key blocks alone leave 68 of 132 SMs idle."""
    blocks = triton.cdiv(spec.N, config(spec)["BLOCK_N"]) * spec.B * spec.Hk
    return 2 if spec.G == 128 and 2 * blocks <= n_sm else 1


def prepare_dkv2(spec: ProblemSpec, profile: bool = False):
    """`_dkv2_ws_kernel`'s launch of `spec` (key_block_parts of the current GPU), made once:
    run(q, k1, k2, v1, v2, dout, lse, delta, dk2, dv2) writes dk2, dv2 (triton_bwd.prepare_dkv2's
    signature); with key_block_parts > 1 through fp32 partials (2 x parts x dk2's elements x 4
    bytes of scratch) summed in part order by `_sum_parts_kernel`: deterministic, not bitwise
    equal to the one-part sums."""
    cfg = config(spec)
    keys = kv_layout(spec, cfg["BLOCK_N"] // 2)
    rows = q_layout(spec, ROWS)  # boxes of 64 heads of a token
    parts = key_block_parts(spec, sm_count())
    blocks = triton.cdiv(spec.N, cfg["BLOCK_N"]) * spec.B * spec.Hk
    kernel = Kernel(_dkv2_ws_kernel, (blocks, parts), HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=spec.D,
                    PROFILE=profile, PARTIAL=parts > 1, **cfg)
    if parts > 1:
        sum_parts = prepare_sum_parts(spec.B * spec.N * spec.Hk * spec.D, spec.sm_scale, parts)
    args = scalars(spec)

    def run(q, k1, k2, v1, v2, dout, lse, delta, dk2, dv2) -> None:
        if parts > 1:
            out_k, out_v = torch.empty(2, parts, *dk2.shape, dtype=torch.float32, device=q.device)
        else:
            out_k, out_v = dk2, dv2
        kernel(rows(q), k1, keys(k2), v1, keys(v2), rows(dout), lse, delta, out_k, out_v, *args)
        if parts > 1:
            sum_parts(out_k, out_v, dk2, dv2)

    return run


def profiled_kernels(spec: ProblemSpec) -> dict[str, int]:
    """`triton`'s (kernels_triton.simplicial.bwd.profiled_kernels), with this file's k-owner in
    "dkv2" and, where it runs, kernels_tlx/simplicial/bwd_dq_ws.py's row-owner in "dq": a producer
    and NUM_CONSUMERS consumer warp groups each."""
    warps = config(spec)["num_warps"] * (1 + NUM_CONSUMERS.value)
    out = {**triton_bwd.profiled_kernels(spec), "dkv2": warps}
    if bwd_dq_ws.supports(spec) is None:
        out["dq"] = bwd_dq_ws.config(spec)["num_warps"] * (1 + NUM_CONSUMERS.value)
    return out


def prepare(spec: ProblemSpec, profile: bool | str = False):
    """`kernels_triton.simplicial.bwd.prepare` (its run's arguments) with this file's k-owner in
    place of `_dkv2_kernel` and, at G in {64, 128}, kernels_tlx/simplicial/bwd_dq_ws.py's
    row-owner in place of `_dq_kernel`."""
    row_owner = bwd_dq_ws.prepare_dq if bwd_dq_ws.supports(spec) is None else None
    return triton_bwd.prepare(spec, profile, k_owner=prepare_dkv2, row_owner=row_owner)


def launch(spec: ProblemSpec, q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2,
           profile: bool | str = False) -> None:
    prepare(spec, profile)(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2)


def compile_configs() -> list[CompileConfig]:
    """The k-owner and kernels_tlx/simplicial/bwd_dq_ws.py's row-owner at every compile shape
    they support (the rest is `triton`'s), the k-owner in two parts too where key_block_parts
    makes them (G = 128 at B = 1; B = 4 gives one part)."""
    specs = [s for s in compile_specs() if supports(s) is None]
    specs += [replace(s, B=4) for s in specs if s.G == 128]
    kernels = {_dkv2_ws_kernel: lambda launch: "dkv2" + ("_parts" if launch.constexprs["PARTIAL"]
                                                         else ""),
               bwd_dq_ws._dq_ws_kernel: "dq"}
    return build_compile_configs(prepare, kernels, specs)

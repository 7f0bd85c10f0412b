"""`tlx_pairs` backward: one warp-specialized TLX kernel that owns (j, key block) pairs and runs
the 5 GEMMs of FlashAttention's backward, with dQ, dK2 and dV2 reduce-added (not deterministic).

For a fixed j, the pairs (j, k) are the keys of an ordinary attention: B_jk = K1[j] * K2[k] and
C_jk = V1[j] * V2[k] (the keys-side form, docs/MATH.md §1), seen by the
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
  and reduce-adds it by TMA (a box per token of the tile that sees j). Tile u - 1's dQ GEMMs
  are issued right behind tile u's dC and dB and waited with them (`pair_step`): one wait a
  step for the three, not two.
Remainder programs (PACK, a second launch; kernels_tlx/simplicial/pairs_remainder.py): j's keys
span w1 + w2 - 1 tokens, so its last key block is short (31 keys at S*) and as a program of its
own cost two thirds of a full one; where it holds at most 32 (64) keys, `remainder_pack` packs
the last blocks of 4 (2) consecutive j into one program, each row a pair (j, k) with its own j.
Form "det" (DET): B = K1a[j] * K2a + K1b[j] * K2b from det_keys_side's packed K1 and K2 (the
sign of a pair exchange is in the packing), the end's sums taken against both slots in the
packing's columns and unpacked on the host by its adjoint (det_keys_side_grads).
Supports G = Hq/Hk >= 16 (`supports`; a token's rows are one TMA box of >= 16), D 64 or 128.
Its speed against `tlx_ws` at S* is measured in docs/perf-bwd.md, form det in docs/perf-det.md.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from altattn.registry import CompileConfig
from altattn.simplicial.spec import ProblemSpec
from kernels_tlx.simplicial.common import (CONSUMER_THREADS, ENDS_BARRIER, EPILOGUE_BARRIER,
                                           NUM_CONSUMERS, opaque)
from kernels_tlx.simplicial.pairs_parts import (
    KEYS,
    ROWS,
    active_tiles,
    add_dq,
    box_rows,
    build_keys_values,
    dq_share,
    epilogue_rows,
    first_token,
    load_rows,
    pair_program,
    pair_step,
    program_of,
    remainder_program,
    remainder_rows,
    remainder_tiles,
    row_width,
    scale_add_rows,
    slot_rows,
    tile_tokens,
)
from kernels_tlx.simplicial.pairs_order import from_fixed, order_args, visit
from kernels_tlx.simplicial.pairs_plan import (config, key_blocks,  # noqa: F401 - the module's
                                               ordered_supports, remainder_pack, supports)
from kernels_tlx.simplicial.pairs_remainder import (build_remainder, load_remainder_kv,
                                                    remainder_end)
from kernels_triton.launch import Desc, Kernel, meta
from kernels_triton.proton import profiled
from kernels_triton.simplicial.bwd_common import (
    build_compile_configs,
    compile_specs,
    prepare_delta,
    prepare_finish,
    prepare_sum_parts,
)
from kernels_triton.simplicial.det import det_keys_side, det_keys_side_grads, det_of
from kernels_triton.simplicial.host import kv_layout, q_layout
from kernels_triton.simplicial.tiling import BF16_BYTES, LOG2E, enter, leave
from kernels_tlx.ring import empty_phase


@triton.jit
def _pairs_kernel(Q, K1, K2, V1, V2, DO, Lse2, Delta, K2rows, V2rows, DQacc, DK1acc, DK2acc,
                  DV1acc, DV2acc, N, w1, w2, n_kb, qk_scale, HQ: tl.constexpr,
                  HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_Q: tl.constexpr,
                  CH: tl.constexpr, CONSUMER_REGS: tl.constexpr, PROFILE: tl.constexpr = False,
                  Seq=None, VARLEN: tl.constexpr = False, DET: tl.constexpr = False,
                  PACK: tl.constexpr = 0, Flags=None, Base=None, Off=None, Scale=None,
                  ORDERED: tl.constexpr = False):
    R: tl.constexpr = box_rows(G)  # rows of one token in a tile
    E_ROWS: tl.constexpr = epilogue_rows(G, D)  # rows per chunk of the end's passes
    # the end of a full program at G < 64: dB's pass, then dC through the same staging tile, the
    # sums over the keys a chunk at a time (both staged at once and summed once, as elsewhere,
    # spills there: 20 bytes at G = 16)
    ONE_STAGE: tl.constexpr = G < 64 and PACK == 0
    # a barrier between the end's passes, a fence to the compiler: without it their loads and
    # atomics overlap and spill (form det; sm_90a, fbtriton 3.7.4)
    FENCE: tl.constexpr = DET
    # form "det": K1 and K2 (and their fp32 gradients) in det_keys_side's packing, SL = 2 rows of
    # D per token and head; B = K1a[j] * K2a + K1b[j] * K2b
    SL: tl.constexpr = 2 if DET else 1
    tl.static_assert(NUM_Q >= NUM_CONSUMERS, "the row ring holds the raw K2/V2 halves first")
    tl.static_assert(not ORDERED or (G >= 64 and not VARLEN and not DET),
                     "ORDERED: one dQ box a tile, the plain form")
    DH: tl.constexpr = D // NUM_CONSUMERS  # dQ columns per consumer
    # consumer 0's staging tiles at its end are the Q row ring's bytes (dB) and both B tiles'
    # (dC), consumer 1's the dO ring's and both C tiles': the rings and C are free once both
    # consumers have waited for the last tile's dS (they have then read its Q and dO, and C),
    # B once consumer 1's last dQ GEMMs are done too (ENDS_BARRIER)
    rows_b = tlx.storage_alias_spec()
    rows_c = tlx.storage_alias_spec()
    b_tiles = tlx.local_alloc((64, D), tl.bfloat16, NUM_CONSUMERS, reuse=rows_b)
    c_tiles = tlx.local_alloc((64, D), tl.bfloat16, NUM_CONSUMERS, reuse=rows_c)
    stage_b = tlx.local_alloc((64, D), tl.float32, 1, reuse=rows_b)
    stage_c = tlx.local_alloc((64, D), tl.float32, 1, reuse=rows_c)
    rows_q = tlx.storage_alias_spec()
    rows_do = tlx.storage_alias_spec()
    q_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, NUM_Q, reuse=rows_q)
    do_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, NUM_Q, reuse=rows_do)
    stage_q = tlx.local_alloc((64, D), tl.float32, 1, reuse=rows_q)
    stage_do = tlx.local_alloc((64, D), tl.float32, 1, reuse=rows_do)
    ds_tiles = tlx.local_alloc((64, ROWS), tl.bfloat16, 2 * NUM_CONSUMERS)  # [slot * 2 + c]
    if DET:  # K2b's halves in the dQ staging tiles' bytes: free until the first tile's dQ
        staged = tlx.storage_alias_spec()
        dq_stage = tlx.local_alloc((ROWS, DH), tl.float32, NUM_CONSUMERS, reuse=staged)
        k2b_tiles = tlx.local_alloc((64, D), tl.bfloat16, NUM_CONSUMERS, reuse=staged)
    else:
        dq_stage = tlx.local_alloc((ROWS, DH), tl.float32, NUM_CONSUMERS)
        k2b_tiles = q_tiles
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
            b, g, j, kb, kv_base, n_tiles, live, t_end = program_of(
                tl.program_id(0), N, w1, w2, n_kb, HK, D, G, PACK, Seq, VARLEN, ORDERED)
            if live:
                # K2 and V2 (64 keys per consumer) land in the row ring, free until the first
                # tile's rows; B and C are built from there
                enter("load_kv", PROFILE)
                tlx.barrier_expect_bytes(kv_full, (1 + SL) * NUM_CONSUMERS * 64 * D * BF16_BYTES)
                if PACK:
                    load_remainder_kv(K2, V2, q_tiles, do_tiles, k2b_tiles, kv_full, b, g, j, N,
                                      w1, w2, n_kb, D, PACK, DET, Seq, VARLEN)
                else:
                    for c in tl.static_range(NUM_CONSUMERS):
                        tlx.async_descriptor_load(K2, tlx.local_view(q_tiles, c),
                                                  [b, kb + c * 64, SL * g * D], kv_full)
                        if DET:
                            tlx.async_descriptor_load(K2, tlx.local_view(k2b_tiles, c),
                                                      [b, kb + c * 64, (2 * g + 1) * D], kv_full)
                        tlx.async_descriptor_load(V2, tlx.local_view(do_tiles, c),
                                                  [b, kb + c * 64, g * D], kv_full)
                tlx.barrier_wait(kv_full, 0)
                leave("load_kv", PROFILE)
                enter("build_a", PROFILE)
                if PACK:
                    build_remainder(K1, V1, q_tiles, do_tiles, k2b_tiles, b_tiles, c_tiles,
                                    kv_base, j, N, w1, w2, n_kb, HK, D, CH, PACK, DET, Seq,
                                    VARLEN)
                else:
                    kv_row = kv_base + j.to(tl.int64) * (HK * D)
                    # (packed: the keys from the next sequence's on build as zeros)
                    n_rows = tl.minimum(j + w1, t_end) - kb
                    build_keys_values(K1, V1, q_tiles, do_tiles, k2b_tiles, b_tiles, c_tiles,
                                      kv_row, n_rows, D, CH, DET, VARLEN)
                if DET and PACK:  # the coordinates again (held over the det build, they spill)
                    b, g, j, kv_base, n_tiles, t_end = remainder_program(
                        opaque(tl.program_id(0)), opaque(N), w1, w2, n_kb, HK, D, G, PACK, Seq,
                        VARLEN)
                elif DET:
                    b, g, j, kb, kv_base, n_tiles, _, t_end = pair_program(
                        opaque(tl.program_id(0)), N, w1, w2, n_kb, HK, D, G, Seq, VARLEN, ORDERED)
                tlx.barrier_arrive(bc_full, 1)
                tlx.barrier_wait(bc_full, 0)  # every producer thread has read the ring
                leave("build_a", PROFILE)
                for u in range(0, n_tiles):
                    s = u % NUM_Q
                    enter("load_kv", PROFILE)
                    tlx.barrier_wait(tlx.local_view(q_empties, s), empty_phase(u, NUM_Q))
                    i0, h0 = first_token(j, visit(u, n_tiles, ORDERED), G)
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
            b, g, j, kb, kv_base, n_tiles, live, t_end = program_of(
                tl.program_id(0), N, w1, w2, n_kb, HK, D, G, PACK, Seq, VARLEN, ORDERED)
            if live:
                if PACK:  # each row its own pair (j, k): its tokens' bounds, packed
                    keys = remainder_rows(j, cid, N, w1, w2, n_kb, PACK, Seq, VARLEN)
                    u_lo, u_hi = remainder_tiles(j, cid, n_tiles, w1, t_end, G, PACK)
                    i_end = t_end
                else:
                    k0 = kb + cid * 64
                    u_lo, u_hi = active_tiles(j, k0, n_tiles, w2, G)
                    i_end = tl.minimum(j + w1, t_end)  # the tokens past it do not see j
                    keys = k0 + tl.arange(0, 64)
                b_tile = tlx.local_view(b_tiles, cid)
                c_tile = tlx.local_view(c_tiles, cid)
                dk = tl.zeros([64, D], tl.float32)
                dv = tl.zeros([64, D], tl.float32)
                tlx.barrier_wait(bc_full, 0)
                # tile u's GEMMs, then tile u - 1's dQ issued behind its dC/dB and waited with
                # them: the consumers meet at the dS of the tile before, so either may run a tile
                # ahead (the first tile has no dQ before it: peeled)
                v = visit(0, n_tiles, ORDERED)
                dk, dv = pair_step(0, dk, dv, (v >= u_lo) & (v < u_hi), False, b_tile, c_tile,
                                   q_tiles, do_tiles, ds_tiles, b_tiles, lse_tiles, delta_tiles,
                                   q_fulls, q_empties, ds_fulls, ds_empties, dq_stage, DQacc, b,
                                   g, j, i_end, keys, qk_scale, w2, N, cid, NUM_Q, G, HQ, DH,
                                   PROFILE, PACK > 0, n_tiles, Flags, Base, Off, n_kb, PACK,
                                   ORDERED)
                for u in range(1, n_tiles):
                    v = visit(u, n_tiles, ORDERED)
                    dk, dv = pair_step(u, dk, dv, (v >= u_lo) & (v < u_hi), True, b_tile, c_tile,
                                       q_tiles, do_tiles, ds_tiles, b_tiles, lse_tiles,
                                       delta_tiles, q_fulls, q_empties, ds_fulls, ds_empties,
                                       dq_stage, DQacc, b, g, j, i_end, keys, qk_scale, w2, N,
                                       cid, NUM_Q, G, HQ, DH, PROFILE, PACK > 0, n_tiles, Flags,
                                       Base, Off, n_kb, PACK, ORDERED)
                # the coordinates again, from an opaque program id (held over the loop they spill)
                if PACK:  # (N opaque too: N - 1 held over the loop spilled)
                    n_end = opaque(N)
                    b, g, j, kv_base, n_tiles, t_end = remainder_program(
                        opaque(tl.program_id(0)), n_end, w1, w2, n_kb, HK, D, G, PACK, Seq,
                        VARLEN)
                    i_end = t_end
                    any_keys = True
                else:
                    b, g, j, kb, kv_base, n_tiles, _, t_end = pair_program(
                        opaque(tl.program_id(0)), N, w1, w2, n_kb, HK, D, G, Seq, VARLEN, ORDERED)
                    k0 = kb + cid * 64
                    u_lo, u_hi = active_tiles(j, k0, n_tiles, w2, G)
                    i_end = tl.minimum(j + w1, t_end)
                    any_keys = u_lo < u_hi
                enter("epilogue", PROFILE)
                dq = dq_share(ds_tiles, b_tiles, ds_fulls, n_tiles - 1, cid, DH)
                if not ONE_STAGE:
                    # consumer 0's dC goes over both B tiles, which consumer 1's last dQ GEMMs
                    # (just waited) read: a hand-over one way, consumer 1 arrives and consumer 0
                    # waits (both replicas at one bar.sync, two instructions, fail synccheck:
                    # docs/sanitizers.md); the C tiles under consumer 1's dC were last read by
                    # consumer 0's dP^T GEMMs, waited before its last ds_full
                    if cid == 0:
                        tlx.named_barrier_wait(ENDS_BARRIER, CONSUMER_THREADS)
                    else:
                        tlx.named_barrier_arrive(ENDS_BARRIER, CONSUMER_THREADS)
                add_dq(dq, dq_stage, DQacc, b, g, j, n_tiles - 1, N, i_end, cid, HQ, G, DH,
                       n_tiles, Flags, Base, Off, n_kb, PACK, ORDERED, LAST=True)
                tlx.async_descriptor_store_wait(0)
                if any_keys:  # dB and dC are zero otherwise
                    if cid == 0:
                        stage_k = tlx.local_view(stage_q, 0)
                        stage_v = tlx.local_view(stage_b, 0)
                    else:
                        stage_k = tlx.local_view(stage_do, 0)
                        stage_v = tlx.local_view(stage_c, 0)
                    # both staged at once, in two tiles (but ONE_STAGE): no accumulator held
                    # through the passes and no wait between dB's and dC's
                    tlx.local_store(stage_k, dk)
                    if not ONE_STAGE:
                        tlx.local_store(stage_v, dv)
                    tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
                    if PACK:
                        remainder_end(stage_k, K1, K2rows, DK2acc, DK1acc, j, kv_base, cid, n_end,
                                      w1, w2, n_kb, HK, D, E_ROWS, PACK, Seq, VARLEN, SL,
                                      Scale=Scale)
                        if DET:  # the b slot's columns
                            tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)  # FENCE
                            remainder_end(stage_k, K1, K2rows, DK2acc, DK1acc, j, kv_base, cid,
                                          n_end, w1, w2, n_kb, HK, D, E_ROWS, PACK, Seq, VARLEN, SL,
                                          opaque(tl.full([], D, tl.int32)))
                        if FENCE:
                            tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
                        remainder_end(stage_v, V1, V2rows, DV2acc, DV1acc, j, kv_base, cid,
                                      n_end, w1, w2, n_kb, HK, D, E_ROWS, PACK, Seq, VARLEN,
                                      Scale=Scale)
                    else:
                        kv_row = kv_base + j.to(tl.int64) * (HK * D)
                        offs_d = tl.arange(0, D)
                        # dK1a[j] += sum_k K2a[k] * dB[k], dK2a[k] += K1a[j] * dB[k], and the
                        # same of the b slots (det), in det_keys_side's packed columns
                        k1 = tl.load(K1 + SL * kv_row + offs_d).to(tl.float32)
                        scale_add_rows(stage_k, k1, K2rows, SL * kv_base, k0, t_end, DK2acc,
                                       DK1acc, SL * kv_row, SL * HK, D, E_ROWS, EACH=ONE_STAGE,
                                       Scale=Scale)
                        if DET:  # (the slot's offset opaque: else the first pass's row offsets
                            # are kept for this one, and spill)
                            tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)  # FENCE
                            sl = opaque(tl.full([], D, tl.int32))
                            k1 = tl.load(K1 + SL * kv_row + sl + offs_d).to(tl.float32)
                            scale_add_rows(stage_k, k1, K2rows, SL * kv_base + sl, k0, t_end,
                                           DK2acc, DK1acc, SL * kv_row + sl, SL * HK, D, E_ROWS,
                                           EACH=ONE_STAGE)
                        if ONE_STAGE:  # dB's passes have read the tile: dC through it
                            tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
                            tlx.local_store(stage_k, dv)
                            stage_v = stage_k
                        if FENCE or ONE_STAGE:
                            tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)
                        v1 = tl.load(V1 + kv_row + offs_d).to(tl.float32)
                        scale_add_rows(stage_v, v1, V2rows, kv_base, k0, t_end, DV2acc, DV1acc,
                                       kv_row, HK, D, E_ROWS, EACH=ONE_STAGE, Scale=Scale)
                leave("epilogue", PROFILE)


def prepare(spec: ProblemSpec, profile: bool | str = False, packed: bool = False,
            ordered: bool = False):
    """The launches of `spec`, made once: run(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1,
    dk2, dv1, dv2) (kernels_triton.simplicial.bwd.prepare's): Delta (`prepare_delta`),
    `_pairs_kernel` into zeroed fp32 accumulators, twice where j's last key block is packed
    (`remainder_pack`: the programs of one j, then the remainder programs; the per-call
    descriptors of Q, dO, LSE and Delta made once for both; profile: True or "pairs" runs its
    Proton-scoped copies), then the bf16 gradients (dQ, dK1, dK2 scaled by sm_scale) by
    `prepare_finish` and `prepare_sum_parts`. ordered=True (`tlx_pairs_ordered`): ORDERED, its
    per-call arguments (pairs_order.py's `order_args`), dK/dV summed in int64. Form "det": K1 and
    K2 packed per call (det_keys_side), B built from both slots, dK1 and dK2 summed in the packing's
    columns and unpacked by its adjoint (det_keys_side_grads: a few small torch passes each way).
    Scratch: fp32 copies of the five gradients (B*N*Hq*D*4 bytes for dQ: 4.3 GB at S*; form
    "det": dK1 and dK2 twice, and the packed bf16 K1 and K2) and [B, N, Hq] copies of LSE (log2)
    and Delta (two small passes per call: `_delta_kernel` writes [B, Hq, N]).
    packed=True (spec.varlen): run takes `bounds=` too, each token's sequence start and end
    (altattn/simplicial/varlen.py's Packed.bounds, per call), `_pairs_kernel`'s keyword
    argument `Seq`."""
    profile = profiled(profile, "pairs", ("pairs",))
    delta_of = prepare_delta(spec)
    r = min(spec.G, ROWS.value)  # a token's rows in a tile
    rows = spec.B * spec.N * spec.Hq
    row_values = Desc([rows // r, r], [r, 1], [1, r])  # LSE or Delta, [B, N, Hq] fp32
    heads = q_layout(spec, ROWS.value)
    det = det_of(spec)
    k2_shape = (spec.B, spec.N, spec.Hk, 2, spec.D) if det else None  # det_keys_side's K2
    pack = remainder_pack(spec)
    n_full = key_blocks(spec) - (pack > 0)  # the key blocks of a program of one j
    dq_halves = Desc([rows, spec.D], [spec.D, 1], [r, spec.D // 2])  # the fp32 dQ scratch
    options = dict(HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=spec.D, PROFILE=bool(profile),
                   **config(spec), **({"VARLEN": True} if packed else {}),
                   **({"DET": True} if det else {}), **({"ORDERED": True} if ordered else {}))
    # the launches: (kernel, K2's layout, V2's layout) for the programs of one j (key blocks of
    # 64 rows a consumer) and the remainder programs (slots of slot_rows(pack) rows)
    launches = []
    if n_full:
        launches.append((Kernel(_pairs_kernel, (spec.B * spec.Hk * spec.N * n_full,), **options),
                         kv_layout(spec, KEYS, k2_shape), kv_layout(spec, KEYS)))
    if pack:
        launches.append((Kernel(_pairs_kernel, (spec.B * spec.Hk * triton.cdiv(spec.N, pack),),
                                **options, PACK=pack),
                         kv_layout(spec, slot_rows(pack), k2_shape),
                         kv_layout(spec, slot_rows(pack))))
    finish = prepare_finish(rows * spec.D, spec.sm_scale)  # dQ = bf16(sm_scale * its sum)
    # dK = sm_scale * its sum, dV its sum, in bf16: the k-owner's sum of one part
    sum_parts = prepare_sum_parts(spec.B * spec.N * spec.Hk * spec.D, spec.sm_scale, 1)
    args = (spec.N, spec.w1, spec.w2, n_full, spec.sm_scale * LOG2E)

    def run(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2, bounds=None
            ) -> None:
        delta = delta_of(out, dout, dlse)
        lse2, delta = (t.transpose(1, 2).contiguous() for t in (lse * LOG2E, delta))
        dq_acc = torch.zeros(dq.shape, dtype=torch.float32, device=q.device)
        if det:
            k1, k2 = det_keys_side(k1, k2, det)
            dk1_acc, dk2_acc = torch.zeros((2, *k1.shape), dtype=torch.float32, device=q.device)
            dv1_acc, dv2_acc = torch.zeros((2, *dv1.shape), dtype=torch.float32, device=q.device)
        else:  # (ordered: int64 fixed point, pairs_order.py's `end_scale`)
            dk1_acc, dk2_acc, dv1_acc, dv2_acc = torch.zeros(
                (4, *dk1.shape), dtype=torch.int64 if ordered else torch.float32, device=q.device)
        seq = {"Seq": bounds} if packed else {}
        if ordered:
            seq.update(order_args(spec, n_full, pack, q, k1, k2, v1, v2, dout, lse, dlse))
        q_d, do_d, lse_d, delta_d = heads(q), heads(dout), row_values(lse2), row_values(delta)
        grads = (dq_halves(dq_acc), dk1_acc, dk2_acc, dv1_acc, dv2_acc)
        for kernel, k2_layout, v2_layout in launches:
            kernel(q_d, k1, k2_layout(k2), v1, v2_layout(v2), do_d, lse_d, delta_d, k2, v2,
                   *grads, *args, **seq)
        finish(dq_acc, dq)
        if det:
            dk1_acc, dk2_acc = det_keys_side_grads(dk1_acc, dk2_acc, det)
        if ordered:
            dk1_acc, dk2_acc, dv1_acc, dv2_acc = (from_fixed(t, seq["Scale"])
                                                  for t in (dk1_acc, dk2_acc, dv1_acc, dv2_acc))
        sum_parts(dk1_acc, dv1_acc, dk1, dv1)
        sum_parts(dk2_acc, dv2_acc, dk2, dv2)

    return run


@functools.lru_cache(maxsize=64)
def _prepared_packed(spec: ProblemSpec, profile: bool | str):
    return prepare(spec, profile, packed=True)


def launch(spec: ProblemSpec, q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2,
           profile: bool | str = False, packed=None) -> None:
    """One backward; packed (altattn/simplicial/varlen.py's Packed): packed sequences, their
    launches made once per spec."""
    run = prepare(spec, profile) if packed is None else _prepared_packed(spec, profile)
    run(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2,
        bounds=None if packed is None else packed.bounds)


def profiled_kernels(spec: ProblemSpec) -> dict[str, int]:
    """The one Proton-scoped kernel, "pairs": a producer and NUM_CONSUMERS consumer warp groups."""
    return {"pairs": config(spec)["num_warps"] * (1 + NUM_CONSUMERS.value)}


def compile_configs() -> list[CompileConfig]:
    """The kernel at every compile shape it supports, and packed (VARLEN) at the first."""
    kernels = {_pairs_kernel: lambda launch: (
        ("pairs_remainder" if launch.constexprs.get("PACK") else "pairs")
        + ("_packed" if launch.constexprs.get("VARLEN") else ""))}
    specs = [s for s in compile_specs() if supports(s) is None]
    # form "det" at each (one kernel for both signs: the sign is in det_keys_side's packing)
    out = build_compile_configs(prepare, kernels, specs + [replace(s, form="det") for s in specs])
    spec = compile_specs()[0]
    if supports(spec) is None:  # a packed run takes each token's bounds (`launch`'s packed)
        bounds = meta(spec.B * spec.N, 2, dtype=torch.int32)
        out += build_compile_configs(
            lambda s: functools.partial(prepare(s, packed=True), bounds=bounds), kernels,
            [spec, replace(spec, form="det")])
    return out


def variant(ordered: bool) -> dict:
    """`tlx_pairs_ordered` (altattn/registry.py: Variant.switches): this kernel with ORDERED,
    bitwise-repeatable sums (pairs_order.py: each tile's dQ share reduce-added in fp32 in launch
    order behind per-box counters, the end's dK/dV in int64 fixed point; the same GEMMs and dQ
    bytes), at `ordered_supports`' shapes; speed in docs/perf-bwd-ordered.md."""
    def prepare_variant(spec: ProblemSpec, profile: bool | str = False):
        return prepare(spec, profile, ordered=ordered)

    def launch_variant(spec: ProblemSpec, q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2,
                       dv1, dv2, profile: bool | str = False) -> None:
        prepare_variant(spec, profile)(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1,
                                       dv2)

    def compile_configs_variant() -> list[CompileConfig]:
        kernels = {_pairs_kernel: lambda launch: (
            "pairs_ordered_remainder" if launch.constexprs.get("PACK") else "pairs_ordered")}
        return build_compile_configs(prepare_variant, kernels,
                                     [s for s in compile_specs() if ordered_supports(s) is None])

    return dict(supports=ordered_supports, config=config, prepare=prepare_variant,
                launch=launch_variant, compile_configs=compile_configs_variant,
                profiled_kernels=profiled_kernels)

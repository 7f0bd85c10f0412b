"""The TLX spherical-attention forward: one kernel body with constexpr switches (PIPELINE,
PINGPONG, PERSISTENT), its producer loop, consumer step, epilogue, and the host side (descriptors,
launch, compile configs). Its three variants are this module with switches (`variant`;
altattn/spherical/family.py names them):
- `tlx_ws` (PIPELINE off, PINGPONG off): FlashAttention-3's forward shape with softmax replaced
  by the square-accumulate; each consumer waits for each of its GEMMs, and the two consumers
  overlap each other on the tensor cores on their own.
- `tlx_pipelined` (PIPELINE): FlashAttention-3's intra-warp-group overlap. Step j issues QK(j),
  then PV(j-1) (P(j-1) held in registers), waits for QK(j) only (`async_dot_wait(1)`), frees the
  K slot, squares and sums S(j) while PV(j-1) still runs, then waits for PV(j-1), frees its V
  slot and only then converts P(j) = bf16(S(j)) (so ptxas cannot write P(j) into the registers
  PV(j-1) reads). Prologue QK(0), epilogue PV(last). Registers at D 128: acc 64 + S 64 + P 32.
- `tlx_pingpong` (PIPELINE, PINGPONG): the two consumers take turns on the tensor cores
  (inter-warp-group pingpong): consumer c waits on named barrier 11 + c before issuing its
  step's wgmma pair and arrives on the other's once they are issued, so the pairs alternate;
  consumer 1 arrives once at the start so consumer 0 goes first. Both consumers of a tile issue
  the same number of pairs (they share its key blocks), across persistent tiles too.

Math (docs/MATH.md §2), per query row y of head h, kv head
g = h // G:  t = q_y . k_x (fp32);  z = sum_{visible x} t^2;  acc = sum_{visible x} bf16(t) v_x;
r = c sqrt(z);  out = acc c / (r + eps) (0 where z = 0 or y >= Lq). No max, no rescale, no exp.

Warp groups of one CTA (BLOCK_M = 128 query rows of one (b, h), BLOCK_N-key blocks):
- producer ("default", 4 warps, 24 registers): TMA-loads the tile's Q as two 64-row halves
  (`q_fulls[c]`; consumer c frees its half, `q_empties[c]`, once its last QK is done, so the next
  tile's Q loads under the epilogue), then the tile's K and V blocks into rings of NUM_BUFFERS
  slots, K and V with their own full / empty barriers (a K slot frees as soon as QK has read it).
- two consumer warp groups, 64 rows each (240 registers): S = Q K^T (SS-wgmma), z += rowsum(S*S),
  P = bf16(S) in registers, acc += P V (RS-wgmma). Epilogue: out staged in the consumer's own
  o_tiles slot and TMA-stored through a [B, N, Hq*D] descriptor (rows past N clipped; the store is
  waited for only before the next tile's epilogue reuses the slot); r stored per row.
Shared memory at D 128: Q 32 KB + O 32 KB + K, V 2 x 2 x 32 KB = 192 KB; D 64: 160 KB.
Switches: PIPELINE issues QK(j) and PV(j-1) back to back and waits for QK(j) only (square-add under
PV(j-1)); PINGPONG makes the consumers take turns issuing wgmma (named barriers); PERSISTENT runs a
grid of min(#SMs, tiles) programs walking tiles (tile += programs), ring counters carried.
Tile order: (b, kv head) outermost, then the query block (descending when causal: long tiles first),
then the G query heads of the kv head (they read the same K/V blocks at the same time).
Masks: causal and varlen tiles mask only blocks past the first `n_full` (the diagonal block, the
block holding Lk); key blocks past Lk (or past the diagonal) are never loaded; a tile with no row
below Lq runs no mainloop and writes zeros.
PACKED (packed sequences, kernels_triton/spherical/host.py): tiles are the rows of a tile map
(a head's tile of one sequence; a sequence's tiles head by head, the sequences by work, largest
first; persistent programs walk them in that order), coordinates
local to the tile's sequence and offset by its first row at each TMA load; out and r leave by
masked stores of the sequence's own rows (no o_tiles staging: a TMA store of a tile that runs
past its sequence would overwrite the next one's rows).
"""
from __future__ import annotations


import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from altattn.registry import CompileConfig
from altattn.spherical.spec import SphericalSpec
from kernels_triton.proton import BF16_BYTES, enter, leave
from kernels_triton.spherical.host import (
    PerGrid,
    build_compile_configs,
    layout,
    packed_map,
    store_rows,
)
from kernels_triton.spherical.host import supports as host_supports
from kernels_triton.launch import Kernel, constexprs, sm_count
from kernels_tlx.consumers import NUM_CONSUMERS, pass_turn, take_turn
from kernels_tlx.ring import empty_phase, full_phase
from kernels_tlx.spherical.fwd_tiles import tile_info

ROWS = tl.constexpr(64)  # query rows per consumer warp group
EPILOGUE_BARRIER = tl.constexpr(13)  # 13 + c: consumer c's 128 threads around its output store


@triton.jit
def produce_tile(Qd, Kd, Vd, q_tiles, k_tiles, v_tiles, q_fulls, q_empties, k_fulls, k_empties,
                 v_fulls, v_empties, tile, it, cnt, Seqlens, N, NK, n_m, HQ: tl.constexpr,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 NUM_BUFFERS: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
                 PACKED: tl.constexpr, PROFILE: tl.constexpr):
    """Producer, one tile (the `it`-th of this program; ring position `cnt`): Q halves, then K and
    V blocks 0 .. n_blocks - 1. Returns the ring position after the tile."""
    b, h, g, m0, q0, k0, _, _, n_blocks = tile_info(tile, n_m, Seqlens, N, NK, HQ, G, BLOCK_M,
                                                    BLOCK_N, CAUSAL, VARLEN, PACKED)
    for c in tl.static_range(NUM_CONSUMERS):
        tlx.barrier_wait(tlx.local_view(q_empties, c), empty_phase(it, 1))
        q_full = tlx.local_view(q_fulls, c)
        tlx.barrier_expect_bytes(q_full, ROWS * D * BF16_BYTES)
        tlx.async_descriptor_load(Qd, tlx.local_view(q_tiles, c), [b, q0 + m0 + c * ROWS, h * D],
                                  q_full)
    for t in range(n_blocks):
        buf = cnt % NUM_BUFFERS
        phase = empty_phase(cnt, NUM_BUFFERS)
        enter("load_kv", PROFILE)
        tlx.barrier_wait(tlx.local_view(k_empties, buf), phase)
        k_full = tlx.local_view(k_fulls, buf)
        tlx.barrier_expect_bytes(k_full, BLOCK_N * D * BF16_BYTES)
        tlx.async_descriptor_load(Kd, tlx.local_view(k_tiles, buf), [b, k0 + t * BLOCK_N, g * D],
                                  k_full)
        tlx.barrier_wait(tlx.local_view(v_empties, buf), phase)
        v_full = tlx.local_view(v_fulls, buf)
        tlx.barrier_expect_bytes(v_full, BLOCK_N * D * BF16_BYTES)
        tlx.async_descriptor_load(Vd, tlx.local_view(v_tiles, buf), [b, k0 + t * BLOCK_N, g * D],
                                  v_full)
        leave("load_kv", PROFILE)
        cnt += 1
    return cnt


@triton.jit
def wait_full(fulls, cnt, NUM_BUFFERS: tl.constexpr, PROFILE: tl.constexpr):
    """Wait until ring slot cnt % NUM_BUFFERS holds block cnt; returns the slot index."""
    buf = cnt % NUM_BUFFERS
    enter("wait_kv", PROFILE)
    tlx.barrier_wait(tlx.local_view(fulls, buf), full_phase(cnt, NUM_BUFFERS))
    leave("wait_kv", PROFILE)
    return buf


@triton.jit
def square(s, z, t, rows, Lk, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
           PROFILE: tl.constexpr):
    """The step that replaces softmax: with MASK, scores of key block t set to 0 where invisible
    (x >= Lk, causal x > y); z += rowsum(s^2). Returns (s, z)."""
    enter("square", PROFILE)
    if MASK:
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        keep = cols[None, :] < Lk
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        s = tl.where(keep, s, 0.0)
    z += tl.sum(s * s, 1)
    leave("square", PROFILE)
    return s, z


@triton.jit
def qk(q_smem, k_tiles, kb, cid, PINGPONG: tl.constexpr, PROFILE: tl.constexpr):
    """Issue S = Q K^T on K slot kb (the consumer's turn, with pingpong); not waited for."""
    enter("qk_gemm", PROFILE)
    take_turn(cid, PINGPONG)
    s = tlx.async_dot(q_smem, tlx.local_trans(tlx.local_view(k_tiles, kb)))
    leave("qk_gemm", PROFILE)
    return s


@triton.jit
def pv(s, acc, v_tiles, v_fulls, v_empties, cnt, cid, NUM_BUFFERS: tl.constexpr,
       PINGPONG: tl.constexpr, PROFILE: tl.constexpr):
    """acc += bf16(S) @ V on ring slot cnt (the consumer's turn, with pingpong), waited for; the
    V slot released. The plain step's second half and the pipeline's last PV."""
    p = s.to(tl.bfloat16)
    vb = wait_full(v_fulls, cnt, NUM_BUFFERS, PROFILE)
    enter("pv_gemm", PROFILE)
    take_turn(cid, PINGPONG)
    acc = tlx.async_dot(p, tlx.local_view(v_tiles, vb), acc)
    pass_turn(cid, PINGPONG)
    acc = tlx.async_dot_wait(0, acc)
    leave("pv_gemm", PROFILE)
    tlx.barrier_arrive(tlx.local_view(v_empties, vb), 1)
    return acc


@triton.jit
def step(q_smem, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, acc, z, cnt, t,
         rows, Lk, cid, BLOCK_N: tl.constexpr, NUM_BUFFERS: tl.constexpr, MASK: tl.constexpr,
         CAUSAL: tl.constexpr, PINGPONG: tl.constexpr, PROFILE: tl.constexpr):
    """Plain step on key block t (ring position cnt): QK, wait, square, PV, wait."""
    kb = wait_full(k_fulls, cnt, NUM_BUFFERS, PROFILE)
    s = qk(q_smem, k_tiles, kb, cid, PINGPONG, PROFILE)
    pass_turn(cid, PINGPONG)
    enter("qk_gemm", PROFILE)
    s = tlx.async_dot_wait(0, s)
    leave("qk_gemm", PROFILE)
    tlx.barrier_arrive(tlx.local_view(k_empties, kb), 1)
    s, z = square(s, z, t, rows, Lk, BLOCK_N, MASK, CAUSAL, PROFILE)
    acc = pv(s, acc, v_tiles, v_fulls, v_empties, cnt, cid, NUM_BUFFERS, PINGPONG, PROFILE)
    return acc, z


@triton.jit
def pipelined_step(q_smem, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, acc, z, s,
                   cnt, t, rows, Lk, cid, BLOCK_N: tl.constexpr,
                   NUM_BUFFERS: tl.constexpr, CAUSAL: tl.constexpr, PINGPONG: tl.constexpr,
                   PROFILE: tl.constexpr):
    """Pipelined step t >= 1 on an unmasked block (block t at ring position cnt; s = S(t - 1),
    squared): issue QK(t) and PV(t - 1), wait for QK(t), square S(t) under PV(t - 1), wait for
    PV(t - 1).
    Returns (acc, z, S(t))."""
    # P(t - 1) is converted here, in the step that issues its PV: a bf16 P carried around the
    # loop makes ptxas swap the halves of every packed register before the wgmma (32 PRMT)
    p = s.to(tl.bfloat16)
    kb = wait_full(k_fulls, cnt, NUM_BUFFERS, PROFILE)
    s = qk(q_smem, k_tiles, kb, cid, PINGPONG, PROFILE)
    vb = wait_full(v_fulls, cnt - 1, NUM_BUFFERS, PROFILE)
    enter("pv_gemm", PROFILE)
    acc = tlx.async_dot(p, tlx.local_view(v_tiles, vb), acc)
    pass_turn(cid, PINGPONG)
    leave("pv_gemm", PROFILE)
    enter("qk_gemm", PROFILE)
    s = tlx.async_dot_wait(1, s)  # QK(t) done; PV(t - 1) may still run
    leave("qk_gemm", PROFILE)
    tlx.barrier_arrive(tlx.local_view(k_empties, kb), 1)
    s, z = square(s, z, t, rows, Lk, BLOCK_N, False, CAUSAL, PROFILE)  # under PV(t - 1)
    enter("pv_gemm", PROFILE)
    acc = tlx.async_dot_wait(0, acc)
    leave("pv_gemm", PROFILE)
    tlx.barrier_arrive(tlx.local_view(v_empties, vb), 1)
    return acc, z, s


@triton.jit
def mainloop(q_smem, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, acc, z, cnt,
             n_blocks, n_full, rows, Lk, cid, BLOCK_N: tl.constexpr, NUM_BUFFERS: tl.constexpr,
             CAUSAL: tl.constexpr, PIPELINE: tl.constexpr, PINGPONG: tl.constexpr,
             PROFILE: tl.constexpr):
    """One consumer's key loop over blocks 0 .. n_blocks - 1 (n_blocks >= 1), ring position cnt:
    blocks below n_full unmasked, the rest masked (a loop each: a mask under a runtime branch
    keeps two copies of S live).
    Returns (acc, z, cnt)."""
    if PIPELINE:
        if n_full > 0:
            # prologue: S(0), squared; it waits in registers (fp32) for PV(0)
            kb = wait_full(k_fulls, cnt, NUM_BUFFERS, PROFILE)
            s = qk(q_smem, k_tiles, kb, cid, PINGPONG, PROFILE)
            pass_turn(cid, PINGPONG)
            enter("qk_gemm", PROFILE)
            s = tlx.async_dot_wait(0, s)
            leave("qk_gemm", PROFILE)
            tlx.barrier_arrive(tlx.local_view(k_empties, kb), 1)
            s, z = square(s, z, 0, rows, Lk, BLOCK_N, False, CAUSAL, PROFILE)
            for t in range(1, n_full):
                cnt += 1
                acc, z, s = pipelined_step(q_smem, k_tiles, v_tiles, k_fulls, k_empties, v_fulls,
                                           v_empties, acc, z, s, cnt, t, rows, Lk, cid, BLOCK_N,
                                           NUM_BUFFERS, CAUSAL, PINGPONG, PROFILE)
            acc = pv(s, acc, v_tiles, v_fulls, v_empties, cnt, cid, NUM_BUFFERS, PINGPONG,
                     PROFILE)
            cnt += 1
        # the masked blocks (causal diagonal, the block holding Lk: one per tile when
        # BLOCK_M = BLOCK_N) run the plain step: the mask's temporaries next to an in-flight
        # acc and P made ptxas serialize the wgmma (C7512) and spill
        for t in range(n_full, n_blocks):
            acc, z = step(q_smem, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, acc,
                          z, cnt, t, rows, Lk, cid, BLOCK_N, NUM_BUFFERS, True, CAUSAL,
                          PINGPONG, PROFILE)
            cnt += 1
    else:
        for t in range(n_full):
            acc, z = step(q_smem, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, acc,
                          z, cnt, t, rows, Lk, cid, BLOCK_N, NUM_BUFFERS, False, CAUSAL,
                          PINGPONG, PROFILE)
            cnt += 1
        for t in range(n_full, n_blocks):
            acc, z = step(q_smem, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties, acc,
                          z, cnt, t, rows, Lk, cid, BLOCK_N, NUM_BUFFERS, True, CAUSAL,
                          PINGPONG, PROFILE)
            cnt += 1
    return acc, z, cnt


@triton.jit
def epilogue(acc, z, o_smem, Od, R, b, h, q0, row0, Lq, N, sm_scale, eps, cid,
             HQ: tl.constexpr, D: tl.constexpr, PACKED: tl.constexpr, PROFILE: tl.constexpr):
    """r = c sqrt(z), out = acc c / (r + eps), both 0 on rows >= Lq or with z = 0; r stored per
    row (< N), out staged in the consumer's o_smem (once the previous tile's store has read it)
    and TMA-stored (rows past N clipped), not waited for. PACKED: rows from q0, out and r by
    masked stores of rows < Lq alone (Od a pointer)."""
    enter("epilogue", PROFILE)
    rows = row0 + tl.arange(0, ROWS)
    real = rows < Lq
    r = sm_scale * tl.sqrt(z)
    scale = tl.where(real & (z > 0), sm_scale / (r + eps), 0.0)
    out = (acc * scale[:, None]).to(tl.bfloat16)
    if PACKED:
        tl.store(R + h.to(tl.int64) * N + q0 + rows, r, mask=real)
        store_rows(Od, out, q0, rows, real, HQ, h, D)
    else:
        tl.store(R + (b * HQ + h).to(tl.int64) * N + rows, tl.where(real, r, 0.0), mask=rows < N)
        tlx.async_descriptor_store_wait(0)
        tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)  # the previous store has read o_smem
        tlx.local_store(o_smem, out)
        tlx.fence_async_shared()
        tlx.named_barrier_wait(EPILOGUE_BARRIER + cid, 128)  # every thread's part is in o_smem
        tlx.async_descriptor_store(Od, o_smem, [b, row0, h * D])
    leave("epilogue", PROFILE)


@triton.jit
def consume_tile(Od, R, Seqlens, q_tiles, o_tiles, k_tiles, v_tiles, q_fulls, q_empties,
                 k_fulls, k_empties, v_fulls, v_empties, tile, it, cnt, cid, N, NK, n_m,
                 sm_scale, eps, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_BUFFERS: tl.constexpr,
                 CAUSAL: tl.constexpr, VARLEN: tl.constexpr, PIPELINE: tl.constexpr,
                 PINGPONG: tl.constexpr, PACKED: tl.constexpr, PROFILE: tl.constexpr):
    """Consumer cid, one tile (the `it`-th of this program, ring position cnt): its 64 rows.
    Returns the ring position after the tile."""
    b, h, _, m0, q0, _, Lq, Lk, n_blocks = tile_info(tile, n_m, Seqlens, N, NK, HQ, G, BLOCK_M,
                                                     BLOCK_N, CAUSAL, VARLEN, PACKED)
    row0 = m0 + cid * ROWS
    # blocks 0 .. n_full - 1 are visible to every row of this consumer: no mask
    n_full = Lk // BLOCK_N
    if CAUSAL:
        n_full = tl.minimum(n_full, (row0 + 1) // BLOCK_N)
    q_smem = tlx.local_view(q_tiles, cid)
    tlx.barrier_wait(tlx.local_view(q_fulls, cid), it & 1)
    acc = tl.zeros([ROWS, D], tl.float32)
    z = tl.zeros([ROWS], tl.float32)
    if n_blocks > 0:
        rows = row0 + tl.arange(0, ROWS)
        acc, z, cnt = mainloop(q_smem, k_tiles, v_tiles, k_fulls, k_empties, v_fulls, v_empties,
                               acc, z, cnt, n_blocks, n_full, rows, Lk, cid, BLOCK_N,
                               NUM_BUFFERS, CAUSAL, PIPELINE, PINGPONG, PROFILE)
    # every QK of the tile is done: the producer may load the next tile's Q half
    tlx.barrier_arrive(tlx.local_view(q_empties, cid), 1)
    epilogue(acc, z, tlx.local_view(o_tiles, cid), Od, R, b, h, q0, row0, Lq, N, sm_scale, eps,
             cid, HQ, D, PACKED, PROFILE)
    return cnt


@triton.jit
def spherical_fwd_kernel(Qd, Kd, Vd, Od, R, Seqlens, B, N, NK, sm_scale, eps,
                         HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                         CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_BUFFERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
                         PIPELINE: tl.constexpr,
                         PINGPONG: tl.constexpr, PERSISTENT: tl.constexpr,
                         PACKED: tl.constexpr = False, PROFILE: tl.constexpr = False):
    # PACKED: Seqlens is the tile map and B its rows per head; Od a pointer (module docstring)
    tl.static_assert(BLOCK_M == NUM_CONSUMERS * ROWS, "two consumers of 64 rows")
    n_m = tl.cdiv(N, BLOCK_M)
    if PACKED:
        n_tiles = B * HQ
    else:
        n_tiles = B * HQ * n_m
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    q_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, NUM_CONSUMERS)
    # each consumer's output staging tile (not its Q half: a tile that local_store writes gets
    # a proxy fence, MEMBAR.ALL.CTA, before every wgmma that reads it)
    o_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, NUM_CONSUMERS)
    k_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_BUFFERS)
    v_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_BUFFERS)
    q_fulls = tlx.alloc_barriers(num_barriers=NUM_CONSUMERS, arrive_count=1)
    q_empties = tlx.alloc_barriers(num_barriers=NUM_CONSUMERS, arrive_count=1)
    k_fulls = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    v_fulls = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    # every consumer thread arrives after its own wgmma has read the slot (warp barriers)
    k_empties = tlx.alloc_warp_barrier(num_barriers=NUM_BUFFERS, num_warps=4 * NUM_CONSUMERS)
    v_empties = tlx.alloc_warp_barrier(num_barriers=NUM_BUFFERS, num_warps=4 * NUM_CONSUMERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):
            if PERSISTENT:
                cnt = 0
                it = 0
                for tile in range(pid, n_tiles, nprog):
                    cnt = produce_tile(Qd, Kd, Vd, q_tiles, k_tiles, v_tiles, q_fulls, q_empties,
                                       k_fulls, k_empties, v_fulls, v_empties, tile, it, cnt,
                                       Seqlens, N, NK, n_m, HQ, G, D, BLOCK_M, BLOCK_N,
                                       NUM_BUFFERS, CAUSAL, VARLEN, PACKED, PROFILE)
                    it += 1
            else:
                produce_tile(Qd, Kd, Vd, q_tiles, k_tiles, v_tiles, q_fulls, q_empties, k_fulls,
                             k_empties, v_fulls, v_empties, pid, 0, pid * 0, Seqlens, N, NK, n_m, HQ,
                             G, D, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL, VARLEN, PACKED,
                             PROFILE)
        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid = tlx.async_task_replica_id()
            if PINGPONG:
                if cid == 1:
                    pass_turn(cid, PINGPONG)  # consumer 0 issues first
            if PERSISTENT:
                cnt = 0
                it = 0
                for tile in range(pid, n_tiles, nprog):
                    cnt = consume_tile(Od, R, Seqlens, q_tiles, o_tiles, k_tiles, v_tiles, q_fulls,
                                       q_empties, k_fulls, k_empties, v_fulls, v_empties, tile,
                                       it, cnt, cid, N, NK, n_m, sm_scale, eps, HQ, G, D,
                                       BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL, VARLEN, PIPELINE,
                                       PINGPONG, PACKED, PROFILE)
                    it += 1
                tlx.async_descriptor_store_wait(0)
            else:
                consume_tile(Od, R, Seqlens, q_tiles, o_tiles, k_tiles, v_tiles, q_fulls, q_empties,
                             k_fulls, k_empties, v_fulls, v_empties, pid, 0, pid * 0, cid, N, NK, n_m,
                             sm_scale, eps, HQ, G, D, BLOCK_M, BLOCK_N, NUM_BUFFERS, CAUSAL,
                             VARLEN, PIPELINE, PINGPONG, PACKED, PROFILE)
                tlx.async_descriptor_store_wait(0)


# ---- host side ---------------------------------------------------------------------------------

def config(spec: SphericalSpec, pipeline: bool, pingpong: bool,
           persistent: bool | None = None) -> dict:
    """BLOCK_M 128 (two consumers of 64 rows), BLOCK_N 128; K and V rings of 2 slots at D 128
    (Q + O 64 KB + 4 x 32 KB = 192 KB), 4 at D 64 (32 + 8 x 16 = 160 KB); consumers 240
    registers (the producer is left 24). Persistent unless causal (faster non-causal, slower
    causal: the persistent order balances causal tiles worse; docs/perf-spherical.md has the
    measurements); `persistent` overrides it."""
    return {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_BUFFERS": 2 if spec.D == 128 else 4,
            "CONSUMER_REGS": 240, "PIPELINE": pipeline, "PINGPONG": pingpong,
            "PERSISTENT": not spec.causal if persistent is None else persistent, "num_warps": 4,
            "num_stages": 1}


def supports(spec: SphericalSpec) -> str | None:
    return host_supports(spec)


def grid(spec: SphericalSpec, cfg: dict, per_head: int | None = None) -> tuple[int]:
    """One program per tile, or min(#SMs of the current GPU, tiles) programs walking tiles
    (PERSISTENT); packed: the tiles are the map's rows, heads x per_head (its tiles a head)."""
    tiles = spec.B * spec.Hq * triton.cdiv(spec.N, cfg["BLOCK_M"])
    if per_head is not None:
        tiles = spec.Hq * per_head
    if cfg["PERSISTENT"]:
        return (min(tiles, sm_count()),)
    return (tiles,)


def prepare_with(cfg: dict, spec: SphericalSpec, profile: bool = False):
    """The launch of `spec` with config `cfg` (config()), made once: run(q, k, v, seqlens, out,
    r) writes out [B, N, Hq, D] bf16 and r [B, Hq, N] fp32 from q [B, N, Hq, D], k, v
    [B, Nk, Hk, D] (bf16, contiguous) and seqlens (int32 [B], or None when not spec.varlen;
    spec.packed: altattn.packing.PackedSeqs, B = 1)."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    rows = layout(spec.B, spec.N, spec.Hq, spec.D, bm // 2)
    keys = layout(spec.B, spec.Nk, spec.Hk, spec.D, bn)
    opts = dict(HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=spec.D, CAUSAL=spec.causal,
                VARLEN=spec.varlen, PROFILE=bool(profile), num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], **constexprs(cfg))
    B, N, Nk, scale, eps = spec.B, spec.N, spec.Nk, spec.sm_scale, spec.eps
    if spec.packed:
        per_grid = PerGrid(spherical_fwd_kernel, lambda n: grid(spec, cfg, n), PACKED=True,
                           **opts)

        def run_packed(q, k, v, seqs, out, r) -> None:
            tiles, n = packed_map(seqs, N, bm, spec.causal, spec.Hq)
            if n:
                per_grid(n)(rows(q), keys(k), keys(v), out, r, tiles, n, N, Nk, scale, eps)

        return run_packed
    kernel = Kernel(spherical_fwd_kernel, grid(spec, cfg), **opts)

    def run(q, k, v, seqlens, out, r) -> None:
        kernel(rows(q), keys(k), keys(v), rows(out), r, seqlens, B, N, Nk, scale, eps)

    return run


def launch_with(cfg: dict, spec: SphericalSpec, q, k, v, seqlens, out, r,
                profile: bool = False) -> None:
    """One launch with config `cfg` (tuning and tests): prepare_with's, run once."""
    prepare_with(cfg, spec, profile)(q, k, v, seqlens, out, r)


def variant(pipeline: bool, pingpong: bool) -> dict:
    """The variant of these switches (altattn/registry.py: Variant.switches): its `supports`,
    `config`, `prepare`, `launch` and `compile_configs`."""
    cfg, prepare, launch, compile_configs = entry_points(pipeline, pingpong)
    return dict(supports=supports, config=cfg, prepare=prepare, launch=launch,
                compile_configs=compile_configs)


def entry_points(pipeline: bool, pingpong: bool):
    """`config`, `prepare`, `launch` and `compile_configs` (altattn/registry.py) of the shared
    kernel run with these switches."""

    def variant_config(spec: SphericalSpec, persistent: bool | None = None) -> dict:
        return config(spec, pipeline, pingpong, persistent)

    def prepare(spec: SphericalSpec, profile: bool = False):
        return prepare_with(variant_config(spec), spec, profile)

    def launch(spec: SphericalSpec, q, k, v, seqlens, out, r, profile: bool = False) -> None:
        prepare(spec, profile)(q, k, v, seqlens, out, r)

    def compile_configs() -> list[CompileConfig]:
        return build_compile_configs(prepare, "fwd")

    return variant_config, prepare, launch, compile_configs

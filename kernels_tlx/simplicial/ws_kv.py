"""`tlx_ws_kv`: `tlx_ws_keys` with the values' Hadamard product built by a producer too.

    S = Q @ (K1[j] * K2)^T,   acc += P @ (V1[j] * V2)     instead of   acc += (P @ V2) * V1[j]

For one j, (B_j, C_j) = (K1[j] * K2, V1[j] * V2) is a block of keys and values of ordinary
attention, so a consumer step is a FlashAttention step: one RS-wgmma for S, the online softmax,
acc *= alpha and one RS-wgmma that accumulates P @ C_j straight into acc. No P @ V2 tile
(64 registers) and no V1 multiply on the consumers' path.

Warp groups (4 warps each):
- producer of B ("default") and producer of C: per K2 (V2) block, TMA-load it into a slot that
  only this producer reads; then for each j of the window build B_j = K1[j] * K2 (C_j =
  V1[j] * V2) into ring slot c % NUM_B in CH-row chunks (packed bf16x2 multiplies), fence the
  proxy and mark the slot full. Two producers because one building both fell behind the
  consumers (docs/history/perf-notes.md, session 5).
- Two consumers, rows 64c .. 64c + 63 of the tile (one token's 128 heads), both on the same j.
  Each loads its Q rows into registers once (32 per thread) and keeps them there. Per step:
      S = Q @ B_j^T                 RS-wgmma (Q the register operand); B slot released
      online softmax in exp2
      acc = acc * alpha + P @ C_j   RS-wgmma accumulating into acc; C slot released
`PIPELINE` (the `tlx_pipelined_kv` variant: this module with switches, `variant`) issues the QK
wgmma of a step together with the PV wgmma of the one before (consume_pipelined): P of the
previous step is carried in registers, and a consumer holds only acc, S, P and its Q rows (zero
spills at 224 registers). In the compiled code ptxas writes the new P into the registers that
PV(c - 1) still reads, so the consumer waits for PV(c - 1) before its softmax ("ex2 under wgmma"
= 0 in `python -m tools.resources`): the gain over `tlx_ws_kv` is the pair issue, not a
softmax under PV (a version whose softmax does run under PV was slower,
docs/history/perf-notes.md session 12). `PINGPONG` on top of it (`tlx_pipelined_pingpong`) makes
the two consumers take turns issuing those pairs: consumer c waits on named barrier
TURN_BARRIER + c before its pair and arrives on the other's after (common.take_turn /
pass_turn); both run the same steps, so the turns always match. It is the fastest form "det"
forward at D = 128 (docs/perf.md).
Supports G = Hq/Hk = 128, D in {64, 128}, any B, N, Hk, w1 <= w2 (as tlx_ws_keys). VARLEN: one
launch over packed sequences (`packed_mask`); CACHE (trilinear): decoding, the keys read from KV
caches where they lie (hadamard.cache_tile; the masked blocks last, `consume_masked`).
Rounds K1[j] * K2 and V1[j] * V2 to bf16 (tests/simplicial/test_gpu.py emulates both).

Form "det" (DET = +-1, the pipelined variants only: PIPELINED_FORMS) is built keys-side, since
det[q; k1; k2] = q . (k1 x3 k2): the B producer builds B_j = K1[j] x3 K2 = K1a[j] * K2a +
K1b[j] * K2b from the host-packed rotations (kernels_triton/simplicial/det.py: det_keys_side), so each K2
block is two TMA loads and the consumers are unchanged. K2b's slot is the consumers' Q tiles
(shared memory has no 32 KB more): the consumers hold Q in registers (`held`) and release the
tiles on `q_free` before the producer's first load; the epilogue's use of them comes after the
last build. Rounds B_j as bf16(K1a[j] * K2a + bf16(K1b[j] * K2b)) (one fma.rn.bf16x2 and one
mul.rn.bf16x2 per pair).
"""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from kernels_tlx.simplicial.common import (NUM_CONSUMERS, acc_layout, held, opaque, pass_turn,
                                           release_layout, take_turn)
from kernels_tlx.simplicial.hadamard import (build, cache_block, cache_tile, row_tile,
                                             start_consumer, supports, token_tile)
from kernels_triton.simplicial.det import det_keys_side, det_of
from kernels_triton.simplicial.host import entry_points
from kernels_triton.simplicial.tiling import (BF16_BYTES, enter, key_block, leave, mask_scores,
                                              normalized, row_coords, softmax_step, write_rows)
from altattn.simplicial.spec import ProblemSpec
from kernels_tlx.ring import empty_phase, full_phase


@triton.jit
def produce_step(row, src_tile, dst_tiles, fulls, empties, c, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, NUM_B: tl.constexpr, CH: tl.constexpr,
                 DET: tl.constexpr = 0, row_b=None, src_b=None, MASK_ROWS: tl.constexpr = False,
                 n_rows=0):
    """Producer: wait for slot c % NUM_B of a ring, build row * src into it (DET: row * src +
    row_b * src_b; MASK_ROWS: rows n_rows on zero; hadamard.build), mark it full."""
    bs = c % NUM_B
    tlx.barrier_wait(tlx.local_view(empties, bs), empty_phase(c, NUM_B))
    build(row, src_tile, tlx.local_view(dst_tiles, bs), D, BLOCK_N, CH, DET, row_b, src_b,
          MASK_ROWS, n_rows)
    tlx.barrier_arrive(tlx.local_view(fulls, bs), 1)


@triton.jit
def qk_issue(q, b_tiles, b_fulls, c, NUM_B: tl.constexpr):
    """Consumer: wait for B_j of step c, issue S = Q @ B_j^T (not waited); Q in registers."""
    bs = c % NUM_B
    tlx.barrier_wait(tlx.local_view(b_fulls, bs), full_phase(c, NUM_B))
    return tlx.async_dot(q, tlx.local_trans(tlx.local_view(b_tiles, bs)))


@triton.jit
def pv_issue(p, acc, c_tiles, c_fulls, c, NUM_B: tl.constexpr):
    """Consumer: wait for C_j of step c, issue acc += P @ C_j (not waited)."""
    bs = c % NUM_B
    tlx.barrier_wait(tlx.local_view(c_fulls, bs), full_phase(c, NUM_B))
    return tlx.async_dot(p, tlx.local_view(c_tiles, bs), acc)


@triton.jit
def release(empties, c, NUM_B: tl.constexpr):
    tlx.barrier_arrive(tlx.local_view(empties, c % NUM_B), 1)


@triton.jit
def scores_softmax(s, c, n_j, j_first, k_lo, n_lo, n_hi, tok, w1, w2, qk_scale, m_i, l_i,
                   BLOCK_N: tl.constexpr, EDGE: tl.constexpr = "window"):
    """Mask step c's scores if its key block is an edge block; one online-softmax step. EDGE:
    "window" (a dense batch's tile), "packed" (`packed_mask`: n_j is the first masked step and
    k_lo the keys the last block holds), "cache" (`cache_block`: k_lo, n_lo, n_hi its a0, len1,
    len2) or "none" (a decoding tile's whole blocks, before `consume_masked`)."""
    if EDGE == "cache":
        n_valid = cache_block(c // n_j, k_lo, n_lo, n_hi, BLOCK_N)[1]
        if n_valid < BLOCK_N:
            s = tl.where((tl.arange(0, BLOCK_N) < n_valid)[None, :], s, float("-inf"))
    elif EDGE == "packed":
        if c >= n_j:
            s = tl.where((tl.arange(0, BLOCK_N) < k_lo)[None, :], s, float("-inf"))
    elif EDGE == "window":
        t = c // n_j
        if t >= n_hi - n_lo:
            kb, _ = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
            s = mask_scores(s, j_first + c - t * n_j, kb, tok, tl.arange(0, BLOCK_N), w1, w2,
                            False, True)
    return softmax_step(s, m_i, l_i, qk_scale)


@triton.jit
def packed_mask(kpos, k_lo, n_hi, n_blocks, n_j, BLOCK_N: tl.constexpr):
    """A packed tile's edge in two numbers (its token alone; its keys from k_lo, its j all seen):
    the first step of the last block when that block runs past the token (else no step), and
    the keys of that block the token sees. What `scores_softmax` takes in place of n_j and k_lo
    with VARLEN: fewer values held over the consumers' loop, none of them reloaded."""
    return n_hi * n_j, kpos - k_lo + 1 - (n_blocks - 1) * BLOCK_N


@triton.jit
def consume(acc, m_i, l_i, q, b_tiles, b_fulls, b_empties, c_tiles, c_fulls, c_empties,
            n_steps, n_j, j_first, k_lo, n_lo, n_hi, tok, w1, w2, qk_scale, BLOCK_N: tl.constexpr,
            NUM_B: tl.constexpr, PROFILE: tl.constexpr, EDGE: tl.constexpr = "window", c0=0):
    """One consumer warp group, one step after the other (steps c0 .. n_steps - 1): QK,
    softmax, PV."""
    for c in range(c0, n_steps):
        enter("qk_gemm", PROFILE)
        s = qk_issue(q, b_tiles, b_fulls, c, NUM_B)
        s = tlx.async_dot_wait(0, s)
        release(b_empties, c, NUM_B)
        leave("qk_gemm", PROFILE)
        enter("softmax", PROFILE)
        p, alpha, m_i, l_i = scores_softmax(s, c, n_j, j_first, k_lo, n_lo, n_hi, tok, w1, w2,
                                            qk_scale, m_i, l_i, BLOCK_N, EDGE)
        acc = acc * alpha[:, None]
        leave("softmax", PROFILE)
        enter("pv_gemm", PROFILE)
        acc = pv_issue(p.to(tl.bfloat16), acc, c_tiles, c_fulls, c, NUM_B)
        acc = tlx.async_dot_wait(0, acc)
        release(c_empties, c, NUM_B)
        leave("pv_gemm", PROFILE)
    return acc, m_i, l_i


@triton.jit
def consume_pipelined(acc, m_i, l_i, q, b_tiles, b_fulls, b_empties, c_tiles, c_fulls,
                      c_empties, n_steps, n_j, j_first, k_lo, n_lo, n_hi, tok, w1, w2, qk_scale,
                      cid, BLOCK_N: tl.constexpr, NUM_B: tl.constexpr, PINGPONG: tl.constexpr,
                      PROFILE: tl.constexpr, EDGE: tl.constexpr = "window", c0=0):
    """One consumer warp group, FlashAttention-3 style (steps c0 .. n_steps - 1, at least one):
    the QK wgmma of step c and the PV wgmma of step c - 1 are issued together, and QK(c) is
    waited for first. In the compiled code the softmax of step c does not run under PV(c - 1):
    ptxas computes the new P into the registers PV(c - 1) reads (p_prev is loop-carried) and so
    waits for it first (the module docstring). PINGPONG: the two consumers take turns issuing those pairs (both run
    n_steps steps)."""
    take_turn(cid, PINGPONG)
    s = qk_issue(q, b_tiles, b_fulls, c0, NUM_B)
    pass_turn(cid, PINGPONG)
    s = tlx.async_dot_wait(0, s)
    release(b_empties, c0, NUM_B)
    p, alpha, m_i, l_i = scores_softmax(s, c0, n_j, j_first, k_lo, n_lo, n_hi, tok, w1, w2,
                                        qk_scale, m_i, l_i, BLOCK_N, EDGE)
    if EDGE == "cache":  # a decoding tile's masked steps continue a run: acc is not empty
        acc = acc * alpha[:, None]
    p_prev = p.to(tl.bfloat16)
    for c in range(c0 + 1, n_steps):
        enter("qk_gemm", PROFILE)
        take_turn(cid, PINGPONG)
        s = qk_issue(q, b_tiles, b_fulls, c, NUM_B)
        acc = pv_issue(p_prev, acc, c_tiles, c_fulls, c - 1, NUM_B)
        pass_turn(cid, PINGPONG)
        s = tlx.async_dot_wait(1, s)  # QK(c) done, PV(c - 1) runs on
        release(b_empties, c, NUM_B)
        leave("qk_gemm", PROFILE)
        enter("softmax", PROFILE)
        p, alpha, m_i, l_i = scores_softmax(s, c, n_j, j_first, k_lo, n_lo, n_hi, tok, w1, w2,
                                            qk_scale, m_i, l_i, BLOCK_N, EDGE)
        leave("softmax", PROFILE)
        enter("pv_gemm", PROFILE)
        acc = tlx.async_dot_wait(0, acc)
        release(c_empties, c - 1, NUM_B)
        leave("pv_gemm", PROFILE)
        acc = acc * alpha[:, None]
        p_prev = p.to(tl.bfloat16)
    take_turn(cid, PINGPONG)
    acc = pv_issue(p_prev, acc, c_tiles, c_fulls, n_steps - 1, NUM_B)
    pass_turn(cid, PINGPONG)
    acc = tlx.async_dot_wait(0, acc)
    release(c_empties, n_steps - 1, NUM_B)
    return acc, m_i, l_i


@triton.jit
def consume_masked(acc, m_i, l_i, q, q_smem, b_tiles, b_fulls, b_empties, c_tiles, c_fulls,
                   c_empties, N, w1, w2, qk_scale, cid, Lens, n_split, T_new, shift, R1, R2,
                   HK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_B: tl.constexpr,
                   PROFILE: tl.constexpr, PIPELINE: tl.constexpr):
    """A decoding tile's masked blocks (at most two, `cache_block`'s last), after its unmasked
    ones: the tile's bounds found again from an opaque program id, and the QK wgmma reading Q
    from its shared-memory tile, not from registers: with Q's 32 registers free the masks fit
    (masked in the register-Q loop, they spilled 48-64 bytes). Form "det" has no CACHE mode:
    its Q tile is K2b's slot, and with Q in registers these steps spilled. Without PIPELINE
    they run one after the other, Q in registers (`consume`: fewer registers held). At D = 64
    ptxas serialized every wgmma of the pipelined kernels (C7514): CACHE is D = 128 only."""
    _, _, _, a0, len1, len2, n_blocks, _, n_j, _, _, _ = cache_tile(
        opaque(tl.program_id(0)), N, w1, w2, HK, D, BLOCK_N, Lens, n_split, T_new, shift, R1, R2)
    c0 = (len1 // BLOCK_N + len2 // BLOCK_N) * n_j
    if not PIPELINE:
        acc, m_i, l_i = consume(
            acc, m_i, l_i, q, b_tiles, b_fulls, b_empties, c_tiles, c_fulls, c_empties,
            n_blocks * n_j, n_j, 0, a0, len1, len2, 0, w1, w2, qk_scale, BLOCK_N, NUM_B, PROFILE,
            "cache", c0)
    elif c0 < n_blocks * n_j:
        acc, m_i, l_i = consume_pipelined(
            acc, m_i, l_i, q_smem, b_tiles, b_fulls, b_empties, c_tiles, c_fulls, c_empties,
            n_blocks * n_j, n_j, 0, a0, len1, len2, 0, w1, w2, qk_scale, cid, BLOCK_N, NUM_B,
            False, PROFILE, "cache", c0)
    return acc, m_i, l_i


@triton.jit
def produce(X1, X2, x2_tile, full, dst_tiles, fulls, empties, b, g, N, kv_base, j_first, n_j,
            n_blocks, k_lo, n_lo, n_hi, HK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
            NUM_B: tl.constexpr, CH: tl.constexpr, SCOPE: tl.constexpr, PROFILE: tl.constexpr,
            DET: tl.constexpr = 0, x2b_tile=None, q_free=None, MASK_ROWS: tl.constexpr = False,
            Seq=None, CACHE: tl.constexpr = False, R1=1):
    """A producer warp group: per key block, TMA-load X2 (K2 or V2) into `x2_tile` (free: this
    warp group's last builds read it before), then per j build X1[j] * X2 into the ring.
    DET (the B producer of form "det"): X1, X2 are det_keys_side's packed [B, N, HK, 2, D] K1
    and K2, so a key block is two TMA loads (K2a into x2_tile, K2b into x2b_tile), a j two K1
    rows, and B_j = K1a[j] * K2a + K1b[j] * K2b. x2b_tile is the consumers' Q tiles: the first
    load waits until both consumers hold Q in registers (`q_free`). MASK_ROWS (packed
    sequences, the C producer): the rows of keys past the token are built as zeros (its key
    row read from Seq again at each block: held from the start, it spills). CACHE (decoding):
    the blocks are `cache_block`'s (k_lo, n_lo, n_hi its a0, len1, len2), rows past a block's
    window built as zeros (MASK_ROWS), and X1[j] read at slot j mod R1."""
    SLOTS: tl.constexpr = 2 if DET else 1  # packed rows per token and head (det_keys_side)
    if DET:
        tlx.barrier_wait(q_free, 0)
    for t in range(0, n_blocks):
        n_rows = 0
        if CACHE:
            kb, n_rows = cache_block(t, k_lo, n_lo, n_hi, BLOCK_N)
        else:
            kb, _ = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
        enter("load_kv", PROFILE)
        tlx.barrier_expect_bytes(full, SLOTS * BLOCK_N * D * BF16_BYTES)
        tlx.async_descriptor_load(X2, x2_tile, [b, kb, SLOTS * g * D], full)
        if DET:
            tlx.async_descriptor_load(X2, x2b_tile, [b, kb, (2 * g + 1) * D], full)
        tlx.barrier_wait(full, t & 1)
        leave("load_kv", PROFILE)
        if CACHE:
            pass
        elif MASK_ROWS:
            n_rows = tl.load(Seq + 2 * (opaque(tl.program_id(0)) % N)) + 1 - kb
        for jj in range(0, n_j):
            # X1[j] (packed: its rows at SLOTS times the offset of an unpacked X1[j])
            j = j_first + jj
            if CACHE:  # j_first is a slot, n_j <= R1 (cache_tile)
                j = tl.where(j >= R1, j - R1, j)
            x1_row = SLOTS * (kv_base + j.to(tl.int64) * (HK * D))
            row = row_tile(X1, x1_row, D, CH)
            if DET:
                row_b = row_tile(X1, x1_row + D, D, CH)
            else:
                row_b = row
            enter(SCOPE, PROFILE)
            produce_step(row, x2_tile, dst_tiles, fulls, empties, t * n_j + jj, D, BLOCK_N, NUM_B,
                         CH, DET, row_b, x2b_tile, MASK_ROWS, n_rows)
            leave(SCOPE, PROFILE)


@triton.jit
def simplicial_fwd_ws_kv_kernel(Q, K1, K2, V1, V2, Out, Lse, N, w1, w2, qk_scale,
                                HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr,
                                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                NUM_B: tl.constexpr, CH: tl.constexpr,
                                CONSUMER_REGS: tl.constexpr, PRODUCER_REGS: tl.constexpr,
                                PIPELINE: tl.constexpr, PINGPONG: tl.constexpr = False,
                                PROFILE: tl.constexpr = False, DET: tl.constexpr = 0,
                                Seq=None, n_split=1, VARLEN: tl.constexpr = False,
                                CACHE: tl.constexpr = False, T_new=1, shift=None, R1=1, R2=1):
    # shift (CACHE only) defaults to None, not 0: a 0 would be a runtime argument past a dense
    # launch's positional ones, and keep kernels_triton/launch.py's Kernel on the JIT path
    HALF: tl.constexpr = BLOCK_M // NUM_CONSUMERS
    tl.static_assert(PIPELINE or not DET, "form det: pipelined consumers only (PIPELINED_FORMS)")
    tl.static_assert(not (CACHE and (DET or D != 128)), "CACHE: trilinear, D = 128 only")
    b, g, i0, h0, k_lo, n_lo, n_hi, n_blocks, j_first, n_j, kv_base, _, kpos = token_tile(
        N, w1, w2, HK, G, D, BLOCK_M, BLOCK_N, Seq, n_split, VARLEN, CACHE, T_new, shift, R1, R2)
    b_q = b  # Q's, Out's and Lse's batch element
    if CACHE:  # b is the caches'; the queries are [1, N, HQ, D]
        b_q = b * 0

    if DET:  # K2b's slot shares the Q tiles' bytes (shared memory has no 32 KB more)
        q_slot = tlx.storage_alias_spec()
        q_tiles = tlx.local_alloc((HALF, D), tl.bfloat16, NUM_CONSUMERS, reuse=q_slot)
        k2b_tile = tlx.local_view(tlx.local_alloc((BLOCK_N, D), tl.bfloat16, 1, reuse=q_slot), 0)
        q_free = tlx.local_view(tlx.alloc_warp_barrier(num_barriers=1,
                                                       num_warps=4 * NUM_CONSUMERS), 0)
    else:
        q_tiles = tlx.local_alloc((HALF, D), tl.bfloat16, NUM_CONSUMERS)  # consumer c's rows
        k2b_tile, q_free = None, None
    kv_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, 2)   # K2 (K2a), V2: read by a producer
    b_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_B)
    c_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_B)
    kv_fulls = tlx.alloc_barriers(num_barriers=2, arrive_count=1)
    # warp barriers: every thread arrives after its own shared-memory accesses, no warp-group
    # barrier before one thread's arrive (docs/sanitizers.md)
    b_fulls = tlx.alloc_warp_barrier(num_barriers=NUM_B, num_warps=4)
    b_empties = tlx.alloc_warp_barrier(num_barriers=NUM_B, num_warps=4 * NUM_CONSUMERS)
    c_fulls = tlx.alloc_warp_barrier(num_barriers=NUM_B, num_warps=4)
    c_empties = tlx.alloc_warp_barrier(num_barriers=NUM_B, num_warps=4 * NUM_CONSUMERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer of B_j = K1[j] * K2 (K1[j] x3 K2)
            produce(K1, K2, tlx.local_view(kv_tiles, 0), tlx.local_view(kv_fulls, 0), b_tiles,
                    b_fulls, b_empties, b, g, N, kv_base, j_first, n_j, n_blocks, k_lo, n_lo,
                    n_hi, HK, D, BLOCK_N, NUM_B, CH, "build_b", PROFILE, DET, k2b_tile, q_free,
                    CACHE=CACHE, R1=R1)
        with tlx.async_task(num_warps=4, registers=PRODUCER_REGS):  # producer of C_j = V1[j] * V2
            produce(V1, V2, tlx.local_view(kv_tiles, 1), tlx.local_view(kv_fulls, 1), c_tiles,
                    c_fulls, c_empties, b, g, N, kv_base, j_first, n_j, n_blocks, k_lo, n_lo,
                    n_hi, HK, D, BLOCK_N, NUM_B, CH, "build_c", PROFILE, MASK_ROWS=VARLEN,
                    Seq=Seq, CACHE=CACHE, R1=R1)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid = tlx.async_task_replica_id()
            q_smem = tlx.local_view(q_tiles, cid)
            tok, head, m_i, l_i, acc = start_consumer(Q, q_smem, cid, b_q, g, i0, h0, N, HQ, G,
                                                      D, BLOCK_M)
            # Q into registers once: the register operand of every QK wgmma, so a step reads only
            # B_j from shared memory (16 KB less per step, docs/history/perf-notes.md session 10)
            if DET:  # Q's tile becomes K2b's slot: Q is held in registers (`held`: never re-
                # loaded from the tile; the accumulator's layout is the wgmma A operand's), and
                # these reads end before the producer's first TMA
                q = held(release_layout(tlx.local_load(q_smem, layout=acc_layout(D))))
                tlx.fence_async_shared()
                tlx.barrier_arrive(q_free, 1)
            else:
                q = tlx.local_load(q_smem)
            n_steps = n_blocks * n_j
            empty = False
            if CACHE:  # cache_block's whole blocks first, then the masked (consume_masked)
                n_steps = (n_lo // BLOCK_N + n_hi // BLOCK_N) * n_j
                empty = n_steps == 0
            elif VARLEN:  # a split share with no j: the empty softmax state is written
                empty = n_steps == 0
                n_j, k_lo = packed_mask(kpos, k_lo, n_hi, n_blocks, n_j, BLOCK_N)
            if empty:
                pass
            elif CACHE:
                if PINGPONG:
                    if cid == 1:
                        pass_turn(cid, PINGPONG)  # consumer 0 issues first
                if PIPELINE:
                    acc, m_i, l_i = consume_pipelined(
                        acc, m_i, l_i, q, b_tiles, b_fulls, b_empties, c_tiles, c_fulls,
                        c_empties, n_steps, n_j, j_first, k_lo, n_lo, n_hi, tok, w1, w2,
                        qk_scale, cid, BLOCK_N, NUM_B, PINGPONG, PROFILE, "none")
                else:
                    acc, m_i, l_i = consume(
                        acc, m_i, l_i, q, b_tiles, b_fulls, b_empties, c_tiles, c_fulls,
                        c_empties, n_steps, n_j, j_first, k_lo, n_lo, n_hi, tok, w1, w2,
                        qk_scale, BLOCK_N, NUM_B, PROFILE, "none")
            elif PIPELINE:
                if PINGPONG:
                    if cid == 1:
                        pass_turn(cid, PINGPONG)  # consumer 0 issues first
                acc, m_i, l_i = consume_pipelined(
                    acc, m_i, l_i, q, b_tiles, b_fulls, b_empties, c_tiles, c_fulls,
                    c_empties, n_steps, n_j, j_first, k_lo, n_lo, n_hi, tok, w1, w2, qk_scale,
                    cid, BLOCK_N, NUM_B, PINGPONG, PROFILE, "packed" if VARLEN else "window")
            else:
                acc, m_i, l_i = consume(
                    acc, m_i, l_i, q, b_tiles, b_fulls, b_empties, c_tiles, c_fulls,
                    c_empties, n_steps, n_j, j_first, k_lo, n_lo, n_hi, tok, w1, w2, qk_scale,
                    BLOCK_N, NUM_B, PROFILE, "packed" if VARLEN else "window")
            if CACHE:  # the masked blocks, their bounds found again (held, they spill)
                acc, m_i, l_i = consume_masked(
                    acc, m_i, l_i, q, q_smem, b_tiles, b_fulls, b_empties, c_tiles, c_fulls,
                    c_empties, N, w1, w2, qk_scale, cid, Seq, n_split, T_new, shift, R1, R2, HK, D,
                    BLOCK_N, NUM_B, PROFILE, PIPELINE)
            enter("epilogue", PROFILE)
            # O passes through this consumer's Q tile (free now): the layout change for the
            # store then needs no scratch, which shared memory could not spare
            tlx.local_store(q_smem, normalized(acc, l_i))
            if VARLEN:  # split s writes the s-th [N, HQ, D] and [HQ, N] planes (token_tile);
                # the rows' coordinates found again here (held over the loop, they spill)
                pid = opaque(tl.program_id(0))
                split = (pid // N) % n_split
                Out += split.to(tl.int64) * N * HQ * D
                Lse += split.to(tl.int64) * HQ * N
                tok, head = row_coords(pid % N, 0, cid * HALF + tl.arange(0, HALF), G, BLOCK_M)
            write_rows(Out, Lse, tlx.local_load(q_smem), m_i, l_i, b_q, g, tok, head, N, HQ, G,
                       D)
            leave("epilogue", PROFILE)


def config(spec: ProblemSpec, pipelined: bool = False, pingpong: bool = False) -> dict:
    """Every shape: 128-row tile, 128-key blocks, two B and two C slots (all that fits in shared
    memory at D = 128 beside Q and the K2/V2 slots), 8-row build chunks (docs/history/perf-notes.md
    session 5); consumers at 224 registers, which Q in registers needs (216 spill), and so the two
    producers at 32 (24 spill; session 10). Form "det" adds DET (kernels_triton/simplicial/det.py: det_of)."""
    cfg = dict(BLOCK_M=128, BLOCK_N=128, NUM_B=2, CH=8, CONSUMER_REGS=224, PRODUCER_REGS=32,
               PIPELINE=pipelined, PINGPONG=pingpong, num_warps=4, num_stages=1)
    if spec.form == "det":
        cfg["DET"] = det_of(spec)
    return cfg


# The forms of the pipelined variants that run this kernel (form "det": keys-side, det_keys_side).
# `tlx_ws_kv` itself computes the trilinear form only: with DET and PIPELINE off, ptxas put the
# softmax's P into the registers that hold Q, which the next step's QK wgmma reads (wrong scores
# from the second step on; the pipelined consumers keep them apart).
PIPELINED_FORMS = ("trilinear", "det")


def variant(pipelined: bool, pingpong: bool = False) -> dict:
    """The pipelined variants (altattn/registry.py: Variant.switches): this kernel with PIPELINE
    (and PINGPONG), which also computes form "det"."""
    def variant_config(spec: ProblemSpec) -> dict:
        return config(spec, pipelined, pingpong)

    prepare, launch, compile_configs = entry_points(
        simplicial_fwd_ws_kv_kernel, variant_config, supports, forms=PIPELINED_FORMS,
        det_pack=det_keys_side, packed=True)
    return dict(supports=supports, config=variant_config, prepare=prepare, launch=launch,
                compile_configs=compile_configs)


prepare, launch, compile_configs = entry_points(simplicial_fwd_ws_kv_kernel, config, supports,
                                               packed=True)

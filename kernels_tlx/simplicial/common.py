"""Device pieces every TLX variant shares: the consumer count, named barriers, accumulator
layouts, the TMA producer loop, the pingpong turns, the split-j merge epilogue, `opaque`, `fresh`,
`held`, `bulk_wait`. The host side (descriptors, launch, compile configs) is
kernels_triton/simplicial/host.py, shared with the Triton kernel; the G = 128 build pieces are in
hadamard.py. A variant file holds only its technique."""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from kernels_tlx.consumers import (CONSUMER_THREADS, NUM_CONSUMERS, TURN_BARRIER,  # noqa: F401
                                   pass_turn, take_turn)
from kernels_triton.simplicial.tiling import BF16_BYTES, enter, key_block, leave, store_rows
from kernels_tlx.ring import empty_phase

# NUM_CONSUMERS, CONSUMER_THREADS, TURN_BARRIER and the pingpong turns: kernels_tlx/consumers.py
# Named barriers (this build's compiler emits ids 0-3 for its own partition syncs; fbtriton's
# tutorials reserve 0-6; tools.resources lists the ids each kernel uses):
MERGE_BARRIER = tl.constexpr(9)    # the split-j hand-over of (acc, m, l): bar.arrive, bar.sync
EPILOGUE_BARRIER = tl.constexpr(13)  # 13 + c: consumer c's epilogue (bwd row- and k-owner, 128)
ENDS_BARRIER = tl.constexpr(10)  # `tlx_pairs`' end: consumer 1 arrives, consumer 0 waits (256)


# The register layout of a 64-row wgmma accumulator of 4 warps (one warp group), as
# (thread, value) modes over a [64, D] row-major tile: lanes 4 x 2 columns, 8 rows; warps 16 rows;
# per thread 2 adjacent columns, rows r and r + 8, every 8th column group.
@triton.constexpr_function
def acc_layout(d):
    return tlx.layout(shape=((4, 8, 4), (2, 2, d // 8)), stride=((2, d, 16 * d), (1, 8 * d, 8)))


@triton.constexpr_function
def v1_layout(d):
    """The columns of a 64-row wgmma accumulator as a [d] vector: per thread 2 adjacent columns in
    every 8th column group, lanes 4 x 2 columns; the 8 row lanes and the 4 warps hold copies
    (see acc_layout). Equal to the compiler's slice of that accumulator along its rows."""
    return tlx.layout(shape=((4, 8, 4), (2, d // 8)), stride=((2, 0, 0), (1, 8)))


@triton.jit
def produce_kv(K2, V2, k2_tiles, v2_tiles, fulls, empties, first, n_loads, n_blocks, k_lo, n_lo,
               n_hi, b, g, N, D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_BUFFERS: tl.constexpr,
               PROFILE: tl.constexpr):
    """Producer warp group: TMA-load blocks c = first .. first+n_loads-1 (block c % n_blocks of the
    tile's key sequence) into ring slot c % NUM_BUFFERS. `empties` (one arrival per consumer) frees
    a slot; `fulls` (1 arrival + the transaction bytes) says it has landed."""
    for c in range(first, first + n_loads):
        buf = c % NUM_BUFFERS
        kb, _ = key_block(c % n_blocks, k_lo, n_lo, n_hi, BLOCK_N)
        enter("load_kv", PROFILE)
        tlx.barrier_wait(tlx.local_view(empties, buf), empty_phase(c, NUM_BUFFERS))
        full = tlx.local_view(fulls, buf)
        tlx.barrier_expect_bytes(full, 2 * BLOCK_N * D * BF16_BYTES)  # a K2 and a V2 block
        # (host.kv_layout: a block past the batch's last token reads zeros there)
        tlx.async_descriptor_load(K2, tlx.local_view(k2_tiles, buf), [b, kb, g * D], full)
        tlx.async_descriptor_load(V2, tlx.local_view(v2_tiles, buf), [b, kb, g * D], full)
        leave("load_kv", PROFILE)


@triton.jit
def merge_and_store(acc, m_i, l_i, cid, merge_acc, merge_m, Out, Lse, b, g, tok, head, N,
                    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    """Split-j epilogue: consumer 1 hands (acc, m, l) to consumer 0 through shared memory
    (`merge_acc` [rows, D] fp32, `merge_m` 2 x [rows] fp32); consumer 0 merges the two softmax
    states and writes O and LSE."""
    if cid == 1:
        tlx.local_store(merge_acc, acc)
        tlx.local_store(tlx.local_view(merge_m, 0), m_i)
        tlx.local_store(tlx.local_view(merge_m, 1), l_i)
        tlx.named_barrier_arrive(MERGE_BARRIER, CONSUMER_THREADS)
    else:
        tlx.named_barrier_wait(MERGE_BARRIER, CONSUMER_THREADS)
        m_o = tlx.local_load(tlx.local_view(merge_m, 0))
        l_o = tlx.local_load(tlx.local_view(merge_m, 1))
        m_new = tl.maximum(m_i, m_o)
        a_self = tl.math.exp2(m_i - m_new)
        a_other = tl.math.exp2(m_o - m_new)
        # loaded straight into the accumulator's layout (the pin is then released so it meets acc):
        # otherwise the compiler moves acc to the load's layout through 32 KB of scratch
        other = release_layout(tlx.local_load(merge_acc, layout=acc_layout(D)))
        acc = acc * a_self[:, None] + other * a_other[:, None]
        store_rows(Out, Lse, acc, m_new, l_i * a_self + l_o * a_other, b, g, tok, head, N, HQ, G,
                   D)


@triton.jit
def opaque(x):
    """An int32 tensor equal to x that the compiler cannot see through (an inline-asm move): what
    is computed from it is computed where it is used. Against LLVM hoisting index arithmetic out
    of a warp-specialized region or keeping it alive across a loop (ptxas then spills it)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def fresh(x):
    """An int32 equal to x from a volatile inline-asm move, where it stands: not hoisted out of a
    loop (what is derived from it is recomputed in each iteration, not held across it)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def bulk_wait(PENDING: tl.constexpr = 0):
    """Wait until this thread's bulk (TMA) stores and reduce-adds but the last PENDING (0 or 1)
    have completed, their writes to global memory included (`cp.async.bulk.wait_group`;
    tlx.async_descriptor_store_wait is the `.read` form: the shared-memory source has been
    read). A no-op in a thread that issued none."""
    tl.static_assert(PENDING == 0 or PENDING == 1, "bulk_wait: PENDING 0 or 1")
    if PENDING == 0:
        tl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n mov.b32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("cp.async.bulk.wait_group 1;\n mov.b32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def held(x):
    """A bf16 tensor equal to x, made by a volatile inline-asm move where it stands: a tile
    loaded from shared memory and passed through it stays in registers from there on. (Without
    it the compiler may sink the load to the tile's uses, re-reading shared memory in a loop:
    it does so for the Q of `tlx_ws_kv`'s consumers.)"""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16,
                                     is_pure=False, pack=2)


@tl.core.builtin
def release_layout(x, _semantic=None):
    """Drop the user pin of a tensor loaded with `tlx.local_load(..., layout=...)`, keeping its
    layout, so that it may meet tensors of an equal compiler layout (this build exports no
    release op)."""
    return tl.tensor(_semantic.builder.create_release_layout(x.handle), x.type)


@triton.jit
def dot_pair_release(a1, b1, acc1, a2, b2, acc2, empty, PROFILE: tl.constexpr):
    """acc1 += a1 @ b1, then acc2 += a2 @ b2 (a in registers, rounded to bf16; b in shared
    memory), both waited for; then this thread's arrive on `empty`, a warp barrier: the slot of
    the b tiles is free (the backward's k-owner and row-owner step)."""
    enter("pv_gemm", PROFILE)
    acc1 = tlx.async_dot(a1.to(tl.bfloat16), b1, acc1)
    acc2 = tlx.async_dot(a2.to(tl.bfloat16), b2, acc2)
    acc1 = tlx.async_dot_wait(1, acc1)
    acc2 = tlx.async_dot_wait(0, acc2)
    tlx.barrier_arrive(empty, 1)
    leave("pv_gemm", PROFILE)
    return acc1, acc2

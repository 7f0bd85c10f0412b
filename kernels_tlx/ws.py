"""`tlx_ws`: warp-specialized TLX forward (the seeds' Kernel-1).

Warp groups:
- producer ("default", 4 warps, registers given away): walks the tile's K2/V2 blocks in the order of
  `kernels_triton.tiling.key_block` and TMA-loads each into a ring of NUM_BUFFERS shared-memory
  slots; `fulls[i]` (1 arrival + transaction bytes) says a slot is loaded, `empties[i]` (one arrival
  per consumer) says both consumers are done with it.
- Two consumer warp groups (4 warps, 64 rows each) share every K2/V2 slot, so each
  block crosses L2 -> shared memory once per 128 rows. Each keeps its Q rows in shared memory and,
  for every j of the w1 window: A = Q * K1[j] in registers -> RS-wgmma with K2^T -> online softmax
  in exp2 -> wgmma P @ V2 -> acc = acc * alpha + (P @ V2) * V1[j] (V1 multiplies the GEMM output;
  V1 * V2 is never built in shared memory). K1[j]/V1[j] are D-vectors read through L1.
Tile geometry (heads x neighbouring tokens, interior/edge blocks, masks) is the plain Triton
kernel's (kernels_triton/tiling.py). Supports any B, N, Hk, w1 <= w2, D in {64, 128}, G a power of
two up to 128 (G < 64 packs neighbouring tokens; G >= 128 splits heads over CTAs).
Differs from `triton`: TMA producer + mbarrier ring, two consumer groups sharing each K2/V2 slot.
"""
from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.tlx as tlx
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels_triton.tiling import (LOG2E, grid, key_block, key_blocks, load_q, mask_scores,
                                   row_coords, softmax_step, store_rows, tile_coords)
from kernels_triton.tiling import supports  # noqa: F401  (this variant's registry `supports`)
from simplicial_attn.registry import CompileConfig
from simplicial_attn.spec import ProblemSpec


@triton.jit
def consume_block(acc, m_i, l_i, q_smem, k2_tile, v2_tile, k1_base, v1_base, kb, j_lo, j_hi, tok,
                  w1, w2, qk_scale, HK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK_J: tl.constexpr, MASK_K: tl.constexpr):
    """One consumer warp group: one K2/V2 slot against every j of the window."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k2t = tlx.local_trans(k2_tile)
    for j in range(j_lo, j_hi + 1):
        k1j = tl.load(k1_base + j.to(tl.int64) * (HK * D) + offs_d)
        v1j = tl.load(v1_base + j.to(tl.int64) * (HK * D) + offs_d).to(tl.float32)
        a = tlx.local_load(q_smem) * k1j[None, :]
        s = tlx.async_dot(a, k2t)
        s = tlx.async_dot_wait(0, s) * qk_scale
        s = mask_scores(s, j, kb, tok, offs_n, w1, w2, MASK_J, MASK_K)
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        pv = tlx.async_dot(p.to(tl.bfloat16), v2_tile)
        pv = tlx.async_dot_wait(0, pv)
        acc = acc * alpha[:, None] + pv * v1j[None, :]
    return acc, m_i, l_i


@triton.jit
def simplicial_fwd_ws_kernel(Q, K1, K2, V1, V2, Out, Lse, N, w1, w2, qk_scale,
                             HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr,
                             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             NUM_BUFFERS: tl.constexpr, CONSUMER_REGS: tl.constexpr):
    ROWS: tl.constexpr = BLOCK_M // 2  # rows per consumer warp group
    T: tl.constexpr = BLOCK_M // (BLOCK_M if G > BLOCK_M else G)
    b = tl.program_id(1) // HK
    g = tl.program_id(1) % HK
    i0, h0, i_hi = tile_coords(tl.program_id(0), N, G, BLOCK_M)
    k_lo, n_lo, n_hi, n_blocks = key_blocks(i0, i_hi, w2, T, BLOCK_N)

    q_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, 2)
    k2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_BUFFERS)
    v2_tiles = tlx.local_alloc((BLOCK_N, D), tl.bfloat16, NUM_BUFFERS)
    fulls = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    empties = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=2)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: TMA ring of K2/V2 blocks
            for t in range(0, n_blocks):
                buf = t % NUM_BUFFERS
                phase = (t // NUM_BUFFERS) & 1
                kb, _ = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
                tlx.barrier_wait(tlx.local_view(empties, buf), phase ^ 1)
                full = tlx.local_view(fulls, buf)
                tlx.barrier_expect_bytes(full, 2 * 2 * BLOCK_N * D)
                row = b * N + kb
                tlx.async_descriptor_load(K2, tlx.local_view(k2_tiles, buf), [row, g * D], full)
                tlx.async_descriptor_load(V2, tlx.local_view(v2_tiles, buf), [row, g * D], full)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=2):
            cid = tlx.async_task_replica_id()
            tok, head = row_coords(i0, h0, cid * ROWS + tl.arange(0, ROWS), G, BLOCK_M)
            q_smem = tlx.local_view(q_tiles, cid)
            tlx.local_store(q_smem, load_q(Q, b, g, tok, head, N, HQ, G, D))
            kv_base = b.to(tl.int64) * N * (HK * D) + g * D
            j_lo = tl.maximum(i0 - w1 + 1, 0)
            m_i = tl.full([ROWS], -1.0e30, tl.float32)
            l_i = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, D], tl.float32)
            n_int = n_hi - n_lo
            for t in range(0, n_blocks):
                buf = t % NUM_BUFFERS
                kb, masked = key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
                tlx.barrier_wait(tlx.local_view(fulls, buf), (t // NUM_BUFFERS) & 1)
                k2_tile = tlx.local_view(k2_tiles, buf)
                v2_tile = tlx.local_view(v2_tiles, buf)
                if t < n_int:
                    acc, m_i, l_i = consume_block(acc, m_i, l_i, q_smem, k2_tile, v2_tile,
                                                  K1 + kv_base, V1 + kv_base, kb, j_lo, i_hi, tok,
                                                  w1, w2, qk_scale, HK, D, BLOCK_N, T > 1, False)
                else:
                    acc, m_i, l_i = consume_block(acc, m_i, l_i, q_smem, k2_tile, v2_tile,
                                                  K1 + kv_base, V1 + kv_base, kb, j_lo, i_hi, tok,
                                                  w1, w2, qk_scale, HK, D, BLOCK_N, T > 1, True)
                tlx.barrier_arrive(tlx.local_view(empties, buf), 1)
            store_rows(Out, Lse, acc, m_i, l_i, b, g, tok, head, N, HQ, G, D)


def _config(spec: ProblemSpec) -> dict:
    return dict(BLOCK_M=128, BLOCK_N=128, NUM_BUFFERS=2, CONSUMER_REGS=240, num_warps=4,
                num_stages=1)


def kv_descriptor(t, spec: ProblemSpec, block_n: int) -> TensorDescriptor:
    """TMA view of a contiguous [B, N, Hk, D] tensor as [B*N, Hk*D]; a block is [block_n, D] at
    [b*N + token, g*D]. Rows past a batch's N belong to the next batch (or are zero past B*N): they
    only reach keys that the mask removes."""
    hd = spec.Hk * spec.D
    return TensorDescriptor(t, shape=[spec.B * spec.N, hd], strides=[hd, 1],
                            block_shape=[block_n, spec.D])


def launch(spec: ProblemSpec, q, k1, k2, v1, v2, out, lse) -> None:
    cfg = _config(spec)
    k2d, v2d = (kv_descriptor(t, spec, cfg["BLOCK_N"]) for t in (k2, v2))
    simplicial_fwd_ws_kernel[grid(spec, cfg["BLOCK_M"])](
        q, k1, k2d, v1, v2d, out, lse, spec.N, spec.w1, spec.w2, spec.sm_scale * LOG2E,
        HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=spec.D, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], NUM_BUFFERS=cfg["NUM_BUFFERS"], CONSUMER_REGS=cfg["CONSUMER_REGS"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def compile_configs() -> list[CompileConfig]:
    out = []
    for hq, d in ((128, 128), (64, 128), (16, 64)):
        spec = ProblemSpec(B=1, N=4096, Hq=hq, Hk=1, D=d, w1=32, w2=512, sm_scale=d ** -0.5)
        cfg = _config(spec)
        desc = f"tensordesc<bf16[{cfg['BLOCK_N']},{d}]>"
        sig = dict(Q="*bf16", K1="*bf16", K2=desc, V1="*bf16", V2=desc, Out="*bf16", Lse="*fp32",
                   N="i32", w1="i32", w2="i32", qk_scale="fp32")
        consts = dict(HQ=hq, HK=1, G=hq, D=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                      NUM_BUFFERS=cfg["NUM_BUFFERS"], CONSUMER_REGS=cfg["CONSUMER_REGS"])
        sig.update({k: "constexpr" for k in consts})
        out.append(CompileConfig(f"G{hq}_D{d}_M{cfg['BLOCK_M']}_N{cfg['BLOCK_N']}",
                                 simplicial_fwd_ws_kernel, sig, consts, cfg["num_warps"],
                                 cfg["num_stages"]))
    return out

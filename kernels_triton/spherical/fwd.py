"""`triton`: the plain-Triton spherical attention forward (FlashAttention-2's mainloop, softmax
replaced by the L2 row norm).

One program per (b, query head h, BLOCK_M rows); the G query heads of a KV head run side by side
(host.py's grid). Q is loaded once by TMA; each key block of K and V arrives by TMA (Triton's
software pipeline keeps num_stages of them in flight) and
    t   = Q K^T                  (tensor cores, fp32)     [BLOCK_M, BLOCK_N]
    z  += rowsum(t * t)          (the "square" step: one FMA per score, fp32)
    acc += bf16(t) V             (tensor cores, fp32)
No running max, no rescale, no exp. Epilogue: r = c sqrt(z), out = acc c / (r + eps), written by
TMA (bf16; rows past N clipped), r by a masked store; rows past Lq get out = 0, r = 0.
Key blocks: [0, n_full) unmasked, then the few that need a mask (the causal diagonal, the block
holding Lk): host.key_blocks. Causal tiles skip blocks past their last row; with seqlens, blocks
past Lk are skipped and tiles past Lq visit none (they only write zeros).
Warps: num_warps (8) of one group, no warp specialization (Triton's pipeliner does the overlap);
the TLX siblings (kernels_tlx/spherical) add a TMA producer warp group and consumer groups.
Supports every shape host.supports takes: any B, N, Nk, G; D 64 and 128; causal; seqlens; packed
sequences (PACKED: a program per tile-map row, out and r by masked stores: host.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from altattn.registry import CompileConfig
from altattn.spherical.spec import SphericalSpec
from kernels_triton.launch import Kernel, constexprs
from kernels_triton.proton import enter, leave
from kernels_triton.spherical.host import (
    PerGrid,
    build_compile_configs,
    layout,
    key_blocks,
    packed_map,
    packed_row_tile,
    row_grid,
    row_tile,
    seq_bounds,
    store_rows,
    supports,  # noqa: F401  (this variant's `supports`)
)


@triton.jit
def _step(acc, z, q, K, V, b, g, k0, x0, rows, Lk, D: tl.constexpr, BLOCK_N: tl.constexpr,
          MASK: tl.constexpr, CAUSAL: tl.constexpr, PROFILE: tl.constexpr):
    """One key block at x0 (of the keys from row k0): acc += bf16(t) V, z += rowsum(t^2) (t = 0
    where hidden if MASK)."""
    enter("load_kv", PROFILE)
    k = K.load([b, k0 + x0, g * D]).reshape(BLOCK_N, D)
    v = V.load([b, k0 + x0, g * D]).reshape(BLOCK_N, D)
    leave("load_kv", PROFILE)
    enter("qk_gemm", PROFILE)
    t = tl.dot(q, tl.trans(k))
    leave("qk_gemm", PROFILE)
    enter("square", PROFILE)
    if MASK:
        x = x0 + tl.arange(0, BLOCK_N)
        vis = (x < Lk)[None, :]
        if CAUSAL:
            vis = vis & (x[None, :] <= rows[:, None])
        t = tl.where(vis, t, 0.0)
    z += tl.sum(t * t, 1)
    p = t.to(tl.bfloat16)
    leave("square", PROFILE)
    enter("pv_gemm", PROFILE)
    acc = tl.dot(p, v, acc)
    leave("pv_gemm", PROFILE)
    return acc, z


@triton.jit
def spherical_fwd_kernel(Q, K, V, Out, R, Seqlens, N, Nk, sm_scale, eps,
                         HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                         CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         PACKED: tl.constexpr = False, PROFILE: tl.constexpr = False):
    if PACKED:  # Seqlens is the tile map, Out a pointer; rows and keys from q0, k0
        h, q0, k0, Lq, Lk, m0 = packed_row_tile(Seqlens)
        g = h // G
        b = 0
    else:
        b, g, h, m0 = row_tile(N, HK, G, BLOCK_M, CAUSAL)
        Lq, Lk = seq_bounds(Seqlens, b, N, Nk, VARLEN)
        q0 = 0
        k0 = 0
    n_full, n_all = key_blocks(m0, Lq, Lk, CAUSAL, BLOCK_M, BLOCK_N)
    rows = m0 + tl.arange(0, BLOCK_M)
    q = Q.load([b, q0 + m0, h * D]).reshape(BLOCK_M, D)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    z = tl.zeros([BLOCK_M], tl.float32)
    for j in range(n_full):  # every row sees every key
        acc, z = _step(acc, z, q, K, V, b, g, k0, j * BLOCK_N, rows, Lk, D, BLOCK_N,
                       False, CAUSAL, PROFILE)
    for j in range(n_full, n_all):  # the causal diagonal, the block holding Lk
        acc, z = _step(acc, z, q, K, V, b, g, k0, j * BLOCK_N, rows, Lk, D, BLOCK_N,
                       True, CAUSAL, PROFILE)
    enter("epilogue", PROFILE)
    live = rows < Lq
    r = tl.where(live, sm_scale * tl.sqrt(z), 0.0)
    scale = tl.where(live, sm_scale / (r + eps), 0.0)
    out = (acc * scale[:, None]).to(tl.bfloat16)
    if PACKED:  # this sequence's rows only
        store_rows(Out, out, q0, rows, live, HQ, h, D)
        tl.store(R + h.to(tl.int64) * N + q0 + rows, r, mask=live)
    else:
        Out.store([b, m0, h * D], out.reshape(1, BLOCK_M, D))
        tl.store(R + (b.to(tl.int64) * HQ + h) * N + rows, r, mask=rows < N)
    leave("epilogue", PROFILE)


def config(spec: SphericalSpec) -> dict:
    """Tile: 128 rows (two warp groups of 64) x 128 keys, 8 warps, 3 stages of K/V in flight
    (a Triton FlashAttention forward's Hopper config; no exp, so the same tile is GEMM-bound).
    D = 64: 4 stages (half the bytes per stage)."""
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3 if spec.D == 128 else 4}


def prepare(spec: SphericalSpec, profile: bool = False, cfg: dict | None = None):
    """The launch of `spec`, made once: run(q, k, v, seqlens, out, r) writes out [B, N, Hq, D]
    bf16 and r [B, Hq, N] fp32 from q [B, N, Hq, D], k, v [B, Nk, Hk, D] (bf16, contiguous) and
    seqlens (int32 [B], or None unless spec.varlen; spec.packed: altattn.packing.PackedSeqs, B = 1).
    cfg: another tile config (tuning)."""
    cfg = cfg or config(spec)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    rows = layout(spec.B, spec.N, spec.Hq, spec.D, bm)
    keys = layout(spec.B, spec.Nk, spec.Hk, spec.D, bn)
    opts = dict(HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=spec.D, CAUSAL=spec.causal,
                VARLEN=spec.varlen, PROFILE=bool(profile), num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], **constexprs(cfg))
    N, Nk, scale, eps = spec.N, spec.Nk, spec.sm_scale, spec.eps
    if spec.packed:
        per_grid = PerGrid(spherical_fwd_kernel, lambda n: (spec.Hq * n,), PACKED=True, **opts)

        def run_packed(q, k, v, seqs, out, r) -> None:
            tiles, n = packed_map(seqs, N, bm, spec.causal, spec.Hq)
            if n:
                per_grid(n)(rows(q), keys(k), keys(v), out, r, tiles, N, Nk, scale, eps)

        return run_packed
    kernel = Kernel(spherical_fwd_kernel, row_grid(spec, bm), **opts)

    def run(q, k, v, seqlens, out, r) -> None:
        kernel(rows(q), keys(k), keys(v), rows(out), r, seqlens, N, Nk, scale, eps)

    return run


def launch(spec: SphericalSpec, q, k, v, seqlens, out, r, profile: bool = False,
           cfg: dict | None = None) -> None:
    prepare(spec, profile, cfg)(q, k, v, seqlens, out, r)


def compile_configs() -> list[CompileConfig]:
    """The forward's configs and the decoding step's (kernels_triton/spherical/decode.py)."""
    from kernels_triton.spherical import decode
    return build_compile_configs(prepare, "fwd") + decode.compile_configs()

"""`triton` backward: the gradients of spherical attention in plain Triton, deterministic (no
atomics: every sum is made by one program in a fixed order).

FlashAttention-2's backward (the Triton tutorial's split), with the softmax line replaced. Per row
the lead's `row_coeffs` (bwd_common.py) gives A = c/(r + eps) and Bt = c^2 (dr - delta a)/r
(0 on rows past Lq); per visible pair, with t = q . k (unscaled) and dP = dout . v,
    P = A t        ds = A dP + Bt t
    dv[x] = sum_y P dout[y]     dk[x] = sum_y ds q[y]     dq[y] = sum_x ds k[x]
Two kernels after row_coeffs:
  1. `_dkdv_kernel` (key owner): one program per (b, kv head, BLOCK_N keys) holds K, V and fp32
     dK, dV; for each of the kv head's G query heads and each BLOCK_M query block (by TMA):
     t^T = K Q^T, P^T = A t^T, dV += bf16(P^T) dout, dP^T = V dout^T, ds^T, dK += bf16(ds^T) Q
     (4 GEMMs); the sum over the G heads runs in the program, in order. Causal: query blocks
     start at the key block (the first cdiv(BLOCK_N, BLOCK_M) masked x <= y, the rest not);
     blocks past Lq are skipped, rows past Lq have A = Bt = 0.
  2. `_dq_kernel` (row owner): one program per (b, query head, BLOCK_M rows), the forward's grid and
     key-block sequence (host.key_blocks): t = Q K^T, dP = dout V^T, ds, dQ += bf16(ds) K (3 GEMMs).
Keys past Lk and rows past Lq get zero gradients (at the store; keys need a mask only in dQ, since a
key's dk/dv reads only its own column; dk/dv of keys past Lk are zeroed by a multiply, so padding
must be finite, as the forward also assumes). Executed GEMMs 7 for the 5 useful ones.
Warps: 8 (dK/dV) and 8 (dQ), one group each, no warp specialization; the TLX siblings
(kernels_tlx/spherical/bwd_ws*) add producers. Supports every shape host.supports takes, and
packed sequences (PACKED: key-tile and row-tile maps, rows past a sequence's end read with
A = Bt = 0, masked stores; host.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from altattn.registry import CompileConfig
from altattn.spherical.spec import SphericalSpec
from kernels_triton.launch import Kernel, constexprs
from kernels_triton.proton import enter, leave, profiled
from kernels_triton.spherical.bwd_common import coeff_row0, prepare_row_coeffs
from kernels_triton.spherical.host import (
    PerGrid,
    build_compile_configs,
    layout,
    key_blocks,
    key_grid,
    key_tile,
    packed_map,
    packed_row_tile,
    query_blocks,
    row_grid,
    row_tile,
    seq_bounds,
    store_rows,
    supports,  # noqa: F401  (this variant's `supports`)
)

KERNELS = ("dkdv", "dq")  # the Proton-scoped kernels (profiled_kernels)


@triton.jit
def _dkdv_step(dk, dv, k, v, Q, DO, A, Bt, b, h, ab, q0, m0, keys, N, D: tl.constexpr,
               BLOCK_M: tl.constexpr, MASK: tl.constexpr, PROFILE: tl.constexpr):
    """The query block at m0 (of the rows from q0; rows >= N read A = Bt = 0) of head h against
    the program's keys (keys are the GEMM rows)."""
    enter("load_kv", PROFILE)
    q = Q.load([b, q0 + m0, h * D]).reshape(BLOCK_M, D)
    do = DO.load([b, q0 + m0, h * D]).reshape(BLOCK_M, D)
    rows = m0 + tl.arange(0, BLOCK_M)
    a = tl.load(A + ab + q0 + rows, mask=rows < N, other=0.0)
    bt = tl.load(Bt + ab + q0 + rows, mask=rows < N, other=0.0)
    leave("load_kv", PROFILE)
    enter("qk_gemm", PROFILE)
    tt = tl.dot(k, tl.trans(q))  # t^T [BLOCK_N, BLOCK_M]
    leave("qk_gemm", PROFILE)
    enter("square", PROFILE)
    if MASK:
        tt = tl.where(keys[:, None] <= rows[None, :], tt, 0.0)
    pt = (tt * a[None, :]).to(tl.bfloat16)
    leave("square", PROFILE)
    enter("pv_gemm", PROFILE)
    dv = tl.dot(pt, do, dv)
    leave("pv_gemm", PROFILE)
    enter("qk_gemm", PROFILE)
    dpt = tl.dot(v, tl.trans(do))  # dP^T
    leave("qk_gemm", PROFILE)
    enter("square", PROFILE)
    dst = dpt * a[None, :] + tt * bt[None, :]
    if MASK:
        dst = tl.where(keys[:, None] <= rows[None, :], dst, 0.0)
    dst = dst.to(tl.bfloat16)
    leave("square", PROFILE)
    enter("pv_gemm", PROFILE)
    dk = tl.dot(dst, q, dk)
    leave("pv_gemm", PROFILE)
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, DK, DV, A, Bt, Seqlens, N, Nk,
                 HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr = False,
                 PROFILE: tl.constexpr = False):
    if PACKED:  # Seqlens is the key-tile map, DK and DV pointers; rows past Lq read A = Bt = 0
        g, q0, k0, Lq, Lk, x0 = packed_row_tile(Seqlens)
        b = 0
        n_rows = Lq
    else:
        b, g, x0 = key_tile(Nk, HK, BLOCK_N)
        Lq, Lk = seq_bounds(Seqlens, b, N, Nk, VARLEN)
        q0 = 0
        k0 = 0
        n_rows = N
    m_lo, n_diag, n_all = query_blocks(x0, Lq, Lk, CAUSAL, BLOCK_M, BLOCK_N)
    keys = x0 + tl.arange(0, BLOCK_N)
    enter("load_kv", PROFILE)
    k = K.load([b, k0 + x0, g * D]).reshape(BLOCK_N, D)
    v = V.load([b, k0 + x0, g * D]).reshape(BLOCK_N, D)
    leave("load_kv", PROFILE)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for hg in range(G):  # the kv head's query heads, in order
        h = g * G + hg
        ab = coeff_row0(b, h, N, HQ)  # row 0 of (b, h) in A, Bt
        if CAUSAL:  # the diagonal: rows x0 .. x0 + BLOCK_N - 1
            for i in range(n_diag):
                dk, dv = _dkdv_step(dk, dv, k, v, Q, DO, A, Bt, b, h, ab, q0,
                                    m_lo + i * BLOCK_M, keys, n_rows, D, BLOCK_M, True, PROFILE)
        for i in range(n_diag, n_all):  # every row sees every key
            dk, dv = _dkdv_step(dk, dv, k, v, Q, DO, A, Bt, b, h, ab, q0, m_lo + i * BLOCK_M,
                                keys, n_rows, D, BLOCK_M, False, PROFILE)
    enter("epilogue", PROFILE)
    # keys past Lk: zero, by a multiply (finite inputs, as the forward assumes): a select on the
    # accumulators here makes ptxas serialize the loop's wgmmas (C7514) at G = 1, non-causal
    if PACKED:  # this sequence's keys only
        store_rows(DK, dk.to(tl.bfloat16), k0, keys, keys < Lk, HK, g, D)
        store_rows(DV, dv.to(tl.bfloat16), k0, keys, keys < Lk, HK, g, D)
    else:
        live = tl.where(keys < Lk, 1.0, 0.0)[:, None]
        DK.store([b, x0, g * D], (dk * live).to(tl.bfloat16).reshape(1, BLOCK_N, D))
        DV.store([b, x0, g * D], (dv * live).to(tl.bfloat16).reshape(1, BLOCK_N, D))
    leave("epilogue", PROFILE)


@triton.jit
def _dq_step(dq, q, do, a, bt, K, V, b, g, k0, x0, rows, Lk, D: tl.constexpr,
             BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
             PROFILE: tl.constexpr):
    """The key block at x0 (of the keys from row k0) against the program's rows: dq += bf16(ds)
    K."""
    enter("load_kv", PROFILE)
    k = K.load([b, k0 + x0, g * D]).reshape(BLOCK_N, D)
    v = V.load([b, k0 + x0, g * D]).reshape(BLOCK_N, D)
    leave("load_kv", PROFILE)
    enter("qk_gemm", PROFILE)
    t = tl.dot(q, tl.trans(k))
    dp = tl.dot(do, tl.trans(v))
    leave("qk_gemm", PROFILE)
    enter("square", PROFILE)
    ds = dp * a[:, None] + t * bt[:, None]
    if MASK:
        x = x0 + tl.arange(0, BLOCK_N)
        vis = (x < Lk)[None, :]
        if CAUSAL:
            vis = vis & (x[None, :] <= rows[:, None])
        ds = tl.where(vis, ds, 0.0)
    ds = ds.to(tl.bfloat16)
    leave("square", PROFILE)
    enter("pv_gemm", PROFILE)
    dq = tl.dot(ds, k, dq)
    leave("pv_gemm", PROFILE)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, DO, DQ, A, Bt, Seqlens, N, Nk,
               HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
               CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr = False,
               PROFILE: tl.constexpr = False):
    if PACKED:  # Seqlens is the row-tile map, DQ a pointer
        h, q0, k0, Lq, Lk, m0 = packed_row_tile(Seqlens)
        g = h // G
        b = 0
        n_rows = Lq
    else:
        b, g, h, m0 = row_tile(N, HK, G, BLOCK_M, CAUSAL)
        Lq, Lk = seq_bounds(Seqlens, b, N, Nk, VARLEN)
        q0 = 0
        k0 = 0
        n_rows = N
    n_full, n_all = key_blocks(m0, Lq, Lk, CAUSAL, BLOCK_M, BLOCK_N)
    rows = m0 + tl.arange(0, BLOCK_M)
    q = Q.load([b, q0 + m0, h * D]).reshape(BLOCK_M, D)
    do = DO.load([b, q0 + m0, h * D]).reshape(BLOCK_M, D)
    ab = coeff_row0(b, h, N, HQ) + q0
    a = tl.load(A + ab + rows, mask=rows < n_rows, other=0.0)
    bt = tl.load(Bt + ab + rows, mask=rows < n_rows, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for j in range(n_full):  # every row sees every key
        dq = _dq_step(dq, q, do, a, bt, K, V, b, g, k0, j * BLOCK_N, rows, Lk, D, BLOCK_N,
                      False, CAUSAL, PROFILE)
    for j in range(n_full, n_all):  # the causal diagonal, the block holding Lk
        dq = _dq_step(dq, q, do, a, bt, K, V, b, g, k0, j * BLOCK_N, rows, Lk, D, BLOCK_N,
                      True, CAUSAL, PROFILE)
    enter("epilogue", PROFILE)
    live = rows < Lq
    dq = tl.where(live[:, None], dq, 0.0).to(tl.bfloat16)
    if PACKED:
        store_rows(DQ, dq, q0, rows, live, HQ, h, D)
    else:
        DQ.store([b, m0, h * D], dq.reshape(1, BLOCK_M, D))
    leave("epilogue", PROFILE)


def config(spec: SphericalSpec) -> dict:
    """{"dkdv": ..., "dq": ...}: each kernel's tile and warps/stages, the fastest measured at P1
    (H200) among those that compile with no spill at every compile spec (python -m
    tools.resources). dK/dV: 128 keys (two warp groups of 64 rows) with fp32 dK and dV in
    registers (128 of the 255) against query blocks of 64 rows where the masks leave room (D = 64;
    D = 128 without causal or seqlens), else 32 rows, 3 stages (causal); with both masks 32 rows
    x 64 keys, 2 stages (128 keys spill); dQ: 128 rows x 64 keys. docs/perf-spherical.md has
    the measurements behind each choice. Packed sequences mask rows as seqlens does; packed
    causal at D = 64 runs 2 stages (3 spill: not timed against the alternatives)."""
    masked_rows = spec.varlen or spec.packed
    if spec.D == 64:
        # packed causal: 2 stages (3 held 255 registers and spilled 8 bytes: the sequence's
        # bounds from the tile map are registers the dense kernel does not hold)
        dkdv = (64, 128, 2) if spec.causal and spec.packed else (64, 128, 3)
    elif not spec.causal and not masked_rows:
        dkdv = (64, 128, 2)
    else:
        dkdv = (32, 64, 2) if spec.causal and masked_rows else (32, 128, 3)
    return {"dkdv": {"BLOCK_M": dkdv[0], "BLOCK_N": dkdv[1], "num_warps": 8,
                     "num_stages": dkdv[2]},
            "dq": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}}


def profiled_kernels(spec: SphericalSpec) -> dict[str, int]:
    """The Proton-scoped kernels, by the name launch(..., profile=name) takes, with their warps."""
    cfg = config(spec)
    return {name: cfg[name]["num_warps"] for name in KERNELS}


def prepare(spec: SphericalSpec, profile: bool | str = False, cfg: dict | None = None):
    """The launches of `spec`, made once: run(q, k, v, out, r, dout, dr, seqlens, dq, dk, dv)
    writes dq [B, N, Hq, D], dk, dv [B, Nk, Hk, D] (bf16) from the forward's inputs and outputs
    and dout (bf16 [B, N, Hq, D]), dr (fp32 [B, Hq, N] or None), seqlens (int32 [B] or None;
    spec.packed: altattn.packing.PackedSeqs, B = 1). profile: True (both kernels' scoped
    copies), "dkdv" or "dq" (that one). cfg: tuning."""
    cfg = cfg or config(spec)
    coeffs = prepare_row_coeffs(spec)
    common = {"HQ": spec.Hq, "HK": spec.Hk, "G": spec.G, "D": spec.D, "CAUSAL": spec.causal,
              "VARLEN": spec.varlen}
    kernels, descs = {}, {}
    for name, fn, grid in (("dkdv", _dkdv_kernel, key_grid), ("dq", _dq_kernel, row_grid)):
        c = cfg[name]
        bm, bn = c["BLOCK_M"], c["BLOCK_N"]
        descs[name] = (layout(spec.B, spec.N, spec.Hq, spec.D, bm),
                       layout(spec.B, spec.Nk, spec.Hk, spec.D, bn))
        opts = dict(common, PROFILE=profiled(profile, name, KERNELS), num_warps=c["num_warps"],
                    num_stages=c["num_stages"], **constexprs(c))
        if spec.packed:  # a program per map row: heads x tiles (host.packed_map)
            heads = spec.Hk if name == "dkdv" else spec.Hq
            kernels[name] = PerGrid(fn, lambda n, h=heads: (h * n,), PACKED=True, **opts)
        else:
            kernels[name] = Kernel(fn, grid(spec, bn if name == "dkdv" else bm), **opts)
    N, Nk = spec.N, spec.Nk
    if spec.packed:
        def run_packed(q, k, v, out, r, dout, dr, seqs, dq, dk, dv) -> None:
            A, Bt = coeffs(out, dout, r, dr, None)
            rows, keys = descs["dkdv"]
            tiles, n = packed_map(seqs, Nk, cfg["dkdv"]["BLOCK_N"], spec.causal, spec.Hk,
                                  keys=True)
            if n:
                kernels["dkdv"](n)(rows(q), keys(k), keys(v), rows(dout), dk, dv, A, Bt, tiles,
                                   N, Nk)
            rows, keys = descs["dq"]
            tiles, n = packed_map(seqs, N, cfg["dq"]["BLOCK_M"], spec.causal, spec.Hq)
            if n:
                kernels["dq"](n)(rows(q), keys(k), keys(v), rows(dout), dq, A, Bt, tiles, N, Nk)

        return run_packed

    def run(q, k, v, out, r, dout, dr, seqlens, dq, dk, dv) -> None:
        A, Bt = coeffs(out, dout, r, dr, seqlens)
        rows, keys = descs["dkdv"]
        kernels["dkdv"](rows(q), keys(k), keys(v), rows(dout), keys(dk), keys(dv), A, Bt,
                        seqlens, N, Nk)
        rows, keys = descs["dq"]
        kernels["dq"](rows(q), keys(k), keys(v), rows(dout), rows(dq), A, Bt, seqlens, N, Nk)

    return run


def launch(spec: SphericalSpec, q, k, v, out, r, dout, dr, seqlens, dq, dk, dv,
           profile: bool | str = False, cfg: dict | None = None) -> None:
    prepare(spec, profile, cfg)(q, k, v, out, r, dout, dr, seqlens, dq, dk, dv)


def compile_configs() -> list[CompileConfig]:
    return build_compile_configs(prepare, "bwd", {_dkdv_kernel: "dkdv_", _dq_kernel: "dq_"})

"""`tlx_ws_det` spherical backward: bitwise repeatable (no atomics, every sum in a fixed order).

Two warp-specialized kernels after kernels_triton/spherical/bwd_common.row_coeffs:
1. `_dkv_kernel` of bwd_common.py with WITH_DQ=False: dK, dV per key block (its docstring).
2. `_dq_kernel` (this file): dQ per block of 128 query rows of one query head, FlashAttention-2's
   dQ loop with the softmax step replaced (no exp):
       S = Q K^T,  dP = dO V^T + R S  (the wgmma accumulates onto R S, R = Bt / A),
       dS = A dP (masked),  dQ += dS K             (3 wgmmas per key block)
   Warp groups: producer ("default", 4 warps) TMA-loads each consumer's 64 rows of Q and dO once
   (`q_full`), then streams blocks of 128 keys of K and V through NUM_STAGES slots (`kv_fulls`;
   `kv_empties`, one arrival per consumer thread). Two consumers (setmaxnreg CONSUMER_REGS) own
   64 rows each and their fp32 dQ (64 x D) in registers, stored in bf16 at the end.
Supports every spherical spec (D 64 and 128, any B, N, Nk, G, causal, seqlens).
Differs from `tlx_ws` (bwd_ws.py): dQ by its own kernel instead of TMA reduce-adds from the
key-block kernel; 3 more tensor-core GEMM units per (row, key) tile pair than 5 in all (7 vs 5).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import tlx

from altattn.registry import CompileConfig
from kernels_tlx.spherical.bwd_common import (
    BLOCK_N,
    config,
    build_compile_configs,
    _dkv_kernel,
    prepare_dkv,
    rows_layout,
    seq_bounds,
)
from kernels_tlx.spherical.bwd_common import supports as common_supports
from kernels_triton.proton import BF16_BYTES, enter, leave, profiled
from kernels_triton.launch import Kernel
from kernels_triton.spherical.bwd_common import coeff_row0, prepare_row_coeffs
from kernels_tlx.ring import empty_phase, full_phase

ROWS = tl.constexpr(64)      # rows per consumer
BLOCK_Q = 128                # rows per program


@triton.jit
def dq_program(N, Nk, Seqlens, HQ: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    """b, h, first row m0, Lk and the key-block count of this program (0 when its rows are all
    past Lq). Causal: heaviest (last) row blocks first."""
    n_mb = tl.cdiv(N, 128)
    pid = tl.program_id(0)
    mi = pid % n_mb
    if CAUSAL:
        mi = n_mb - 1 - mi
    bh = pid // n_mb
    b = bh // HQ
    h = bh % HQ
    m0 = mi * 128
    Lq, Lk = seq_bounds(Seqlens, b, N, Nk, VARLEN)
    k_end = Lk
    if CAUSAL:
        k_end = tl.minimum(Lk, m0 + 128)
    n_kb = tl.where(m0 < Lq, tl.cdiv(k_end, 128), 0)
    return b, h, m0, Lk, n_kb


@triton.jit
def mask_scores(x, kb, r_first, Lk, CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    """x [64 rows from r_first, 128 keys from kb], 0 at keys >= Lk (VARLEN) and, causal, key > row
    (only blocks that reach past the first row compare)."""
    if VARLEN:  # noqa: SIM102 (a constexpr, then a runtime test)
        if kb + 128 > Lk:
            x = tl.where((kb + tl.arange(0, 128) < Lk)[None, :], x, 0.0)
    if CAUSAL:  # noqa: SIM102 (a constexpr, then a runtime test)
        if kb + 127 > r_first:
            x = tl.where(tl.arange(0, 128)[None, :] <= (r_first - kb) + tl.arange(0, 64)[:, None],
                         x, 0.0)
    return x


@triton.jit
def _dq_kernel(Qd, Kd, Vd, DOd, A, R, Seqlens, DQ, N, Nk, HQ: tl.constexpr, HK: tl.constexpr,
               G: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
               NUM_STAGES: tl.constexpr, CONSUMER_REGS: tl.constexpr,
               PROFILE: tl.constexpr = False):
    q_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, 2)
    do_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, 2)
    k_tiles = tlx.local_alloc((128, D), tl.bfloat16, NUM_STAGES)
    v_tiles = tlx.local_alloc((128, D), tl.bfloat16, NUM_STAGES)
    q_full = tlx.local_view(tlx.alloc_barriers(num_barriers=1, arrive_count=1), 0)
    kv_fulls = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
    kv_empties = tlx.alloc_warp_barrier(num_barriers=NUM_STAGES, num_warps=8)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: Q, dO once; K, V per key block
            b, h, m0, Lk, n_kb = dq_program(N, Nk, Seqlens, HQ, CAUSAL, VARLEN)
            g = h // G
            if n_kb > 0:
                enter("load_kv", PROFILE)
                tlx.barrier_expect_bytes(q_full, 4 * ROWS * D * BF16_BYTES)
                for c in tl.static_range(2):
                    tlx.async_descriptor_load(Qd, tlx.local_view(q_tiles, c),
                                              [b, m0 + c * ROWS, h * D], q_full)
                    tlx.async_descriptor_load(DOd, tlx.local_view(do_tiles, c),
                                              [b, m0 + c * ROWS, h * D], q_full)
                leave("load_kv", PROFILE)
            for j in range(n_kb):
                s = j % NUM_STAGES
                enter("load_kv", PROFILE)
                tlx.barrier_wait(tlx.local_view(kv_empties, s), empty_phase(j, NUM_STAGES))
                full = tlx.local_view(kv_fulls, s)
                tlx.barrier_expect_bytes(full, 2 * 128 * D * BF16_BYTES)
                tlx.async_descriptor_load(Kd, tlx.local_view(k_tiles, s), [b, j * 128, g * D],
                                          full)
                tlx.async_descriptor_load(Vd, tlx.local_view(v_tiles, s), [b, j * 128, g * D],
                                          full)
                leave("load_kv", PROFILE)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=2):
            cid = tlx.async_task_replica_id()
            b, h, m0, Lk, n_kb = dq_program(N, Nk, Seqlens, HQ, CAUSAL, VARLEN)
            r_first = m0 + cid * ROWS
            rows = r_first + tl.arange(0, ROWS)
            at = coeff_row0(b, h, N, HQ) + rows
            a = tl.load(A + at, mask=rows < N, other=0.0)
            rr = tl.load(R + at, mask=rows < N, other=0.0)
            q_tile = tlx.local_view(q_tiles, cid)
            do_tile = tlx.local_view(do_tiles, cid)
            dq = tl.zeros([ROWS, D], tl.float32)
            if n_kb > 0:
                enter("wait_kv", PROFILE)
                tlx.barrier_wait(q_full, 0)
                leave("wait_kv", PROFILE)
            for j in range(n_kb):
                s = j % NUM_STAGES
                enter("wait_kv", PROFILE)
                tlx.barrier_wait(tlx.local_view(kv_fulls, s), full_phase(j, NUM_STAGES))
                leave("wait_kv", PROFILE)
                k_tile = tlx.local_view(k_tiles, s)
                enter("qk_gemm", PROFILE)
                st = tlx.async_dot(q_tile, tlx.local_trans(k_tile))
                st = tlx.async_dot_wait(0, st)
                leave("qk_gemm", PROFILE)
                enter("square", PROFILE)
                st = mask_scores(st, j * 128, r_first, Lk, CAUSAL, VARLEN) * rr[:, None]
                leave("square", PROFILE)
                enter("qk_gemm", PROFILE)
                dp = tlx.async_dot(do_tile, tlx.local_trans(tlx.local_view(v_tiles, s)), st)
                dp = tlx.async_dot_wait(0, dp)
                leave("qk_gemm", PROFILE)
                enter("square", PROFILE)
                ds = (mask_scores(dp, j * 128, r_first, Lk, CAUSAL, VARLEN) * a[:, None])
                leave("square", PROFILE)
                enter("pv_gemm", PROFILE)
                dq = tlx.async_dot(ds.to(tl.bfloat16), k_tile, dq)
                dq = tlx.async_dot_wait(0, dq)
                tlx.barrier_arrive(tlx.local_view(kv_empties, s), 1)
                leave("pv_gemm", PROFILE)
            enter("epilogue", PROFILE)
            out = ((b * N + rows).to(tl.int64) * HQ + h)[:, None] * D + tl.arange(0, D)[None, :]
            tl.store(DQ + out, dq.to(tl.bfloat16), mask=(rows < N)[:, None])
            leave("epilogue", PROFILE)


def supports(spec) -> str | None:
    if spec.packed:  # its dQ kernel has no packed grid yet
        return "packed sequences: not taken (tlx_ws and triton take them)"
    return common_supports(spec)


def prepare_dq(spec, profile: bool = False):
    """The row kernel's launch of `spec`: run(q, k, v, dout, A, R, seqlens, dq)."""
    cfg = config(spec, False)
    D = spec.D
    rows = rows_layout(spec.B, spec.N, spec.Hq * D, 64, D)
    keys = rows_layout(spec.B, spec.Nk, spec.Hk * D, BLOCK_N, D)
    grid = (triton.cdiv(spec.N, BLOCK_Q) * spec.B * spec.Hq,)
    kernel = Kernel(_dq_kernel, grid, HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=D,
                    CAUSAL=spec.causal, VARLEN=spec.varlen, PROFILE=profile, **cfg)
    N, Nk = spec.N, spec.Nk

    def run(q, k, v, dout, A, R, seqlens, dq) -> None:
        kernel(rows(q), keys(k), keys(v), rows(dout), A, R, A if seqlens is None else seqlens,
               dq, N, Nk)

    return run


def profiled_kernels(spec) -> dict[str, int]:
    """The key-block kernel ("dkv") and the row kernel ("dq"): 12 warps each."""
    return {"dkv": 12, "dq": 12}


def prepare(spec, profile: bool | str = False):
    """row_coeffs (A and R = Bt / A), then dk, dv (`_dkv_kernel`) and dq (`_dq_kernel`):
    run(q, k, v, out, r, dout, dr, seqlens, dq, dk, dv). profile: True (both kernels scoped),
    False, or "dkv" / "dq"."""
    coeffs = prepare_row_coeffs(spec, ratio=True)
    dkv = prepare_dkv(spec, False, profiled(profile, "dkv", ("dkv", "dq")))
    dq_rows = prepare_dq(spec, profiled(profile, "dq", ("dkv", "dq")))

    def run(q, k, v, out, r, dout, dr, seqlens, dq, dk, dv) -> None:
        A, R = coeffs(out, dout, r, dr, seqlens)
        dkv(q, k, v, dout, A, R, seqlens, dk, dv, None)
        dq_rows(q, k, v, dout, A, R, seqlens, dq)

    return run


def launch(spec, q, k, v, out, r, dout, dr, seqlens, dq, dk, dv, profile: bool | str = False
           ) -> None:
    prepare(spec, profile)(q, k, v, out, r, dout, dr, seqlens, dq, dk, dv)


def compile_configs() -> list[CompileConfig]:
    """Both kernels at every compile shape (bwd_common.compile_specs)."""
    return build_compile_configs(prepare, {_dkv_kernel: "dkv", _dq_kernel: "dq"}, supports)

"""`triton` backward: the gradients of 2-simplicial attention in plain Triton, deterministic.

The math (docs/MATH.md §1): for row r = (token i, head h) and a valid
pair (j, k), with A_j = Q*K1[j] and dO_j = dO*V1[j] (a D-vector broadcast over the rows),
    P  = exp(s - LSE)                    s = c * A_j . K2[k]      (recomputed, never stored)
    dP = dO_j . V2[k]                    dS = P * (dP - Delta),   Delta = rowsum(dO * O) - dLSE
    dQ = c sum_jk dS K1[j]*K2[k]      dK1[j] = c sum_rk dS q*K2[k]      dK2[k] = c sum_rj dS q*K1[j]
    dV1[j] = sum_rk P dO*V2[k]           dV2[k] = sum_rj P dO*V1[j]
Three reduction index sets (rows, k, j) need three owners. Four kernels, no atomics:
  1. `_delta_kernel` (kernels_triton/simplicial/bwd_common.py): Delta [B, Hq, N] fp32.
  2. `_dkv2_kernel` (k-owner): one program per (batch, KV head, block of BLOCK_N keys) holds K2/V2
     of its block and fp32 dK2/dV2 accumulators; for every row tile whose window covers the block
     and every j of that tile: S^T = K2 A_j^T, P^T, dP^T = V2 dO_j^T, dS^T, dV2 += P^T dO_j,
     dK2 += dS^T A_j (4 GEMMs). The G heads of a KV head sit in the rows, so the sum over heads
     falls inside the GEMMs: dK2/dV2 are complete when the program ends.
  3. `_dq_kernel` (row-owner): one program per (batch, KV head, head split, chunk of tokens), row
     tiles as in the forward (kernels_triton/simplicial/fwd.py). Per tile, j outer, key blocks inner:
     S = A_j K2^T, P, dP = dO_j V2^T, dS, X_j += dS K2, Z_j += P V2 (4 GEMMs); after the key loop
     dQ += K1[j]*X_j, and row j of the program's dK1/dV1 partials gets c sum_r q*X_j and
     sum_r dO*Z_j. X_j and Z_j fill the registers, so the tile's fp32 dQ is accumulated in a
     program-private buffer in memory (L1/L2-resident) and written to dq once, in bf16. The
     partials live in a program-private slice (plain read-add-write, in program order, a barrier
     after each write), one slice per (head split, chunk of L tokens).
  4. `_dkv1_kernel` (bwd_common.py): dK1/dV1 = the sum, in a fixed order, of the <= 2 partial
     slices (per head split) that cover each j.
Executed tensor-core work: 8 GEMMs (4 in each of `_dkv2_kernel` and `_dq_kernel`) for the 5
useful ones: 4 F against the useful 2.5 F (EXECUTED_FLOPS_PER_F).
Rounding (what the GPU tests' emulation mirrors): A_j, dO_j, P and dS are rounded to bf16 as GEMM
operands; everything else is fp32 until the bf16 gradients are stored.

Scratch (`scratch_bytes`), at S* (B4 N16384 Hq128 Hk1 D128, w 32x512, 132 SMs): Delta
B*Hq*N*4 B = 33.6 MB; dK1/dV1 partials 2 x B*Hk*SPLIT*n_chunks*(L + w1 - 1)*D*4 B = 264 MB
(SPLIT = 2 head halves of 64 rows, L = 32 tokens per chunk, 512 chunks); the dQ tiles
n_programs*BLOCK_M*D*4 B = 134 MB; 432 MB in all, against 2.7 GB of inputs and gradients.
Supports every shape the forward's tiling takes: G a power of two up to 128, D in {64, 128}, any B,
N, Hk, w1 <= w2 (the launcher swaps the pairs and their gradients).

Form "det" (constexpr DET = +-1, kernels_triton/simplicial/det.py): both GEMM kernels build A_j as the
forward does (two permuted Q tiles, K1's rotations packed once per call, det_keys), so dK2 =
c sum dS^T A_j is unchanged. X_j = dL/dA_j is in registers with its columns in place, and the
rotations dQ and dK1 need are applied where a sum is read back: `_dq_kernel` keeps two fp32 tiles
(U += X_j K1a[j], W += X_j K1b[j]) and reads dQ = pi^(3-R) U - chi pi^R W through permuted
addresses once per row tile; its dK1 partials are two slices (sum_r X_j Qa, sum_r X_j Qb), which
`_dkv1_kernel` reads through permuted columns. Tensor-core work is the trilinear form's; the
epilogue does two tile read-add-writes and two column sums per j instead of one each, and the
permuted loads' addresses take registers, so det has its own tile configs (dkv2_config,
dq_config) and every column vector built from tl.arange is rebuilt per use (an opaque copy,
`fresh_rows`) so the compiler cannot hoist it into registers held over the key loop (that alone
spilled 1,132 bytes). A permuted load is one narrow load per element, so with STAGE_Q (the 64-row
tiles) `_dq_kernel` loads Qa and Qb through permuted columns once per row tile into the program's
scratch and reads them back contiguously at each j, for the build and for the column sums.
Scratch: twice the dK1 partials, the dQ tiles two or three times (U, W and the staged Qa/Qb:
acc_tiles), and the packed K1.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels_triton.launch import Kernel, sm_count
from kernels_triton.proton import profiled
from kernels_triton.simplicial.bwd_common import (Scratch, build_compile_configs,
                                                  compile_specs, fresh_rows, key_block_program,
                                                  kv_rows, prepare_delta, prepare_dkv1,
                                                  row_stats, scalars, tile, visible, visible_t)
# the Delta and reduce kernels, which tests launch through this module
from kernels_triton.simplicial.bwd_common import (DKV1_ROWS, _delta_kernel,  # noqa: F401
                                                  _dkv1_kernel)
from kernels_triton.simplicial.det import (det_cols, det_keys, det_of, det_specs, k1_rows,
                                           load_q_cols, load_q_det)
from kernels_triton.simplicial.host import kv_layout
from kernels_triton.simplicial.tiling import enter, leave, load_q, row_coords, row_ptrs
from kernels_triton.simplicial.tiling import supports  # noqa: F401  (this variant's registry `supports`)
from altattn.registry import CompileConfig
from altattn.simplicial.spec import ProblemSpec


# Tile configs, the fastest measured at S* (and its D = 64 and Hq = 64 siblings) among those that
# compile with no spill (python -m tools.resources; docs/perf-bwd.md has the measurements).
# Triton puts all the warps along M of a dot whose result feeds another dot, so the first GEMM's M
# (keys in _dkv2, rows in _dq) is 16 x num_warps. With 4 warps a program takes at most 255
# registers per thread, and two programs share an SM: one's softmax runs under the other's GEMMs.
def dkv2_config(spec: ProblemSpec) -> dict:
    """`_dkv2_kernel`. D = 64: 4 warps, 64 keys x 64 rows at G = 128, 32 rows elsewhere (64 spill
    8-184 bytes there). D = 128: 8 warps, 128 keys x 32 rows (4 warps spill); 16 rows (slower at
    S*, docs/perf-bwd.md) where 32 spill: G = 1 (16 bytes) and G = 32 at Hk = 1 (40 bytes). Form "det" (a second
    Q tile held per row tile): 32 rows at D = 64, and 16 rows at D = 128 below G = 64 (32 spill
    8-144 bytes there)."""
    det = spec.form == "det"
    if spec.D == 64:
        return dict(BLOCK_M=64 if spec.G == 128 and not det else 32, BLOCK_N=64, num_warps=4,
                    num_stages=1)
    small = spec.G == 1 or (spec.G, spec.Hk) == (32, 1) or (det and spec.G < 64)
    return dict(BLOCK_M=16 if small else 32, BLOCK_N=128, num_warps=8, num_stages=1)


def dq_config(spec: ProblemSpec) -> dict:
    """`_dq_kernel`. 4 warps and 64 rows where that spills nothing: D = 64 (64 keys, 3 stages),
    and Hk = 1 with G >= 64 at D = 128 (32 keys; 3 stages at G = 128, 2 at G = 64, where 3 spill
    16 bytes). Elsewhere 8 warps and 128 rows: 32 keys at Hk = 1, G in {16, 32}; 16 keys with the
    row addresses rebuilt at each j (FRESH_ROWS; 32 keys spill 4-136 bytes there) and, at
    G <= 2, Z_j in a second pass over the keys (TWO_PASS). 16 keys are slower at S* (docs/perf-bwd.md).
    Form "det" (a longer epilogue): 32 keys at D = 64; at D = 128 the 4-warp tile for every
    G >= 64 (8 warps spill 16 bytes at G = 64, Hk = 2), elsewhere 8 warps, 16 keys, FRESH_ROWS,
    TWO_PASS above G = 2 (each of these spilled 8-88 bytes otherwise). STAGE_Q (det, the 64-row
    tiles): the row tile's Qa and Qb staged once per tile in the program's scratch, so that the
    per-j build and epilogue read them contiguously (at 128 rows it spills 24-128 bytes)."""
    if spec.form == "det":
        if spec.D == 64:
            return dict(BLOCK_M=64, BLOCK_N=32, TWO_PASS=False, FRESH_ROWS=True, STAGE_Q=True,
                        num_warps=4, num_stages=3)
        if spec.G >= 64:
            return dict(BLOCK_M=64, BLOCK_N=32, TWO_PASS=False, FRESH_ROWS=True, STAGE_Q=True,
                        num_warps=4, num_stages=3 if (spec.G, spec.Hk) == (128, 1) else 2)
        return dict(BLOCK_M=128, BLOCK_N=16, TWO_PASS=spec.G > 2, FRESH_ROWS=True, num_warps=8,
                    num_stages=2)
    if spec.D == 64:
        return dict(BLOCK_M=64, BLOCK_N=64, TWO_PASS=False, FRESH_ROWS=True, num_warps=4,
                    num_stages=3)
    if spec.Hk == 1 and spec.G >= 64:
        return dict(BLOCK_M=64, BLOCK_N=32, TWO_PASS=False, FRESH_ROWS=True, num_warps=4,
                    num_stages=3 if spec.G == 128 else 2)
    if spec.Hk == 1 and spec.G >= 16:
        return dict(BLOCK_M=128, BLOCK_N=32, TWO_PASS=False, FRESH_ROWS=False, num_warps=8,
                    num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=16, TWO_PASS=spec.G <= 2, FRESH_ROWS=True, num_warps=8,
                num_stages=2)


@triton.constexpr_function
def acc_tiles(det, stage_q) -> int:
    """`_dq_kernel`'s fp32 [BLOCK_M, D] scratch tiles per program (the kernel and `scratch` both
    read it): the dQ tile; form "det" (det: DET or a bool) the U and W tiles, and with STAGE_Q
    also the row tile's Qa and Qb (bf16, one fp32 tile's bytes)."""
    return 1 if not det else 3 if stage_q else 2


EXECUTED_FLOPS_PER_F = 4.0  # tensor-core FLOPs executed per forward FLOP (8 GEMMs of F / 2 each)
DET_ROWS = tl.constexpr(16)  # rows of a det dQ tile read back (permuted) and stored at a time


def tiling(spec: ProblemSpec) -> tuple[int, int, int]:
    """(HPT heads per tile, T tokens per tile, SPLIT programs per token) of `_dq_kernel`'s tile."""
    block_m = dq_config(spec)["BLOCK_M"]
    hpt = min(spec.G, block_m)
    return hpt, block_m // hpt, spec.G // hpt


def chunk_tokens(spec: ProblemSpec, n_sm: int = 132) -> int:
    """L, tokens per `_dq_kernel` program: a multiple of T that covers the w1 window (so each j's
    dK1/dV1 sum has <= 2 partials per head split), smaller when that would leave fewer than four
    programs per SM."""
    _, T, split = tiling(spec)
    tiles = triton.cdiv(spec.N, T)
    per_window = triton.cdiv(spec.w1, T)
    for_parallelism = max(1, spec.B * spec.Hk * split * tiles // (4 * n_sm))
    return T * max(1, min(per_window, for_parallelism))


def scratch(spec: ProblemSpec, n_sm: int = 132) -> Scratch:
    _, _, split = tiling(spec)
    L = chunk_tokens(spec, n_sm)
    n_chunks = triton.cdiv(spec.N, L)
    n_programs = spec.B * spec.Hk * split * n_chunks
    cfg = dq_config(spec)
    return Scratch(L, n_chunks, n_programs, n_programs * (L + spec.w1 - 1) * spec.D,
                   n_programs * cfg["BLOCK_M"] * spec.D,
                   acc_tiles(spec.form == "det", cfg.get("STAGE_Q", False)))


def scratch_bytes(spec: ProblemSpec, n_sm: int = 132) -> int:
    """Bytes of scratch the backward allocates beyond the gradients: Delta, the dK1/dV1 partials
    and the dQ tiles; form "det" twice the dK1 partials, the dQ tiles acc_tiles times, and the
    packed K1 (det_keys)."""
    sc = scratch(spec, n_sm)
    n = 1 + (spec.form == "det")
    packed = 2 * 2 * spec.B * spec.N * spec.Hk * spec.D if spec.form == "det" else 0
    return (4 * (spec.B * spec.Hq * spec.N + (n + 1) * sc.partial + sc.acc_tiles * sc.dq_tiles)
            + packed)


@triton.jit
def _dkv2_kernel(Q, K1, K2, V1, V2, DO, Lse, Delta, DK2, DV2, N, w1, w2, qk_scale, sm_scale,
                 HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PROFILE: tl.constexpr = False,
                 DET: tl.constexpr = 0):
    """k-owner: dK2, dV2 of one block of BLOCK_N keys of one (batch, KV head). DET = +-1: A_j is
    the det build (kernels_triton/simplicial/det.py; K1 det_keys' packed [B, N, HK, 2, D])."""
    HPT: tl.constexpr = BLOCK_M if G > BLOCK_M else G
    T: tl.constexpr = BLOCK_M // HPT
    SPLIT: tl.constexpr = G // HPT
    b, g, kb, kv_base = key_block_program(N, HK, D, BLOCK_N)
    offs_d = tl.arange(0, D)
    kpos = kb + tl.arange(0, BLOCK_N)
    enter("load_kv", PROFILE)
    k2 = tl.load(K2 + kv_rows(kv_base, kpos, HK, D), mask=(kpos < N)[:, None], other=0.0)
    v2 = tl.load(V2 + kv_rows(kv_base, kpos, HK, D), mask=(kpos < N)[:, None], other=0.0)
    leave("load_kv", PROFILE)
    dk2 = tl.zeros([BLOCK_N, D], tl.float32)
    dv2 = tl.zeros([BLOCK_N, D], tl.float32)
    t_hi = tl.minimum(N - 1, kb + BLOCK_N + w2 - 2) // T  # last token tile that sees the block
    for t in range(kb // T, t_hi + 1):
        i0 = t * T
        for s in range(SPLIT):
            tok, head, lse2, delta = row_stats(Lse, Delta, b, g, i0, s * HPT, N, HQ, G, BLOCK_M)
            if not DET:
                q = load_q(Q, b, g, tok, head, N, HQ, G, D)
            else:  # q = Qa, qb = Qb
                q, qb = load_q_det(Q, b, g, tok, head, N, fresh_rows(i0 + s, D), HQ, G, D, DET)
            do = load_q(DO, b, g, tok, head, N, HQ, G, D)
            for j in range(tl.maximum(i0 - w1 + 1, 0), tl.minimum(i0 + T, N)):
                enter("qk_gemm", PROFILE)
                k1j, k1b = k1_rows(K1, kv_base, j, offs_d, HK, D, DET)
                v1j = tl.load(V1 + kv_base + j.to(tl.int64) * (HK * D) + offs_d)
                if not DET:
                    a = q * k1j[None, :]
                else:  # the det build, rounded as the forward rounds it
                    a = tl.fma(q, k1j[None, :], qb * k1b[None, :])
                doj = do * v1j[None, :]
                st = tl.dot(k2, tl.trans(a))
                dpt = tl.dot(v2, tl.trans(doj))
                leave("qk_gemm", PROFILE)
                enter("softmax", PROFILE)
                ok = visible_t(tok, j, kpos, N, w1, w2)
                pt = tl.where(ok, tl.math.exp2(st * qk_scale - lse2[None, :]), 0.0)
                dst = pt * (dpt - delta[None, :])
                leave("softmax", PROFILE)
                enter("pv_gemm", PROFILE)
                dv2 += tl.dot(pt.to(tl.bfloat16), doj)
                dk2 += tl.dot(dst.to(tl.bfloat16), a)
                leave("pv_gemm", PROFILE)
    enter("epilogue", PROFILE)
    tl.store(DK2 + kv_rows(kv_base, kpos, HK, D), (dk2 * sm_scale).to(tl.bfloat16),
             mask=(kpos < N)[:, None])
    tl.store(DV2 + kv_rows(kv_base, kpos, HK, D), dv2.to(tl.bfloat16), mask=(kpos < N)[:, None])
    leave("epilogue", PROFILE)


@triton.jit
def _dq_step(x, z, a, doj, K2, V2, b, g, kb, tok, j, lse2, delta, N, w1, w2, qk_scale,
             D: tl.constexpr, BLOCK_N: tl.constexpr, DO_Z: tl.constexpr, DO_X: tl.constexpr,
             PROFILE: tl.constexpr):
    """One key block of `_dq_kernel`: Z_j += P V2 (DO_Z) and X_j += dS K2 (DO_X)."""
    enter("load_kv", PROFILE)
    k2 = K2.load([b, kb, g * D]).reshape(BLOCK_N, D)  # rows past N arrive as zeros
    v2 = V2.load([b, kb, g * D]).reshape(BLOCK_N, D)
    leave("load_kv", PROFILE)
    enter("qk_gemm", PROFILE)
    sc = tl.dot(a, tl.trans(k2))
    leave("qk_gemm", PROFILE)
    enter("softmax", PROFILE)
    ok = visible(tok, j, kb + tl.arange(0, BLOCK_N), N, w1, w2)
    p = tl.where(ok, tl.math.exp2(sc * qk_scale - lse2[:, None]), 0.0)
    leave("softmax", PROFILE)
    if DO_Z:
        enter("pv_gemm", PROFILE)
        z += tl.dot(p.to(tl.bfloat16), v2)
        leave("pv_gemm", PROFILE)
    if DO_X:
        enter("qk_gemm", PROFILE)
        dp = tl.dot(doj, tl.trans(v2))
        leave("qk_gemm", PROFILE)
        enter("softmax", PROFILE)
        ds = p * (dp - delta[:, None])
        leave("softmax", PROFILE)
        enter("pv_gemm", PROFILE)
        x += tl.dot(ds.to(tl.bfloat16), k2)
        leave("pv_gemm", PROFILE)
    return x, z


@triton.jit
def _dq_kernel(Q, K1, K2, V1, V2, DO, Lse, Delta, DQ, DQacc, PK1, PV1, N, w1, w2, qk_scale,
               sm_scale, L, n_chunks, HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               TWO_PASS: tl.constexpr = False, FRESH_ROWS: tl.constexpr = True,
               PROFILE: tl.constexpr = False, DET: tl.constexpr = 0,
               STAGE_Q: tl.constexpr = False):
    """Row-owner: dQ of the row tiles of L tokens (one head split), and their dK1/dV1 partials.
    DET = +-1 (kernels_triton/simplicial/det.py): A_j is the det build; two fp32 tiles per program, U and W,
    sum X_j * K1a[j] and X_j * K1b[j], and dQ = pi^(3-R) U - chi pi^R W is read back through
    permuted columns at the tile's end; PK1 holds two partial slices per program, sum_r X_j * Qa
    then sum_r X_j * Qb (`_dkv1_kernel` rotates and adds them). STAGE_Q (DET only): Qa and Qb
    staged once per row tile in the program's scratch (dq_config)."""
    tl.static_assert(DET != 0 or not STAGE_Q, "STAGE_Q stages the det build's Qa and Qb")
    HPT: tl.constexpr = BLOCK_M if G > BLOCK_M else G
    T: tl.constexpr = BLOCK_M // HPT
    SPLIT: tl.constexpr = G // HPT
    pid = tl.program_id(0)
    s = pid % SPLIT
    chunk = (pid // SPLIT) % n_chunks
    bg = pid // (SPLIT * n_chunks)
    b = bg // HK
    g = bg % HK
    offs_d = tl.arange(0, D)
    offs_m = tl.arange(0, BLOCK_M)
    kv_base = b.to(tl.int64) * N * (HK * D) + g * D
    # this program's partial slice: rows j in [j_base, j_base + L + w1 - 1)
    j_base = chunk * L - w1 + 1
    part = ((bg * SPLIT + s).to(tl.int64) * n_chunks + chunk) * (L + w1 - 1) * D
    # this program's fp32 dQ tile, accumulated in memory (registers hold X_j and Z_j); DET: U, W,
    # then (STAGE_Q) the row tile's Qa and Qb (bf16)
    N_ACC: tl.constexpr = acc_tiles(DET, STAGE_Q)
    acc = DQacc + pid.to(tl.int64) * (N_ACC * BLOCK_M * D)
    q_stage = (acc + 2 * BLOCK_M * D).to(tl.pointer_type(tl.bfloat16))
    t_end = tl.cdiv(tl.minimum(N, chunk * L + L), T)
    for t in range(chunk * L // T, t_end):
        i0 = t * T
        i_hi = tl.minimum(i0 + T, N) - 1
        tok, head, lse2, delta = row_stats(Lse, Delta, b, g, i0, s * HPT, N, HQ, G, BLOCK_M)
        k_lo = tl.maximum(i0 - w2 + 1, 0)
        j_lo = tl.maximum(i0 - w1 + 1, 0)
        tl.store(tile(acc, offs_m, D), tl.zeros([BLOCK_M, D], tl.float32))
        if DET:  # W
            tl.store(tile(acc + BLOCK_M * D, offs_m, D), tl.zeros([BLOCK_M, D], tl.float32))
        if STAGE_Q:  # Qa and Qb once per row tile (permuted loads), read back per j contiguously
            rows = fresh_rows(t, BLOCK_M)  # no address held over the tile loop
            qa, qb = load_q_det(Q, b, g, tok, head, N, fresh_rows(t + 1, D), HQ, G, D, DET)
            tl.store(tile(q_stage, rows, D), qa)
            tl.store(tile(q_stage + BLOCK_M * D, rows, D), qb)
            tl.debug_barrier()
        for j in range(j_lo, i_hi + 1):
            if not DET:
                k1j = tl.load(K1 + kv_base + j.to(tl.int64) * (HK * D) + offs_d)
            else:
                k1j, k1b = k1_rows(K1, kv_base, j, offs_d, HK, D, DET)
            v1j = tl.load(V1 + kv_base + j.to(tl.int64) * (HK * D) + offs_d)
            rows = fresh_rows(j, BLOCK_M, FRESH_ROWS)
            tok_j, head_j = row_coords(i0, s * HPT, rows, G, BLOCK_M)
            # A_j and dO_j, invariant over the keys, are wgmma operands from shared memory;
            # X_j = dS_j K2 and Z_j = P_j V2 fill the registers
            if not DET:
                a = load_q(Q, b, g, tok_j, head_j, N, HQ, G, D) * k1j[None, :]
            else:
                if STAGE_Q:
                    qa = tl.load(tile(q_stage, rows, D))
                    qb = tl.load(tile(q_stage + BLOCK_M * D, rows, D))
                else:
                    qa, qb = load_q_det(Q, b, g, tok_j, head_j, N, fresh_rows(j + 3, D), HQ, G,
                                        D, DET)
                a = tl.fma(qa, k1j[None, :], qb * k1b[None, :])
            doj = load_q(DO, b, g, tok_j, head_j, N, HQ, G, D) * v1j[None, :]
            x = tl.zeros([BLOCK_M, D], tl.float32)
            z = tl.zeros([BLOCK_M, D], tl.float32)
            for kb in range(k_lo, i_hi + 1, BLOCK_N):
                x, z = _dq_step(x, z, a, doj, K2, V2, b, g, kb, tok, j, lse2, delta, N, w1, w2,
                                qk_scale, D, BLOCK_N, not TWO_PASS, True, PROFILE)
            if TWO_PASS:  # Z_j in a second pass over the keys (S recomputed): fewer registers
                for kb in range(k_lo, i_hi + 1, BLOCK_N):
                    x, z = _dq_step(x, z, a, doj, K2, V2, b, g, kb, tok, j, lse2, delta, N, w1,
                                    w2, qk_scale, D, BLOCK_N, True, False, PROFILE)
            enter("epilogue", PROFILE)
            # a second opaque copy of the rows: no address is held over the key loop
            rows = fresh_rows(j + 1, BLOCK_M, FRESH_ROWS)
            tok_j, head_j = row_coords(i0, s * HPT, rows, G, BLOCK_M)
            if not DET:
                dq_tile = tile(acc, rows, D)
                tl.store(dq_tile, tl.load(dq_tile) + x * k1j[None, :].to(tl.float32))
                slot = part + (j - j_base) * D + offs_d
                pk1 = tl.sum(load_q(Q, b, g, tok_j, head_j, N, HQ, G, D).to(tl.float32) * x, 0)
                tl.store(PK1 + slot, tl.load(PK1 + slot) + pk1)
                pv1 = tl.sum(load_q(DO, b, g, tok_j, head_j, N, HQ, G, D).to(tl.float32) * z, 0)
                tl.store(PV1 + slot, tl.load(PV1 + slot) + pv1)
            else:  # Z_j first (its registers free), then X_j's four sums; K1a, K1b, Qa, Qb read
                # again (L1/L2): none is held over the key loop. The Qb partials: a second
                # buffer of PK1's layout right after the first
                slot = part + (j - j_base) * D + offs_d
                pk1b = tl.num_programs(0).to(tl.int64) * ((L + w1 - 1) * D)
                pv1 = tl.sum(load_q(DO, b, g, tok_j, head_j, N, HQ, G, D).to(tl.float32) * z, 0)
                tl.store(PV1 + slot, tl.load(PV1 + slot) + pv1)
                k1a, k1b = k1_rows(K1, kv_base, j, fresh_rows(j + 2, D), HK, D, DET)
                u_tile = tile(acc, rows, D)
                tl.store(u_tile, tl.load(u_tile) + x * k1a[None, :].to(tl.float32))
                w_tile = tile(acc + BLOCK_M * D, rows, D)
                tl.store(w_tile, tl.load(w_tile) + x * k1b[None, :].to(tl.float32))
                cols_a, cols_b, in_chunk = det_cols(fresh_rows(j + 4, D), D, DET)
                if STAGE_Q:
                    qa = tl.load(tile(q_stage, rows, D))
                else:
                    qa = load_q_cols(Q, b, g, tok_j, head_j, N, cols_a, cols_a >= 0, HQ, G, D)
                pa = tl.sum(qa.to(tl.float32) * x, 0)
                tl.store(PK1 + slot, tl.load(PK1 + slot) + pa)
                if STAGE_Q:  # the staged Qb
                    qb = tl.load(tile(q_stage + BLOCK_M * D, rows, D))
                    pb = -tl.sum(qb.to(tl.float32) * x, 0)
                else:  # Qb is minus this tile
                    qb = load_q_cols(Q, b, g, tok_j, head_j, N, cols_b, in_chunk, HQ, G, D)
                    pb = tl.sum(qb.to(tl.float32) * x, 0)
                tl.store(PK1 + pk1b + slot, tl.load(PK1 + pk1b + slot) - pb)
            tl.debug_barrier()  # the next read of a slot or of acc, by any thread, sees this write
            leave("epilogue", PROFILE)
        if not DET:
            dq = (tl.load(tile(acc, offs_m, D)) * sm_scale).to(tl.bfloat16)
            tok, head = row_coords(i0, s * HPT, offs_m, G, BLOCK_M)
            tl.store(row_ptrs(DQ, b, g, tok, head, N, HQ, G, D), dq, mask=(tok < N)[:, None])
        else:  # dQ = pi^(3-R) U - chi pi^R W (kernels_triton/simplicial/det.py), DET_ROWS rows at a time
            # (permuted addresses cannot be vectorized: a whole tile's would fill the registers)
            cols_a, cols_b, in_chunk = det_cols(fresh_rows(t, D), D, DET)
            for r0 in tl.static_range(0, BLOCK_M, DET_ROWS):
                r = r0 + tl.arange(0, DET_ROWS)
                u = tl.load(acc + r[:, None] * D + cols_b[None, :])
                w = tl.load(acc + BLOCK_M * D + r[:, None] * D + cols_a[None, :])
                dq = ((u - tl.where(in_chunk[None, :], w, 0.0)) * sm_scale).to(tl.bfloat16)
                tok, head = row_coords(i0, s * HPT, r, G, BLOCK_M)
                tl.store(row_ptrs(DQ, b, g, tok, head, N, HQ, G, D), dq, mask=(tok < N)[:, None])
        tl.debug_barrier()  # acc is zeroed for the next tile only after every thread read it


def prepare_dkv2(spec: ProblemSpec, profile: bool = False):
    """`_dkv2_kernel`'s launch of `spec`, made once: run(q, k1, k2, v1, v2, dout, lse, delta,
    dk2, dv2) writes dk2, dv2 (form "det": k1 packed by det_keys)."""
    cfg = dkv2_config(spec)
    kernel = Kernel(_dkv2_kernel, (triton.cdiv(spec.N, cfg["BLOCK_N"]) * spec.B * spec.Hk,),
                    HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=spec.D, PROFILE=profile,
                    DET=det_of(spec), **cfg)
    args = scalars(spec)

    def run(q, k1, k2, v1, v2, dout, lse, delta, dk2, dv2) -> None:
        kernel(q, k1, k2, v1, v2, dout, lse, delta, dk2, dv2, *args)

    return run


def profiled_kernels(spec: ProblemSpec) -> dict[str, int]:
    """The Proton-scoped kernels at `spec`, by the name `launch(..., profile=name)` takes, with
    their warps per CTA (Delta and the reduce have no scopes). Proton samples one list of warps
    per session and a kernel must have every warp named, so profiling/trace_capture.py traces one
    kernel per session, each with its own warps."""
    return {"dkv2": dkv2_config(spec)["num_warps"], "dq": dq_config(spec)["num_warps"]}


def prepare(spec: ProblemSpec, profile: bool | str = False, k_owner=None, row_owner=None):
    """The launches of `spec`, made once: run(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1,
    dk2, dv1, dv2) fills dq [B,N,Hq,D] and dk1, dk2, dv1, dv2 [B,N,Hk,D] (bf16) from the
    forward's inputs, its out [B,N,Hq,D] bf16 and lse [B,Hq,N] fp32, and the incoming dout (bf16)
    and dlse (fp32 like lse, or None); every tensor contiguous, the pairs ordered (w1 <= w2).
    profile: True, or one kernel's name (profiled_kernels): the Proton-scoped copies.
    k_owner, row_owner: a variant's replacement (kernels_tlx/simplicial/bwd_ws.py) for
    prepare_dkv2 (dk2, dv2) or prepare_dq (dq, dk1, dv1), with its signature. Form "det": run
    packs K1 (det_keys) once per call, for both."""
    det = det_of(spec)
    if det and (k_owner is not None or row_owner is not None):
        raise ValueError("form 'det' runs the Triton k-owner and row-owner only")
    delta_of = prepare_delta(spec)
    dkv2 = (k_owner or prepare_dkv2)(spec, profiled(profile, "dkv2", ("dkv2", "dq")))
    dq_dkv1 = (row_owner or prepare_dq)(spec, profiled(profile, "dq", ("dkv2", "dq")))

    def run(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2) -> None:
        if det:
            k1 = det_keys(k1, det)  # packed once for both kernels
        delta = delta_of(out, dout, dlse)
        dkv2(q, k1, k2, v1, v2, dout, lse, delta, dk2, dv2)
        dq_dkv1(q, k1, k2, v1, v2, dout, lse, delta, dq, dk1, dv1)

    return run


def launch(spec: ProblemSpec, q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2,
           profile: bool | str = False) -> None:
    prepare(spec, profile)(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2)


def prepare_dq(spec: ProblemSpec, profile: bool = False):
    """`_dq_kernel` then `_dkv1_kernel`, made once (scratch sized for the current GPU): run(q,
    k1, k2, v1, v2, dout, lse, delta, dq, dk1, dv1) writes dq, dk1, dv1 (form "det": k1 packed)."""
    sc = scratch(spec, sm_count())
    dqc = dq_config(spec)
    det = spec.form == "det"
    keys = kv_layout(spec, dqc["BLOCK_N"])
    kernel = Kernel(_dq_kernel, (sc.n_programs,), HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=spec.D,
                    PROFILE=profile, DET=det_of(spec), **dqc)
    dkv1 = prepare_dkv1(spec, sc.L, sc.n_chunks, tiling(spec)[2])
    args = (*scalars(spec), sc.L, sc.n_chunks)

    def run(q, k1, k2, v1, v2, dout, lse, delta, dq, dk1, dv1) -> None:
        pk1, pv1, dq_acc = sc.buffers(q.device, det)
        kernel(q, k1, keys(k2), v1, keys(v2), dout, lse, delta, dq, dq_acc, pk1, pv1, *args)
        dkv1(pk1, pv1, dk1, dv1)

    return run


def compile_configs() -> list[CompileConfig]:
    """The two GEMM kernels at every compile shape, in both forms (the Delta and reduce kernels
    are small)."""
    specs = [s for base in compile_specs() for s in (base, *det_specs(base))]
    return build_compile_configs(prepare, {_dkv2_kernel: "dkv2", _dq_kernel: "dq"}, specs)

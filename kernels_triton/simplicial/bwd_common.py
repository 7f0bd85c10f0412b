"""What the deterministic backwards share: the Triton one (kernels_triton/simplicial/bwd.py) and the
TLX ones that reuse its split (kernels_tlx/simplicial/bwd_ws.py, bwd_dq_ws.py) or parts of it
(kernels_tlx/simplicial/bwd_pairs.py).

- `_delta_kernel` / `prepare_delta`: Delta [B, Hq, N] fp32 = rowsum(dO * O) - dLSE, from the bf16 O
  the forward returned.
- `_dkv1_kernel` / `prepare_dkv1`: the reduce. dK1/dV1 = the sum, in a fixed order, of the <= 2
  partial slices (per head split) that cover each j, as a row-owner (`_dq_kernel`,
  `_dq_ws_kernel`) wrote them; form "det" two dK1 partial buffers read through permuted columns.
- `_sum_parts_kernel` / `prepare_sum_parts`: dK = sm_scale * the sum of fp32 partials, dV theirs,
  in part order, in bf16 (the k-owner's head halves in bwd_ws.py; bwd_pairs.py's accumulators);
  `_finish_kernel` / `prepare_finish`: bf16(scale * an fp32 sum) (bwd_pairs.py's dQ).
- `Scratch`: a row-owner's grid and scratch sizes.
- Inlined @triton.jit helpers: `fresh_rows` (an arange the compiler cannot hoist), `tile` and
  `kv_rows` (row pointers/offsets of a dense block, of a [B, N, HK, D] tensor), `row_stats` (a row
  tile's tokens, heads, LSE and Delta), `visible` / `visible_t` (the pair-window mask),
  `key_block_program` (a k-owner program's coordinates).
- `scalars`: the GEMM kernels' scalar arguments at a spec (N, w1, w2, qk_scale, sm_scale).
- Compile configs: `compile_specs` (the backward's compile shapes), `meta_args` (a run's
  arguments on meta tensors) and `build_compile_configs` (a variant's launches at those shapes,
  recorded: kernels_triton/launch.py).
A `prepare_*` makes its kernel's launch once per problem spec (kernels_triton/launch.py's Kernel)
and returns the `run` that launches it.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels_triton.launch import Kernel, compile_configs, meta
from kernels_triton.simplicial.det import det_cols, det_of, form_suffix
from kernels_triton.simplicial.tiling import COMPILE_SHAPES, LOG2E, LOG2E_JIT, row_coords
from altattn.registry import CompileConfig
from altattn.simplicial.spec import ProblemSpec

DELTA_ROWS = 64  # rows of O per program of the Delta kernel
DKV1_ROWS = 32   # rows of dK1/dV1 per program of the reduce kernel
SUM_BLOCK = 1024   # elements per program of `_sum_parts_kernel`


class Scratch(NamedTuple):
    """A row-owner's grid and the scratch sizes (elements) its launch allocates: `_dq_kernel`'s
    (kernels_triton/simplicial/bwd.py `scratch`), `_dq_ws_kernel`'s (kernels_tlx/simplicial/
    bwd_dq_ws.py `scratch`)."""
    L: int            # tokens per program (chunk_tokens)
    n_chunks: int
    n_programs: int
    partial: int      # each of the dK1 and dV1 partial buffers
    dq_tiles: int     # the programs' fp32 dQ tiles
    acc_tiles: int = 1  # fp32 tiles per program (acc_tiles): the dQ tile; det U, W (Qa, Qb)

    def buffers(self, device, det: bool = False):
        """(pk1, pv1, dq_acc): the dK1 and dV1 partials (zeroed: read-add-written) and the dQ
        tiles (each tile zeroed by its program), fp32; form "det" (det) twice pk1 and dq_acc (the
        Qa and Qb partials, the U and W tiles)."""
        n = 2 if det else 1
        return (torch.zeros(n * self.partial, dtype=torch.float32, device=device),
                torch.zeros(self.partial, dtype=torch.float32, device=device),
                torch.empty(self.acc_tiles * self.dq_tiles, dtype=torch.float32, device=device))


@triton.jit
def _delta_kernel(Out, DOut, DLse, Delta, N, rows, HQ: tl.constexpr, D: tl.constexpr,
                  ROWS: tl.constexpr, HAS_DLSE: tl.constexpr):
    """Delta[b, h, i] = sum_d dO[b,i,h,d] O[b,i,h,d] - dLSE[b,h,i] for `ROWS` of the B*N*HQ rows."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = r < rows
    b = r // (N * HQ)
    i = (r // HQ) % N
    h = r % HQ
    offs_d = tl.arange(0, D)
    o = tl.load(Out + r[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DOut + r[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse_off = (b * HQ + h) * N + i
    if HAS_DLSE:
        delta -= tl.load(DLse + lse_off, mask=ok, other=0.0)
    tl.store(Delta + lse_off, delta, mask=ok)


def prepare_delta(spec: ProblemSpec):
    """`_delta_kernel`'s launch of `spec`, made once: run(out, dout, dlse) -> Delta [B, Hq, N]
    fp32, rowsum(dO * O) - dLSE, from out and dout [B, N, Hq, D] bf16 and dlse [B, Hq, N] fp32
    or None (a Kernel of its own each way, made at its first call)."""
    shape = (spec.B, spec.Hq, spec.N)
    rows = spec.B * spec.N * spec.Hq
    grid = (triton.cdiv(rows, DELTA_ROWS),)
    N = spec.N

    @functools.cache  # HAS_DLSE -> its Kernel, made at its first call
    def kernel(has_dlse: bool) -> Kernel:
        return Kernel(_delta_kernel, grid, HQ=spec.Hq, D=spec.D, ROWS=DELTA_ROWS,
                      HAS_DLSE=has_dlse, num_warps=4)

    def run(out, dout, dlse) -> torch.Tensor:
        delta = torch.empty(shape, dtype=torch.float32, device=out.device)
        kernel(dlse is not None)(out, dout, delta if dlse is None else dlse, delta, N, rows)
        return delta

    return run


@triton.jit
def fresh_rows(j, ROWS: tl.constexpr, FRESH: tl.constexpr = True):
    """tl.arange(0, ROWS) recomputed at each j: an opaque copy of arange + j, minus j, keeps LLVM
    from hoisting the [ROWS, D] address tensors built from it out of the j loop (held across the
    loop, they spill)."""
    if not FRESH:
        return tl.arange(0, ROWS)
    r = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [tl.arange(0, ROWS) + j],
                                  dtype=tl.int32, is_pure=True, pack=1)
    return r - j


@triton.jit
def tile(base, rows, COLS: tl.constexpr):
    """Pointers to rows `rows` of a dense row-major [*, COLS] block at `base`."""
    return base + rows[:, None] * COLS + tl.arange(0, COLS)[None, :]


@triton.jit
def kv_rows(kv_base, pos, HK: tl.constexpr, D: tl.constexpr):
    """Offsets of the [len(pos), D] rows at tokens `pos` of one (batch, KV head) of a
    [B, N, HK, D] tensor whose token 0 is at kv_base."""
    return kv_base + pos.to(tl.int64)[:, None] * (HK * D) + tl.arange(0, D)[None, :]


@triton.jit
def row_stats(Lse, Delta, b, g, i0, h0, N, HQ: tl.constexpr, G: tl.constexpr,
              BLOCK_M: tl.constexpr):
    """One row tile's tokens and heads, LSE in log2 units and Delta (0 past N)."""
    tok, head = row_coords(i0, h0, tl.arange(0, BLOCK_M), G, BLOCK_M)
    row_off = (b.to(tl.int64) * HQ + g * G + head) * N + tok
    lse2 = tl.load(Lse + row_off, mask=tok < N, other=0.0) * LOG2E_JIT
    delta = tl.load(Delta + row_off, mask=tok < N, other=0.0)
    return tok, head, lse2, delta


@triton.jit
def visible(tok, j, kpos, N, w1, w2):
    """[len(tok), len(kpos)]: row tok < N sees the pair (j, kpos)."""
    row = (tok < N) & (j <= tok) & (j > tok - w1)
    return row[:, None] & (kpos[None, :] <= tok[:, None]) & (kpos[None, :] > tok[:, None] - w2)


@triton.jit
def visible_t(tok, j, kpos, N, w1, w2):
    """`visible` transposed: [len(kpos), len(tok)]."""
    row = (tok < N) & (j <= tok) & (j > tok - w1)
    return row[None, :] & (kpos[:, None] <= tok[None, :]) & (kpos[:, None] > tok[None, :] - w2)


@triton.jit
def key_block_program(N, HK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """A k-owner program's batch b, KV head g, first key kb (grid: key blocks fastest, then
    B * HK), and kv_base, the offset of token 0 of (b, g) in a [B, N, HK, D] tensor."""
    n_kb = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    bg = pid // n_kb
    b = bg // HK
    g = bg % HK
    return b, g, (pid % n_kb) * BLOCK_N, b.to(tl.int64) * N * (HK * D) + g * D


@triton.jit
def _dkv1_kernel(PK1, PK1b, PV1, DK1, DV1, N, w1, sm_scale, L, n_chunks, HK: tl.constexpr,
                 D: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr, DET: tl.constexpr = 0):
    """ROWS rows of dK1, dV1 of one (batch, KV head): the partials that cover each row j, summed
    in a fixed order (head split, then chunk). One flat grid axis: (row blocks, B * HK).
    DET: dK1 = pi^R PK1 + pi^(3-R) PK1b (kernels_triton/simplicial/det.py), read through permuted
    columns."""
    n_jb = tl.cdiv(N, ROWS)
    bg = tl.program_id(0) // n_jb
    b = bg // HK
    g = bg % HK
    j = (tl.program_id(0) % n_jb) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, D)
    R = L + w1 - 1
    c_first = j // L
    c_last = tl.minimum((j + w1 - 1) // L, n_chunks - 1)
    acc_k = tl.zeros([ROWS, D], tl.float32)
    acc_v = tl.zeros([ROWS, D], tl.float32)
    for s in range(SPLIT):
        for dc in range(0, (w1 - 1) // L + 2):
            c = c_first + dc
            ok = (c <= c_last) & (j < N)
            row = ((bg * SPLIT + s).to(tl.int64) * n_chunks + c) * R + (j - (c * L - w1 + 1))
            off = row[:, None] * D + offs_d[None, :]
            if not DET:
                acc_k += tl.load(PK1 + off, mask=ok[:, None], other=0.0)
            else:
                cols_a, cols_b, _ = det_cols(offs_d, D, DET)
                acc_k += tl.load(PK1 + row[:, None] * D + cols_a[None, :], mask=ok[:, None],
                                 other=0.0)
                acc_k += tl.load(PK1b + row[:, None] * D + cols_b[None, :], mask=ok[:, None],
                                 other=0.0)
            acc_v += tl.load(PV1 + off, mask=ok[:, None], other=0.0)
    out = (b.to(tl.int64) * N + j)[:, None] * (HK * D) + g * D + offs_d[None, :]
    tl.store(DK1 + out, (acc_k * sm_scale).to(tl.bfloat16), mask=(j < N)[:, None])
    tl.store(DV1 + out, acc_v.to(tl.bfloat16), mask=(j < N)[:, None])


def prepare_dkv1(spec: ProblemSpec, L: int, n_chunks: int, split: int):
    """`_dkv1_kernel`'s launch of `spec`, made once: run(pk1, pv1, dk1, dv1) writes dk1, dv1
    [B, N, Hk, D] bf16 from the fp32 partial slices (split head splits, n_chunks chunks of L
    tokens) that a row-owner wrote (Scratch.buffers); form "det": pk1 holds the Qa partials,
    then the Qb ones."""
    det = det_of(spec)
    kernel = Kernel(_dkv1_kernel, (triton.cdiv(spec.N, DKV1_ROWS) * spec.B * spec.Hk,),
                    HK=spec.Hk, D=spec.D, SPLIT=split, ROWS=DKV1_ROWS, DET=det, num_warps=4)
    N, w1, sm_scale = spec.N, spec.w1, spec.sm_scale

    def run(pk1, pv1, dk1, dv1) -> None:
        pk1b = pk1[pk1.numel() // 2:] if det else pk1
        kernel(pk1, pk1b, pv1, dk1, dv1, N, w1, sm_scale, L, n_chunks)

    return run


@triton.jit
def _sum_parts_kernel(DK2P, DV2P, DK2, DV2, numel, sm_scale, PARTS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """dK2 = sm_scale * the sum of the PARTS fp32 partials, dV2 = theirs, in part order, stored
    in bf16."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    dk = tl.zeros([BLOCK], tl.float32)
    dv = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(PARTS):
        dk += tl.load(DK2P + p * numel + i, mask=ok, other=0.0)
        dv += tl.load(DV2P + p * numel + i, mask=ok, other=0.0)
    tl.store(DK2 + i, (dk * sm_scale).to(tl.bfloat16), mask=ok)
    tl.store(DV2 + i, dv.to(tl.bfloat16), mask=ok)


def prepare_sum_parts(numel: int, sm_scale: float, parts: int):
    """`_sum_parts_kernel`'s launch, made once: run(dk_parts, dv_parts, dk, dv) writes dk =
    bf16(sm_scale * the sum of dk_parts' `parts` fp32 partials of `numel` elements each) and dv
    the same of dv_parts, unscaled."""
    kernel = Kernel(_sum_parts_kernel, (triton.cdiv(numel, SUM_BLOCK),), PARTS=parts,
                    BLOCK=SUM_BLOCK, num_warps=4)

    def run(dk_parts, dv_parts, dk, dv) -> None:
        kernel(dk_parts, dv_parts, dk, dv, numel, sm_scale)

    return run


@triton.jit
def _finish_kernel(ACC, OUT, numel, scale, BLOCK: tl.constexpr):
    """OUT = bf16(scale * ACC), fp32 -> bf16."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    tl.store(OUT + i, (tl.load(ACC + i, mask=ok, other=0.0) * scale).to(tl.bfloat16), mask=ok)


FINISH_BLOCK = 2048  # elements per program of `_finish_kernel`


def prepare_finish(numel: int, scale: float):
    """`_finish_kernel`'s launch, made once: run(acc, out) writes out = bf16(scale * acc), numel
    fp32 elements."""
    kernel = Kernel(_finish_kernel, (triton.cdiv(numel, FINISH_BLOCK),), BLOCK=FINISH_BLOCK,
                    num_warps=4)

    def run(acc, out) -> None:
        kernel(acc, out, numel, scale)

    return run


# The forward's compile shapes, with G = 1 taken at Hk = 2: at Hq = Hk = 1 `_dq_kernel` spills
# 64 bytes in every config tried (it runs correctly, slower); G = 1 at Hk = 2 does not.
COMPILE_SHAPES_BWD = tuple((2, 2, d) if (hq, hk) == (1, 1) else (hq, hk, d)
                           for hq, hk, d in COMPILE_SHAPES)
def scalars(spec: ProblemSpec) -> tuple:
    """The GEMM kernels' scalar arguments at `spec`: N, w1, w2, qk_scale, sm_scale."""
    return spec.N, spec.w1, spec.w2, spec.sm_scale * LOG2E, spec.sm_scale


def compile_specs() -> list[ProblemSpec]:
    """One spec per COMPILE_SHAPES_BWD shape, at the resource report's N and windows."""
    return [ProblemSpec(B=1, N=4096, Hq=hq, Hk=hk, D=d, w1=32, w2=512, sm_scale=d ** -0.5)
            for hq, hk, d in COMPILE_SHAPES_BWD]


def meta_args(spec: ProblemSpec) -> tuple:
    """A backward run's arguments (q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1,
    dv2) for `spec` on meta tensors (compile configs)."""
    q = meta(spec.B, spec.N, spec.Hq, spec.D)
    kv = meta(spec.B, spec.N, spec.Hk, spec.D)
    lse = meta(spec.B, spec.Hq, spec.N, dtype=torch.float32)
    return q, kv, kv, kv, kv, q, lse, q, lse, q, kv, kv, kv, kv


def build_compile_configs(prepare, kernels: dict, specs) -> list[CompileConfig]:
    """The launches `prepare(spec)` makes (recorded on meta tensors) at each of `specs`, of the
    kernels in `kernels` (kernel -> its name, or launch -> its name), named by kernel, shape,
    tile and form; a name met twice is kept once."""
    out, seen = [], set()
    for spec in specs:
        def name(launch, spec=spec):
            kern = kernels.get(launch.fn)
            if kern is None:
                return None
            kern = kern if isinstance(kern, str) else kern(launch)
            c = launch.constexprs
            blocks = "".join(f"_{k[-1]}{c[k]}" for k in ("BLOCK_M", "BLOCK_N") if k in c)
            return f"{kern}_G{spec.G}_Hk{spec.Hk}_D{spec.D}{blocks}{form_suffix(spec)}"
        for cc in compile_configs(lambda s=spec: prepare(s), meta_args(spec), name):
            if cc.name not in seen:
                seen.add(cc.name)
                out.append(cc)
    return out

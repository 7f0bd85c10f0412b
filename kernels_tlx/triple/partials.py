"""TLX `partials`: the state's split-N partial sums (kernels_triton/triple/core.py's contraction),
warp-specialized, with the built operand in registers.

    P[b, h, s, i, j, k] = sum_{n in split s} X1[n, i] Y[n, j] X2[n, k]          (fp32)

One GEMM per value of i: acc_i [j, k] += A_i [j, n] @ X2 [n, k] with A_i = Y^T scaled column-wise
by X1[:, i] (bf16): Y^T is read from shared memory once per token tile straight into the wgmma
A-fragment layout (ldmatrix, transposed) and each A_i costs one HMUL2 per register pair; B = the
X2 tile, in shared memory. No operand goes through shared memory twice.

Warp groups of one CTA (a block of BI values of i, one split of N, one (b, h)):
- producer ("default", 4 warps): TMA-loads the Y and X2 tiles of BN tokens into rings of
  NUM_BUFFERS slots (full / empty mbarriers), and prefetches the step's X1 lines into L1
  (`prefetch_x1`).
- two consumer warp groups: each owns 64 rows of j and ACC values of i (ACC accumulators
  [64, D2] fp32); per token tile it loads Y^T, reads its X1 values by plain loads from the
  permuted copy (`permute_x1`, one pass over X1 before the launch; `column_factor`), issues its
  ACC x BN/16 wgmmas and waits for them, then frees the slot (`step_gemms`).
Splits of N are summed by the caller in a fixed order (bitwise repeatable). Y 64 or 128 wide
here; 32 in partials_pairs.py (a wgmma A operand has 64 rows).
Extra memory: the permuted copy of X1, B * H * D1 * N bf16 (one input's size), for the launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from altattn.registry import CompileConfig
from kernels_triton.launch import Desc, Kernel, sm_count
from kernels_triton.proton import enter, leave
from kernels_triton.triple import host as triton_host
from kernels_triton.triple.core import split_program
from kernels_tlx.consumers import NUM_CONSUMERS
from kernels_tlx.ring import empty_phase, full_phase

ROWS = tl.constexpr(64)    # rows of j per consumer (one wgmma M)
BF16 = tl.constexpr(2)
BN = tl.constexpr(64)      # tokens per step (the GEMM's K)
# The wgmma A-fragment layout of a [64, BN] bf16 operand (4 warps, 16 rows each; a thread holds
# rows r, r + 8 and columns c, c + 1, c + 8, c + 9 of each 16-column step), as flat offsets
# row * BN + column: lane bits 0-1 -> columns 2, 4; lane bits 2-4 -> rows 1, 2, 4; warp bits ->
# rows 16, 32; register bits -> column 1, row 8, columns 8, 16, 32
A_LAYOUT = tlx.layout(shape=((4, 8, 4), (2, 2, 8)), stride=((2, 64, 1024), (1, 512, 8)))


@triton.jit
def column_factor(like, ptr, pair=0):
    """A [64, BN] bf16 tensor in A_LAYOUT (like `like`) holding X1[n, i] at every row of column n:
    the thread's 16 values are 32 contiguous bytes of the permuted copy of X1 (`permute_x1`)
    at ptr + 32 * (lane % 4), read by two 16-byte loads; each word serves rows r and r + 8.
    pair: a byte offset the rows 32-63 (warps 2 and 3 of the warp group) add to ptr, so that
    they read the next value of i (partials_pairs.py; 0 here)."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .u32 lane, warp;
        .reg .u64 off, p;
        .reg .pred upper;
        mov.u32 lane, %laneid;
        and.b32 lane, lane, 3;
        mul.wide.u32 off, lane, 32;
        add.s64 p, $32, off;
        mov.u32 warp, %tid.x;
        bfe.u32 warp, warp, 5, 2;
        setp.ge.u32 upper, warp, 2;
        @upper add.s64 p, p, $64;
        ld.global.nc.v4.b32 {$0, $2, $4, $6}, [p];
        ld.global.nc.v4.b32 {$8, $10, $12, $14}, [p + 16];
        mov.b32 $1, $0;
        mov.b32 $3, $2;
        mov.b32 $5, $4;
        mov.b32 $7, $6;
        mov.b32 $9, $8;
        mov.b32 $11, $10;
        mov.b32 $13, $12;
        mov.b32 $15, $14;
        }
        """,
        "=r," * 16 + "r," * 16 + ",".join(["l"] * 64),
        [like, ptr.to(tl.int64), tl.cast(pair, tl.int64)], dtype=tl.bfloat16, is_pure=True, pack=32)


@triton.jit
def prefetch_x1(X1P, bh, D1: tl.constexpr, i0, BI: tl.constexpr, NP, n0):
    """Producer: the step's X1 values (BI rows of the permuted copy, one 128-byte line each)
    into L1, where the consumers' plain loads (`column_factor`) find them."""
    tlx.prefetch(X1P + (bh.to(tl.int64) * D1 + i0 + tl.arange(0, BI)) * NP + n0, level="L1")


@triton.jit
def step_gemms(vt, x1p, i_stride, pair, x2, acc0, acc1, acc2, acc3, ACC: tl.constexpr):
    """One consumer step: acc_a += (vt scaled by the X1 row at x1p + a i_stride) @ x2 for the
    ACC accumulators (the others pass through), issued together, then waited for."""
    acc0 = tlx.async_dot(vt * column_factor(vt, x1p, pair), x2, acc0)
    if ACC > 1:
        acc1 = tlx.async_dot(vt * column_factor(vt, x1p + i_stride, pair), x2, acc1)
    if ACC > 2:
        acc2 = tlx.async_dot(vt * column_factor(vt, x1p + 2 * i_stride, pair), x2, acc2)
        acc3 = tlx.async_dot(vt * column_factor(vt, x1p + 3 * i_stride, pair), x2, acc3)
    acc0 = tlx.async_dot_wait(0, acc0)  # every wgmma of the step
    if ACC > 1:
        acc1 = tlx.async_dot_wait(0, acc1)
    if ACC > 2:
        acc2 = tlx.async_dot_wait(0, acc2)
        acc3 = tlx.async_dot_wait(0, acc3)
    return acc0, acc1, acc2, acc3


@triton.jit
def store_accs(ptrs, step, acc0, acc1, acc2, acc3, ACC: tl.constexpr):
    """Epilogue: accumulator a to ptrs + a step (fp32 partial sums)."""
    tl.store(ptrs, acc0)
    if ACC > 1:
        tl.store(ptrs + step, acc1)
    if ACC > 2:
        tl.store(ptrs + 2 * step, acc2)
        tl.store(ptrs + 3 * step, acc3)


@triton.jit
def partials_ws_kernel(X1P, Yd, X2d, P, N, NP, split_len, n_splits,
                       H: tl.constexpr, D1: tl.constexpr, DY: tl.constexpr, D2: tl.constexpr,
                       BI: tl.constexpr, ACC: tl.constexpr,
                       NUM_BUFFERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
                       PROFILE: tl.constexpr = False, Splits=None):
    NJB: tl.constexpr = DY // ROWS       # 64-row blocks of j (2 at DY = 128)
    tl.static_assert(NJB * (BI // ACC) == NUM_CONSUMERS, "consumers = j blocks x i groups")
    tl.static_assert(ACC <= 4, "at most four accumulators")
    ib, s, bh, b, h, start, end, pstart = split_program(N, split_len, n_splits, H, D1 // BI,
                                                        Splits)
    n_steps = tl.cdiv(tl.maximum(end - start, 0), BN)

    y_tiles = tlx.local_alloc((BN, DY), tl.bfloat16, NUM_BUFFERS)
    x2_tiles = tlx.local_alloc((BN, D2), tl.bfloat16, NUM_BUFFERS)
    fulls = tlx.alloc_barriers(num_barriers=NUM_BUFFERS, arrive_count=1)
    empties = tlx.alloc_warp_barrier(num_barriers=NUM_BUFFERS, num_warps=4 * NUM_CONSUMERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):
            for t in range(n_steps):
                enter("load", PROFILE)
                buf = t % NUM_BUFFERS
                tlx.barrier_wait(tlx.local_view(empties, buf), empty_phase(t, NUM_BUFFERS))
                full = tlx.local_view(fulls, buf)
                tlx.barrier_expect_bytes(full, BN * (DY + D2) * BF16)
                n0 = start + t * BN
                tlx.async_descriptor_load(Yd, tlx.local_view(y_tiles, buf), [b, n0, h * DY], full)
                tlx.async_descriptor_load(X2d, tlx.local_view(x2_tiles, buf), [b, n0, h * D2],
                                          full)
                prefetch_x1(X1P, bh, D1, ib * BI, BI, NP, pstart + t * BN)
                leave("load", PROFILE)
        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid: tl.constexpr = tlx.async_task_replica_id()
            jb: tl.constexpr = cid % NJB
            i0: tl.constexpr = (cid // NJB) * ACC
            acc0 = tl.zeros([ROWS, D2], tl.float32)
            acc1 = tl.zeros([ROWS, D2], tl.float32)
            acc2 = tl.zeros([ROWS, D2], tl.float32)
            acc3 = tl.zeros([ROWS, D2], tl.float32)
            for t in range(n_steps):
                buf = t % NUM_BUFFERS
                enter("wait", PROFILE)
                tlx.barrier_wait(tlx.local_view(fulls, buf), full_phase(t, NUM_BUFFERS))
                leave("wait", PROFILE)
                enter("build", PROFILE)
                y = tlx.local_slice(tlx.local_view(y_tiles, buf), [0, jb * ROWS], [BN, ROWS])
                vt = tlx.local_load(tlx.local_trans(y), layout=A_LAYOUT)
                x1p = X1P + ((bh.to(tl.int64) * D1 + ib * BI + i0) * NP + pstart + t * BN)
                leave("build", PROFILE)
                enter("gemm", PROFILE)
                acc0, acc1, acc2, acc3 = step_gemms(vt, x1p, NP, 0, tlx.local_view(x2_tiles, buf),
                                                    acc0, acc1, acc2, acc3, ACC)
                leave("gemm", PROFILE)
                tlx.barrier_arrive(tlx.local_view(empties, buf), 1)
            # P[b, h, s, i, j, k]: accumulator a is i = ib BI + i0 + a, its rows j = jb 64 + r
            r = jb * ROWS + tl.arange(0, ROWS)
            k = tl.arange(0, D2)
            offs = r[:, None] * D2 + k[None, :]
            base = ((bh.to(tl.int64) * n_splits + s) * D1 + ib * BI + i0) * (DY * D2)
            enter("epilogue", PROFILE)
            store_accs(P + base + offs, DY * D2, acc0, acc1, acc2, acc3, ACC)
            leave("epilogue", PROFILE)


# ---- host side ---------------------------------------------------------------------------------

def takes(dy: int) -> bool:
    """Y's widths the TLX kernels take: 64 and 128 here, 32 in partials_pairs.py (elsewhere
    `partials` is the Triton kernel's)."""
    return dy in (32, 64, 128)


def config(d1: int, dy: int, d2: int) -> dict:
    """ACC accumulators [64, D2] per consumer (at most 128 fp32 registers), BI values of i per
    CTA: the consumers split Y's 64-row blocks, then the values of i."""
    acc = min(4, 256 // d2)
    if dy == 32:  # partials_pairs.py: two values of i per accumulator, a copier warp group;
        # the consumers' 216 registers hold 64 of accumulators without serializing the wgmmas
        acc = min(4, 128 // d2)
        return {"BI": acc * int(NUM_CONSUMERS) * 2, "ACC": acc, "NUM_BUFFERS": 3,
                "COPIER_REGS": 56, "CONSUMER_REGS": 216, "num_warps": 4, "num_stages": 1}
    bi = acc * int(NUM_CONSUMERS) // (dy // int(ROWS))
    return {"BI": min(bi, d1), "ACC": acc, "NUM_BUFFERS": 3, "CONSUMER_REGS": 240,
            "num_warps": 4, "num_stages": 1}


@triton.jit
def _permute_kernel(X1, X1P, N, NP, H: tl.constexpr, D1: tl.constexpr, RUNS: tl.constexpr):
    """RUNS BN-token runs of one (b, h): X1P[b, h, i, run + pos(t)] = X1[b, run + t, h, i],
    with t = 16 ks + 8 hi + 2 g + e  ->  pos(t) = 16 g + 4 ks + 2 hi + e (zeros past N)."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    p = tl.program_id(0) * (RUNS * BN) + tl.arange(0, RUNS * BN)
    # the token at position p (the inverse of pos): loads stay whole rows, stores contiguous runs
    q = p % BN
    n = p - q + 16 * ((q >> 2) & 3) + 8 * ((q >> 1) & 1) + 2 * (q >> 4) + (q & 1)
    i = tl.arange(0, D1)
    x = tl.load(X1 + ((b.to(tl.int64) * N + n[:, None]) * H + h) * D1 + i[None, :],
                mask=n[:, None] < N, other=0.0)
    dst = (bh.to(tl.int64) * D1 + i[:, None]) * NP + p[None, :]
    tl.store(X1P + dst, tl.trans(x), mask=p[None, :] < NP)


@triton.jit
def _permute_varlen_kernel(X1, X1P, Runs, Splits, NP, H: tl.constexpr, D1: tl.constexpr,
                           RUNS: tl.constexpr):
    """Packed sequences (B = 1): `_permute_kernel` with each split's runs starting at its padded
    position Splits[s, 2] (a multiple of BN): X1P[h, i, pstart + pos(t)] = X1[start + t, h, i]
    for t < end - start, zeros elsewhere; Runs[r]: the split whose padded runs hold run r."""
    h = tl.program_id(1)
    p = tl.program_id(0) * (RUNS * BN) + tl.arange(0, RUNS * BN)
    inside = p < NP
    split = Splits + 3 * tl.load(Runs + p // BN, mask=inside, other=0)
    start = tl.load(split)
    q = p % BN
    n = start + p - q + 16 * ((q >> 2) & 3) + 8 * ((q >> 1) & 1) + 2 * (q >> 4) + (q & 1) - \
        tl.load(split + 2)
    live = inside & (n < tl.load(split + 1))
    i = tl.arange(0, D1)
    x = tl.load(X1 + (n[:, None].to(tl.int64) * H + h) * D1 + i[None, :], mask=live[:, None],
                other=0.0)
    tl.store(X1P + (h.to(tl.int64) * D1 + i[:, None]) * NP + p[None, :], tl.trans(x),
             mask=inside[None, :])


def _padded(N: int) -> int:
    """NP: N rounded up to BN (at least one run), the token axis of the permuted copy of X1."""
    return triton.cdiv(max(N, 1), int(BN)) * int(BN)


def prepare_permute_x1(B: int, N: int, H: int, D1: int):
    """`permute_x1`'s launch for x1 [B, N, H, D1], made once: run(x1) -> permute_x1(x1)."""
    bn, NP = int(BN), _padded(N)
    runs = max(1, 8192 // (bn * D1))  # 8192 elements a program
    kernel = Kernel(_permute_kernel, (triton.cdiv(NP // bn, runs), B * H), H=H, D1=D1, RUNS=runs,
                    num_warps=4)
    shape = (B, H, D1, NP)

    def run(x1) -> torch.Tensor:
        x1p = torch.empty(shape, device=x1.device, dtype=x1.dtype)
        if B * H:
            kernel(x1, x1p, N, NP)
        return x1p

    return run


def permute_x1(x1):
    """X1 [B, N, H, D1] -> [B, H, D1, NP] (NP = N rounded up to BN, zero tail), each BN-token
    run permuted so that a consumer thread's 16 values (tokens 2g, 2g + 1 + 8m, m < 8, of lane
    group g = lane % 4) are 32 contiguous bytes, in the order of its A-fragment registers
    (`column_factor`). One pass over X1."""
    return prepare_permute_x1(*x1.shape)(x1)


def n_splits(B: int, N: int, H: int, d1: int, dy: int, d2: int) -> int:
    """One CTA per multiprocessor of the current GPU: splits of N so that the programs just fill
    it once (2 at T2: 128 programs on 132 multiprocessors; 1, 2 and 4 splits measured level
    there, docs/perf-triple.md)."""
    if not takes(dy):
        return triton_host.n_splits(B, N, H, d1, dy, d2)
    tiles = B * H * (d1 // config(d1, dy, d2)["BI"])
    return max(1, min(sm_count() // max(tiles, 1), triton.cdiv(N, int(BN))))


def _layout(B: int, L: int, H: int, D: int) -> Desc:
    """TMA view of a contiguous [B, L, H, D] tensor as [B, L, H*D], box [1, BN, D]."""
    return Desc([B, L, H * D], [L * H * D, H * D, 1], [1, int(BN), D])


def prepare_partials(B: int, N: int, H: int, d1: int, dy: int, d2: int, splits: int,
                     split_len: int | None = None, profile: bool = False):
    """kernels_triton.triple.host.prepare_partials' contract: run(x1, y, x2) -> P [B, H, splits,
    D1, DY, D2] fp32 (the Triton kernel's launch where `takes` says no; `profile`: the
    Proton-scoped copy). run permutes x1 (`prepare_permute_x1`), then launches the TLX kernel."""
    if not takes(dy):
        return triton_host.prepare_partials(B, N, H, d1, dy, d2, splits, split_len, profile)
    cfg = config(d1, dy, d2)
    bn, NP = int(BN), _padded(N)
    if split_len is None:
        split_len = triton.cdiv(triton.cdiv(N, splits), bn) * bn
    assert split_len % bn == 0, split_len
    permute = prepare_permute_x1(B, N, H, d1)
    y_layout, x2_layout = _layout(B, N, H, dy), _layout(B, N, H, d2)
    fn, consts = _kernel(d1, dy, d2, H)
    kernel = Kernel(fn, (B * H * splits * (d1 // cfg["BI"]),), **consts, PROFILE=bool(profile),
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    shape = (B, H, splits, d1, dy, d2)

    def run(x1, y, x2) -> torch.Tensor:
        x1p = permute(x1)
        P = torch.empty(shape, device=x1.device, dtype=torch.float32)
        kernel(x1p, y_layout(y), x2_layout(x2), P, N, NP, split_len, splits)
        return P

    return run


def split_blocks(d1: int, dy: int, d2: int) -> int:
    """`partials` CTAs per split and head (blocks of BI values of i)."""
    if not takes(dy):
        return triton_host.split_blocks(d1, dy, d2)
    return d1 // config(d1, dy, d2)["BI"]


def padded_varlen(T: int, C: int) -> int:
    """NP of packed sequences cut in at most C splits: room for each split's tokens rounded up
    to BN (the permuted copy's runs start at a split's start)."""
    return _padded(T) + C * int(BN)


def prepare_partials_varlen(T: int, H: int, d1: int, dy: int, d2: int, C: int,
                            profile: bool = False):
    """kernels_triton.triple.host.prepare_partials_varlen's contract: run(x1, y, x2, maps) -> P
    [1, H, C, D1, DY, D2] fp32, split s the tokens maps.splits[s] = (start, end, pstart). The
    permuted copy of X1 puts each split's runs at pstart (maps.runs: each run's split), zeros
    past its end, so the last step's tokens of the next sequence (loaded by TMA with the step)
    are multiplied by 0: finite values there add nothing. (An inf or NaN there would: isolation
    holds for finite inputs.)"""
    if not takes(dy):
        return triton_host.prepare_partials_varlen(T, H, d1, dy, d2, C, profile)
    cfg = config(d1, dy, d2)
    bn, NP = int(BN), padded_varlen(T, C)
    runs = max(1, 8192 // (bn * d1))
    permute = Kernel(_permute_varlen_kernel, (triton.cdiv(NP // bn, runs), H), H=H, D1=d1,
                     RUNS=runs, num_warps=4)
    y_layout, x2_layout = _layout(1, T, H, dy), _layout(1, T, H, d2)
    fn, consts = _kernel(d1, dy, d2, H)
    kernel = Kernel(fn, (H * C * (d1 // cfg["BI"]),), **consts, PROFILE=bool(profile),
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    def run(x1, y, x2, maps) -> torch.Tensor:
        x1p = torch.empty((1, H, d1, NP), device=x1.device, dtype=x1.dtype)
        permute(x1, x1p, maps.runs, maps.splits, NP)
        P = torch.empty((1, H, C, d1, dy, d2), device=x1.device, dtype=torch.float32)
        kernel(x1p, y_layout(y), x2_layout(x2), P, T, NP, 0, C, Splits=maps.splits)
        return P

    return run


def partials(x1, y, x2, splits: int, split_len: int | None = None, profile: bool = False):
    """`prepare_partials` of these tensors' shapes, run once on them (tests)."""
    return triton_host.partials(x1, y, x2, splits, split_len, profile, prepare_partials)


def _kernel(d1: int, dy: int, d2: int, H: int):
    """The kernel for these widths and its constexpr arguments."""
    cfg = config(d1, dy, d2)
    consts = {"H": H, "D1": d1, "D2": d2, "BI": cfg["BI"], "ACC": cfg["ACC"],
              "NUM_BUFFERS": cfg["NUM_BUFFERS"], "CONSUMER_REGS": cfg["CONSUMER_REGS"]}
    if dy == 32:
        from kernels_tlx.triple.partials_pairs import partials_pairs_kernel
        return partials_pairs_kernel, {**consts, "COPIER_REGS": cfg["COPIER_REGS"]}
    return partials_ws_kernel, {**consts, "DY": dy}


def compile_configs() -> list[CompileConfig]:
    """The kernel at every (D1, DY, D2) the passes launch it with (DY 32, 64 and 128), recorded
    on meta tensors."""
    out, N, H, S = [], triton_host.COMPILE_N, triton_host.COMPILE_H, triton_host.COMPILE_SPLITS
    for d1, dy, d2 in ((64, 64, 64), (128, 128, 128), (32, 64, 32), (64, 128, 64), (128, 64, 128),
                       (32, 32, 32), (64, 32, 64), (128, 32, 128)):
        kernel = _kernel(d1, dy, d2, H)[0]
        out.append(triton_host.recorded_config(
            f"{kernel.__name__}_D{d1}x{dy}x{d2}", kernel,
            lambda: prepare_partials(1, N, H, d1, dy, d2, S),
            *map(triton_host.tokens, (d1, dy, d2))))
    return out



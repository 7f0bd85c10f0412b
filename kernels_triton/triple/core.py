"""The two contractions every triple-attention pass is made of, in plain Triton.

Tensors are [B, N, H, D] bf16, contiguous (a token's row of one head is D elements, rows H*D
apart); offsets are int64 (B*N*H*D passes 2^31 at N = 524,288, H = 8, D = 128 ... and beyond).

`partials`: a third-order sum over tokens, split over N,
    P[b, h, s, i, j, k] = sum_{n in split s} X1[n, i] Y[n, j] X2[n, k]          (fp32)
as a GEMM whose A operand is built on the fly: A[(i, j), n] = X1[n, i] Y[n, j] (the Y tile scaled
by a column of X1, rounded to bf16), B = X2 [n, k]. One program owns a block of BI values of i
(all j, k) and one split of N; splits are summed later in a fixed order (no atomics). Phase 1 of
the forward (K1, V, K2) and the backward's dS (Q1, dO, Q2).

`apply`: a GEMM against a state slab, with the outer product built on the fly,
    Out[n, o] = c * sum_p sum_x (X[n, x] Y[n, p]) W[p, x, o]
A = the X tile scaled by column p of Y (bf16), B = W[p] [DX, DO] (bf16, by TMA; L2-resident:
every token tile of a head reads the same W). Phase 2 of the forward (X = Q2, Y = Q1, W[i, k, j] = S[i, j, k])
and the backward's five input gradients (bwd.py). W may hold one slab per chunk of CHUNK tokens
(causal: each chunk reads the state of the chunks before it).

`state`: between the forward's two, the splits of P summed into the state (plus an initial
state, where a call has one) and its bf16 slab written, one pass.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels_triton.proton import enter, leave


@triton.jit
def _rows(X, rows, live, b, h, N, H: tl.constexpr, D: tl.constexpr):
    """The [len(rows), D] tile of head h of X [B, N, H, D] at tokens `rows` (0 where not live)."""
    row = (b.to(tl.int64) * N + rows) * H + h
    return tl.load(X + row[:, None] * D + tl.arange(0, D)[None, :], mask=live[:, None], other=0.0)


@triton.jit
def split_program(N, split_len, n_splits, H: tl.constexpr, NIB: tl.constexpr, Splits=None):
    """(ib, s, bh, b, h, start, end, pstart) of a `partials` program: its block of i (NIB blocks,
    fastest: they read the same Y and X2 rows at the same time, from L2), its split of N (tokens
    start .. end - 1), its (b, h) (slowest). Every `partials` kernel's grid is one flat axis.
    Splits (packed sequences, B = 1; kernels_triton/triple/varlen.py): int32 [n_splits, 3], split
    s is tokens Splits[s, 0] .. Splits[s, 1] - 1 (of one sequence) and pstart = Splits[s, 2] its
    first position in the TLX kernels' padded copy of X1; without it pstart = start."""
    pid = tl.program_id(0)
    ib = pid % NIB
    rest = pid // NIB
    s = rest % n_splits
    bh = rest // n_splits
    if Splits is None:
        start = s * split_len
        end = tl.minimum(start + split_len, N)
        pstart = start
    else:
        start = tl.load(Splits + 3 * s)
        end = tl.load(Splits + 3 * s + 1)
        pstart = tl.load(Splits + 3 * s + 2)
    return ib, s, bh, bh // H, bh % H, start, end, pstart


@triton.jit
def partials_kernel(X1, Y, X2, P, N, split_len, n_splits,
                    H: tl.constexpr, D1: tl.constexpr, DY: tl.constexpr, D2: tl.constexpr,
                    BI: tl.constexpr, BN: tl.constexpr, PROFILE: tl.constexpr = False,
                    Splits=None):
    """P [B, H, n_splits, D1, DY, D2] fp32 (module docstring); grid: `split_program` (Splits:
    its packed splits)."""
    ib, s, bh, b, h, start, end, _ = split_program(N, split_len, n_splits, H, D1 // BI, Splits)
    cols = ib * BI + tl.arange(0, BI)
    acc = tl.zeros([BI * DY, D2], tl.float32)
    for n0 in range(start, end, BN):
        enter("load", PROFILE)
        n = n0 + tl.arange(0, BN)
        live = n < end
        row = (b.to(tl.int64) * N + n) * H + h
        x1 = tl.load(X1 + row[:, None] * D1 + cols[None, :], mask=live[:, None], other=0.0)
        y = _rows(Y, n, live, b, h, N, H, DY)
        x2 = _rows(X2, n, live, b, h, N, H, D2)
        leave("load", PROFILE)
        enter("build", PROFILE)
        a = tl.reshape(x1[:, :, None] * y[:, None, :], (BN, BI * DY))
        leave("build", PROFILE)
        enter("gemm", PROFILE)
        acc = tl.dot(tl.trans(a), x2, acc)
        leave("gemm", PROFILE)
    enter("epilogue", PROFILE)
    r = tl.arange(0, BI * DY)
    base = (bh.to(tl.int64) * n_splits + s) * (D1 * DY * D2) + ib * (BI * DY * D2)
    tl.store(P + base + r[:, None] * D2 + tl.arange(0, D2)[None, :], acc)
    leave("epilogue", PROFILE)


@triton.jit
def apply_kernel(X, Y, W, Out, N, c, w_head, w_chunk,
                 H: tl.constexpr, DX: tl.constexpr, DY: tl.constexpr, DO: tl.constexpr,
                 BM: tl.constexpr, CHUNK: tl.constexpr, PROFILE: tl.constexpr = False,
                 Tiles=None, CS=None):
    """Out [B, N, H, DO] (bf16, or fp32 when Out is): the module docstring's sum. W is a TMA
    descriptor of the slabs as rows [B*H*chunks*DY*DX, DO], box [DX, DO]: a head's first row is
    bh * w_head, a chunk's w_chunk rows further (CHUNK = 0: one slab per head). Grid: one flat
    axis, the token tiles of a head fastest.
    Packed sequences (B = 1; kernels_triton/triple/varlen.py): Tiles int32 [G, 5], grid (G, H):
    tile t is rows Tiles[t, 0] .. Tiles[t, 2] - 1 (at most BM, one sequence), reading slab
    Tiles[t, 3] (its row h * w_head + slab * w_chunk), scaled by c * CS[Tiles[t, 4]] (CS: fp32
    per sequence, or None)."""
    if Tiles is None:
        pid = tl.program_id(0)
        n_m = tl.cdiv(N, BM)
        mi = pid % n_m
        bh = pid // n_m
        b = bh // H
        h = bh % H
        r0 = mi * BM
        r1 = N
    else:
        tile = Tiles + 5 * tl.program_id(0)
        h = tl.program_id(1)
        b = h * 0
        r0 = tl.load(tile)
        r1 = tl.load(tile + 2)
        if r0 >= r1:  # past the last tile of the packed sequences
            return
    enter("load", PROFILE)
    rows = r0 + tl.arange(0, BM)
    live = rows < r1
    yrow = ((b.to(tl.int64) * N + rows) * H + h) * DY
    x = _rows(X, rows, live, b, h, N, H, DX)
    leave("load", PROFILE)
    if Tiles is None:
        w0 = bh * w_head
        if CHUNK > 0:
            w0 += ((mi * BM) // CHUNK) * w_chunk
    else:
        w0 = h * w_head + tl.load(tile + 3) * w_chunk
        if CS is not None:
            c = c * tl.load(CS + tl.load(tile + 4))
    acc = tl.zeros([BM, DO], tl.float32)
    for p in range(DY):
        enter("build", PROFILE)
        yp = tl.load(Y + yrow + p, mask=live, other=0.0)
        a = x * yp[:, None]
        w = W.load([w0 + p * DX, 0])
        leave("build", PROFILE)
        enter("gemm", PROFILE)
        acc = tl.dot(a, w, acc)
        leave("gemm", PROFILE)
    enter("epilogue", PROFILE)
    orow = ((b.to(tl.int64) * N + rows) * H + h) * DO
    tl.store(Out + orow[:, None] + tl.arange(0, DO)[None, :], (acc * c).to(Out.dtype.element_ty),
             mask=live[:, None])
    leave("epilogue", PROFILE)


@triton.jit
def state_kernel(P, S, W, n_splits, c, D1: tl.constexpr, DY: tl.constexpr, D2: tl.constexpr,
                 S0=None):
    """Between the two: S[bh, i, j, k] = S0[bh, i, j, k] + c * sum_s P[bh, s, i, j, k] (fp32, the
    splits summed in order: bitwise repeatable; S0 the initial state, fp32 like S, or None: a
    compile-time None, no load) and its bf16 slab W[bh, i, k, j] (what the forward's apply
    reads, host.slab's "ikj"), in one pass over P. Grid (D1, B*H): program (i, bh) owns
    S[bh, i]."""
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, DY)
    k = tl.arange(0, D2)
    jk = j[:, None] * D2 + k[None, :]
    part = bh * n_splits * (D1 * DY * D2) + i * (DY * D2)
    acc = tl.zeros([DY, D2], tl.float32)
    for s in range(n_splits):
        acc += tl.load(P + part + s * (D1 * DY * D2) + jk)
    acc = acc * c
    own = (bh * D1 + i) * (DY * D2)
    if S0 is not None:
        acc += tl.load(S0 + own + jk)
    tl.store(S + own + jk, acc)
    tl.store(W + own + k[:, None] * DY + j[None, :], tl.trans(acc.to(tl.bfloat16)))

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

`scan`: the splits of P summed into the state (plus an initial state, where a call has one), or
walked as causal prefix or suffix sums, with the bf16 slabs `apply` reads written in the same
pass (the forward's state and W; the backward's dS and its three slabs; the causal chunks'
exclusive prefix and suffix states as their slabs).
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
                    Splits=None, W_IKJ=None, S0=None, c=None):
    """P [B, H, n_splits, D1, DY, D2] fp32 (module docstring); grid: `split_program` (Splits:
    its packed splits). With c (one split, dense; kernels_triton/triple/short.py): the state
    in one pass, the scan's SUM folded in: P is then S [B, H, D1, DY, D2] = S0 + c * the sum
    (S0 None: 0; the scan's arithmetic, so bitwise a scan of this kernel's one split) and
    W_IKJ, where given, its bf16 slab [B, H, D1, D2, DY]."""
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
    k = tl.arange(0, D2)
    base = (bh.to(tl.int64) * n_splits + s) * (D1 * DY * D2)
    ijk = ib * (BI * DY * D2) + r[:, None] * D2 + k[None, :]
    if c is None:
        tl.store(P + base + ijk, acc)
    else:
        acc = acc * c
        if S0 is not None:
            acc += tl.load(S0 + base + ijk)
        tl.store(P + base + ijk, acc)
        if W_IKJ is not None:
            i = ib * BI + r // DY
            ikj = (i[:, None] * D2 + k[None, :]) * DY + (r % DY)[:, None]
            tl.store(W_IKJ + base + ikj, acc.to(tl.bfloat16))
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


SUM, PREFIX, SUFFIX = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # scan_kernel's MODE


@triton.jit
def _store_slabs(W_IJK, W_IKJ, W_JKI, at, x, ijk, ikj, jki):
    """x's bf16 slabs, each where given, at `at` + the tile's offsets in that order."""
    w = x.to(tl.bfloat16)
    if W_IJK is not None:
        tl.store(W_IJK + at + ijk, w)
    if W_IKJ is not None:
        tl.store(W_IKJ + at + ikj, w)
    if W_JKI is not None:
        tl.store(W_JKI + at + jki, w)


@triton.jit
def _split(Slot, lo, hi, u, MODE: tl.constexpr):
    """The index in P of a head's split u in scan order (in reverse for SUFFIX; through Slot
    where given); u past the last: any index, not to be read (Slot itself is not read there)."""
    if MODE == SUFFIX:
        split = hi - 1 - u
    else:
        split = lo + u
    if Slot is not None:
        split = tl.load(Slot + split, mask=u < hi - lo, other=0)
    return split


@triton.jit
def scan_kernel(P, S, n_splits, c, H: tl.constexpr, D1: tl.constexpr, DY: tl.constexpr,
                D2: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr,
                MODE: tl.constexpr, W_IJK=None, W_IKJ=None, W_JKI=None, S0=None, CS=None,
                Seg=None, Slot=None):
    """One pass over the splits (or causal chunks) of P [heads, n_splits, D1, DY, D2] fp32, in
    order, per head (grid (heads, tiles): program (g, t) owns the [BI, BJ, BK] block t of head
    g's states):
    SUM     S = S0 + c * the sum of the splits (S0 None: 0), and its bf16 slabs;
    PREFIX  each split's exclusive prefix plus S0 / c (the state its tokens read, unscaled:
            apply scales by c) written as its bf16 slabs; S = S0 + c * the sum of all;
    SUFFIX  each split's exclusive suffix plus S0 (dstate) as its slabs; S = S0 + the sum
            of all (initial_state's gradient).
    S, S0 [heads, D1, DY, D2] fp32 (S None: not written); slabs W_IJK [.., D1, DY, D2], W_IKJ
    [.., D1, D2, DY], W_JKI [.., DY, D2, D1] bf16 (host.slab's orders), each where given, shaped
    as S (SUM) or as P (one per split). Every sum in a fixed order (bitwise repeatable, the
    same at any tiling).
    Packed sequences (kernels_triton/triple/varlen.py): head g = s H + h of sequence s, its
    splits Slot[Seg[s]] .. Slot[Seg[s+1] - 1] of P [1, H, n_splits, ...] head h, c scaled by
    CS[s] where given (fp32 [n])."""
    g = tl.program_id(0)
    t = tl.program_id(1)
    NJ: tl.constexpr = DY // BJ
    NK: tl.constexpr = D2 // BK
    i = (t // (NJ * NK)) * BI + tl.arange(0, BI)
    j = (t // NK % NJ) * BJ + tl.arange(0, BJ)
    k = (t % NK) * BK + tl.arange(0, BK)
    i3 = i[:, None, None]
    j3 = j[None, :, None]
    k3 = k[None, None, :]
    ijk = (i3 * DY + j3) * D2 + k3
    ikj = (i3 * D2 + k3) * DY + j3
    jki = (j3 * D2 + k3) * D1 + i3
    step = D1 * DY * D2
    own = g.to(tl.int64) * step
    if Seg is None:
        lo = g * 0  # a tensor (n_splits may be the constant 1)
        hi = lo + n_splits
        head = g
    else:
        s = g // H
        lo = tl.load(Seg + s)
        hi = tl.load(Seg + s + 1)
        head = g % H
        if CS is not None:
            c = c * tl.load(CS + s)
    base = head.to(tl.int64) * n_splits * step
    run = tl.zeros([BI, BJ, BK], tl.float32)
    if S0 is not None:
        run = tl.load(S0 + own + ijk)
        if MODE == PREFIX:
            run = tl.div_rn(run, tl.zeros_like(run) + c)  # IEEE, as torch (not div.full)
    total = tl.zeros([BI, BJ, BK], tl.float32)
    n = hi - lo
    at = base + _split(Slot, lo, hi, lo * 0, MODE).to(tl.int64) * step
    x = tl.load(P + at + ijk, mask=n > 0, other=0.0)
    for u in range(n):  # split u + 1 loads while split u is stored: two loads in flight
        nxt = base + _split(Slot, lo, hi, u + 1, MODE).to(tl.int64) * step
        x_next = tl.load(P + nxt + ijk, mask=u + 1 < n, other=0.0)
        if MODE != SUM:
            _store_slabs(W_IJK, W_IKJ, W_JKI, at, run, ijk, ikj, jki)
            run += x
        if MODE != SUFFIX:
            total += x
        at = nxt
        x = x_next
    if MODE == SUFFIX:
        total = run
    else:
        total = total * c
        if S0 is not None:
            total += tl.load(S0 + own + ijk)
    if S is not None:
        tl.store(S + own + ijk, total)
    if MODE == SUM:
        _store_slabs(W_IJK, W_IKJ, W_JKI, own, total, ijk, ikj, jki)

"""The spherical backward's per-row scalars, shared by every backward variant (Triton and TLX): the
FlashAttention-2 "preprocess" with the softmax's delta turned into the two coefficients of
    P = A t,   ds' = A dP + Bt t        (t = q . k unscaled, dP = dout . v, ds' = c ds)
that the mainloops need: with a = 1/(r + eps), delta = sum_d dout * out (out as stored) and
g = dr - delta a,  A = c a  and  Bt = c^2 g / r (0 where r = 0). Rows past a sequence's length
(seqlens) get A = Bt = 0, so they add nothing to dk, dv and their dq is 0.

Layout: [B, Hq, NP] fp32 with each (b, h)'s row padded to NP = N rounded up to a multiple of 4
(16 bytes: TMA needs 16-byte-aligned starts and strides, so a TLX kernel can bulk-copy any
64-row run of it); the padding holds zeros. `coeff_row0` gives a (b, h)'s first element.
Packed sequences, slots=True (the TLX key-block kernel's): [Hq, NA] with NA = 64 * (cdiv(T, 64) +
n), sequence s's rows from `slot_row0` on, zeros to the end of its last 64-row tile: every
64-row run of a sequence starts on 16 bytes and meets zeros past the sequence's end, so the
kernel's producer brings it by TMA as in a batch.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from altattn.packing import max_tiles
from kernels_triton.launch import Kernel

ROWS = 64  # rows of one program
ALIGN = 4  # elements per 16 bytes of fp32: each (b, h) row of A and Bt starts on 16 bytes


def padded_rows(N: int) -> int:
    """NP: N rounded up to a multiple of ALIGN (the row length of A and Bt)."""
    return -(-N // ALIGN) * ALIGN


@triton.jit
def coeff_row0(b, h, N, HQ: tl.constexpr):
    """Element offset of row 0 of (b, h) in A or Bt (int64), rows padded as `padded_rows`."""
    return (b.to(tl.int64) * HQ + h) * ((N + 3) // 4 * 4)


def slot_rows(T: int, n: int) -> int:
    """NA: the row length of the slots layout of n packed sequences of T rows (module docstring):
    each sequence's slots start past the previous one's last 64-row tile."""
    return 64 * max_tiles(T, n, 64)


@triton.jit
def slot_row0(q_start, seq):
    """The first slot of packed sequence `seq` (starting at row q_start): 64 * (q_start // 64 +
    seq), past the previous sequence's last 64-row tile (that ends at most 64 * (q_start // 64
    + seq) with the 64 rows one tile can take beyond its rows)."""
    return 64 * (q_start // 64 + seq)


@triton.jit
def sequence_of(Cu, n, y, STEPS: tl.constexpr):
    """The packed sequence holding each row y (int32 [n + 1] offsets Cu; rows y < Cu[n]): the
    last s < n with Cu[s] <= y (empty sequences are never the answer), by STEPS >= log2(n)
    halvings of [lo, lo + size), which holds it (Cu[lo] <= y from Cu[0] = 0)."""
    lo = tl.zeros_like(y)
    size = tl.zeros_like(y) + n
    for _ in tl.static_range(STEPS):
        half = size // 2
        mid = lo + half  # < lo + size <= n where half > 0
        go = (half > 0) & (tl.load(Cu + mid, mask=half > 0, other=0) <= y)
        lo = tl.where(go, mid, lo)
        size = tl.where(half > 0, tl.where(go, size - half, half), size)
    return lo


@triton.jit
def _row_coeffs_kernel(Out, dOut, R, dR, Seqlens, A, Bt, DQ0, N, NA, n_seq, c, eps,
                       HQ: tl.constexpr, D: tl.constexpr, HAS_DR: tl.constexpr,
                       VARLEN: tl.constexpr, ROWS: tl.constexpr, RATIO: tl.constexpr,
                       ZERO_DQ: tl.constexpr, SLOTS: tl.constexpr = 0):
    bh = tl.program_id(0)  # b * HQ + h: axis 0 has no 65535 limit
    b = bh // HQ
    h = bh % HQ
    y = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    lq = N
    if VARLEN:
        lq = tl.minimum(tl.maximum(tl.load(Seqlens + b), 0), N)
    live = y < lq
    rows = (b.to(tl.int64) * N + y) * (HQ * D) + h * D  # [B, N, HQ, D]
    ptr = rows[:, None] + d[None, :]
    o = tl.load(Out + ptr, mask=live[:, None], other=0.0).to(tl.float32)
    do = tl.load(dOut + ptr, mask=live[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    r = tl.load(R + bh.to(tl.int64) * N + y, mask=live, other=0.0)  # [B, HQ, N]
    a = 1.0 / (r + eps)
    g = -delta * a
    if HAS_DR:
        g += tl.load(dR + bh.to(tl.int64) * N + y, mask=live, other=0.0)
    bt = tl.where(r > 0, (c * c) * g / tl.where(r > 0, r, 1.0), 0.0)
    a = tl.where(live, c * a, 0.0)
    bt = tl.where(live, bt, 0.0)
    if RATIO:  # Bt / A, 0 where A = 0, rounded as torch divides (the TLX backwards' R)
        bt = tl.where(a != 0, tl.div_rn(bt, tl.where(a != 0, a, 1.0)), 0.0)
    if SLOTS:  # packed (SLOTS: halvings of the search): Seqlens holds the offsets; [HQ, NA],
        # the padding zeroed by the caller
        s = sequence_of(Seqlens, n_seq, y, SLOTS)
        first = tl.load(Seqlens + s, mask=live, other=0)
        at = h.to(tl.int64) * NA + slot_row0(first, s) + (y - first)
        tl.store(A + at, a, mask=live)
        tl.store(Bt + at, bt, mask=live)
    else:
        at = coeff_row0(b, h, N, HQ) + y  # [B, HQ, NP]: rows N .. NP - 1 get zeros
        tl.store(A + at, a, mask=y < (N + 3) // 4 * 4)
        tl.store(Bt + at, bt, mask=y < (N + 3) // 4 * 4)
    if ZERO_DQ:  # the fp32 dQ scratch [B, N, HQ, D] a backward reduce-adds into, zeroed here
        tl.store(DQ0 + ptr, tl.zeros([ROWS, D], tl.float32), mask=(y < N)[:, None])


def prepare_row_coeffs(spec, ratio: bool = False, zero_dq: bool = False, slots: bool = False):
    """The row-coefficient launch of `spec`, made once: run(out, dout, r, dr, seqlens, dq0=None)
    -> (A, Bt), fp32 [B, Hq, NP] (module docstring; two planes of one allocation), from out and
    dout [B, N, Hq, D] bf16 (contiguous), r and dr [B, Hq, N] fp32 (dr may be None) and seqlens
    int32 [B] (None unless spec.varlen). ratio=True: (A, R) with R = Bt / A (0 where A = 0), what
    the TLX backwards read. zero_dq=True: the same launch zeroes dq0, fp32 [B, N, Hq, D] (a dQ
    scratch; no memset launch of its own). slots=True (spec.packed, B = 1): `seqlens` is the
    packed offsets cu_seqlens, and A, R are [Hq, NA] in the slots layout (module docstring)."""
    grid = (spec.B * spec.Hq, triton.cdiv(spec.N, ROWS))
    N, c, eps = spec.N, spec.sm_scale, spec.eps

    @functools.cache  # (HAS_DR, halvings of the sequence search) -> its Kernel, made at first use
    def kernel(has_dr: bool, steps: int) -> Kernel:
        return Kernel(_row_coeffs_kernel, grid, HQ=spec.Hq, D=spec.D, HAS_DR=has_dr,
                      VARLEN=spec.varlen, ROWS=ROWS, RATIO=ratio, ZERO_DQ=zero_dq, SLOTS=steps,
                      num_warps=4)

    def run(out, dout, r, dr, seqlens, dq0=None) -> tuple[torch.Tensor, torch.Tensor]:
        if slots:
            n = seqlens.numel() - 1
            NA, steps = slot_rows(N, n), max(1, n.bit_length())
            A, Bt = torch.zeros((2, spec.Hq, NA), dtype=torch.float32,
                                device=out.device).unbind(0)
        else:
            n, NA, steps = 0, 0, 0
            A, Bt = torch.empty((2, spec.B, spec.Hq, padded_rows(N)), dtype=torch.float32,
                                device=out.device).unbind(0)
        if A.numel():
            kernel(dr is not None, steps)(out, dout, r, r if dr is None else dr,
                                          r if seqlens is None else seqlens, A, Bt,
                                          dq0 if zero_dq else A, N, NA, n, c, eps)
        return A, Bt

    return run


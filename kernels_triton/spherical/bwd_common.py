"""The spherical backward's per-row scalars, shared by every backward variant (Triton and TLX): the
FlashAttention-2 "preprocess" with the softmax's delta turned into the two coefficients of
    P = A t,   ds' = A dP + Bt t        (t = q . k unscaled, dP = dout . v, ds' = c ds)
that the mainloops need: with a = 1/(r + eps), delta = sum_d dout * out (out as stored) and
g = dr - delta a,  A = c a  and  Bt = c^2 g / r (0 where r = 0). Rows past a sequence's length
(seqlens) get A = Bt = 0, so they add nothing to dk, dv and their dq is 0.

Layout: [B, Hq, NP] fp32 with each (b, h)'s row padded to NP = N rounded up to a multiple of 4
(16 bytes: TMA needs 16-byte-aligned starts and strides, so a TLX kernel can bulk-copy any
64-row run of it); the padding holds zeros. `coeff_row0` gives a (b, h)'s first element.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

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


@triton.jit
def _row_coeffs_kernel(Out, dOut, R, dR, Seqlens, A, Bt, DQ0, N, c, eps, HQ: tl.constexpr,
                       D: tl.constexpr, HAS_DR: tl.constexpr, VARLEN: tl.constexpr,
                       ROWS: tl.constexpr, RATIO: tl.constexpr, ZERO_DQ: tl.constexpr):
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
    at = coeff_row0(b, h, N, HQ) + y  # [B, HQ, NP]: rows N .. NP - 1 get zeros
    a = tl.where(live, c * a, 0.0)
    bt = tl.where(live, bt, 0.0)
    if RATIO:  # Bt / A, 0 where A = 0, rounded as torch divides (the TLX backwards' R)
        bt = tl.where(a != 0, tl.div_rn(bt, tl.where(a != 0, a, 1.0)), 0.0)
    tl.store(A + at, a, mask=y < (N + 3) // 4 * 4)
    tl.store(Bt + at, bt, mask=y < (N + 3) // 4 * 4)
    if ZERO_DQ:  # the fp32 dQ scratch [B, N, HQ, D] a backward reduce-adds into, zeroed here
        tl.store(DQ0 + ptr, tl.zeros([ROWS, D], tl.float32), mask=(y < N)[:, None])


def prepare_row_coeffs(spec, ratio: bool = False, zero_dq: bool = False):
    """The row-coefficient launch of `spec`, made once: run(out, dout, r, dr, seqlens, dq0=None)
    -> (A, Bt), fp32 [B, Hq, NP] (module docstring; two planes of one allocation), from out and
    dout [B, N, Hq, D] bf16 (contiguous), r and dr [B, Hq, N] fp32 (dr may be None) and seqlens
    int32 [B] (None unless spec.varlen). ratio=True: (A, R) with R = Bt / A (0 where A = 0), what
    the TLX backwards read. zero_dq=True: the same launch zeroes dq0, fp32 [B, N, Hq, D] (a dQ
    scratch; no memset launch of its own)."""
    shape = (2, spec.B, spec.Hq, padded_rows(spec.N))
    grid = (spec.B * spec.Hq, triton.cdiv(spec.N, ROWS))
    N, c, eps = spec.N, spec.sm_scale, spec.eps

    @functools.cache  # HAS_DR -> its Kernel, made at its first call
    def kernel(has_dr: bool) -> Kernel:
        return Kernel(_row_coeffs_kernel, grid, HQ=spec.Hq, D=spec.D, HAS_DR=has_dr,
                      VARLEN=spec.varlen, ROWS=ROWS, RATIO=ratio, ZERO_DQ=zero_dq, num_warps=4)

    def run(out, dout, r, dr, seqlens, dq0=None) -> tuple[torch.Tensor, torch.Tensor]:
        A, Bt = torch.empty(shape, dtype=torch.float32, device=out.device).unbind(0)
        if A.numel():
            kernel(dr is not None)(out, dout, r, r if dr is None else dr,
                                   r if seqlens is None else seqlens, A, Bt,
                                   dq0 if zero_dq else A, N, c, eps)
        return A, Bt

    return run


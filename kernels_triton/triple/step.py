"""Triple attention's decoding step: T new tokens of each sequence read and advance the state in
one pass over it (altattn/triple/decode.py's `step`).

For each (b, h) and each token t in order (causal inside the step too):
    S[i, j, k] += c * K1[t, i] V[t, j] K2[t, k]          the state, fp32, in place
    out[t, j]   = sum_{i,k} Q1[t, i] S[i, j, k] Q2[t, k]   what token t reads (its own term in)
One program per (b, h, block of BJ values of j): it streams S[:, j-block, :] once, a [BJ, Dq]
tile per i (k contiguous), applies the T rank-1 updates to the tile and adds each token's
contribution to its [BJ] output, then stores the tile. Memory-bound: the state is read and
written once a launch (Dq^2 Dv fp32 per head); no tensor cores, so Triton's CPU interpreter runs
it (tests). At most MAX_T tokens a launch; `prepare_step` chains launches for more (a pass over
the state each).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels_triton.launch import Kernel

MAX_T = 8      # tokens per launch (unrolled; a [MAX_T, BJ] accumulator per program)
BLOCK_J = 32   # values of j per program


@triton.jit
def step_kernel(Q1, Q2, K1, K2, V, S, Out, T, t0, T_all, c, H: tl.constexpr, DQ: tl.constexpr,
                DV: tl.constexpr, BJ: tl.constexpr, BT: tl.constexpr):
    """Tokens t0 .. t0 + T - 1 of T_all (rows of [B, T_all, H, D] inputs), T <= BT."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    j = tl.program_id(1) * BJ + tl.arange(0, BJ)
    k = tl.arange(0, DQ)
    t = tl.arange(0, BT)
    jok = j < DV
    acc = tl.zeros([BT, BJ], tl.float32)
    state = S + bh.to(tl.int64) * (DQ * DV * DQ)
    tile = (j[:, None] * DQ + k[None, :]).to(tl.int64)
    for i in range(0, DQ):
        at = state + i * (DV * DQ) + tile
        s = tl.load(at, mask=jok[:, None], other=0.0)
        for tt in tl.static_range(BT):
            live = tt < T
            row = ((b * T_all + t0 + tt) * H + h).to(tl.int64)
            k1 = tl.load(K1 + row * DQ + i, mask=live, other=0.0).to(tl.float32)
            k2 = tl.load(K2 + row * DQ + k, mask=live, other=0.0).to(tl.float32)
            v = tl.load(V + row * DV + j, mask=live & jok, other=0.0).to(tl.float32)
            s += (c * k1) * (v[:, None] * k2[None, :])
            q1 = tl.load(Q1 + row * DQ + i, mask=live, other=0.0).to(tl.float32)
            q2 = tl.load(Q2 + row * DQ + k, mask=live, other=0.0).to(tl.float32)
            read = tl.sum(s * q2[None, :], 1) * q1
            acc += tl.where(t[:, None] == tt, read[None, :], 0.0)
        tl.store(at, s, mask=jok[:, None])
    rows = ((b * T_all + t0 + t) * H + h).to(tl.int64)
    tl.store(Out + rows[:, None] * DV + j[None, :], acc.to(Out.dtype.element_ty),
             mask=(t < T)[:, None] & jok[None, :])


def block_t(T: int) -> int:
    """The accumulator's rows for a launch of T tokens: a power of two >= T, at most MAX_T."""
    return triton.next_power_of_2(max(1, min(T, MAX_T)))


@functools.lru_cache(maxsize=256)
def prepare_step(B: int, T: int, H: int, Dq: int, Dv: int, device_index: int = 0):
    """The step's launches for these shapes on GPU `device_index` (a Kernel keeps one device's
    compiled kernel), made once: run(q1, q2, k1, k2, v, state, out, c)
    advances state [B, H, Dq, Dv, Dq] (fp32, contiguous) by the T tokens in place and writes
    out [B, T, H, Dv] (q1, q2, k1, k2 [B, T, H, Dq], v [B, T, H, Dv], contiguous); tokens in
    launches of MAX_T."""
    grid = (B * H, triton.cdiv(Dv, BLOCK_J))
    starts = range(0, T, MAX_T)
    kernels = [Kernel(step_kernel, grid, H=H, DQ=Dq, DV=Dv, BJ=BLOCK_J,
                      BT=block_t(min(MAX_T, T - t0)), num_warps=4) for t0 in starts]

    def run(q1, q2, k1, k2, v, state, out, c: float) -> None:
        if B * H == 0:
            return
        for kernel, t0 in zip(kernels, starts):
            kernel(q1, q2, k1, k2, v, state, out, min(MAX_T, T - t0), t0, T, float(c))

    return run


def compile_configs():
    """The step at Dq = Dv = 32, 64, 128 (and Dq 64, Dv 32), one token and MAX_T (recorded on
    meta tensors)."""
    from kernels_triton.launch import compile_configs as configs_of
    from kernels_triton.launch import meta
    out = []
    for dq, dv in ((32, 32), (64, 64), (128, 128), (64, 32)):
        for T in (1, MAX_T):
            x = [meta(1, T, 8, d) for d in (dq, dq, dq, dq, dv)]
            args = (*x, meta(1, 8, dq, dv, dq, dtype=torch.float32), meta(1, T, 8, dv), 1.0)
            out += configs_of(lambda T=T, dq=dq, dv=dv: prepare_step.__wrapped__(1, T, 8, dq, dv, 0),
                              args, lambda launch, n=f"step_D{dq}x{dv}_T{T}": n)
    return out

"""The two small kernels around a decoding launch (altattn/simplicial/kvcache.py): the new keys and
values written into their cache slots, and the merge of the j window's split shares by their LSE.
One launch each, whatever the batch, so that a decoding step is three launches (append, attention,
merge) and no host work: what a CUDA graph replays. Each launch is made once per size
(kernels_triton.launch.Kernel: every integer it takes is a function of the sizes).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from altattn.checks import dense_aligned
from kernels_triton.launch import Kernel


@triton.jit
def _append_kernel(K1c, K2c, V1c, V2c, K1, K2, V1, V2, Lens, T, R1, R2, HKD: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Program b * T + t: the [Hk, D] rows of new token t of sequence b into slot
    (Lens[b] + t) mod R of each cache (R1 for K1/V1, R2 for K2/V2); none at a negative
    position (cache_seqlens < 0, which the host refuses where it can read it)."""
    pid = tl.program_id(0)
    b = pid // T
    pos = tl.load(Lens + b) + pid % T
    offs = tl.arange(0, BLOCK)
    ok = (offs < HKD) & (pos >= 0)
    src = pid.to(tl.int64) * HKD + offs
    slot1 = (b.to(tl.int64) * R1 + pos % R1) * HKD + offs
    slot2 = (b.to(tl.int64) * R2 + pos % R2) * HKD + offs
    tl.store(K1c + slot1, tl.load(K1 + src, mask=ok), mask=ok)
    tl.store(V1c + slot1, tl.load(V1 + src, mask=ok), mask=ok)
    tl.store(K2c + slot2, tl.load(K2 + src, mask=ok), mask=ok)
    tl.store(V2c + slot2, tl.load(V2 + src, mask=ok), mask=ok)


@functools.lru_cache(maxsize=256)
def prepare_append(B: int, T: int, Hk: int, D: int, R1: int, R2: int):
    """`append`'s launch for these sizes, made once: run(caches, new, lens)."""
    hkd = Hk * D
    kernel = Kernel(_append_kernel, (B * T,), HKD=hkd, BLOCK=triton.next_power_of_2(hkd),
                    num_warps=4)

    def run(caches, new, lens) -> None:
        if B * T:
            kernel(*caches, *new, lens, T, R1, R2)

    return run


def append(caches, new, lens: torch.Tensor) -> None:
    """caches (k1, k2, v1, v2) [B, R, Hk, D], contiguous with 16-byte aligned starts; new
    [B, T, Hk, D] each; lens int32 [B]: token t of sequence b written at position lens[b] + t,
    slot (position mod R), in place."""
    B, T, Hk, D = new[0].shape
    run = prepare_append(B, T, Hk, D, caches[0].shape[1], caches[1].shape[1])
    run(caches, [dense_aligned(t) for t in new], dense_aligned(lens))


@triton.jit
def _merge_kernel(Part, PartLse, Out, Lse, n_split, N, T, HQ: tl.constexpr, D: tl.constexpr,
                  ROWS: tl.constexpr):
    """ROWS rows (token * HQ + head) of the n_split shares [n_split, N, HQ, D] (bf16, each
    normalized by its own sum) and their LSE [n_split, HQ, N]: out = sum_s exp(lse_s - lse) out_s
    with lse = log sum_s exp(lse_s); Lse [B, HQ, T] for token b * T + t."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < N * HQ
    tok = r // HQ
    head = r % HQ
    lse_at = PartLse + head * N + tok
    m = tl.full([ROWS], float("-inf"), tl.float32)
    for s in range(n_split):
        m = tl.maximum(m, tl.load(lse_at + s * HQ * N, mask=ok, other=0.0))
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    rows = r.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    for s in range(n_split):
        w = tl.exp(tl.load(lse_at + s * HQ * N, mask=ok, other=0.0) - m)
        total += w
        part = tl.load(Part + s.to(tl.int64) * N * HQ * D + rows, mask=ok[:, None], other=0.0)
        acc += w[:, None] * part.to(tl.float32)
    tl.store(Out + rows, (acc / total[:, None]).to(tl.bfloat16), mask=ok[:, None])
    tl.store(Lse + ((tok // T) * HQ + head) * T + tok % T, m + tl.log(total), mask=ok)


@functools.lru_cache(maxsize=256)
def prepare_merge(S: int, N: int, Hq: int, D: int, T: int):
    """`merge`'s launch for S shares of N = B*T tokens, made once: run(part, part_lse) ->
    (out, lse)."""
    rows = 64
    kernel = Kernel(_merge_kernel, (triton.cdiv(N * Hq, rows),), HQ=Hq, D=D, ROWS=rows,
                    num_warps=4)

    def run(part, part_lse):
        out = part.new_empty(N // T, T, Hq, D)
        lse = part_lse.new_empty(N // T, Hq, T)
        kernel(part, part_lse, out, lse, S, N, T)
        return out, lse

    return run


def merge(part: torch.Tensor, part_lse: torch.Tensor, T: int):
    """The shares part [S, B*T, Hq, D] and part_lse [S, Hq, B*T] (contiguous, new) merged: out
    [B, T, Hq, D] and lse [B, Hq, T] (contiguous)."""
    S, N, Hq, D = part.shape
    return prepare_merge(S, N, Hq, D, T)(part, part_lse)

"""The two small kernels around a decoding launch (altattn/simplicial/kvcache.py): the new keys and
values written into their cache slots, and the merge of the j window's split shares by their LSE.
One launch each, whatever the batch, so that a decoding step is three launches (append, attention,
merge) and no host work: what a CUDA graph replays.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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


def append(caches, new, lens: torch.Tensor) -> None:
    """caches (k1, k2, v1, v2) [B, R, Hk, D], contiguous; new [B, T, Hk, D] each; lens int32 [B]:
    token t of sequence b written at position lens[b] + t, slot (position mod R), in place."""
    B, T, Hk, D = new[0].shape
    if B * T == 0:
        return
    hkd = Hk * D
    _append_kernel[(B * T,)](*caches, *(t.contiguous() for t in new), lens, T,
                             caches[0].shape[1], caches[1].shape[1], HKD=hkd,
                             BLOCK=triton.next_power_of_2(hkd), num_warps=4)


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


def merge(part: torch.Tensor, part_lse: torch.Tensor, T: int):
    """The shares part [S, B*T, Hq, D] and part_lse [S, Hq, B*T] merged: out [B, T, Hq, D] and
    lse [B, Hq, T] (contiguous)."""
    S, N, Hq, D = part.shape
    out = part.new_empty(N // T, T, Hq, D)
    lse = part_lse.new_empty(N // T, Hq, T)
    rows = 64
    _merge_kernel[(triton.cdiv(N * Hq, rows),)](part, part_lse, out, lse, S, N, T, HQ=Hq, D=D,
                                                 ROWS=rows, num_warps=4)
    return out, lse

"""Spherical attention's decoding step against a KV cache (altattn/spherical/kvcache.py):
split-K over the cached keys, merged by plain sums.

Spherical attention's normaliser is additive: for any split of a row's keys into parts p,
U_p = sum_x t[x] v[x] and Z_p = sum_x t[x]^2 (t = q . k, unscaled) give exactly
    r = c sqrt(sum_p Z_p),    out = c sum_p U_p / (r + eps)        (c = sm_scale)
so the parts merge by fp32 sums: no running max, no rescale.

Launches (each made once per shape: `prepare`; no host work, no value-dependent allocation, so a
step captures in a CUDA graph):
  1. `append_kernel` (when k, v are given): token t of sequence b into cache row lens[b] + t.
  2. `decode_kernel`, one program per (row tile, split, b * Hk + kv head). Its rows are the G * T
     query rows of that kv head (row m: token m // G, query head kv_head * G + m % G), padded to
     BLOCK_M >= 16, so all G heads and T tokens share each K/V tile load (GQA). It walks its
     share of the sequence's L rows in BLOCK_N-key tiles, plain loads that Triton's pipeliner
     keeps num_stages deep (cp.async, 16-byte vectors: a key row is D * 2 contiguous bytes):
         t = q k^T (tl.dot, fp32)   z += rowsum(t^2)   acc += bf16(t) v (tl.dot, fp32)
     (the forward's rounding: kernels_triton/spherical/fwd.py). With one split it writes out and
     r itself; else acc and z go to fp32 partials.
  3. `merge_kernel` (splits > 1): the partials summed in split order (deterministic), then out, r.
Memory-bound: per step it reads the visible cache rows, 2 * sum_b L_b * Hk * D * 2 bytes;
q, out, r, the new rows and the partials are small beside them. The split count is a function
of the shapes (`n_split`): enough programs for every multiprocessor. No TMA and no tensor-core
instruction that the CPU interpreter lacks, so TRITON_INTERPRET=1 runs it (tests).

Visible rows (FlashAttention's `flash_attn_with_kvcache`): L = lens[b] (+ T with appended keys),
clamped to [0, R]; causal: token t sees rows x < L - T + 1 + t (the queries are the last T of the
L positions), else x < L. Rows that see nothing give out = 0, r = 0.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels_triton.launch import Kernel, sm_count

MIN_SPLIT_KEYS = 256   # keys a split reads at least (the cache's rows R over this caps the split)
CTAS_PER_SM = 2        # what one SM holds of decode_kernel up to 64 rows (config; 128 rows: one)
MERGE_ROWS = 16        # rows of a merge program


@triton.jit
def append_kernel(Kc, Vc, K, V, Lens, T, R, HKD: tl.constexpr, BLOCK: tl.constexpr):
    """Program (b * T + t, chunk): a chunk of the [Hk, D] row of new token t of sequence b into
    cache row lens[b] + t; nothing outside [0, R) (cache_seqlens out of range)."""
    pid = tl.program_id(0)
    b = pid // T
    pos = tl.load(Lens + b) + pid % T
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (offs < HKD) & (pos >= 0) & (pos < R)
    src = pid.to(tl.int64) * HKD + offs
    dst = (b.to(tl.int64) * R + pos) * HKD + offs
    tl.store(Kc + dst, tl.load(K + src, mask=ok), mask=ok)
    tl.store(Vc + dst, tl.load(V + src, mask=ok), mask=ok)


@triton.jit
def decode_kernel(Q, Kc, Vc, Lens, Out, Rn, PartU, PartZ, T, R, n_split, n_rows, sm_scale, eps,
                  HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                  APPENDED: tl.constexpr, CAUSAL: tl.constexpr, FINAL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Q [B, T, HQ, D], caches [B, R, HK, D] (bf16, contiguous); Lens int32 [B]. FINAL: Out
    [B, T, HQ, D] bf16 and Rn [B, HQ, T] fp32; else PartU [n_split, n_rows, D] and PartZ
    [n_split, n_rows] fp32 (row (b * T + t) * HQ + h, n_rows = B * T * HQ)."""
    p = tl.program_id(1)
    bk = tl.program_id(2)
    b = bk // HK
    kh = bk % HK
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = m // G
    h = kh * G + m % G
    live = m < T * G
    d = tl.arange(0, D)
    row = (b * T + t).to(tl.int64) * HQ + h                      # into [B * T * HQ]
    q = tl.load(Q + row[:, None] * D + d[None, :], mask=live[:, None], other=0.0)

    L = tl.load(Lens + b)
    if APPENDED:
        L += T
    L = tl.minimum(tl.maximum(L, 0), R)
    if CAUSAL:
        lim = L - T + 1 + t                                      # token t's visible rows
    n_blocks = tl.cdiv(L, BLOCK_N)
    per = tl.cdiv(n_blocks, n_split)
    start = p * per * BLOCK_N
    stop = tl.minimum(start + per * BLOCK_N, L)

    base = b.to(tl.int64) * R * (HK * D) + kh * D
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    z = tl.zeros([BLOCK_M], tl.float32)
    for x0 in range(start, stop, BLOCK_N):
        x = x0 + tl.arange(0, BLOCK_N)
        ok = (x < stop)[:, None]
        at = base + x.to(tl.int64)[:, None] * (HK * D) + d[None, :]
        k = tl.load(Kc + at, mask=ok, other=0.0)
        v = tl.load(Vc + at, mask=ok, other=0.0)
        s = tl.dot(q, tl.trans(k))
        if CAUSAL:
            s = tl.where(x[None, :] < lim[:, None], s, 0.0)
        z += tl.sum(s * s, 1)
        acc = tl.dot(s.to(tl.bfloat16), v, acc)

    if FINAL:
        r = sm_scale * tl.sqrt(z)
        out = acc * (sm_scale / (r + eps))[:, None]
        tl.store(Out + row[:, None] * D + d[None, :], out.to(tl.bfloat16), mask=live[:, None])
        tl.store(Rn + (b.to(tl.int64) * HQ + h) * T + t, r, mask=live)
    else:
        at = p.to(tl.int64) * n_rows + row
        tl.store(PartU + at[:, None] * D + d[None, :], acc, mask=live[:, None])
        tl.store(PartZ + at, z, mask=live)


@triton.jit
def merge_kernel(PartU, PartZ, Out, Rn, T, n_split, n_rows, sm_scale, eps, HQ: tl.constexpr,
                 D: tl.constexpr, ROWS: tl.constexpr):
    """ROWS rows (b * T + t) * HQ + h of the partials, summed over the splits in order:
    r = c sqrt(sum Z), out = c sum U / (r + eps)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = row < n_rows
    row = row.to(tl.int64)
    d = tl.arange(0, D)
    acc = tl.zeros([ROWS, D], tl.float32)
    z = tl.zeros([ROWS], tl.float32)
    for p in range(n_split):
        at = p * n_rows + row
        acc += tl.load(PartU + at[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        z += tl.load(PartZ + at, mask=live, other=0.0)
    r = sm_scale * tl.sqrt(z)
    out = acc * (sm_scale / (r + eps))[:, None]
    tl.store(Out + row[:, None] * D + d[None, :], out.to(tl.bfloat16), mask=live[:, None])
    bt = row // HQ
    h = row % HQ
    tl.store(Rn + ((bt // T) * HQ + h) * T + bt % T, r, mask=live)


def config(G: int, T: int, D: int) -> dict:
    """Tile: BLOCK_M = the G * T rows as a power of two in [16, 128] (more rows: row tiles);
    BLOCK_N keys of 16 KiB per tensor (64 at D 128, 128 at D 64); up to 32 rows 4 stages (three
    tiles of K and V buffered, two in flight while one is used: 102-108 KiB of shared memory, two
    CTAs an SM; 3 stages read the cache ~9% slower at 16 rows, B 64, 4,096 cached:
    docs/perf-spherical.md), else 3 (4 would take 136-160 KiB: one CTA an SM at 64 rows, where
    3 stages keep two; not measured at 4); 4 warps (8 at 128 rows)."""
    bm = min(128, max(16, triton.next_power_of_2(G * T)))
    return {"BLOCK_M": bm, "BLOCK_N": 8192 // D, "num_warps": 8 if bm == 128 else 4,
            "num_stages": 4 if bm <= 32 else 3}


def n_split(tiles: int, R: int, sms: int) -> int:
    """Splits of each sequence's keys: enough that tiles * splits programs fill every SM's
    CTAS_PER_SM slots once, at most R / MIN_SPLIT_KEYS (a function of the shapes only)."""
    cap = max(1, R // MIN_SPLIT_KEYS)
    return max(1, min(cap, triton.cdiv(sms * CTAS_PER_SM, max(tiles, 1))))


@functools.lru_cache(maxsize=256)
def prepare(B: int, T: int, Hq: int, Hk: int, D: int, R: int, appended: bool, causal: bool,
            device_index: int = 0, cfg: tuple | None = None, splits: int | None = None):
    """The step's launches for these shapes on GPU `device_index` (a Kernel keeps one device's
    compiled kernel), made once: run(q, k_cache, v_cache, lens, k, v, out, r, sm_scale, eps)
    (contiguous; k, v None unless appended) writes out [B, T, Hq, D] bf16 and r [B, Hq, T] fp32.
    cfg: another tile config as a tuple of items, splits: another split count (tuning)."""
    G = Hq // Hk
    c = dict(cfg) if cfg else config(G, T, D)
    bm = c["BLOCK_M"]
    row_tiles = triton.cdiv(G * T, bm)
    S = splits or n_split(B * Hk * row_tiles, R, sm_count(device_index))
    n_rows = B * T * Hq
    decode = Kernel(decode_kernel, (row_tiles, S, B * Hk), HQ=Hq, HK=Hk, G=G, D=D,
                    APPENDED=appended, CAUSAL=causal, FINAL=S == 1, **c)
    merge = Kernel(merge_kernel, (triton.cdiv(n_rows, MERGE_ROWS),), HQ=Hq, D=D,
                   ROWS=MERGE_ROWS, num_warps=4)
    hkd = Hk * D
    block = min(triton.next_power_of_2(hkd), 2048)
    append = Kernel(append_kernel, (B * T, triton.cdiv(hkd, block)), HKD=hkd, BLOCK=block,
                    num_warps=4)

    def run(q, k_cache, v_cache, lens, k, v, out, r, sm_scale: float, eps: float) -> None:
        if n_rows == 0:
            return
        if appended:
            append(k_cache, v_cache, k, v, lens, T, R)
        if S == 1:
            decode(q, k_cache, v_cache, lens, out, r, None, None, T, R, S, n_rows,
                   sm_scale, eps)
            return
        part_u = torch.empty(S, n_rows, D, dtype=torch.float32, device=q.device)
        part_z = torch.empty(S, n_rows, dtype=torch.float32, device=q.device)
        decode(q, k_cache, v_cache, lens, None, None, part_u, part_z, T, R, S, n_rows,
               sm_scale, eps)
        merge(part_u, part_z, out, r, T, S, n_rows, sm_scale, eps)

    run.n_split = S
    return run


def compile_configs():
    """The step at the target (D 128, B 64, Hk 8, G 4, T 1, R 4096: one split), with several
    splits (D 64, B 1, T 4: its append and merge kernels too) and with 128-row tiles (D 128, G
    32, T 4), recorded on meta tensors."""
    from kernels_triton.launch import compile_configs as configs_of
    from kernels_triton.launch import meta
    out = []
    for D, B, Hk, G, T in ((128, 64, 8, 4, 1), (64, 1, 8, 4, 4), (128, 1, 1, 32, 4)):
        Hq, R = G * Hk, 4096
        args = (meta(B, T, Hq, D), meta(B, R, Hk, D), meta(B, R, Hk, D),
                meta(B, dtype=torch.int32), meta(B, T, Hk, D), meta(B, T, Hk, D),
                meta(B, T, Hq, D), meta(B, Hq, T, dtype=torch.float32), 0.1, 1e-6)

        def name(launch, tag=f"D{D}_B{B}_G{G}_T{T}"):
            kind = launch.fn.__name__.split("_")[0]
            if kind == "decode":
                return f"decode_{tag}_M{launch.constexprs['BLOCK_M']}"
            return f"{kind}_D{D}_Hk{Hk}" if B == 1 and G == 4 else None
        out += configs_of(lambda B=B, T=T, Hq=Hq, Hk=Hk, D=D, R=R: prepare.__wrapped__(
            B, T, Hq, Hk, D, R, True, True), args, name)
    return out

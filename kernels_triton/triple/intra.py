"""`triton`: causal triple attention's intra-chunk part (FAMILIES.md §2), forward and backward, in
plain Triton (no TLX), deterministic (no atomics: every sum is made by one program, in order).

Causal triple attention is chunked linear attention. With chunks of C tokens (normally a power of
two in 256..4096; any multiple of the config's tiles works), s[n, m] = (Q1[n].K1[m]) (Q2[n].K2[m]):
    Y[n] = c sum_{m <= n} s[n, m] V[m] = inter[n] + c sum_{m in chunk(n), m <= n} s[n, m] V[m]
"inter" (keys of earlier chunks: the prefix state) comes from other kernels as fp32; these add
the intra part, a FlashAttention-like quadratic form with no softmax, and write bf16.

  forward (`_fwd_kernel`, row owner): one program per (b, h, BLOCK_M rows); for each BLOCK_N key
    block from the chunk's start to the diagonal (TMA loads, Triton's software pipeline):
        a = Q1 K1^T, bb = Q2 K2^T (tensor cores, fp32);  acc += bf16(a bb) V
    Key blocks wholly below the tile's first row take no mask, the diagonal ones mask m <= n.
    Epilogue: out = inter + c acc (bf16, stored by TMA: rows past N clipped).
  backward, with dp = dO V^T (dA = c dp bb, dB = c dp a on visible pairs):
    `_dq_kernel` (row owner, the forward's grid and key blocks): a, bb, dp (3 GEMMs);
        dq1 += bf16(dp bb) K1, dq2 += bf16(dp a) K2 (2 GEMMs).
    `_dkdv_kernel` (key owner): one program per (b, h, BLOCK_N keys) holds K1, K2, V and visits the
        query blocks from its diagonal to the chunk's end (transposed scores, keys as GEMM rows):
        dk1 += bf16(dp^T bb^T) Q1, dk2 += bf16(dp^T a^T) Q2, dv += bf16(a^T bb^T) dO (6 GEMMs).
    Epilogues: grad = inter_grad + c acc (bf16). 11 GEMMs executed for the 8 useful ones.
Where c goes: on the fp32 accumulator, once, in the epilogue. bf16 and fp32 share one exponent
range, so rounding a bb (or dp bb) to bf16 before or after scaling by c has the same relative
error, and large products cannot overflow either; scaling the accumulator costs BLOCK x D
multiplies per tile instead of one per score, keeps tiny c (1/N) products away from bf16's
subnormals, and never rounds a c-scaled q or k.
Masks: tiles are aligned to chunks (C is a multiple of every BLOCK), so a program's key blocks are
all in its rows' chunk. Rows and keys past N are read as zeros by TMA (3-D view [B, N, H*D], box
[1, BLOCK, D]: batches never mix) and contribute nothing; stores clip them. Only the causal
diagonal needs a mask (m <= n).
Grids: one flat axis 0 (no 65535 limit): B * H * cdiv(N, BLOCK) programs, tiles of a (b, h)
fastest; row owners visit each chunk's tiles last-first (most key blocks first). N, H and C are
runtime arguments (not specialized): one compile per (Dq, Dv, tile config). Offsets past 2^31
elements need no int64 here: TMA coordinates (b, n, h*D) are each small.
Shapes: any B, N, H; Dq, Dv in {32, 64, 128}; q1, q2, k1, k2 [B, N, H, Dq], v, dout [B, N, H, Dv]
bf16 contiguous; inter tensors fp32 of the same shapes (read, never written); outputs bf16.
Warps: 8 (one group, no warp specialization); tiles in `config`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from altattn.registry import CompileConfig
from kernels_triton.launch import Desc, Kernel
from kernels_triton.launch import compile_configs as configs_of
from kernels_triton.triple.host import COMPILE_H, COMPILE_N, tokens

SUPPORTED_D = (32, 64, 128)
GRADS = ("dq1", "dq2", "dk1", "dk2", "dv")


def layout(B: int, N: int, H: int, D: int, rows: int) -> Desc:
    """TMA view of a contiguous [B, N, H, D] tensor as [B, N, H*D], box [1, rows, D];
    `layout(...)(t)` is t's descriptor (one layout a tensor argument: a Desc is of one dtype)."""
    return Desc([B, N, H * D], [N * H * D, H * D, 1], [1, rows, D])


# ------------------------------------------------------------------------------------ kernels

@triton.jit
def _row_tile(N, H, chunk, BLOCK_M: tl.constexpr):
    """(b, h, first row m0, chunk start c0) of this program of a row-owner launch: the tiles of a
    (b, h) fastest; inside each chunk the last tile (the most key blocks) first."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(N, BLOCK_M)
    i = pid % n_m
    bh = pid // n_m
    per = chunk // BLOCK_M
    ci = i // per
    cnt = tl.minimum(per, n_m - ci * per)  # tiles in this chunk (the last one may be short)
    mi = ci * per + cnt - 1 - i % per
    return bh // H, bh % H, mi * BLOCK_M, ci * chunk


@triton.jit
def _packed_tile(Tiles, c, CS):
    """(b, h, first row m0, chunk start c0, end hi, c) of a packed launch's program (B = 1,
    grid (tiles, H); kernels_triton/triple/varlen.py): tile t is Tiles[t] = (m0, c0, hi, slab,
    seq), rows m0 .. hi - 1 at most a tile (hi: the end of the chunk or of the sequence), c
    scaled by CS[seq] (CS fp32 per sequence, or None)."""
    tile = Tiles + 5 * tl.program_id(0)
    h = tl.program_id(1)
    if CS is not None:
        c = c * tl.load(CS + tl.load(tile + 4))
    return h * 0, h, tl.load(tile), tl.load(tile + 1), tl.load(tile + 2), c


@triton.jit
def _rows_at(b, N, m0, h, H, D: tl.constexpr, ROWS: tl.constexpr):
    """(offsets [ROWS, D] of rows m0 .. of head h, batch b, of a [B, N, H, D] tensor; the rows)."""
    rows = m0 + tl.arange(0, ROWS)
    offs = ((b.to(tl.int64) * N + rows) * H + h) * D
    return offs[:, None] + tl.arange(0, D)[None, :], rows


@triton.jit
def _epilogue(Inter, Out, acc, c, b, m0, h, hi, N, H, D: tl.constexpr, ROWS: tl.constexpr,
              DESC: tl.constexpr, PTR: tl.constexpr = False):
    """Out rows m0 .. of head h = Inter's (None: 0) + c acc, bf16: by TMA (DESC; rows past N
    clipped), packed (Out a tensor, rows < hi), or PTR: Inter and Out tensors, rows < hi (the C
    dispatcher's descriptor and parameter limits: kernels_triton/launch.py)."""
    y = c * acc
    if PTR:
        offs, rows = _rows_at(b, N, m0, h, H, D, ROWS)
        live = (rows < hi)[:, None]
        if Inter is not None:
            y = tl.load(Inter + offs, mask=live, other=0.0) + y
        tl.store(Out + offs, y.to(Out.dtype.element_ty), mask=live)
    else:
        if Inter is not None:
            y = Inter.load([b, m0, h * D]).reshape(ROWS, D) + y
        if DESC:
            Out.store([b, m0, h * D], y.to(tl.bfloat16).reshape(1, ROWS, D))
        else:
            offs, rows = _rows_at(b * 0, N, m0, h, H, D, ROWS)
            tl.store(Out + offs, y.to(Out.dtype.element_ty), mask=(rows < hi)[:, None])


@triton.jit
def _row_blocks(m0, c0, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(n_full, n_all) for the row tile at m0: key blocks c0 + j * BLOCK_N, j < n_full wholly
    below row m0 (no mask), n_full <= j < n_all on the diagonal (mask m <= n)."""
    return (m0 - c0) // BLOCK_N, tl.cdiv(tl.minimum(m0 + BLOCK_M, N) - c0, BLOCK_N)


@triton.jit
def _fwd_step(acc, q1, q2, K1, K2, V, b, h, x0, rows, DQ: tl.constexpr, DV: tl.constexpr,
              BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """acc += bf16(a bb) V for the key block at x0 (a bb = 0 where m > n if MASK)."""
    k1 = K1.load([b, x0, h * DQ]).reshape(BLOCK_N, DQ)
    k2 = K2.load([b, x0, h * DQ]).reshape(BLOCK_N, DQ)
    v = V.load([b, x0, h * DV]).reshape(BLOCK_N, DV)
    p = tl.dot(q1, tl.trans(k1)) * tl.dot(q2, tl.trans(k2))
    if MASK:
        keys = x0 + tl.arange(0, BLOCK_N)
        p = tl.where(keys[None, :] <= rows[:, None], p, 0.0)
    return tl.dot(p.to(tl.bfloat16), v, acc)


@triton.jit(do_not_specialize=["N", "H", "chunk"])
def _fwd_kernel(Q1, Q2, K1, K2, V, Inter, Out, N, H, chunk, c,
                DQ: tl.constexpr, DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Tiles=None, CS=None,
                CAUSAL: tl.constexpr = True):
    """CAUSAL False (dense, one chunk of every row: `prepare_forward(..., causal=False)`): every
    row sees every key (keys past N read as zeros), no mask; Inter may be None (0)."""
    if Tiles is None:
        b, h, m0, c0 = _row_tile(N, H, chunk, BLOCK_M)
        hi = N
    else:  # packed: Out a tensor, rows past hi not stored
        b, h, m0, c0, hi, c = _packed_tile(Tiles, c, CS)
        if m0 >= hi:
            return
    if CAUSAL:
        n_full, n_all = _row_blocks(m0, c0, hi, BLOCK_M, BLOCK_N)
    else:
        n_full = tl.cdiv(hi, BLOCK_N)
        n_all = n_full
    rows = m0 + tl.arange(0, BLOCK_M)
    q1 = Q1.load([b, m0, h * DQ]).reshape(BLOCK_M, DQ)
    q2 = Q2.load([b, m0, h * DQ]).reshape(BLOCK_M, DQ)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    for j in range(n_full):  # every row sees every key
        acc = _fwd_step(acc, q1, q2, K1, K2, V, b, h, c0 + j * BLOCK_N, rows, DQ, DV, BLOCK_N,
                        False)
    for j in range(n_full, n_all):  # the diagonal
        acc = _fwd_step(acc, q1, q2, K1, K2, V, b, h, c0 + j * BLOCK_N, rows, DQ, DV, BLOCK_N,
                        True)
    _epilogue(Inter, Out, acc, c, b, m0, h, hi, N, H, DV, BLOCK_M, Tiles is None)


@triton.jit
def _dq_step(dq1, dq2, q1, q2, do, K1, K2, V, b, h, x0, rows, DQ: tl.constexpr,
             DV: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """dq1 += bf16(dp bb) K1, dq2 += bf16(dp a) K2 for the key block at x0."""
    k1 = K1.load([b, x0, h * DQ]).reshape(BLOCK_N, DQ)
    k2 = K2.load([b, x0, h * DQ]).reshape(BLOCK_N, DQ)
    v = V.load([b, x0, h * DV]).reshape(BLOCK_N, DV)
    a = tl.dot(q1, tl.trans(k1))
    bb = tl.dot(q2, tl.trans(k2))
    dp = tl.dot(do, tl.trans(v))
    if MASK:
        keys = x0 + tl.arange(0, BLOCK_N)
        dp = tl.where(keys[None, :] <= rows[:, None], dp, 0.0)
    dq1 = tl.dot((dp * bb).to(tl.bfloat16), k1, dq1)
    dq2 = tl.dot((dp * a).to(tl.bfloat16), k2, dq2)
    return dq1, dq2


@triton.jit(do_not_specialize=["N", "H", "chunk"])
def _dq_kernel(Q1, Q2, K1, K2, V, DO, IDQ1, IDQ2, DQ1, DQ2, N, H, chunk, c,
               DQ: tl.constexpr, DV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Tiles=None, CS=None,
               CAUSAL: tl.constexpr = True, PTR: tl.constexpr = False):
    """CAUSAL False: as _fwd_kernel's (every key, no mask; IDQ1, IDQ2 may be None). PTR: the
    inter gradients and outputs tensors (`_epilogue`)."""
    if Tiles is None:
        b, h, m0, c0 = _row_tile(N, H, chunk, BLOCK_M)
        hi = N
    else:  # packed, as _fwd_kernel
        b, h, m0, c0, hi, c = _packed_tile(Tiles, c, CS)
        if m0 >= hi:
            return
    if CAUSAL:
        n_full, n_all = _row_blocks(m0, c0, hi, BLOCK_M, BLOCK_N)
    else:
        n_full = tl.cdiv(hi, BLOCK_N)
        n_all = n_full
    rows = m0 + tl.arange(0, BLOCK_M)
    q1 = Q1.load([b, m0, h * DQ]).reshape(BLOCK_M, DQ)
    q2 = Q2.load([b, m0, h * DQ]).reshape(BLOCK_M, DQ)
    do = DO.load([b, m0, h * DV]).reshape(BLOCK_M, DV)
    dq1 = tl.zeros([BLOCK_M, DQ], tl.float32)
    dq2 = tl.zeros([BLOCK_M, DQ], tl.float32)
    for j in range(n_full):  # every row sees every key
        dq1, dq2 = _dq_step(dq1, dq2, q1, q2, do, K1, K2, V, b, h, c0 + j * BLOCK_N, rows,
                            DQ, DV, BLOCK_N, False)
    for j in range(n_full, n_all):  # the diagonal
        dq1, dq2 = _dq_step(dq1, dq2, q1, q2, do, K1, K2, V, b, h, c0 + j * BLOCK_N, rows,
                            DQ, DV, BLOCK_N, True)
    _epilogue(IDQ1, DQ1, dq1, c, b, m0, h, hi, N, H, DQ, BLOCK_M, Tiles is None, PTR)
    _epilogue(IDQ2, DQ2, dq2, c, b, m0, h, hi, N, H, DQ, BLOCK_M, Tiles is None, PTR)


@triton.jit
def _dkdv_step(dk1, dk2, dv, k1, k2, v, Q1, Q2, DO, b, h, m0, keys, DQ: tl.constexpr,
               DV: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, hi=None):
    """The query block at m0 against the program's keys (keys are the GEMM rows: a^T, bb^T,
    dp^T are [BLOCK_N, BLOCK_M]); with MASK and hi (packed), rows >= hi masked too."""
    q1 = Q1.load([b, m0, h * DQ]).reshape(BLOCK_M, DQ)
    q2 = Q2.load([b, m0, h * DQ]).reshape(BLOCK_M, DQ)
    do = DO.load([b, m0, h * DV]).reshape(BLOCK_M, DV)
    at = tl.dot(k1, tl.trans(q1))
    bt = tl.dot(k2, tl.trans(q2))
    dpt = tl.dot(v, tl.trans(do))
    if MASK:  # a^T and dp^T masked: every product below has one of them
        rows = m0 + tl.arange(0, BLOCK_M)
        vis = keys[:, None] <= rows[None, :]
        if hi is not None:
            vis = vis & (rows < hi)[None, :]
        at = tl.where(vis, at, 0.0)
        dpt = tl.where(vis, dpt, 0.0)
    dv = tl.dot((at * bt).to(tl.bfloat16), do, dv)
    dk1 = tl.dot((dpt * bt).to(tl.bfloat16), q1, dk1)
    dk2 = tl.dot((dpt * at).to(tl.bfloat16), q2, dk2)
    return dk1, dk2, dv


@triton.jit(do_not_specialize=["N", "H", "chunk"])
def _dkdv_kernel(Q1, Q2, K1, K2, V, DO, IDK1, IDK2, IDV, DK1, DK2, DV_, N, H, chunk, c,
                 DQ: tl.constexpr, DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Tiles=None, CS=None,
                 CAUSAL: tl.constexpr = True, PTR: tl.constexpr = False):
    """CAUSAL False (dense): every query block for every key (rows past N read as zeros), no
    mask; IDK1, IDK2, IDV may be None. PTR: as _dq_kernel's."""
    if Tiles is None:
        pid = tl.program_id(0)
        n_n = tl.cdiv(N, BLOCK_N)
        bh = pid // n_n
        b = bh // H
        h = bh % H
        x0 = (pid % n_n) * BLOCK_N  # key tiles of a chunk: the first (the most query blocks) first
        if CAUSAL:
            hi = tl.minimum(x0 // chunk * chunk + chunk, N)  # the chunk's end
            m_lo = x0 // BLOCK_M * BLOCK_M
        else:
            hi = N
            m_lo = x0 * 0
    else:  # packed: a key tile of the chunk at c0, whose queries end at hi (chunk or sequence)
        b, h, x0, c0, hi, c = _packed_tile(Tiles, c, CS)
        if x0 >= hi:
            return
        m_lo = c0 + (x0 - c0) // BLOCK_M * BLOCK_M
    n_all = tl.cdiv(hi - m_lo, BLOCK_M)
    if CAUSAL:
        n_diag = tl.minimum(tl.cdiv(x0 + BLOCK_N - m_lo, BLOCK_M), n_all)  # blocks needing m <= n
    else:
        n_diag = n_all * 0
    keys = x0 + tl.arange(0, BLOCK_N)
    k1 = K1.load([b, x0, h * DQ]).reshape(BLOCK_N, DQ)
    k2 = K2.load([b, x0, h * DQ]).reshape(BLOCK_N, DQ)
    v = V.load([b, x0, h * DV]).reshape(BLOCK_N, DV)
    dk1 = tl.zeros([BLOCK_N, DQ], tl.float32)
    dk2 = tl.zeros([BLOCK_N, DQ], tl.float32)
    dv = tl.zeros([BLOCK_N, DV], tl.float32)
    if Tiles is None:
        for i in range(n_diag):  # the diagonal
            dk1, dk2, dv = _dkdv_step(dk1, dk2, dv, k1, k2, v, Q1, Q2, DO, b, h,
                                      m_lo + i * BLOCK_M, keys, DQ, DV, BLOCK_M, True)
        for i in range(n_diag, n_all):  # every row sees every key
            dk1, dk2, dv = _dkdv_step(dk1, dk2, dv, k1, k2, v, Q1, Q2, DO, b, h,
                                      m_lo + i * BLOCK_M, keys, DQ, DV, BLOCK_M, False)
    else:  # packed: the last query block, where it runs past hi, masked as the diagonal
        n_plain = n_all
        if (hi - m_lo) % BLOCK_M != 0:
            n_plain = tl.maximum(n_all - 1, n_diag)
        for i in range(n_diag):
            dk1, dk2, dv = _dkdv_step(dk1, dk2, dv, k1, k2, v, Q1, Q2, DO, b, h,
                                      m_lo + i * BLOCK_M, keys, DQ, DV, BLOCK_M, True, hi)
        for i in range(n_diag, n_plain):
            dk1, dk2, dv = _dkdv_step(dk1, dk2, dv, k1, k2, v, Q1, Q2, DO, b, h,
                                      m_lo + i * BLOCK_M, keys, DQ, DV, BLOCK_M, False)
        for i in range(n_plain, n_all):
            dk1, dk2, dv = _dkdv_step(dk1, dk2, dv, k1, k2, v, Q1, Q2, DO, b, h,
                                      m_lo + i * BLOCK_M, keys, DQ, DV, BLOCK_M, True, hi)
    _epilogue(IDK1, DK1, dk1, c, b, x0, h, hi, N, H, DQ, BLOCK_N, Tiles is None, PTR)
    _epilogue(IDK2, DK2, dk2, c, b, x0, h, hi, N, H, DQ, BLOCK_N, Tiles is None, PTR)
    _epilogue(IDV, DV_, dv, c, b, x0, h, hi, N, H, DV, BLOCK_N, Tiles is None, PTR)


# --------------------------------------------------------------------------------------- host

def config(Dq: int, Dv: int) -> dict:
    """{"fwd", "dq", "dkdv"} -> BLOCK_M (query rows), BLOCK_N (keys), num_warps, num_stages.
    Chosen to compile with no spill at every (Dq, Dv) (compile_configs), not yet timed; 8 warps
    (two warp groups of 64 GEMM rows) everywhere. Dq, Dv <= 64, 3 stages: fwd 128 x 128 (a, bb
    [128, 128] fp32 and acc in registers: 235-247), dQ 128 rows x 64 keys (a, bb, dp and two
    [128, Dq] accumulators), dK/dV 128 keys x 64 rows (three [128, D] accumulators, three
    [128, 64] score tiles). A dimension of 128, 2 stages: narrower tiles keep the accumulators
    within 255 registers: fwd 128 x 64, dQ 128 x 32 at Dq = 128, dK/dV 128 keys x 32 rows, or
    64 x 32 once 2 Dq + Dv > 320 accumulator columns (Dq = Dv = 128: 64 x 64 spills or
    serializes its wgmmas)."""
    small = max(Dq, Dv) <= 64
    stages = 3 if small else 2
    if small:
        dkdv = (64, 128)
    else:
        dkdv = (32, 128) if 2 * Dq + Dv <= 320 else (32, 64)
    tiles = {"fwd": (128, 128 if small else 64), "dq": (128, 64 if Dq <= 64 else 32),
             "dkdv": dkdv}
    return {k: {"BLOCK_M": m, "BLOCK_N": n, "num_warps": 8, "num_stages": stages}
            for k, (m, n) in tiles.items()}


def _check_tensors(tensors: dict) -> None:
    """Raise ValueError unless tensors (name -> (tensor, dtype, last dim)) are contiguous
    [B, N, H, last dim] tensors of that dtype with one (B, N, H)."""
    B, N, H, _ = next(iter(tensors.values()))[0].shape
    for name, (t, dtype, d) in tensors.items():
        if t.dtype != dtype or tuple(t.shape) != (B, N, H, d) or not t.is_contiguous():
            raise ValueError(f"{name}: want contiguous {dtype} [{B}, {N}, {H}, {d}], got "
                             f"{t.dtype} {list(t.shape)} (contiguous: {t.is_contiguous()})")


def _check_config(Dq: int, Dv: int, chunk: int, cfg: dict) -> None:
    """Raise ValueError unless Dq and Dv are supported and chunk is a multiple of cfg's tiles (so
    tiles never straddle chunks)."""
    for k, d in (("Dq", Dq), ("Dv", Dv)):
        if d not in SUPPORTED_D:
            raise ValueError(f"{k} = {d} not in {SUPPORTED_D}")
    blocks = sorted({c[k] for c in cfg.values() for k in ("BLOCK_M", "BLOCK_N")})
    if chunk <= 0 or any(chunk % x for x in blocks):
        raise ValueError(f"chunk = {chunk}: want a multiple of the tiles {blocks} (a power of "
                         f"two >= 128 suits every default config)")


def _prepared(fn, B: int, N: int, H: int, Dq: int, Dv: int, tiles: dict, grid_rows: int,
              widths: str, **consts):
    """(the Kernel of fn with tile config `tiles` (and constexprs `consts`), one grid program
    per grid_rows tokens of a (b, h); the layouts of its descriptor arguments, in order):
    widths has a letter per descriptor, q or v (width Dq or Dv), lower case for a tile of
    BLOCK_M query rows, upper case for one of BLOCK_N keys."""
    kernel = Kernel(fn, (B * H * triton.cdiv(N, grid_rows),), DQ=Dq, DV=Dv, **consts,
                    **_launch_args(tiles))
    descs = [layout(B, N, H, Dq if w in "qQ" else Dv,
                    tiles["BLOCK_M"] if w.islower() else tiles["BLOCK_N"]) for w in widths]
    return kernel, descs


def _launch_args(c: dict) -> dict:
    return {"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"], "num_warps": c["num_warps"],
            "num_stages": c["num_stages"]}


def prepare_forward(B: int, N: int, H: int, Dq: int, Dv: int, chunk: int, c: float,
                    cfg: dict | None = None, causal: bool = True):
    """The forward's launch of these shapes, made once: run(q1, q2, k1, k2, v, inter, out)
    writes out = inter + c sum_{m in chunk(n), m <= n} (q1[n].k1[m]) (q2[n].k2[m]) v[m]
    (tensors as intra_forward's, not checked; inter None, at every call of one run: 0). causal
    False: every key of the chunk (short.py). cfg: config(Dq, Dv) or another tile config."""
    cfg = cfg or config(Dq, Dv)
    _check_config(Dq, Dv, chunk, {"fwd": cfg["fwd"]})
    f = cfg["fwd"]
    # Q1, Q2, K1, K2, V, Out; Inter (fp32, Out's rows)
    kernel, descs = _prepared(_fwd_kernel, B, N, H, Dq, Dv, f, f["BLOCK_M"], "qqQQVv",
                              CAUSAL=causal)
    inter_desc = layout(B, N, H, Dv, f["BLOCK_M"])
    c = float(c)
    empty = B * N * H == 0

    def run(q1, q2, k1, k2, v, inter, out) -> None:
        if not empty:
            d = [desc(t) for desc, t in zip(descs, (q1, q2, k1, k2, v, out))]
            kernel(*d[:5], None if inter is None else inter_desc(inter), d[5], N, H, chunk, c)

    return run


def intra_forward(q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor,
                  v: torch.Tensor, inter: torch.Tensor, out: torch.Tensor, chunk: int, c: float,
                  cfg: dict | None = None) -> torch.Tensor:
    """out = inter + c sum_{m in chunk(n), m <= n} (q1[n].k1[m]) (q2[n].k2[m]) v[m].
    q1, q2, k1, k2 [B, N, H, Dq], v [B, N, H, Dv] bf16; inter fp32 [B, N, H, Dv] (read only);
    out bf16 [B, N, H, Dv] (written); all contiguous, on one GPU. Returns out.
    cfg: config(Dq, Dv) or another tile config (tuning). Checks the tensors, then runs
    `prepare_forward`'s launch once."""
    Dq, Dv = q1.shape[-1], v.shape[-1]
    bf, f32 = torch.bfloat16, torch.float32
    _check_tensors({"q1": (q1, bf, Dq), "q2": (q2, bf, Dq), "k1": (k1, bf, Dq),
                    "k2": (k2, bf, Dq), "v": (v, bf, Dv), "inter": (inter, f32, Dv),
                    "out": (out, bf, Dv)})
    B, N, H, _ = q1.shape
    prepare_forward(B, N, H, Dq, Dv, chunk, c, cfg)(q1, q2, k1, k2, v, inter, out)
    return out


def prepare_backward(B: int, N: int, H: int, Dq: int, Dv: int, chunk: int, c: float,
                     cfg: dict | None = None, causal: bool = True):
    """The backward's two launches of these shapes, made once: run(q1, q2, k1, k2, v, dout,
    inter_grads, grads) with inter_grads and grads sequences of the five gradients in GRADS
    order (fp32 read, bf16 written) adds the intra-chunk part (tensors as intra_backward's, not
    checked; inter_grads None: 0, at every call of one run). cfg, causal as prepare_forward's."""
    cfg = cfg or config(Dq, Dv)
    _check_config(Dq, Dv, chunk, {k: cfg[k] for k in ("dq", "dkdv")})
    # descriptors Q1, Q2, K1, K2, V, DO; inter gradients and gradients by pointer (PTR, _epilogue)
    f = cfg["dkdv"]
    dkdv, dkdv_descs = _prepared(_dkdv_kernel, B, N, H, Dq, Dv, f, f["BLOCK_N"], "qqQQVv",
                                 PTR=True, CAUSAL=causal)
    f = cfg["dq"]
    dq, dq_descs = _prepared(_dq_kernel, B, N, H, Dq, Dv, f, f["BLOCK_M"], "qqQQVv", PTR=True,
                             CAUSAL=causal)
    c = float(c)
    empty = B * N * H == 0

    def run(q1, q2, k1, k2, v, dout, inter_grads, grads) -> None:
        if empty:
            return
        idq1, idq2, idk1, idk2, idv = inter_grads or (None,) * 5
        dq1, dq2, dk1, dk2, dv = grads
        x = (q1, q2, k1, k2, v, dout)
        dkdv(*[d(t) for d, t in zip(dkdv_descs, x)], idk1, idk2, idv, dk1, dk2, dv, N, H, chunk,
             c)
        dq(*[d(t) for d, t in zip(dq_descs, x)], idq1, idq2, dq1, dq2, N, H, chunk, c)

    return run


def intra_backward(q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor,
                   v: torch.Tensor, dout: torch.Tensor, inter_grads: dict, grads: dict,
                   chunk: int, c: float, cfg: dict | None = None) -> dict:
    """grads[g] = inter_grads[g] + the intra-chunk part of g, for g in dq1, dq2, dk1, dk2, dv
    (the module docstring's formulas). Inputs as intra_forward's, dout bf16 [B, N, H, Dv];
    inter_grads: fp32 tensors of the inputs' shapes (read only); grads: bf16 tensors of the same
    shapes (written). Returns grads. Checks the tensors, then runs `prepare_backward`'s launches
    once."""
    Dq, Dv = q1.shape[-1], v.shape[-1]
    bf, f32 = torch.bfloat16, torch.float32
    dims = {"dq1": Dq, "dq2": Dq, "dk1": Dq, "dk2": Dq, "dv": Dv}
    if set(inter_grads) != set(GRADS) or set(grads) != set(GRADS):
        raise ValueError(f"inter_grads and grads: want the keys {GRADS}, got "
                         f"{sorted(inter_grads)} and {sorted(grads)}")
    tensors = {"q1": (q1, bf, Dq), "q2": (q2, bf, Dq), "k1": (k1, bf, Dq), "k2": (k2, bf, Dq),
               "v": (v, bf, Dv), "dout": (dout, bf, Dv)}
    tensors.update({f"inter_grads[{g}]": (inter_grads[g], f32, d) for g, d in dims.items()})
    tensors.update({f"grads[{g}]": (grads[g], bf, d) for g, d in dims.items()})
    _check_tensors(tensors)
    B, N, H, _ = q1.shape
    prepare_backward(B, N, H, Dq, Dv, chunk, c, cfg)(
        q1, q2, k1, k2, v, dout, [inter_grads[g] for g in GRADS], [grads[g] for g in GRADS])
    return grads


# ------------------------------------------- compile configs (tools.resources, no GPU needed)

KERNELS = {_fwd_kernel: "fwd", _dq_kernel: "dq", _dkdv_kernel: "dkdv"}


def compile_configs(dims=((32, 32), (64, 64))) -> list[CompileConfig]:
    """Each kernel's launch (fwd, dq, dkdv; recorded on meta tensors) at each (Dq, Dv) in dims,
    with config(Dq, Dv)."""

    def name(launch):
        c = launch.constexprs
        return (f"{KERNELS[launch.fn]}_Dq{c['DQ']}_Dv{c['DV']}_M{c['BLOCK_M']}_"
                f"N{c['BLOCK_N']}")
    out = []
    for Dq, Dv in dims:
        q, v = tokens(Dq), tokens(Dv)
        inter = [tokens(Dq, torch.float32)] * 4 + [tokens(Dv, torch.float32)]
        grads = [q] * 4 + [v]
        # a chunk that every tile divides (its value is a runtime argument's)
        chunk = 2 * max(x for c in config(Dq, Dv).values() for x in (c["BLOCK_M"], c["BLOCK_N"]))
        shape = (1, COMPILE_N, COMPILE_H, Dq, Dv, chunk, 1.0)
        out += configs_of(lambda s=shape: prepare_forward(*s), (q, q, q, q, v, inter[-1], v), name)
        out += configs_of(lambda s=shape: prepare_backward(*s), (q, q, q, q, v, v, inter, grads),
                          name)
    return out

"""Tile geometry and the online-softmax step, shared by the Triton and TLX kernels.

A tile is BLOCK_M rows = T tokens x HPT heads of one KV head (see kernels_triton/simplicial/fwd.py). Its keys
are cut into BLOCK_N blocks, enumerated as: interior blocks (every row sees every key: no mask),
then edge blocks (first/last T-1 keys of the range, the partial last block: masked per row).
Producer and consumers enumerate the same sequence, block index t = 0, 1, ... via `key_block`.
"""
import triton
import triton.language as tl

from altattn.simplicial.spec import ProblemSpec
# the kernels import these from here
from kernels_triton.proton import BF16_BYTES, enter, leave  # noqa: F401

LOG2E = 1.4426950408889634
LOG2E_JIT = tl.constexpr(LOG2E)  # the same, for kernels (LSE to log2 units)
# The running max of an online softmax before any score (log2 units): finite, so that a row whose
# scores are all masked gives p = 0 and alpha = 1, never NaN (softmax_step).
M_START = tl.constexpr(-1.0e30)
SUPPORTED_G = (1, 2, 4, 8, 16, 32, 64, 128)
# (Hq, Hk, D) each variant's compile configs cover (resource report, CI compile tests): the paper's
# G = 128 and 64, small G with neighbouring tokens packed (masks on), Hk > 1 (at G = 8 and at
# G = 64, where tlx_ws copies its window a row at a time), and D = 64.
COMPILE_SHAPES = ((128, 1, 128), (64, 1, 128), (32, 1, 128), (16, 1, 128), (16, 1, 64), (8, 1, 128),
                  (1, 1, 128), (32, 4, 128), (128, 2, 128), (128, 1, 64))


def supports(spec: ProblemSpec) -> str | None:
    """Shapes this tiling takes: G a power of two up to 128, D in {64, 128}; any B, N, Hk, w."""
    if spec.G not in SUPPORTED_G:
        return f"G = Hq/Hk = {spec.G} must be a power of two <= 128"
    if spec.D not in (64, 128):
        return f"D = {spec.D} not in (64, 128)"
    return None


def grid(spec: ProblemSpec, block_m: int) -> tuple[int]:
    """One flat axis: (token tiles x head splits) fastest, then B * Hk. Neighbouring programs share
    a K2/V2 window while it is hot in L2; a flat axis has no 65535 limit (grid y/z have)."""
    hpt = min(spec.G, block_m)
    return (triton.cdiv(spec.N, block_m // hpt) * (spec.G // hpt) * spec.B * spec.Hk,)


@triton.jit
def tile_coords(tile, N, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """(first token i0, first head h0 within the KV group, last real token i_hi) of tile `tile`."""
    HPT: tl.constexpr = BLOCK_M if G > BLOCK_M else G
    T: tl.constexpr = BLOCK_M // HPT
    SPLIT: tl.constexpr = G // HPT
    i0 = (tile // SPLIT) * T
    h0 = (tile % SPLIT) * HPT
    i_hi = tl.minimum(i0 + T, N) - 1
    return i0, h0, i_hi


@triton.jit
def tile_setup(N, w2, HK: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """This program's batch b, KV head g, first token i0, first head h0, last real token i_hi, and
    its key blocks (k_lo, n_lo, n_hi, n_blocks) — see key_blocks."""
    HPT: tl.constexpr = BLOCK_M if G > BLOCK_M else G
    T: tl.constexpr = BLOCK_M // HPT
    n_tiles = tl.cdiv(N, T) * (G // HPT)
    pid = tl.program_id(0)
    bg = pid // n_tiles
    b = bg // HK
    g = bg % HK
    i0, h0, i_hi = tile_coords(pid % n_tiles, N, G, BLOCK_M)
    k_lo, n_lo, n_hi, n_blocks = key_blocks(i0, i_hi, w2, T, BLOCK_N)
    return b, g, i0, h0, i_hi, k_lo, n_lo, n_hi, n_blocks


@triton.jit
def row_coords(i0, h0, offs_m, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Token and head (within the KV group) of each row offs_m (0 .. BLOCK_M-1) of a tile."""
    HPT: tl.constexpr = BLOCK_M if G > BLOCK_M else G
    return i0 + offs_m // HPT, h0 + offs_m % HPT


@triton.jit
def key_blocks(i0, i_hi, w2, T: tl.constexpr, BLOCK_N: tl.constexpr, k_min=0):
    """(k_lo, n_lo, n_hi, n_blocks): keys [k_lo, i_hi] in n_blocks blocks; blocks [n_lo, n_hi)
    need no mask. k_min: the first key any row may see (its sequence's start, packed
    sequences)."""
    k_lo = tl.maximum(i0 - w2 + 1, k_min)
    L = i_hi - k_lo + 1
    n_blocks = tl.cdiv(L, BLOCK_N)
    n_lo = tl.cdiv(T - 1, BLOCK_N)
    n_hi = tl.maximum(n_lo, tl.minimum((L - T + 1) // BLOCK_N, n_blocks))
    return k_lo, n_lo, n_hi, n_blocks


@triton.jit
def key_block(t, k_lo, n_lo, n_hi, BLOCK_N: tl.constexpr):
    """Start key of the t-th block in visiting order (interior blocks first), and whether it needs
    a mask."""
    n_int = n_hi - n_lo
    masked = t >= n_int
    e = t - n_int
    n = tl.where(masked, tl.where(e < n_lo, e, e - n_lo + n_hi), n_lo + t)
    return k_lo + n * BLOCK_N, masked


@triton.jit
def mask_scores(s, j, kb, tok, offs_n, w1, w2, MASK_J: tl.constexpr, MASK_K: tl.constexpr):
    """-inf where row's token does not see key j (MASK_J) or key kb + offs_n (MASK_K)."""
    if MASK_J:
        jvalid = (j <= tok) & (j > tok - w1)
        s = tl.where(jvalid[:, None], s, float("-inf"))
    if MASK_K:
        kpos = kb + offs_n
        kvalid = (kpos[None, :] <= tok[:, None]) & (kpos[None, :] > tok[:, None] - w2)
        s = tl.where(kvalid, s, float("-inf"))
    return s


@triton.jit
def softmax_step(s, m_i, l_i, qk_scale):
    """Online softmax in log2 units over raw scores s (qk_scale = sm_scale * log2 e > 0 is folded
    into the exp2 argument: one FFMA per score, no separate scaling pass): returns
    (p, alpha, m_new, l_new), m in log2 units. m starts at M_START, finite, so fully masked rows
    give p = 0 and alpha = 1, never NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def normalized(acc, l_i):
    """The O rows of a finished online softmax, in bf16 (a row with l = 0 stays 0)."""
    return (acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]).to(tl.bfloat16)


@triton.jit
def write_rows(Out, Lse, out, m_i, l_i, b, g, tok, head, N, HQ: tl.constexpr, G: tl.constexpr,
               D: tl.constexpr):
    """Write the bf16 O rows `out` and LSE (natural log) for rows with tok < N."""
    row_ok = tok < N
    hq = g * G + head
    tl.store(row_ptrs(Out, b, g, tok, head, N, HQ, G, D), out, mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453
    tl.store(Lse + (b.to(tl.int64) * HQ + hq) * N + tok, lse, mask=row_ok)


@triton.jit
def store_rows(Out, Lse, acc, m_i, l_i, b, g, tok, head, N, HQ: tl.constexpr, G: tl.constexpr,
               D: tl.constexpr):
    """Normalise and write O rows (bf16) and LSE (natural log) for rows with tok < N."""
    write_rows(Out, Lse, normalized(acc, l_i), m_i, l_i, b, g, tok, head, N, HQ, G, D)


@triton.jit
def load_q(Q, b, g, tok, head, N, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    """The [rows, D] tile of a [B, N, HQ, D] tensor (q, dO) at tokens tok, heads head; 0 past N."""
    return tl.load(row_ptrs(Q, b, g, tok, head, N, HQ, G, D), mask=(tok < N)[:, None], other=0.0)


@triton.jit
def row_ptrs(X, b, g, tok, head, N, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    """Pointers to the [rows, D] entries of a [B, N, HQ, D] tensor (q, out, dO, dQ) at tokens
    tok, query heads g * G + head (int64 offsets)."""
    off = (b.to(tl.int64) * N + tok) * (HQ * D) + (g * G + head) * D
    return X + off[:, None] + tl.arange(0, D)[None, :]

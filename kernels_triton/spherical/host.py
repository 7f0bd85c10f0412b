"""The host side every spherical-attention kernel shares (Triton and TLX): `supports`, the TMA
descriptors, the grid and its decoding in the kernel (which tile a program owns, the sequence
bounds, the key blocks it visits), and the compile-config builder of tools.resources.

Tensors are [B, L, H, D] (q, k, v, out, dout, dq, dk, dv), read and written through one 3-D TMA
view [B, L, H*D] with boxes [1, BLOCK, D] at [b, first row, head*D]: rows past L read as zeros
and a store clips them, so batches never mix. Per-row vectors (r, A, Bt) are [B, Hq, N] fp32.

Grid of a row-tile kernel (forward, dQ): one flat axis, the G query heads of one KV head fastest
(they read the same K/V blocks at the same time, from L2), then the row tiles, then (b, kv head).
Causal kernels visit a head's row tiles from the last (the most keys) to the first, so the short
tiles fill the end of the launch. A key-block kernel (dK/dV) has key blocks fastest, then (b, g).

Packed sequences (spec.packed, altattn/spherical/varlen.py): B = 1 over the packed tokens, and in
place of `seqlens` a launch gets altattn.packing.PackedSeqs (the offsets). Its run builds a tile
map on the device (altattn.packing.tile_map: per tile the sequence's first query and key row,
both lengths, the tile's first row or key, its head and its sequence; a sequence's tiles head
by head, the sequences by work, largest first) and launches a program per map row
(`packed_row_tile`). A program's coordinates are local to its sequence (masks, causal
diagonal, key blocks as a batch element's), offset by the
sequence's first row at each load; a tile that runs past its sequence reads the next one's rows,
masked in the scores (exactly 0 for finite values), and stores only its own rows (masked stores,
not TMA: a TMA store of such a tile would overwrite the next sequence's rows).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from altattn.packing import MAP_COLUMNS, PackedSeqs, max_tiles, tile_map
from altattn.registry import CompileConfig
from kernels_triton.launch import Desc, Kernel, compile_configs, meta
from altattn.spherical.spec import SphericalSpec

SUPPORTED_D = (64, 128)
BF16 = tl.constexpr(2)  # bytes of one bf16 element (TMA transaction counts)


def supports(spec: SphericalSpec) -> str | None:
    """Shapes every spherical kernel takes: D in {64, 128}, Hq a multiple of Hk, causal only with
    N == Nk; any B, N, Nk, G, seqlens."""
    if spec.D not in SUPPORTED_D:
        return f"D = {spec.D} not in {SUPPORTED_D}"
    if spec.Hq % spec.Hk:
        return f"Hq = {spec.Hq} is not a multiple of Hk = {spec.Hk}"
    if spec.causal and spec.N != spec.Nk:
        return f"causal needs N == Nk, got N = {spec.N}, Nk = {spec.Nk}"
    return None


def layout(B: int, L: int, H: int, D: int, block_rows: int) -> Desc:
    """TMA view of a contiguous [B, L, H, D] bf16 tensor as [B, L, H*D], box [1, block_rows, D]
    (module docstring); `layout(...)(t)` is t's descriptor."""
    return Desc([B, L, H * D], [L * H * D, H * D, 1], [1, block_rows, D])


def row_grid(spec: SphericalSpec, block_m: int) -> tuple[int]:
    """Row-tile kernels: B * Hq * cdiv(N, block_m) programs on axis 0 (no 65535 limit)."""
    return (spec.B * spec.Hq * triton.cdiv(spec.N, block_m),)


def key_grid(spec: SphericalSpec, block_n: int) -> tuple[int]:
    """Key-block kernels: B * Hk * cdiv(Nk, block_n) programs on axis 0."""
    return (spec.B * spec.Hk * triton.cdiv(spec.Nk, block_n),)


@triton.jit
def row_tile(N, HK: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """(b, kv head g, query head h, first row m0) of this program of a row_grid launch."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(N, BLOCK_M)
    hg = pid % G
    rest = pid // G
    mi = rest % n_m
    bg = rest // n_m
    if CAUSAL:
        mi = n_m - 1 - mi
    g = bg % HK
    return bg // HK, g, g * G + hg, mi * BLOCK_M


@triton.jit
def key_tile(Nk, HK: tl.constexpr, BLOCK_N: tl.constexpr):
    """(b, kv head g, first key x0) of this program of a key_grid launch."""
    pid = tl.program_id(0)
    n_n = tl.cdiv(Nk, BLOCK_N)
    bg = pid // n_n
    return bg // HK, bg % HK, (pid % n_n) * BLOCK_N


@triton.jit
def seq_bounds(Seqlens, b, N, Nk, VARLEN: tl.constexpr):
    """(Lq, Lk): rows y < Lq and keys x < Lk are real (clamp(seqlens[b]) with VARLEN)."""
    lq = N
    lk = Nk
    if VARLEN:
        L = tl.maximum(tl.load(Seqlens + b), 0)
        lq = tl.minimum(L, N)
        lk = tl.minimum(L, Nk)
    return lq, lk


@triton.jit
def key_blocks(m0, Lq, Lk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(n_full, n_all) of the row tile at m0: key blocks [0, n_full) are visible to every row of
    the tile (no mask), [n_full, n_all) need one (x < Lk, causal x <= y). A tile past Lq visits
    none."""
    hi = Lk
    full = Lk
    if CAUSAL:
        hi = tl.minimum(Lk, m0 + BLOCK_M)
        full = tl.minimum(Lk, m0 + 1)
    live = m0 < Lq
    return tl.where(live, full // BLOCK_N, 0), tl.where(live, tl.cdiv(hi, BLOCK_N), 0)


@triton.jit
def query_blocks(x0, Lq, Lk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(m_lo, n_diag, n_all) of the key block at x0: query blocks m_lo + i * BLOCK_M for i in
    [0, n_all), the first n_diag of them masked (causal x <= y); none for a block past Lk."""
    m_lo = 0
    n_diag = 0
    if CAUSAL:
        m_lo = x0
        n_diag = tl.cdiv(BLOCK_N, BLOCK_M)
    n_all = tl.where(x0 < Lk, tl.maximum(tl.cdiv(Lq - m_lo, BLOCK_M), 0), 0)
    return m_lo, tl.minimum(n_diag, n_all), n_all


# ---- packed sequences ---------------------------------------------------------------------

def packed_map(seqs: PackedSeqs, T: int, block: int, causal: bool, heads: int,
               keys: bool = False) -> tuple[torch.Tensor, int]:
    """(tile map, its tiles per head) of the packed launch of `heads` heads over T rows
    (keys=True: T keys) in tiles of `block` (module docstring); no host read of the offsets."""
    n = max_tiles(T, seqs.cu_q.numel() - 1, block)
    return tile_map(seqs.cu_q, seqs.cu_k, block, n, heads=heads, causal=causal, keys=keys), n


class PerGrid:
    """A packed launch's Kernels, one per grid (its grid grows with the number of sequences):
    `per_grid(n)` is the Kernel of fn over grid(n) with `options`, made at its first use."""

    def __init__(self, fn, grid: Callable[[int], tuple], **options):
        self.fn, self.grid, self.options = fn, grid, options
        self.kernels: dict[int, Kernel] = {}

    def __call__(self, n: int) -> Kernel:
        k = self.kernels.get(n)
        if k is None:
            k = self.kernels[n] = Kernel(self.fn, self.grid(n), **self.options)
        return k


MAP_WIDTH: tl.constexpr = tl.constexpr(len(MAP_COLUMNS))
# the kernels' column indexes of a tile-map row, by name (altattn.packing.MAP_COLUMNS)
(MAP_Q_START, MAP_K_START, MAP_LEN_Q, MAP_LEN_K, MAP_FIRST, MAP_HEAD, MAP_SEQ) = (
    tl.constexpr(MAP_COLUMNS.index(c)) for c in ("q_start", "k_start", "len_q", "len_k", "first",
                                                 "head", "seq"))


@triton.jit
def map_field(Map, ti, COL: tl.constexpr):
    """Column COL (MAP_*) of tile-map row ti."""
    return tl.load(Map + ti * MAP_WIDTH + COL)


@triton.jit
def packed_tile(Map, ti):
    """(head, q_start, k_start, Lq, Lk, first) of tile-map row ti: its head, the sequence's first
    query row and first key row in the packed tensors, its lengths, the tile's first row (or key)
    in it (altattn.packing.MAP_COLUMNS)."""
    return (map_field(Map, ti, MAP_HEAD), map_field(Map, ti, MAP_Q_START),
            map_field(Map, ti, MAP_K_START), map_field(Map, ti, MAP_LEN_Q),
            map_field(Map, ti, MAP_LEN_K), map_field(Map, ti, MAP_FIRST))


@triton.jit
def packed_row_tile(Map):
    """packed_tile of this program's map row (a packed grid: one program per row)."""
    return packed_tile(Map, tl.program_id(0))


@triton.jit
def store_rows(Ptr, x, tok0, rows, live, H: tl.constexpr, h, D: tl.constexpr):
    """x [rows, D] into rows tok0 + rows of head h of a [T, H, D] tensor, where `live`."""
    tok = (tok0 + rows).to(tl.int64)
    tl.store(Ptr + (tok * H + h)[:, None] * D + tl.arange(0, D)[None, :], x,
             mask=live[:, None])


# ---- compile configs (tools.resources; CI compiles them for sm_90a without a GPU) ----------

Prepare = Callable[[SphericalSpec], Callable]   # spec -> the prepared launch, run(*meta_args)


def compile_specs() -> list[SphericalSpec]:
    """The specs compile configs cover: D 64 and 128, causal and not, seqlens and not, G 1 and 8
    (not every combination: G and seqlens change little code), packed at D 128 and 64."""
    out = []
    for d, causal, varlen, hq, hk in ((128, False, False, 16, 16), (128, True, False, 16, 16),
                                      (128, False, True, 16, 2), (128, True, True, 16, 2),
                                      (64, False, False, 16, 16), (64, True, True, 16, 2)):
        out.append(SphericalSpec(B=2, N=4096, Nk=4096, Hq=hq, Hk=hk, D=d, causal=causal,
                                 sm_scale=d ** -0.5, varlen=varlen))
    for d, causal in ((128, False), (128, True), (64, True)):
        out.append(SphericalSpec(B=1, N=8192, Nk=8192, Hq=16, Hk=2, D=d, causal=causal,
                                 sm_scale=d ** -0.5, packed=True))
    return out


def meta_args(spec: SphericalSpec, pass_: str) -> tuple:
    """A pass's run arguments for `spec` on meta tensors (compile configs): the forward's (q, k,
    v, seqlens, out, r), the backward's (q, k, v, out, r, dout, dr, seqlens, dq, dk, dv)."""
    q = meta(spec.B, spec.N, spec.Hq, spec.D)
    kv = meta(spec.B, spec.Nk, spec.Hk, spec.D)
    r = meta(spec.B, spec.Hq, spec.N, dtype=torch.float32)
    seqlens = meta(spec.B, dtype=torch.int32) if spec.varlen else None
    if spec.packed:  # 4 sequences
        seqlens = PackedSeqs(*[meta(5, dtype=torch.int32)] * 2)
    if pass_ == "fwd":
        return q, kv, kv, seqlens, q, r
    return q, kv, kv, q, r, q, r, seqlens, q, kv, kv


def spec_tag(spec: SphericalSpec) -> str:
    return (f"G{spec.G}_D{spec.D}" + ("_causal" if spec.causal else "")
            + ("_varlen" if spec.varlen else "") + ("_packed" if spec.packed else ""))


def build_compile_configs(prepare: Prepare, pass_: str, names: dict | None = None,
                          supports_fn: Callable = supports) -> list[CompileConfig]:
    """The launches of `prepare(spec)` (recorded on meta tensors) at every compile_specs() spec
    that `supports_fn` takes, named by the spec and the launch's blocks; names: the kernels to
    report, each with its name's prefix (default every launch, no prefix)."""
    out = []
    for spec in compile_specs():
        if supports_fn(spec) is not None:
            continue

        def name(launch, tag=spec_tag(spec)):
            if names is not None and launch.fn not in names:
                return None
            blocks = "_".join(f"{k[6:]}{v}" for k, v in launch.constexprs.items()
                              if k.startswith("BLOCK_"))
            return f"{(names or {}).get(launch.fn, '')}{tag}_{blocks}"
        out += compile_configs(lambda s=spec: prepare(s), meta_args(spec, pass_), name)
    return out

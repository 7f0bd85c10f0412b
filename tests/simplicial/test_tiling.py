"""kernels_triton/simplicial/tiling.py's index math, on the CPU: a plain-Python mirror of each @triton.jit
function, properties of the mirror, and the real functions run in Triton's interpreter.

Every kernel (Triton and TLX) enumerates its work through these functions: which (token, head)
rows a program owns (`tile_setup`, `tile_coords`, `row_coords`, `grid`), which key blocks it visits
and in which order (`key_blocks`, `key_block`: interior blocks first, then the edge blocks) and
which scores it masks (`mask_scores`). A slip there shows on the GPU only at some shapes; here:

1. The mirror below restates each function in plain Python.
2. Properties of the mirror, over G in {1, ..., 128}, BLOCK_M and BLOCK_N in {64, 128}, ragged N
   (also N < w2) and windows from 1 to past N: the programs of the grid own every (b, g, token,
   head) once; a tile's key range is exactly the keys its rows see; its blocks are each visited
   once, interior ones first; an unmasked block holds only keys that every row of the tile sees,
   and a block is masked only where the docstring says (the partial last block, or one that
   meets the first or last T - 1 keys); with the masks, each row sees exactly its window.
3. tests/simplicial/tiling_probe.py runs the real functions under TRITON_INTERPRET=1 (in a child process:
   the interpreter is chosen when `triton` is imported) from small wrapper kernels that call them
   as the variant kernels do; their results must equal the mirror's, value for value.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, no_gpu_env

BLOCK_SIZES = [(bm, bn) for bm in (64, 128) for bn in (64, 128)]
GS = (1, 2, 4, 8, 16, 32, 64, 128)
COMBOS = [(g, bm, bn) for g in GS for bm, bn in BLOCK_SIZES]
COMBO_IDS = [f"G{g}-M{bm}-N{bn}" for g, bm, bn in COMBOS]


# ------------------------------------------------------------------------------------------------
# The mirror: tiling.py's functions in plain Python, line by line

def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b  # tl.cdiv; only ever called with a >= 0 here


def tdiv(a: int, b: int) -> int:
    """`a // b` as Triton computes it on integers: truncated toward zero, as in C (b > 0)."""
    q = abs(a) // b
    return q if a >= 0 else -q


def tile_shape(G: int, BM: int) -> tuple[int, int, int]:
    """(HPT heads per tile, T tokens per tile, SPLIT tiles per token block)."""
    hpt = min(G, BM)
    return hpt, BM // hpt, G // hpt


def tile_coords(tile: int, N: int, G: int, BM: int) -> tuple[int, int, int]:
    """(first token i0, first head h0, last real token i_hi) of tile `tile`."""
    hpt, T, split = tile_shape(G, BM)
    i0 = (tile // split) * T
    h0 = (tile % split) * hpt
    i_hi = min(i0 + T, N) - 1
    return i0, h0, i_hi


def key_blocks(i0: int, i_hi: int, w2: int, T: int, BN: int) -> tuple[int, int, int, int]:
    """(k_lo, n_lo, n_hi, n_blocks): keys [k_lo, i_hi] in n_blocks blocks of BN from k_lo; blocks
    n_lo <= n < n_hi are the interior ones."""
    k_lo = max(i0 - w2 + 1, 0)
    L = i_hi - k_lo + 1
    n_blocks = cdiv(L, BN)
    n_lo = cdiv(T - 1, BN)
    n_hi = max(n_lo, min(tdiv(L - T + 1, BN), n_blocks))  # L - T + 1 may be < 0
    return k_lo, n_lo, n_hi, n_blocks


def key_block(t: int, k_lo: int, n_lo: int, n_hi: int, BN: int) -> tuple[int, bool]:
    """(first key, masked) of the t-th block visited: the interior blocks n_lo .. n_hi - 1 first,
    then the edge blocks 0 .. n_lo - 1 and n_hi .. n_blocks - 1."""
    n_int = n_hi - n_lo
    if t < n_int:
        return k_lo + (n_lo + t) * BN, False
    e = t - n_int
    n = e if e < n_lo else e - n_lo + n_hi
    return k_lo + n * BN, True


def tile_setup(pid: int, N: int, w2: int, HK: int, G: int, BM: int, BN: int) -> tuple:
    """(b, g, i0, h0, i_hi, k_lo, n_lo, n_hi, n_blocks) of program `pid`."""
    hpt, T, split = tile_shape(G, BM)
    n_tiles = cdiv(N, T) * split
    bg = pid // n_tiles
    i0, h0, i_hi = tile_coords(pid % n_tiles, N, G, BM)
    return (bg // HK, bg % HK, i0, h0, i_hi, *key_blocks(i0, i_hi, w2, T, BN))


def row_coords(i0: int, h0: int, r: int, G: int, BM: int) -> tuple[int, int]:
    """(token, head) of row r of a tile."""
    hpt = min(G, BM)
    return i0 + r // hpt, h0 + r % hpt


def grid(B: int, N: int, Hk: int, G: int, BM: int) -> int:
    hpt, T, split = tile_shape(G, BM)
    return cdiv(N, T) * split * B * Hk


def sees(tok: int, key: int, w: int) -> bool:
    """Whether query token `tok` sees key `key` in a window of w: what mask_scores keeps."""
    return tok - w < key <= tok


# ------------------------------------------------------------------------------------------------
# Shapes: ragged N, windows from 1 to past N (the launcher clamps w to N; the functions must not
# need it), and for long sequences a sample of tiles: every tile up to the end of the ramp where
# k_lo is clamped at 0 (w2 tokens), the last tiles (partial) and a seeded draw in between (every
# other tile is a shifted copy of one of them).

NS = (1, 2, 3, 5, 17, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 300, 777, 1537)
W2S = (1, 2, 3, 7, 16, 63, 64, 65, 127, 128, 129, 300, 512, 1024, 2000)


def sampled_tiles(N: int, w2: int, G: int, BM: int, rng: random.Random) -> list[int]:
    hpt, T, split = tile_shape(G, BM)
    n_tiles = cdiv(N, T) * split
    if n_tiles <= 96:
        return list(range(n_tiles))
    ramp = min(n_tiles, (cdiv(w2, T) + 2) * split)
    head = range(min(ramp, 48))
    tail = range(n_tiles - 2 * split, n_tiles)
    middle = rng.sample(range(n_tiles), 32)
    return sorted(set(head) | set(tail) | set(middle) | set(rng.sample(range(ramp), min(ramp, 16))))


def block_rows(G: int, BM: int) -> list[tuple[int, int, int]]:
    """(tile, N, w2) rows checked for one (G, BLOCK_M): every pair of NS x W2S."""
    rng = random.Random(f"{G}-{BM}")
    return [(tile, N, w2) for N in NS for w2 in W2S
            for tile in sampled_tiles(N, w2, G, BM, rng)]


def max_blocks(BM: int, BN: int) -> int:
    """A power of two >= any n_blocks of the rows (L <= w2 + T - 1)."""
    return 1 << (cdiv(max(W2S) + BM - 1, BN) - 1).bit_length()


# fields: (B, N, Hq, Hk, w2, BM, BN). Small grids (the interpreter runs one program at a time):
# batches and KV heads, G = 128 split over two tiles, many tokens per tile with a partial last
# tile, w2 below and above N.
SETUP_CASES = {
    "B2_Hk2_G128_M64_split": (2, 5, 256, 2, 3, 64, 64),
    "B3_Hk2_G1_M64_N70": (3, 70, 2, 2, 33, 64, 128),
    "Hk4_G8_M128_N37": (1, 37, 32, 4, 40, 128, 64),
    "B2_G64_M128_N9": (2, 9, 64, 1, 1, 128, 128),
    "Hk3_G128_M128_N3": (1, 3, 384, 3, 2, 128, 64),
    "G2_M128_N200_w129": (1, 200, 2, 1, 129, 128, 64),
    "G16_M64_N13_w7": (1, 13, 16, 1, 7, 64, 128),
}


def mask_cases(BM: int, BN: int) -> dict:
    """Rows' tokens as a real tile lays them out (T tokens x HPT heads, from token 0 on, some past
    N) or drawn at random; key blocks mostly across the rows' tokens (both window ends inside the
    block), j around them, windows from 1 to past the block."""
    rng = random.Random(f"mask-{BM}-{BN}")
    toks, args = [], []
    for case in range(24):
        G = (1, 2, 8, 64, 128)[case % 5]
        hpt = min(G, BM)
        i0 = rng.choice((0, 1, 3, rng.randrange(0, 300)))
        rows = ([i0 + r // hpt for r in range(BM)] if case % 4 else
                [rng.randrange(0, 400) for _ in range(BM)])
        w1, w2 = sorted((rng.choice((1, 2, 3, 17, 64, 200)), rng.choice((1, 5, 64, 129, 500))))
        j = rng.randrange(max(0, min(rows) - w1 - 2), max(rows) + 3)
        anchor = rng.choice(rows)
        kb = max(0, anchor - rng.randrange(0, BN)) if case % 3 else rng.randrange(0, 500)
        toks.append(rows)
        args.append([j, kb, w1, w2])
    return {"BM": BM, "BN": BN, "toks": toks, "args": args}


# ------------------------------------------------------------------------------------------------
# Properties of the mirror

def visit_order(i0: int, i_hi: int, w2: int, T: int, BN: int) -> list[tuple[int, bool]]:
    k_lo, n_lo, n_hi, n_blocks = key_blocks(i0, i_hi, w2, T, BN)
    return [key_block(t, k_lo, n_lo, n_hi, BN) for t in range(n_blocks)]


def check_tile(tile: int, N: int, w2: int, G: int, BM: int, BN: int) -> None:
    hpt, T, split = tile_shape(G, BM)
    where = f"tile {tile} of N={N} w2={w2} G={G} BLOCK_M={BM} BLOCK_N={BN} (T={T})"
    i0, h0, i_hi = tile_coords(tile, N, G, BM)
    assert 0 <= i0 <= i_hi < N and i_hi - i0 + 1 == min(T, N - i0), where
    assert 0 <= h0 and h0 + hpt <= G, where
    k_lo, n_lo, n_hi, n_blocks = key_blocks(i0, i_hi, w2, T, BN)
    # the key range is exactly the keys that the tile's real rows see
    seen = [(max(0, i - w2 + 1), i) for i in range(i0, i_hi + 1)]
    assert (k_lo, i_hi) == (min(a for a, _ in seen), max(b for _, b in seen)), where
    assert all(a <= b + 1 for (_, b), (a, _) in zip(seen, seen[1:])), where  # no gap between rows
    order = visit_order(i0, i_hi, w2, T, BN)
    starts = [kb for kb, _ in order]
    # every block of [k_lo, i_hi] once, and no more blocks than that takes
    assert sorted(starts) == [k_lo + n * BN for n in range(cdiv(i_hi - k_lo + 1, BN))], where
    masked = [m for _, m in order]
    assert masked == sorted(masked), f"{where}: an edge block before an interior one: {order}"
    rows = range(i0, i0 + T)  # every row of the tile, also those past N (they are not stored)
    for kb, m in order:
        partial = kb + BN - 1 > i_hi
        edge = kb < k_lo + T - 1 or kb + BN - 1 > i_hi - T + 1  # meets the first/last T - 1 keys
        assert m == (partial or edge), f"{where}: block at {kb} masked={m}; {order}"
        if not m:  # no mask: every key of the block is seen by every row
            assert all(sees(i, kb, w2) and sees(i, kb + BN - 1, w2) for i in rows), (
                f"{where}: unmasked block [{kb}, {kb + BN}) has a key some row does not see")
    # with its masks, each real row sees exactly its window: the blocks are disjoint, unmasked
    # ones are whole windows' worth, masked ones keep the keys the row sees
    for i in range(i0, i_hi + 1):
        kept = sum(BN if not m else max(0, min(kb + BN - 1, i) - max(kb, i - w2 + 1) + 1)
                   for kb, m in order)
        assert kept == min(i + 1, w2), f"{where}: row token {i} sees {kept} keys"


@pytest.mark.parametrize("G,BM,BN", COMBOS, ids=COMBO_IDS)
def test_key_blocks_properties(G, BM, BN):
    for tile, N, w2 in block_rows(G, BM):
        check_tile(tile, N, w2, G, BM, BN)


@pytest.mark.parametrize("G,BM", [(g, bm) for g in GS for bm in (64, 128)])
def test_grid_owns_every_row_once(G, BM):
    """The programs of the grid, through tile_setup and row_coords, own each (b, g, token, head)
    with token < N exactly once; every program owns at least one."""
    for B, Hk, N in ((1, 1, 1), (2, 3, 5), (1, 2, 64), (3, 1, 129), (1, 1, 300)):
        owned = []
        for pid in range(grid(B, N, Hk, G, BM)):
            b, g, i0, h0, i_hi, *_ = tile_setup(pid, N, 7, Hk, G, BM, 64)
            rows = [(b, g, *row_coords(i0, h0, r, G, BM)) for r in range(BM)]
            real = [row for row in rows if row[2] < N]
            assert real, f"program {pid} owns no row (B={B} Hk={Hk} N={N} G={G} BM={BM})"
            assert all(row[2] <= i_hi for row in real)
            owned += real
        want = set(itertools.product(range(B), range(Hk), range(N), range(G)))
        assert len(owned) == len(want) and set(owned) == want, (B, Hk, N, G, BM)


@pytest.mark.parametrize("G,BM", [(g, bm) for g in GS for bm in (64, 128)])
def test_real_grid_matches_mirror(G, BM):
    from kernels_triton.simplicial import tiling
    from altattn.simplicial.spec import ProblemSpec
    for B, Hk, N in ((1, 1, 1), (2, 3, 5), (4, 2, 1000), (1, 1, 16384)):
        spec = ProblemSpec(B, N, G * Hk, Hk, 128, 1, 1, 0.1)
        assert tiling.grid(spec, BM) == (grid(B, N, Hk, G, BM),)


def test_j_window_needs_a_mask_only_with_several_tokens():
    """kernels_triton/simplicial/fwd.py visits j in [max(i0 - w1 + 1, 0), i_hi] with MASK_J = T > 1: that
    range is the union of the rows' K1 windows, and with one token per tile it is that token's."""
    for G, BM in itertools.product(GS, (64, 128)):
        _, T, split = tile_shape(G, BM)
        for N, w1 in itertools.product((1, 5, 70, 150), (1, 3, 64, 100)):
            for tile in range(cdiv(N, T) * split):
                i0, _, i_hi = tile_coords(tile, N, G, BM)
                js = set(range(max(i0 - w1 + 1, 0), i_hi + 1))
                assert js == {j for i in range(i0, i_hi + 1)
                              for j in range(max(0, i - w1 + 1), i + 1)}, (tile, N, w1, G, BM)
                if T == 1:
                    assert all(sees(i0, j, w1) for j in js)


# ------------------------------------------------------------------------------------------------
# The real functions, in Triton's interpreter

@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Everything tiling_probe.py computes, for every case of this module, in one child process."""
    cases = {
        "blocks": [{"G": G, "BM": BM, "BN": BN, "max_blocks": max_blocks(BM, BN),
                    "rows": block_rows(G, BM)} for G, BM, BN in COMBOS],
        "setup": [{"B": B, "N": N, "Hq": Hq, "Hk": Hk, "w2": w2, "BM": BM, "BN": BN,
                   "max_blocks": max_blocks(BM, BN)}
                  for B, N, Hq, Hk, w2, BM, BN in SETUP_CASES.values()],
        "mask": [mask_cases(BM, BN) for BM, BN in BLOCK_SIZES],
    }
    tmp = tmp_path_factory.mktemp("tiling_probe")
    (tmp / "cases.json").write_text(json.dumps(cases))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "simplicial", "tiling_probe.py"),
                        str(tmp / "cases.json"), str(tmp / "out.pt")], cwd=ROOT,
                       env=no_gpu_env(TRITON_INTERPRET="1"), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, f"tiling_probe.py failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    out = torch.load(tmp / "out.pt")
    return {"cases": cases, **{k: out[k] for k in ("blocks", "setup", "mask")}}


@pytest.mark.parametrize("combo", range(len(COMBOS)), ids=COMBO_IDS)
def test_interpreted_key_blocks_match_mirror(interpreted, combo):
    """tile_coords, key_blocks and key_block (every block a tile visits) as run by Triton."""
    G, BM, BN = COMBOS[combo]
    case = interpreted["cases"]["blocks"][combo]
    got = interpreted["blocks"][combo].tolist()
    mb = case["max_blocks"]
    _, T, _ = tile_shape(G, BM)
    for (tile, N, w2), row in zip(case["rows"], got, strict=True):
        i0, h0, i_hi = tile_coords(tile, N, G, BM)
        want = [i0, h0, i_hi, *key_blocks(i0, i_hi, w2, T, BN)]
        where = f"tile {tile} N={N} w2={w2} G={G} BLOCK_M={BM} BLOCK_N={BN}"
        assert row[:7] == want, f"{where}: (i0, h0, i_hi, k_lo, n_lo, n_hi, n_blocks) {row[:7]}"
        order = [(row[7 + t], bool(row[7 + mb + t])) for t in range(want[-1])]
        assert order == visit_order(i0, i_hi, w2, T, BN), f"{where}: visiting order {order}"


@pytest.mark.parametrize("name", SETUP_CASES, ids=SETUP_CASES.keys())
def test_interpreted_tile_setup_matches_mirror(interpreted, name):
    """tile_setup and row_coords in every program of the launch grid (tiling.grid)."""
    B, N, Hq, Hk, w2, BM, BN = SETUP_CASES[name]
    G = Hq // Hk
    k = list(SETUP_CASES).index(name)
    mb = interpreted["cases"]["setup"][k]["max_blocks"]
    got = interpreted["setup"][k].tolist()
    assert len(got) == grid(B, N, Hk, G, BM)
    owned = set()
    for pid, row in enumerate(got):
        want = tile_setup(pid, N, w2, Hk, G, BM, BN)
        assert tuple(row[:9]) == want, f"{name} program {pid}: {row[:9]} != {want}"
        b, g, i0, h0 = want[:4]
        toks, heads = row[9:9 + BM], row[9 + BM:9 + 2 * BM]
        assert list(zip(toks, heads)) == [row_coords(i0, h0, r, G, BM) for r in range(BM)], pid
        owned |= {(b, g, t, h) for t, h in zip(toks, heads) if t < N}
        order = [(row[9 + 2 * BM + t], bool(row[9 + 2 * BM + mb + t])) for t in range(want[-1])]
        assert order == visit_order(i0, want[4], w2, BM // min(G, BM), BN), pid
    assert owned == set(itertools.product(range(B), range(Hk), range(N), range(G))), name


@pytest.mark.parametrize("k", range(len(BLOCK_SIZES)),
                         ids=[f"M{bm}-N{bn}" for bm, bn in BLOCK_SIZES])
def test_interpreted_mask_scores_matches_mirror(interpreted, k):
    """mask_scores keeps (row, key) iff the row's token sees j (MASK_J) and key kb + n (MASK_K)."""
    case = interpreted["cases"]["mask"][k]
    BN = case["BN"]
    for c, (toks, (j, kb, w1, w2)) in enumerate(zip(case["toks"], case["args"], strict=True)):
        got_j, got_k, got_jk = interpreted["mask"][k][c].tolist()
        for r, tok in enumerate(toks):
            want_j = [int(sees(tok, j, w1))] * BN
            want_k = [int(sees(tok, kb + n, w2)) for n in range(BN)]
            where = f"case {c} row {r} token {tok} j={j} kb={kb} w1={w1} w2={w2}"
            assert got_j[r] == want_j, f"{where}: MASK_J"
            assert got_k[r] == want_k, f"{where}: MASK_K"
            assert got_jk[r] == [a & b for a, b in zip(want_j, want_k)], f"{where}: both"

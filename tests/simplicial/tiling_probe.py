"""Runs kernels_triton/simplicial/tiling.py's @triton.jit index functions in Triton's interpreter, on the CPU.

    TRITON_INTERPRET=1 python tests/simplicial/tiling_probe.py CASES.json OUT.pt

(the interpreter is chosen when `triton` is imported, so this runs in its own process; see
tests/simplicial/test_tiling.py, which compares what it writes with a plain-Python mirror). Small wrapper
kernels call the functions exactly as the variant kernels do and store what they return:

    blocks_probe  tile_coords, key_blocks and key_block, vectorized over many (tile, N, w2) rows
    setup_probe   tile_setup and row_coords, one program per tile of the launch grid (tiling.grid),
                  and key_block over the program's key blocks
    mask_probe    mask_scores on a tile of zero scores: which (row, key) it leaves finite

CASES.json: {"blocks": [...], "setup": [...], "mask": [...]} (fields: see the run_* functions);
OUT.pt: a torch.save of the same structure, one int32 tensor per case.
"""
from __future__ import annotations

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("tiling_probe.py: run with TRITON_INTERPRET=1 (Triton's CPU interpreter)")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels_triton.simplicial import tiling  # noqa: E402
from altattn.simplicial.spec import ProblemSpec  # noqa: E402

HEAD = 7  # per row: i0, h0, i_hi, k_lo, n_lo, n_hi, n_blocks; then kb[MAX_BLOCKS], masked[...]


@triton.jit
def blocks_probe(Tiles, Ns, W2s, Out, n_rows, G: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, ROWS: tl.constexpr, MAX_BLOCKS: tl.constexpr):
    HPT: tl.constexpr = BLOCK_M if G > BLOCK_M else G
    T: tl.constexpr = BLOCK_M // HPT
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < n_rows
    tile = tl.load(Tiles + r, mask=ok, other=0)
    N = tl.load(Ns + r, mask=ok, other=1)
    w2 = tl.load(W2s + r, mask=ok, other=1)
    i0, h0, i_hi = tiling.tile_coords(tile, N, G, BLOCK_M)
    k_lo, n_lo, n_hi, n_blocks = tiling.key_blocks(i0, i_hi, w2, T, BLOCK_N)
    t = tl.arange(0, MAX_BLOCKS)
    kb, masked = tiling.key_block(t[None, :], k_lo[:, None], n_lo, n_hi[:, None], BLOCK_N)
    W: tl.constexpr = 7 + 2 * MAX_BLOCKS
    row = Out + r * W
    tl.store(row + 0, i0, mask=ok)
    tl.store(row + 1, h0, mask=ok)
    tl.store(row + 2, i_hi, mask=ok)
    tl.store(row + 3, k_lo, mask=ok)
    tl.store(row + 4, n_lo + 0 * r, mask=ok)
    tl.store(row + 5, n_hi, mask=ok)
    tl.store(row + 6, n_blocks, mask=ok)
    tl.store(row[:, None] + 7 + t[None, :], kb, mask=ok[:, None])
    tl.store(row[:, None] + 7 + MAX_BLOCKS + t[None, :], masked.to(tl.int32), mask=ok[:, None])


@triton.jit
def setup_probe(Out, N, w2, HK: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, MAX_BLOCKS: tl.constexpr):
    b, g, i0, h0, i_hi, k_lo, n_lo, n_hi, n_blocks = tiling.tile_setup(N, w2, HK, G, BLOCK_M,
                                                                       BLOCK_N)
    tok, head = tiling.row_coords(i0, h0, tl.arange(0, BLOCK_M), G, BLOCK_M)
    t = tl.arange(0, MAX_BLOCKS)
    kb, masked = tiling.key_block(t, k_lo, n_lo, n_hi, BLOCK_N)
    W: tl.constexpr = 9 + 2 * BLOCK_M + 2 * MAX_BLOCKS
    row = Out + tl.program_id(0) * W
    tl.store(row + 0, b)
    tl.store(row + 1, g)
    tl.store(row + 2, i0)
    tl.store(row + 3, h0)
    tl.store(row + 4, i_hi)
    tl.store(row + 5, k_lo)
    tl.store(row + 6, n_lo)
    tl.store(row + 7, n_hi)
    tl.store(row + 8, n_blocks)
    tl.store(row + 9 + tl.arange(0, BLOCK_M), tok)
    tl.store(row + 9 + BLOCK_M + tl.arange(0, BLOCK_M), head)
    tl.store(row + 9 + 2 * BLOCK_M + t, kb)
    tl.store(row + 9 + 2 * BLOCK_M + MAX_BLOCKS + t, masked.to(tl.int32))


@triton.jit
def mask_probe(Toks, Args, Out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Case c: rows' tokens Toks[c, :], (j, kb, w1, w2) = Args[c, :]; writes three [BLOCK_M,
    BLOCK_N] 0/1 tiles (finite score kept): MASK_J only, MASK_K only, both."""
    c = tl.program_id(0)
    tok = tl.load(Toks + c * BLOCK_M + tl.arange(0, BLOCK_M))
    j = tl.load(Args + c * 4 + 0)
    kb = tl.load(Args + c * 4 + 1)
    w1 = tl.load(Args + c * 4 + 2)
    w2 = tl.load(Args + c * 4 + 3)
    offs_n = tl.arange(0, BLOCK_N)
    zero = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + offs_n[None, :]
    out = Out + c * 3 * BLOCK_M * BLOCK_N + tile
    s = tiling.mask_scores(zero, j, kb, tok, offs_n, w1, w2, True, False)
    tl.store(out, (s == 0.0).to(tl.int32))
    s = tiling.mask_scores(zero, j, kb, tok, offs_n, w1, w2, False, True)
    tl.store(out + BLOCK_M * BLOCK_N, (s == 0.0).to(tl.int32))
    s = tiling.mask_scores(zero, j, kb, tok, offs_n, w1, w2, True, True)
    tl.store(out + 2 * BLOCK_M * BLOCK_N, (s == 0.0).to(tl.int32))


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def run_blocks(case: dict) -> torch.Tensor:
    """case: G, BM, BN, max_blocks, rows = [[tile, N, w2], ...] -> [rows, 7 + 2 * max_blocks]."""
    rows = case["rows"]
    tiles, ns, w2s = (i32([r[k] for r in rows]) for k in range(3))
    width = HEAD + 2 * case["max_blocks"]
    out = torch.full((len(rows), width), -99, dtype=torch.int32)
    per_program = 1024
    blocks_probe[(triton.cdiv(len(rows), per_program),)](
        tiles, ns, w2s, out, len(rows), G=case["G"], BLOCK_M=case["BM"], BLOCK_N=case["BN"],
        ROWS=per_program, MAX_BLOCKS=case["max_blocks"])
    return out


def run_setup(case: dict) -> torch.Tensor:
    """case: B, N, Hq, Hk, w2, BM, BN, max_blocks -> [grid, 9 + 2 * BM + 2 * max_blocks]."""
    spec = ProblemSpec(case["B"], case["N"], case["Hq"], case["Hk"], 64, 1, case["w2"], 0.125)
    (programs,) = tiling.grid(spec, case["BM"])
    out = torch.full((programs, 9 + 2 * case["BM"] + 2 * case["max_blocks"]), -99,
                     dtype=torch.int32)
    setup_probe[(programs,)](out, spec.N, spec.w2, HK=spec.Hk, G=spec.G, BLOCK_M=case["BM"],
                             BLOCK_N=case["BN"], MAX_BLOCKS=case["max_blocks"])
    return out


def run_mask(case: dict) -> torch.Tensor:
    """case: BM, BN, toks = [[BM tokens], ...], args = [[j, kb, w1, w2], ...]
    -> [cases, 3, BM, BN]."""
    n = len(case["args"])
    out = torch.full((n, 3, case["BM"], case["BN"]), -99, dtype=torch.int32)
    mask_probe[(n,)](i32(case["toks"]), i32(case["args"]), out, BLOCK_M=case["BM"],
                     BLOCK_N=case["BN"])
    return out


def main(cases_path: str, out_path: str) -> None:
    with open(cases_path) as f:
        cases = json.load(f)
    torch.save({"blocks": [run_blocks(c) for c in cases["blocks"]],
                "setup": [run_setup(c) for c in cases["setup"]],
                "mask": [run_mask(c) for c in cases["mask"]]}, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])

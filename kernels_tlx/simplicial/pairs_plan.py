"""The shape decisions of the `tlx_pairs` backward (kernels_tlx/simplicial/bwd_pairs.py, which
re-exports them): which shapes it takes (`supports`; `ordered_supports`, its ORDERED variant
`tlx_pairs_ordered`'s), its launch configuration (`config`), key blocks per j (`key_blocks`) and
how many j's last key blocks a remainder program packs (`remainder_pack`). Host code only."""
from __future__ import annotations

import triton

from altattn.simplicial.spec import ProblemSpec
from kernels_tlx.simplicial.pairs_parts import BLOCK_N
from kernels_triton.simplicial.det import det_of
from kernels_triton.simplicial.tiling import supports as tiling_supports


def supports(spec: ProblemSpec) -> str | None:
    why = tiling_supports(spec)
    if why is None and spec.G < 16:
        why = (f"G = Hq/Hk = {spec.G}: G >= 16 only (a tile is 64 heads of one token or all G "
               "heads of 64 / G tokens, a TMA box of >= 16 rows per token)")
    if why is None and spec.B * spec.N * spec.Hq >= 2 ** 31:
        why = (f"B*N*Hq = {spec.B * spec.N * spec.Hq} rows: its TMA boxes take int32 row "
               "coordinates (fewer than 2**31 rows)")
    return why


def config(spec: ProblemSpec) -> dict:
    """Q/dO ring slots: 2 at D = 128 (202 KB of shared memory), 4 at D = 64 (152 KB; +3.8% at
    S* with D 64 against 2, docs/perf-bwd-remainder.md); the producer's build in 8-row chunks,
    the consumers at 232 registers."""
    return dict(NUM_Q=4 if spec.D == 64 else 2, CH=8, CONSUMER_REGS=232, num_warps=4,
                num_stages=1)


def key_blocks(spec: ProblemSpec) -> int:
    """Key blocks per j: j's keys span w1 + w2 - 1 tokens."""
    return triton.cdiv(spec.w1 + spec.w2 - 1, BLOCK_N)


def remainder_pack(spec: ProblemSpec) -> int:
    """How many j's last key blocks a remainder program packs (kernels_tlx/simplicial/
    pairs_remainder.py): 4 when that block holds at most 32 keys (31 at S*), 2 at most 64, else 0:
    each key block its own program. Also 0 where its remainder kernel spills (sm_90a, fbtriton
    3.7.4: 16 bytes at G = 32; form det 4-40 bytes at G < 64 or D = 64, 24 at Hk > 1) and for
    w1 >= 2**15 - 4 (remainder_rows' packed token bounds)."""
    last = spec.w1 + spec.w2 - 1 - BLOCK_N * (key_blocks(spec) - 1)
    spills = spec.G == 32 or (det_of(spec) and (spec.G < 64 or spec.D == 64 or spec.Hk > 1))
    if spills or spec.w1 + 4 >= 2 ** 15:
        return 0
    return 4 if last <= 32 else 2 if last <= 64 else 0


def ordered_supports(spec: ProblemSpec) -> str | None:
    """`tlx_pairs_ordered`'s shapes: `supports`' with G >= 64 (one 64-row dQ box a tile, its
    counter), Hk = 1 (at Hk > 1 its kernel spills 16 bytes: sm_90a, fbtriton 3.7.4), the
    trilinear form (packed sequences: its Variant's `accepts`)."""
    why = supports(spec)
    if why is None and spec.G < 64:
        why = f"G = Hq/Hk = {spec.G}: G >= 64 only (one 64-row dQ box a tile, its counter)"
    if why is None and spec.Hk != 1:
        why = (f"Hk = {spec.Hk}: Hk = 1 only (at Hk > 1 its kernel spills 16 bytes of registers; "
               "deterministic=True takes `tlx_ws` there)")
    if why is None and det_of(spec):
        why = "form 'trilinear' only"
    return why

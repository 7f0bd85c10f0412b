"""`tlx_pairs`' program plan on the CPU: which shapes pack j's last key block into remainder
programs (`remainder_pack`), and that the plan covers each j's keys once, the last block within
a slot (the kernels' own coverage is checked on the GPU against the reference,
tests/simplicial/test_gpu_bwd.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from altattn.simplicial.spec import validate_shape

pytest.importorskip("triton")
bwd_pairs = pytest.importorskip("kernels_tlx.simplicial.bwd_pairs")
from kernels_tlx.simplicial.pairs_parts import BLOCK_N, slot_rows  # noqa: E402


@pytest.mark.parametrize("shape,pack", [
    ((4, 16384, 128, 1, 128, 32, 512), 4),   # S*: 543 keys a j, the last block 31
    ((1, 2000, 64, 1, 128, 32, 545), 2),     # 576: the last block 64
    ((1, 2000, 64, 1, 128, 32, 546), 0),     # 577: 65
    ((1, 300, 64, 1, 128, 32, 97), 0),       # 128: one full block
    ((1, 300, 16, 1, 64, 1, 2), 4),          # 2 keys: no full block, one slot
    ((1, 2000, 64, 2, 128, 32, 512), 0),     # G = 32 (its remainder kernel spills)
])
def test_remainder_pack(shape, pack):
    assert bwd_pairs.remainder_pack(validate_shape(*shape)) == pack


@pytest.mark.parametrize("Hq,D,pack", [(128, 128, 4), (64, 128, 4), (16, 128, 0), (128, 64, 0)])
def test_form_det_packs_at_d128_g64_and_up(Hq, D, pack):
    spec = validate_shape(4, 1024, Hq, 1, D, 32, 512)
    assert bwd_pairs.remainder_pack(replace(spec, form="det")) == pack
    assert bwd_pairs.remainder_pack(spec) == 4


def test_form_det_does_not_pack_at_hk_2():  # its remainder kernel spills there
    spec = validate_shape(1, 1024, 128, 2, 128, 32, 512)
    assert bwd_pairs.remainder_pack(replace(spec, form="det")) == 0
    assert bwd_pairs.remainder_pack(spec) == 4


@pytest.mark.parametrize("N,w1,w2", [(300, 32, 512), (700, 32, 256), (700, 32, 280), (257, 300, 5),
                                     (40, 1, 2), (1000, 7, 129)])
def test_plan_covers_each_key_once(N, w1, w2):
    """For every j (a dense sequence of N): the full blocks of 128 from j's first key, then the
    last block's keys, are j's keys once each, and the last block fits its slot."""
    spec = validate_shape(1, N, 16, 1, 64, w1, w2)
    pack = bwd_pairs.remainder_pack(spec)
    n_full = bwd_pairs.key_blocks(spec) - (pack > 0)
    for j in range(N):
        k_lo, k_hi = max(j - w2 + 1, 0), min(j + w1, N) - 1  # pair_program's
        keys = [k for m in range(n_full) for k in range(k_lo + m * BLOCK_N,
                                                          k_lo + (m + 1) * BLOCK_N) if k <= k_hi]
        if pack:  # remainder_keys: from k_lo + n_full * 128 to k_hi
            last = list(range(k_lo + n_full * BLOCK_N, k_hi + 1))
            assert len(last) <= slot_rows(pack), (j, len(last))
            keys += last
        assert keys == list(range(k_lo, k_hi + 1)), j

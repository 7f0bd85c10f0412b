"""flops() against counting the valid (i, j, k) triples one by one."""
from __future__ import annotations

import itertools

import pytest

from altattn.simplicial import flops


def count_triples(N: int, w1: int, w2: int) -> int:
    """Number of (i, j, k) with 0 <= j, k, j in (i - w1, i], k in (i - w2, i], by enumeration."""
    return sum(1 for i in range(N) for j in range(N) for k in range(N)
               if i - w1 < j <= i and i - w2 < k <= i)


def count_by_row(N: int, w1: int, w2: int) -> int:
    """The same count, one query row at a time (cheap enough for N in the thousands)."""
    return sum(len(range(max(0, i - w1 + 1), i + 1)) * len(range(max(0, i - w2 + 1), i + 1))
               for i in range(N))


def brute_flops(B, N, Hq, D, w1, w2, count=count_triples):
    # QK and PV: one multiply-add (2 FLOPs) per element of D, twice, per valid triple and head
    return 4 * B * Hq * D * count(N, w1, w2)


SMALL = sorted(set(itertools.product(range(0, 11), (1, 2, 3, 5, 8, 13), (1, 2, 4, 7, 12))))


@pytest.mark.parametrize("N,w1,w2", SMALL)
def test_flops_matches_enumeration(N, w1, w2):
    want = brute_flops(1, N, 1, 1, w1, w2)
    assert flops(1, N, 1, 1, w1, w2) == want, (N, w1, w2)


@pytest.mark.parametrize("N,w1,w2", [
    (100, 7, 30), (100, 30, 7), (257, 32, 512), (1000, 1, 1), (1000, 1, 1000),
    (1537, 32, 1024), (4096, 32, 512), (4096, 512, 32), (4096, 64, 64), (999, 998, 999),
    (2048, 4096, 8192), (3000, 100, 2999), (3000, 100, 3000), (3000, 100, 3001),
])
def test_flops_matches_row_count(N, w1, w2):
    assert flops(1, N, 1, 1, w1, w2) == brute_flops(1, N, 1, 1, w1, w2, count_by_row)


@pytest.mark.parametrize("B,N,Hq,D,w1,w2", [
    (2, 9, 3, 64, 4, 6), (3, 17, 128, 128, 16, 3), (1, 5, 1, 64, 9, 9)])
def test_flops_scales_with_B_Hq_D(B, N, Hq, D, w1, w2):
    assert flops(B, N, Hq, D, w1, w2) == brute_flops(B, N, Hq, D, w1, w2)


def test_flops_is_symmetric_in_windows():
    for N, a, b in [(50, 3, 20), (7, 2, 9), (300, 64, 128)]:
        assert flops(2, N, 4, 64, a, b) == flops(2, N, 4, 64, b, a)


@pytest.mark.parametrize("args", [(0, 100, 8, 64, 4, 8), (1, 0, 8, 64, 4, 8),
                                  (1, 100, 0, 64, 4, 8), (1, 100, 8, 0, 4, 8)])
def test_flops_zero_sizes(args):
    assert flops(*args) == 0


def test_flops_s_star_value():
    """The headline shape: B=4, N=16384, Hq=128, D=128, w1=32, w2=512."""
    assert flops(4, 16384, 128, 128, 32, 512) == 69269949775872
    assert flops(4, 16384, 128, 128, 512, 32) == 69269949775872


def test_flops_is_exact_int_for_huge_shapes():
    f = flops(1024, 10**6, 128, 128, 4096, 65536)
    assert isinstance(f, int)
    assert f == 4 * 1024 * 128 * 128 * count_closed(10**6, 4096, 65536)


def count_closed(N, a, b):
    """sum_i min(i+1, a) min(i+1, b) split at a and b by hand (a <= b <= N), as a second check."""
    ramp = sum(n * n for n in range(1, a + 1))
    mid = a * sum(range(a + 1, b + 1))
    flat = a * b * (N - b)
    return ramp + mid + flat


@pytest.mark.parametrize("args,frag", [
    ((-1, 10, 1, 64, 2, 2), "B"), ((1, -1, 1, 64, 2, 2), "N"), ((1, 10, -1, 64, 2, 2), "Hq"),
    ((1, 10, 1, -64, 2, 2), "D"), ((1, 10, 1, 64, 0, 2), "w1"), ((1, 10, 1, 64, 2, 0), "w2"),
    ((1, 10, 1, 64, -3, 2), "w1"),
])
def test_flops_rejects_bad_sizes(args, frag):
    with pytest.raises(ValueError, match=frag):
        flops(*args)

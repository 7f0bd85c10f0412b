"""The FLOP model: useful tensor-core work of the forward pass, counted exactly."""
from __future__ import annotations


def _sum_min_products(N: int, a: int, b: int) -> int:
    """sum_{n=1..N} min(n, a) * min(n, b), exact, for a <= b."""
    def sq(n):  # sum_{m=1..n} m^2
        return n * (n + 1) * (2 * n + 1) // 6

    def lin(n):  # sum_{m=1..n} m
        return n * (n + 1) // 2

    total = sq(min(N, a))                       # n <= a: n * n
    if N > a:
        total += a * (lin(min(N, b)) - lin(a))  # a < n <= b: a * n
    if N > b:
        total += a * b * (N - b)                # n > b: a * b
    return total


def flops(B: int, N: int, Hq: int, D: int, w1: int, w2: int) -> int:
    """4 * B * Hq * D * sum_i min(i+1, w1) * min(i+1, w2): two GEMMs (QK and PV) of 2*D FLOPs per
    valid (i, j, k) triple and head. Elementwise work (Q*K1, *V1, softmax) is not counted."""
    for name, v in (("B", B), ("N", N), ("Hq", Hq), ("D", D)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if w1 < 1 or w2 < 1:
        raise ValueError(f"windows must be >= 1, got w1={w1} w2={w2}")
    a, b = sorted((w1, w2))
    return 4 * B * Hq * D * _sum_min_products(N, a, b)

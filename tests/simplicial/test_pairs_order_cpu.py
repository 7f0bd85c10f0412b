"""`tlx_pairs_ordered`'s host side on the CPU (kernels_tlx/simplicial/pairs_order.py): the rank
tables against the programs enumerated in launch order, the end's fixed-point scale (a power of
two within the bounds, NaN for a batch element with a non-finite input only), and the variant's
refusals."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from altattn import registry
from altattn.simplicial.spec import ProblemSpec
from kernels_tlx.simplicial.pairs_order import SCALE_BITS, _tables, end_scale, from_fixed


def launch_order_ranks(N, w1, w2, n_kb, pack):
    """{(launch, program, token): programs before it at that token} from the launches'
    programs in launch order: the programs of one j (key block m, then j; live where block m
    holds one of j's keys, tokens j .. min(j + w1, N) - 1), then the remainder groups of `pack`
    j (tokens from the group's first j to its last j's w1 - 1 after, below N)."""
    seen, ranks = np.zeros(N, int), {}
    for m in range(n_kb):
        for j in range(N):
            if max(j + 1, w2) - w2 + 128 * m > min(j + w1, N) - 1:
                continue
            for i in range(j, min(j + w1, N)):
                ranks["full", (m, j), i] = seen[i]
                seen[i] += 1
    for q in range(-(-N // pack) if pack else 0):
        for i in range(q * pack, min(min(q * pack + pack - 1, N - 1) + w1, N)):
            ranks["rem", q, i] = seen[i]
            seen[i] += 1
    return ranks


@pytest.mark.parametrize("N,w1,w2,n_kb,pack", [(333, 32, 128, 1, 4), (700, 32, 512, 4, 4),
                                               (50, 8, 100, 1, 2), (1, 32, 512, 4, 4),
                                               (200, 16, 64, 0, 4), (400, 64, 64, 1, 0)])
def test_rank_tables_follow_launch_order(N, w1, w2, n_kb, pack):
    base, off = (t.numpy() for t in _tables(N, w1, w2, n_kb, pack, "cpu"))
    for (launch, who, i), rank in launch_order_ranks(N, w1, w2, n_kb, pack).items():
        if launch == "full":
            m, j = who
            got = base[m, i] + off[m, j]
        else:
            got = base[n_kb, i] + who
        assert got == rank, (launch, who, i)


SPEC = ProblemSpec(B=3, N=40, Hq=64, Hk=1, D=32, w1=8, w2=16, sm_scale=32 ** -0.5)


def inputs(gen, spec=SPEC):
    q = torch.randn(spec.B, spec.N, spec.Hq, spec.D, generator=gen)
    kv = [torch.randn(spec.B, spec.N, spec.Hk, spec.D, generator=gen) for _ in range(4)]
    dout = torch.randn(q.shape, generator=gen)
    lse = torch.randn(spec.B, spec.Hq, spec.N, generator=gen)
    return [q, *kv, dout, lse, None]


def test_end_scale_is_a_power_of_two_within_the_bound(gen):
    spec = replace(SPEC, B=1)  # (the bound is taken per batch element, then the largest)
    x = inputs(gen, spec)
    scale = end_scale(spec, *x)
    s = scale[0].item()
    assert s == 2.0 ** round(np.log2(s))
    assert torch.equal(scale[1:], torch.full((1,), 1 / s))
    # the bound (end_scale's docstring) at most 2**SCALE_BITS once scaled, and not 4 times below
    amax = lambda t: t.abs().max().item()  # noqa: E731
    q, k1, k2, v1, v2, dout = x[:6]
    dp = spec.D * amax(dout) * 2 * amax(v1) * amax(v2)
    rows = spec.G * max(spec.w1, spec.w2)
    bound = 2 * max(rows * max(amax(k1), amax(k2)) * amax(q) * 2 * dp,
                    rows * max(amax(v1), amax(v2)) * amax(dout))  # (dLSE None here)
    assert 2.0 ** (SCALE_BITS - 1) < bound * s <= 2.0 ** SCALE_BITS
    acc = torch.tensor([[1234.5678, -5.0]], dtype=torch.float64)
    assert torch.equal(from_fixed((acc * s).round().long(), scale)[0],
                       (acc[0] * s).round().mul(1 / s).float())


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("poisoned", range(7))
def test_a_non_finite_input_makes_only_its_batch_element_nan(gen, value, poisoned):
    x = inputs(gen)
    finite = end_scale(replace(SPEC, B=2), *(t[[0, 2]] if t is not None else None for t in x))
    x[poisoned] = x[poisoned].clone()
    x[poisoned][1] = value
    scale = end_scale(SPEC, *x)
    assert torch.isnan(scale[2]) and not torch.isnan(scale[[0, 1, 3]]).any()
    assert scale[0] == finite[0]  # from the finite elements' bounds only
    acc = torch.ones(SPEC.B, 4, dtype=torch.int64)
    out = from_fixed(acc, scale)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()


def test_variant_refusals():
    star = registry.get_family("simplicial").presets["star"].spec()
    v = registry.get("tlx_pairs_ordered", "bwd", "simplicial")
    supports = v.load().supports
    assert supports(star) is None
    assert "G >= 64" in supports(replace(star, Hq=32))
    assert "Hk = 1" in supports(replace(star, Hq=256, Hk=2))
    assert "trilinear" in supports(replace(star, form="det"))
    assert v.deterministic and v.cannot_take(replace(star, varlen=True)) is not None


def test_end_scale_bounds_dlse_and_the_rows(gen):
    """dS = P (dP - Delta) with Delta = rowsum(dO * O) - dLSE: a dLSE alone (dO = 0) still
    bounds the dK sums; with every gradient zero, s stays where s * K1 is finite in fp32."""
    spec = replace(SPEC, B=1)
    x = inputs(gen, spec)
    x[5] = torch.zeros_like(x[5])  # dO = 0
    x[7] = torch.full_like(x[6], 1e3)  # dLSE
    s = end_scale(spec, *x)[0].item()
    amax = lambda t: t.abs().max().item()  # noqa: E731
    rows = spec.G * max(spec.w1, spec.w2)
    assert rows * max(amax(x[1]), amax(x[2])) * amax(x[0]) * 1e3 * s <= 2.0 ** SCALE_BITS
    x[7] = None
    s = end_scale(spec, *x)[0].item()  # no gradient at all
    assert max(amax(t) for t in x[1:5]) * s < 2.0 ** 126

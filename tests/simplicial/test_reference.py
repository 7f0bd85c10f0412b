"""The fp64 reference against the brute-force N x N x N form, and its chunking (CPU only)."""
from __future__ import annotations

import importlib
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from altattn import simplicial as simplicial_attn
from altattn.simplicial.reference import brute_force, reference
from altattn.simplicial.spec import FORMS

# `import altattn.simplicial.reference as m` would give the function: the package re-exports
# `reference` under the submodule's name, so take the module itself from the import system.
ref_mod = importlib.import_module("altattn.simplicial.reference")

TOL = 1e-12  # both are fp64 computations of the same sums; they differ only in summation order


def assert_same(got, want, what):
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert err <= TOL, f"{what}: max abs error {err:.3e} > {TOL:.0e}"


# (B, N, Hq, Hk, D, w1, w2, sm_scale): every window regime on tiny shapes
TINY = {
    "N<w1": (1, 5, 2, 1, 64, 8, 16, None),
    "N<w1=w2": (1, 6, 2, 1, 64, 9, 9, None),
    "w1<=N<w2": (2, 9, 2, 1, 64, 4, 16, None),
    "N=w1<w2": (1, 4, 2, 1, 64, 4, 7, None),
    "N>=w2": (1, 12, 2, 1, 64, 3, 5, None),
    "N=w2": (1, 5, 2, 1, 64, 2, 5, None),
    "w1==w2": (1, 10, 2, 2, 64, 4, 4, None),
    "w1>w2": (1, 11, 2, 1, 64, 7, 3, None),
    "w1>w2>=N": (1, 3, 2, 1, 64, 7, 5, None),
    "w1=w2=1": (1, 6, 2, 1, 64, 1, 1, None),
    "w1=1": (1, 7, 2, 1, 64, 1, 4, None),
    "w2=1": (2, 7, 2, 1, 64, 4, 1, None),
    "N=1": (1, 1, 2, 1, 64, 3, 5, None),
    "Hq4_Hk2": (1, 8, 4, 2, 64, 3, 6, None),
    "Hq6_Hk3": (2, 7, 6, 3, 64, 5, 2, None),
    "Hq4_Hk4": (1, 6, 4, 4, 64, 2, 3, None),
    "D128": (1, 6, 2, 1, 128, 2, 4, None),
    "scale0.37": (1, 8, 2, 1, 64, 3, 4, 0.37),
    "scale2": (1, 8, 4, 2, 64, 5, 3, 2.0),
    "scale_int": (1, 5, 2, 1, 64, 2, 2, 1),
    # D mod 3 = 0 and D < 3 (form "det": whole chunks only, no chunk); the `any_head_dim` fixture
    "D6": (2, 7, 2, 1, 6, 3, 5, None),
    "D9_Hq4_Hk2_w1>w2": (1, 9, 4, 2, 9, 5, 2, None),
    "D8_w1>w2": (1, 8, 2, 1, 8, 6, 3, None),
    "D2": (1, 6, 2, 1, 2, 3, 4, None),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", TINY.values(), ids=TINY.keys())
def test_reference_matches_brute_force(shape, form, rand, any_head_dim):
    """brute_force never exchanges the pairs: w1 > w2 also checks the reference's exchange."""
    B, N, Hq, Hk, D, w1, w2, scale = shape
    x = rand(B, N, Hq, Hk, D)
    out, lse = reference(*x, w1, w2, sm_scale=scale, form=form)
    bout, blse = brute_force(*x, w1, w2, sm_scale=scale, form=form)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert_same(out, bout, "out")
    assert_same(lse, blse, "lse")


def one_row(x, w1, w2, b, i, h, sm_scale=None):
    """(out [D], lse) of query i, head h, batch b, straight from the definition (fp64)."""
    q, k1, k2, v1, v2 = (t.double() for t in x)
    D, Hq, Hk = q.shape[3], q.shape[2], k1.shape[2]
    g = h // (Hq // Hk)
    scale = 1 / math.sqrt(D) if sm_scale is None else sm_scale
    js = torch.arange(max(0, i - w1 + 1), i + 1)
    ks = torch.arange(max(0, i - w2 + 1), i + 1)
    s = scale * (q[b, i, h] * k1[b, js, g]) @ k2[b, ks, g].T  # s[j, k]
    lse = torch.logsumexp(s.flatten(), 0)
    p = torch.exp(s - lse)
    out = torch.einsum("jk,jd,kd->d", p, v1[b, js, g], v2[b, ks, g])
    return out, lse


def test_reference_matches_definition_rowwise(rand):
    B, N, Hq, Hk, D, w1, w2 = 2, 40, 6, 3, 64, 5, 17
    x = rand(B, N, Hq, Hk, D)
    out, lse = reference(*x, w1, w2)
    for b, i, h in [(0, 0, 0), (1, 3, 5), (0, 4, 2), (1, 16, 1), (0, 17, 4), (1, 39, 3)]:
        o, l = one_row(x, w1, w2, b, i, h)
        assert_same(out[b, i, h], o, f"out[{b},{i},{h}]")
        assert_same(lse[b, h, i], l, f"lse[{b},{h},{i}]")


def test_reference_lse_is_natural_log_and_one_pair_rows(rand):
    """w1 = w2 = 1: each query sees the single pair (i, i): out = v1 * v2, lse = that score."""
    B, N, Hq, Hk, D = 1, 5, 2, 1, 64
    q, k1, k2, v1, v2 = x = rand(B, N, Hq, Hk, D)
    out, lse = reference(*x, 1, 1)
    want = (v1.double() * v2.double()).expand(B, N, Hq, D)
    assert_same(out, want, "out")
    s = (q.double() * k1.double() * k2.double()).sum(-1) / math.sqrt(D)  # [B, N, Hq]
    assert_same(lse, s.transpose(1, 2), "lse")


@pytest.mark.parametrize("form", FORMS)
def test_reference_chunk_boundaries(form, rand, monkeypatch):
    """Budgets from 1 element to the default: chunks of one query, ragged splits (last chunk
    shorter) and a single chunk all give the brute-force result, and the chunks tile [0, N)."""
    B, N, Hq, Hk, D, w1, w2 = 1, 23, 4, 2, 64, 3, 6
    x = rand(B, N, Hq, Hk, D)
    bf = brute_force(*x, w1, w2, form=form)
    real = ref_mod._window
    spans = []

    def spy(t, i0, i1, w):
        spans.append((i0, i1))
        return real(t, i0, i1, w)

    monkeypatch.setattr(ref_mod, "_window", spy)
    layouts = set()
    for budget in [2 ** e for e in range(0, 26)]:
        monkeypatch.setattr(ref_mod, "_CHUNK_ELEMENTS", budget)
        spans.clear()
        out, lse = reference(*x, w1, w2, form=form)
        chunks = sorted(set(spans))
        assert chunks[0][0] == 0 and chunks[-1][1] == N, (budget, chunks)
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])), (budget, chunks)
        layouts.add(tuple(i1 - i0 for i0, i1 in chunks))
        assert_same(out, bf[0], f"out, budget {budget}, chunks {chunks}")
        assert_same(lse, bf[1], f"lse, budget {budget}, chunks {chunks}")
    assert (1,) * N in layouts and (N,) in layouts, layouts
    assert any(1 < len(c) < N and c[-1] < c[0] for c in layouts), f"no ragged split in {layouts}"


def test_reference_fp32_close_to_fp64(rand):
    x = rand(1, 30, 4, 2, 64)
    o64, l64 = reference(*x, 8, 13)
    o32, l32 = reference(*x, 8, 13, dtype=torch.float32)
    assert o32.dtype == torch.float32 and l32.dtype == torch.float32
    assert (o32.double() - o64).abs().max() < 1e-5
    assert (l32.double() - l64).abs().max() < 1e-5


@pytest.mark.parametrize("B,N", [(0, 5), (2, 0), (0, 0)])
def test_reference_empty(B, N, rand):
    x = rand(B, N, 4, 2, 64)
    out, lse = reference(*x, 3, 5)
    assert out.shape == (B, N, 4, 64) and out.dtype == torch.float64
    assert lse.shape == (B, 4, N) and lse.dtype == torch.float64


def test_reference_large_cpu_fp32(rand):
    """The S-sized window at N = 4096 fits and runs on a CPU in fp32; spot rows vs the definition."""
    B, N, Hq, Hk, D, w1, w2 = 1, 4096, 2, 1, 64, 32, 512
    x = rand(B, N, Hq, Hk, D)
    out, lse = reference(*x, w1, w2, dtype=torch.float32)
    assert out.shape == (B, N, Hq, D) and lse.shape == (B, Hq, N)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for i, h in [(0, 0), (31, 1), (32, 0), (511, 1), (512, 0), (2047, 1), (4095, 0)]:
        o, l = one_row(x, w1, w2, 0, i, h)
        assert (out[0, i, h].double() - o).abs().max() < 1e-5, f"row {i} head {h}"
        assert abs(lse[0, h, i].item() - l.item()) < 1e-4, f"row {i} head {h}"


def test_reference_large_cpu_fp32_peak_memory():
    """The same call in a fresh process: its peak resident memory stays well under the 24 GiB
    machine (measured ~1.5 GiB including torch itself)."""
    code = textwrap.dedent("""
        import resource, torch
        from altattn import simplicial as simplicial_attn
        g = torch.Generator().manual_seed(1)
        mk = lambda h: torch.randn(1, 4096, h, 64, generator=g).bfloat16()
        x = (mk(2), mk(1), mk(1), mk(1), mk(1))
        out, lse = simplicial_attn.reference(*x, 32, 512, dtype=torch.float32)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
    """)
    from conftest import ROOT
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    peak_gib = int(p.stdout.split()[-1]) / 2**20
    assert peak_gib < 4.0, f"reference peak RSS {peak_gib:.2f} GiB"


@pytest.mark.parametrize("B,N,Hq,Hk,D,w1,w2", [(1, 64, 1, 1, 128, 1, 32),
                                                (1, 50, 2, 2, 128, 1, 16),
                                                (2, 40, 8, 1, 64, 4, 8)])
def test_reference_chunk_bounds_all_gathered_windows(B, N, Hq, Hk, D, w1, w2, rand, monkeypatch):
    """Every window tensor the reference gathers for a chunk stays within a small multiple of
    _CHUNK_ELEMENTS, also for w1 = 1 with D = 128 (the gathered K2/V2 windows and the einsum
    intermediates then outgrow the score tensor by D / w1). Shrunk to a toy budget: cheap."""
    budget = 4096
    monkeypatch.setattr(ref_mod, "_CHUNK_ELEMENTS", budget)
    sizes = []
    real = ref_mod._window

    def spy(x, i0, i1, w):
        xw, valid = real(x, i0, i1, w)
        sizes.append(xw.numel())
        return xw, valid

    monkeypatch.setattr(ref_mod, "_window", spy)
    x = rand(B, N, Hq, Hk, D)
    out, lse = reference(*x, w1, w2)
    assert max(sizes) <= 4 * budget, f"gathered {max(sizes)} elements for a {budget} budget"
    bf = brute_force(*x, w1, w2)
    assert_same(out, bf[0], "out")
    assert_same(lse, bf[1], "lse")


def test_reference_symmetric_in_pairs(rand):
    """Exchanging (k1, v1, w1) with (k2, v2, w2) leaves the function unchanged."""
    q, k1, k2, v1, v2 = rand(1, 13, 2, 1, 64)
    a = reference(q, k1, k2, v1, v2, 3, 8)
    b = reference(q, k2, k1, v2, v1, 8, 3)
    assert_same(a[0], b[0], "out")
    assert_same(a[1], b[1], "lse")


def test_public_reference_is_module_reference():
    assert simplicial_attn.reference is reference

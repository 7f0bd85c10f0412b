"""Spherical attention on the CPU: the fp64 reference against a loop over the math, its closed-form
backward against autograd, the op (gradcheck, opcheck, torch.compile), the layer, the FLOP model,
and bad input refused naming the argument. Fresh random inputs per test (the `gen` fixture)."""
from __future__ import annotations

import math

import pytest
import torch

import altattn
from altattn.spherical import reference, reference_backward
from altattn.spherical.shapes import PRESETS, Shape, pass_flops, visible_pairs

F64 = torch.float64


def _x(gen, B, N, Nk, Hq, Hk, D, dtype=F64):
    q = torch.randn(B, N, Hq, D, generator=gen, dtype=dtype)
    k, v = (torch.randn(B, Nk, Hk, D, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v


def loop_reference(q, k, v, causal, c, eps, lens):
    """The math one (b, h, y) at a time."""
    B, N, Hq, D = q.shape
    Nk, G = k.shape[1], Hq // k.shape[2]
    out, r = torch.zeros_like(q), torch.zeros(B, Hq, N, dtype=q.dtype)
    for b in range(B):
        lq = N if lens is None else min(lens[b], N)
        lk = Nk if lens is None else min(lens[b], Nk)
        for h in range(Hq):
            for y in range(lq):
                xs = range(min(lk, y + 1) if causal else lk)
                s = torch.stack([c * q[b, y, h] @ k[b, x, h // G] for x in xs]) if xs else None
                if s is None:
                    continue
                r[b, h, y] = s.norm()
                out[b, y, h] = sum(si * v[b, x, h // G] for si, x in zip(s, xs)) / (s.norm() + eps)
    return out, r


CASES = [  # (B, N, Nk, Hq, Hk, D, causal, lens)
    (2, 5, 5, 4, 2, 8, False, None),
    (2, 6, 6, 2, 1, 4, True, None),
    (3, 5, 5, 2, 2, 4, True, [5, 2, 0]),
    (2, 4, 7, 3, 1, 4, False, [9, 3]),   # Nk != N; a length past both is clamped
]


@pytest.mark.parametrize("case", CASES)
def test_reference_is_the_math(case, gen):
    B, N, Nk, Hq, Hk, D, causal, lens = case
    q, k, v = _x(gen, B, N, Nk, Hq, Hk, D)
    seqlens = None if lens is None else torch.tensor(lens, dtype=torch.int32)
    out, r = reference(q, k, v, causal, 0.7, 1e-3, seqlens)
    want_out, want_r = loop_reference(q, k, v, causal, 0.7, 1e-3, lens)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r, want_r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_dr", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_closed_form_backward_is_autograd(case, with_dr, gen):
    """FAMILIES.md's ds = a dP + (dr - delta a) s / r, for eps > 0, against autograd."""
    B, N, Nk, Hq, Hk, D, causal, lens = case
    x = [t.requires_grad_() for t in _x(gen, B, N, Nk, Hq, Hk, D)]
    seqlens = None if lens is None else torch.tensor(lens, dtype=torch.int32)
    out, r = reference(*x, causal, None, 0.05, seqlens)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dr = torch.randn(r.shape, generator=gen, dtype=F64) * (r > 0) if with_dr else None
    loss = (out * dout).sum() + (0 if dr is None else (r * dr).sum())
    want = torch.autograd.grad(loss, x)
    got = reference_backward(*(t.detach() for t in x), dout, dr, causal, None, 0.05, seqlens)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"d{name}")


def test_a_row_of_zero_scores_gives_zero_and_finite_gradients(gen):
    q, k, v = _x(gen, 1, 3, 3, 1, 1, 4)
    q[0, 1] = 0  # row 1 sees only zero scores: r = 0
    out, r = reference(q, k, v)
    assert r[0, 0, 1] == 0 and not out[0, 1].any()
    grads = reference_backward(q, k, v, torch.ones_like(out), torch.ones_like(r))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.slow
def test_the_op_gradchecks_and_opchecks(gen):
    q, k, v = (t.requires_grad_() for t in _x(gen, 2, 3, 3, 2, 1, 64))
    seqlens = torch.tensor([3, 2], dtype=torch.int32)
    assert torch.autograd.gradcheck(
        lambda *x: altattn.spherical_attention(*x, causal=True, seqlens=seqlens), (q, k, v))
    args = (q.detach(), k.detach(), v.detach(), True, 0.125, 1e-6, seqlens, "auto", "auto", False)
    torch.library.opcheck(torch.ops.altattn.spherical_fwd.default, args)
    out, r = reference(*args[:3], True, 0.125, 1e-6, seqlens)
    bwd_args = (torch.randn_like(out), torch.randn_like(r), *args[:3], out, r, True, 0.125, 1e-6,
                seqlens, "auto", False)
    torch.library.opcheck(torch.ops.altattn.spherical_bwd.default, bwd_args)


@pytest.mark.slow
def test_the_layer_compiles_fullgraph_and_matches_eager(gen):
    torch.manual_seed(0)
    layer = altattn.SphericalAttention(64, 4, 2, 64, causal=True).double()
    x = torch.randn(2, 9, 64, generator=gen, dtype=F64)
    seqlens = torch.tensor([9, 4], dtype=torch.int32)
    mult = torch.rand(2, 9, generator=gen, dtype=F64)
    want = layer(x, seqlens, mult)
    got = torch.compile(layer, fullgraph=True)(x, seqlens, mult)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert torch.isfinite(layer.k.weight.grad).all()


def test_multiplicity_scales_the_keys(gen):
    layer = altattn.SphericalAttention(64, 2, 1, 64).double()
    x = torch.randn(1, 5, 64, generator=gen, dtype=F64)
    ones = layer(x, multiplicity=torch.ones(1, 5, dtype=F64))
    torch.testing.assert_close(ones, layer(x))
    twice = torch.ones(1, 5, dtype=F64)
    twice[0, 2] = 2.0
    assert not torch.allclose(layer(x, multiplicity=twice), ones)


BAD = [  # (kwargs, error type, words the message must hold)
    (dict(q=None), TypeError, "q must be a torch.Tensor"),
    (dict(k=torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)), ValueError, "v must have k's shape"),
    (dict(q=torch.zeros(1, 4, 3, 64, dtype=torch.bfloat16)), ValueError, "multiple of Hk"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(causal=True, k=torch.zeros(1, 5, 2, 64, dtype=torch.bfloat16),
          v=torch.zeros(1, 5, 2, 64, dtype=torch.bfloat16)), ValueError, "causal=True needs"),
    (dict(eps=-1.0), ValueError, "eps must be"),
    (dict(sm_scale=0.0), ValueError, "sm_scale"),
    (dict(seqlens=[4]), TypeError, "seqlens must be a torch.Tensor"),
    (dict(seqlens=torch.tensor([4.0])), TypeError, "seqlens must be a 1-D int32"),
    (dict(seqlens=torch.tensor([4, 4], dtype=torch.int32)), ValueError, "seqlens must have B = 1"),
    (dict(variant="nope"), ValueError, "unknown variant 'nope'"),
    (dict(q=torch.zeros(1, 4, 2, 96, dtype=torch.bfloat16),
          k=torch.zeros(1, 4, 2, 96, dtype=torch.bfloat16),
          v=torch.zeros(1, 4, 2, 96, dtype=torch.bfloat16)), ValueError, "head dim D=96"),
]


@pytest.mark.parametrize("kwargs, kind, words", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_refused_naming_the_argument(kwargs, kind, words):
    args = dict(q=torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16),
                k=torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16),
                v=torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16))
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(kind, match=words.replace("(", r"\(").replace("[", r"\[")):
        altattn.spherical_attention(q, k, v, **args)


def test_the_backward_names_its_own_inputs_for_a_tensor_elsewhere():
    """An `out` on another device than q, k, v: the error names spherical attention's inputs."""
    from altattn.spherical import backward
    x = [torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16) for _ in range(3)]
    out = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16, device="meta")
    r = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match=r"out is on meta but q, k, v are on cpu"):
        backward(torch.zeros_like(x[0]), None, *x, out, r)


def test_flops_count_visible_pairs_on_real_tokens():
    s = PRESETS["p1"]
    assert pass_flops(s) == 4 * 4 * 128 * 16384 * 16384 * 128
    assert pass_flops(s, "bwd") == 2.5 * pass_flops(s)
    causal = Shape(1, 4, 1, 1, 64, causal=True)
    assert visible_pairs(causal) == 1 + 2 + 3 + 4
    padded = Shape(4, 1000, 1, 1, 64, pad=0.25)
    assert padded.lengths() == [1000, 833, 667, 500]
    assert math.isclose(sum(padded.lengths()) / 4000, 0.75, abs_tol=1e-3)
    assert visible_pairs(padded) == sum(n * n for n in padded.lengths())


def test_the_family_is_registered():
    assert altattn.families()["spherical"] == "spherical attention"
    assert set(altattn.variants("spherical", "fwd")) >= {"triton", "tlx_ws"}

"""Spherical attention's kernels against the fp64 reference, every registered variant, on the GPU.

Each check draws fresh inputs, prefills the outputs with NaN, and bounds the kernel's relative
Frobenius error two ways (TOLERANCES in altattn/spherical/family.py, named once): at most the
issue's absolute bound (out and gradients 1e-2, r 1e-3; the emulation's where its own error
passes it, `check`), and at most `vs_emulation` times the error of a bf16 emulation of the same
computation (bf16 inputs, fp32 products, P and dS rounded to bf16 before their GEMMs, bf16
outputs) plus a floor. Odd shapes always: ragged N, N = 1, Nk != N,
GQA, D = 64, causal, seqlens (0, 1, ragged, the full length), finite garbage in the padding.
"""
from __future__ import annotations

import pytest
import torch

from altattn import launcher, registry
from altattn.spherical import passes, reference, reference_backward
from altattn.spherical.family import TOLERANCES
from altattn.spherical.reference import scores

pytestmark = pytest.mark.gpu

FWD = [pytest.param(v.name, id=v.name) for v in registry.all_variants("fwd", "spherical")]
BWD = [pytest.param(v.name, id=v.name) for v in registry.all_variants("bwd", "spherical")]
FLOOR = 1e-4  # relative errors below this pass whatever the emulation's (both are rounding noise)

# (B, N, Nk, Hq, Hk, D, causal, seqlens)
SHAPES = [
    (2, 333, 333, 8, 2, 128, False, None),
    (2, 333, 333, 8, 2, 64, True, None),
    (2, 333, 333, 4, 4, 128, True, [333, 100]),
    (3, 257, 257, 2, 1, 128, False, [0, 1, 200]),
    (1, 1, 1, 2, 2, 128, False, None),
    (2, 200, 333, 4, 1, 64, False, None),
    (1, 1024, 1024, 4, 4, 128, True, None),
]
IDS = [f"B{s[0]}-N{s[1]}-Nk{s[2]}-H{s[3]}x{s[4]}-D{s[5]}{'-causal' if s[6] else ''}"
       f"{'-seqlens' if s[7] else ''}" for s in SHAPES]


def _inputs(shape, gen):
    B, N, Nk, Hq, Hk, D, causal, lens = shape

    def randn(*s):
        return torch.randn(*s, generator=gen).to("cuda", torch.bfloat16)

    q, k, v = randn(B, N, Hq, D), randn(B, Nk, Hk, D), randn(B, Nk, Hk, D)
    seqlens = None if lens is None else torch.tensor(lens, dtype=torch.int32, device="cuda")
    if seqlens is not None:  # finite garbage in the padding: it must change nothing
        for b, n in enumerate(lens):
            q[b, n:] = 1e3
            k[b, n:] = -1e3
            v[b, n:] = 1e3
    return q, k, v, causal, seqlens


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _bf16(t):
    return t.bfloat16().double()


def emulate_fwd(q, k, v, causal, seqlens, c, eps):
    """The kernels' computation with their roundings: P = bf16(t) (t = q.k in fp32), r and the
    division in fp32, out rounded to bf16."""
    G = q.shape[2] // k.shape[2]
    s, _, mask = scores(q, k, causal, 1.0, seqlens, torch.float32)
    r = c * s.square().sum(-1).sqrt()
    o = torch.einsum("bhnm,bmhd->bnhd", _bf16(s), v.double().repeat_interleave(G, 2))
    return (o * c / (r.double() + eps).transpose(1, 2)[..., None]).bfloat16(), r


def check(name, got, ref, emu, bound):
    """At most `bound`, and at most vs_emulation x the bf16 emulation's error (+ FLOOR). Where
    the emulation's own error passes `bound` (an input whose rounding no kernel can beat: row 0
    of a causal sequence has one key, out = sign(s) v, and its dq, dk are eps/|s| times terms
    that cancel), the emulation's bound is the one that holds."""
    err, emu_err = rel(got, ref), rel(emu, ref)
    assert not got.isnan().any(), f"{name}: NaN left (an element not written)"
    if emu_err > bound:
        bound = TOLERANCES["vs_emulation"] * emu_err + FLOOR
    assert err <= bound, f"{name}: rel. error {err:.3g} > bound {bound}"
    assert err <= TOLERANCES["vs_emulation"] * emu_err + FLOOR, (
        f"{name}: rel. error {err:.3g} > {TOLERANCES['vs_emulation']} x the bf16 emulation's "
        f"{emu_err:.3g} (+{FLOOR})")


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("variant", FWD)
def test_forward_matches_fp64(variant, shape, gen):
    q, k, v, causal, seqlens = _inputs(shape, gen)
    c, eps = q.shape[-1] ** -0.5, 1e-6
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    r = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda")
    passes.forward(q, k, v, causal=causal, seqlens=seqlens, variant=variant, out=out, r=r)
    ref_out, ref_r = reference(q, k, v, causal, None, eps, seqlens)
    emu_out, emu_r = emulate_fwd(q, k, v, causal, seqlens, c, eps)
    check("out", out, ref_out, emu_out, TOLERANCES["out_rel"])
    check("r", r, ref_r, emu_r, TOLERANCES["r_rel"])
    if seqlens is not None:  # padded rows: exactly zero
        for b, n in enumerate(seqlens.tolist()):
            assert not out[b, n:].any() and not r[b, :, n:].any(), f"padding of sequence {b}"


def emulate_bwd(q, k, v, out, r, dout, dr, causal, seqlens, c, eps):
    """The backward with the kernels' roundings: per-row A, Bt in fp32 from the bf16 out; P and
    dS rounded to bf16 before their GEMMs; gradients rounded to bf16."""
    G = q.shape[2] // k.shape[2]
    t, _, mask = scores(q, k, causal, 1.0, seqlens, torch.float64)
    a = 1.0 / (r.double() + eps)
    delta = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    g = -delta * a + (0 if dr is None else dr.double())
    A = (c * a)[..., None]
    Bt = torch.where(r > 0, c * c * g / r.double().clamp_min(1e-30), 0.0)[..., None]
    kx, vx = (x.double().repeat_interleave(G, 2) for x in (k, v))
    dp = torch.einsum("bnhd,bmhd->bhnm", dout.double(), vx)
    p = _bf16(A * t).masked_fill(~mask, 0)
    ds = _bf16(A * dp + Bt * t).masked_fill(~mask, 0)
    B, Nk, Hk, D = k.shape
    dq = torch.einsum("bhnm,bmhd->bnhd", ds, kx)
    dk = torch.einsum("bhnm,bnhd->bmhd", ds, q.double()).view(B, Nk, Hk, G, D).sum(3)
    dv = torch.einsum("bhnm,bnhd->bmhd", p, dout.double()).view(B, Nk, Hk, G, D).sum(3)
    return tuple(x.bfloat16() for x in (dq, dk, dv))


@pytest.mark.parametrize("with_dr", [False, True], ids=["no-dr", "dr"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("variant", BWD)
def test_backward_matches_fp64(variant, shape, with_dr, gen):
    q, k, v, causal, seqlens = _inputs(shape, gen)
    c, eps = q.shape[-1] ** -0.5, 1e-6
    out, r = passes.forward(q, k, v, causal=causal, seqlens=seqlens)
    dout = torch.randn(out.shape, generator=gen).to("cuda", torch.bfloat16)
    dr = torch.randn(r.shape, generator=gen).cuda() if with_dr else None
    grads = [torch.full(t.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
             for t in (q, k, v)]
    launcher.run("spherical", "bwd", dout, dr, q, k, v, out, r, causal, None, eps, seqlens,
                 variant=variant, outputs=dict(zip(passes.Backward.outputs, grads)))
    refs = reference_backward(q, k, v, dout, dr, causal, None, eps, seqlens)
    emus = emulate_bwd(q, k, v, out, r, dout, dr, causal, seqlens, c, eps)
    for name, g, ref, emu in zip(("dq", "dk", "dv"), grads, refs, emus):
        if ref.norm() == 0:  # e.g. no real rows
            assert not g.any(), f"{name} should be zero"
        elif q.shape[1] == 1 and name != "dv":
            # one key per row: out = sign(s) v up to eps, so dq and dk are ~eps/|s| times the
            # terms of ds that cancel; their relative error measures rounding of out, not the
            # kernel. Finite and written is what can be asked.
            assert torch.isfinite(g).all(), f"{name}: not finite"
        else:
            check(name, g, ref, emu, TOLERANCES["grad_rel"])


@pytest.mark.parametrize("variant", [v.name for v in registry.all_variants("bwd", "spherical")
                                     if v.deterministic])
def test_deterministic_backward_is_bitwise_repeatable(variant, gen):
    q, k, v, causal, seqlens = _inputs((2, 1000, 1000, 8, 1, 128, True, None), gen)
    out, r = passes.forward(q, k, v, causal=causal)
    dout = torch.randn(out.shape, generator=gen).to("cuda", torch.bfloat16)
    first = passes.backward(dout, None, q, k, v, out, r, causal=causal, variant=variant)
    for _ in range(3):
        again = passes.backward(dout, None, q, k, v, out, r, causal=causal, variant=variant)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_op_trains_like_the_reference(gen):
    """The differentiable op end to end ("auto" both passes), and the layer under torch.compile."""
    import altattn
    q, k, v, causal, seqlens = _inputs((2, 300, 300, 8, 2, 128, True, [300, 150]), gen)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out, r = altattn.spherical_attention(*x, causal=True, seqlens=seqlens)
    (out.float().square().sum() + r.sum()).backward()
    xr = [t.double().requires_grad_() for t in (q, k, v)]
    o64, r64 = reference(*xr, True, None, 1e-6, seqlens)
    (o64.square().sum() + r64.sum()).backward()
    for a, b in zip(x, xr):
        assert rel(a.grad, b.grad) < TOLERANCES["grad_rel"]
    layer = altattn.SphericalAttention(256, 8, 2, 128, causal=True).cuda()
    y = torch.compile(layer, fullgraph=True)(torch.randn(2, 64, 256, device="cuda"))
    y.sum().backward()
    assert torch.isfinite(layer.q.weight.grad).all()

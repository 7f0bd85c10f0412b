"""Triple attention's kernels against the fp64 reference, every registered variant, on the GPU.

Each check draws fresh inputs, prefills the outputs with NaN, and bounds the kernel's relative
Frobenius error two ways (TOLERANCES in altattn/triple/family.py, named once): at most the issue's
bound (1e-2 for out, state and every gradient), and, for out and state, at most `vs_emulation`
times the error of a bf16 emulation of the same computation (bf16 inputs, the outer products and
the state rounded to bf16 before their GEMMs, fp64 sums; the short forward's quadratic form: each
score rounded) plus a floor. Odd shapes always: ragged N,
N = 1, N = 0, Dq != Dv, D = 128, causal with N not a multiple of the chunk; state and gradients
bitwise repeatable.
"""
from __future__ import annotations

import pytest
import torch

import altattn
from altattn import launcher, registry
from altattn.triple import reference, reference_backward
from altattn.triple.family import TOLERANCES
from altattn.triple.spec import TripleSpec
from kernels_triton.triple import short

pytestmark = pytest.mark.gpu

FWD = [pytest.param(v.name, id=v.name) for v in registry.all_variants("fwd", "triple")]
BWD = [pytest.param(v.name, id=v.name) for v in registry.all_variants("bwd", "triple")]
FLOOR = 1e-4  # relative errors below this pass whatever the emulation's

# (B, N, H, Dq, Dv, causal)
SHAPES = [
    (1, 1000, 2, 64, 64, False),    # short past ONE_PASS_N: the split state, quadratic output
    (1, 1500, 2, 128, 128, False),  # the same at D 128 (short.longest)
    (1, 3000, 2, 128, 128, False),  # the general forward, the quadratic backward
    (2, 333, 3, 32, 32, False),
    (1, 1, 1, 32, 64, False),
    (3, 129, 2, 64, 32, False),     # short (kernels_triton/triple/short.py)
    (1, 512, 2, 128, 128, False),   # the longest short one
    (1, 4099, 2, 128, 128, False),
    (1, 2048, 2, 64, 32, False),
    (1, 5000, 2, 64, 64, True),     # two chunks and a ragged third
    (2, 333, 3, 32, 32, True),
    (1, 1, 1, 32, 64, True),
    (1, 700, 2, 128, 64, True),
    (1, 3000, 2, 64, 64, True),     # causal short past one chunk (short.LONGEST_N)
]
IDS = [f"B{s[0]}-N{s[1]}-H{s[2]}-Dq{s[3]}-Dv{s[4]}{'-causal' if s[5] else ''}" for s in SHAPES]


def _inputs(B, N, H, Dq, Dv, gen):
    def randn(d):
        return torch.randn(B, N, H, d, generator=gen).to("cuda", torch.bfloat16)
    return randn(Dq), randn(Dq), randn(Dq), randn(Dq), randn(Dv)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _bf16(t):
    return t.to(torch.bfloat16).double()


def emulation(q1, q2, k1, k2, v, c):
    """(out, state) as the kernels round: K1 (x) V and Q1 (x) Q2 to bf16, the state to bf16
    before phase 2 (non-causal), sums in fp64."""
    x = [t.double() for t in (q1, q2, k1, k2, v)]
    kv = _bf16(torch.einsum("bnhi,bnhj->bnhij", x[2], x[4]))
    state = c * torch.einsum("bnhij,bnhk->bhijk", kv, x[3])
    qq = _bf16(torch.einsum("bnhi,bnhk->bnhik", x[0], x[1]))
    return torch.einsum("bnhik,bhijk->bnhj", qq, _bf16(state)), state


def emulation_short(q1, q2, k1, k2, v, c):
    """out as the short forward rounds (non-causal, N <= short.longest, no initial state:
    kernels_triton/triple/short.py's quadratic form): each score (Q1.K1)(Q2.K2) to bf16, sums in
    fp64."""
    x = [t.double() for t in (q1, q2, k1, k2, v)]
    s = _bf16(torch.einsum("bnhi,bmhi->bhnm", x[0], x[2])
              * torch.einsum("bnhk,bmhk->bhnm", x[1], x[3]))
    return c * torch.einsum("bhnm,bmhj->bnhj", s, x[4])


def _forward(variant, q1, q2, k1, k2, v, causal):
    B, N, H, Dq = q1.shape
    Dv = v.shape[-1]
    out = torch.full((B, N, H, Dv), float("nan"), device="cuda", dtype=torch.bfloat16)
    state = torch.full((B, H, Dq, Dv, Dq), float("nan"), device="cuda")
    return launcher.run("triple", "fwd", q1, q2, k1, k2, v, None, causal, variant=variant,
                        outputs={"out": out, "state": state})


def emulate_grads(q1, q2, k1, k2, v, dout, dstate, c):
    """(dq1, dq2, dk1, dk2, dv) of the non-causal form as the kernels round: each GEMM's outer
    product to bf16, the state and dS to bf16 before the GEMMs that read them, sums in fp64."""
    x1, x2, y1, y2, vv, do = (t.double() for t in (q1, q2, k1, k2, v, dout))

    def outer(a, b):
        return _bf16(torch.einsum("bnhi,bnhj->bnhij", a, b))
    S = _bf16(c * torch.einsum("bnhij,bnhk->bhijk", outer(y1, vv), y2))
    dS = _bf16(torch.einsum("bnhij,bnhk->bhijk", outer(x1, do), x2) + dstate.double())
    return (torch.einsum("bnhkj,bhijk->bnhi", outer(x2, do), S),
            torch.einsum("bnhji,bhijk->bnhk", outer(do, x1), S),
            c * torch.einsum("bnhkj,bhijk->bnhi", outer(y2, vv), dS),
            c * torch.einsum("bnhji,bhijk->bnhk", outer(vv, y1), dS),
            c * torch.einsum("bnhki,bhijk->bnhj", outer(y2, y1), dS))


def emulate_grads_short(q1, q2, k1, k2, v, dout, c):
    """(dq1, dq2, dk1, dk2, dv) as the short backward rounds (no dstate, no initial state: the
    quadratic form's, kernels_triton/triple/short.py): each product of scores to bf16 before
    its GEMM, sums in fp64."""
    x1, x2, y1, y2, vv, do = (t.double() for t in (q1, q2, k1, k2, v, dout))
    a = torch.einsum("bnhi,bmhi->bhnm", x1, y1)
    bb = torch.einsum("bnhk,bmhk->bhnm", x2, y2)
    dp = torch.einsum("bnhj,bmhj->bhnm", do, vv)
    return (c * torch.einsum("bhnm,bmhi->bnhi", _bf16(dp * bb), y1),
            c * torch.einsum("bhnm,bmhk->bnhk", _bf16(dp * a), y2),
            c * torch.einsum("bhnm,bnhi->bmhi", _bf16(dp * bb), x1),
            c * torch.einsum("bhnm,bnhk->bmhk", _bf16(dp * a), x2),
            c * torch.einsum("bhnm,bnhj->bmhj", _bf16(a * bb), do))


def _small(shape) -> bool:
    """Small enough for the emulation's fp64 outer products [B, N, H, D, D]."""
    return shape[1] * shape[3] * max(shape[3], shape[4]) <= 2048 * 64 * 64


def _check(name: str, got, want, bound: float, emu=None) -> None:
    """rel(got, want) within `bound`, and, where the bf16 emulation was computed, within
    vs_emulation x its error (+ FLOOR). Few tokens (N = 1) average no rounding away: there the
    emulation's own error can pass `bound`, and the emulation's bound is the one that holds."""
    err = rel(got, want)
    if emu is not None:
        limit = TOLERANCES["vs_emulation"] * rel(emu, want) + FLOOR
        assert err <= limit, (name, err, limit)
        if rel(emu, want) > bound:
            bound = limit
    assert err <= bound, (name, err, bound)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("variant", FWD)
def test_forward(variant, shape, gen):
    *dims, causal = shape
    x = _inputs(*dims, gen)
    out, state = _forward(variant, *x, causal)
    want_out, want_state = reference(*x, causal=causal)
    emu_out, emu_state = (emulation(*x, 1.0 / shape[1]) if not causal and _small(shape)
                          else (None, None))
    if not causal and short.takes(TripleSpec(*shape)):  # the quadratic form rounds the scores
        emu_out = emulation_short(*x, 1.0 / shape[1])
    _check("out", out, want_out, TOLERANCES["out_rel"], emu_out)
    _check("state", state, want_state, TOLERANCES["state_rel"], emu_state)
    out2, state2 = _forward(variant, *x, causal)
    assert torch.equal(out, out2) and torch.equal(state, state2), "not bitwise repeatable"


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("with_dstate", [True, False], ids=["dstate", "no-dstate"])
@pytest.mark.parametrize("variant", BWD)
def test_backward(variant, with_dstate, shape, gen):
    *dims, causal = shape
    x = _inputs(*dims, gen)
    _, state = _forward("auto", *x, causal)
    dout = torch.randn(x[4].shape, generator=gen).to("cuda", torch.bfloat16)
    dstate = 0.1 * torch.randn(state.shape, generator=gen).to("cuda") if with_dstate else None
    grads = launcher.run("triple", "bwd", dout, dstate, *x, state, None, causal, variant=variant)
    want = reference_backward(*x, dout, dstate, causal=causal)
    # few tokens (N = 1) average no rounding away: there the bound is the emulation's error
    emu = (emulate_grads(*x, dout, torch.zeros_like(state) if dstate is None else dstate,
                         1.0 / shape[1]) if not causal and _small(shape) else [None] * 5)
    if not causal and short.takes(TripleSpec(*shape), "bwd") and dstate is None:  # quadratic
        emu = emulate_grads_short(*x, dout, 1.0 / shape[1])
    for name, g, w, e in zip(("dq1", "dq2", "dk1", "dk2", "dv"), grads, want, emu):
        assert not g.isnan().any(), name
        bound = TOLERANCES["grad_rel"]
        if e is not None:
            bound = max(bound, TOLERANCES["vs_emulation"] * rel(e, w) + FLOOR)
        assert rel(g, w) <= bound, (name, rel(g, w), bound)
    again = launcher.run("triple", "bwd", dout, dstate, *x, state, None, causal, variant=variant)
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "not bitwise repeatable"


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_op_end_to_end(causal, gen):
    """triple_attention with autograd: out and state both in the loss, scale given."""
    x = [t.requires_grad_() for t in _inputs(1, 777, 2, 64, 32, gen)]
    out, state = altattn.triple_attention(*x, scale=0.01, causal=causal)
    dout = torch.randn(out.shape, generator=gen).to("cuda", torch.bfloat16)
    dstate = torch.randn(state.shape, generator=gen).to("cuda")
    ((out.float() * dout).sum() + (state * dstate).sum()).backward()
    want_out, want_state = reference(*x, scale=0.01, causal=causal)
    want = reference_backward(*(t.detach() for t in x), dout, dstate, scale=0.01, causal=causal)
    assert rel(out, want_out) <= TOLERANCES["out_rel"]
    assert rel(state, want_state) <= TOLERANCES["state_rel"]
    for t, w in zip(x, want):
        assert rel(t.grad, w) <= TOLERANCES["grad_rel"]


def test_empty_and_long(gen):
    """N = 0 gives an empty out and a zero state; a long sequence (int offsets, many splits)
    matches the reference."""
    x = _inputs(1, 0, 2, 32, 32, gen)
    out, state = altattn.triple_attention(*x)
    assert out.shape == (1, 0, 2, 32) and torch.equal(state, torch.zeros_like(state))
    x = _inputs(1, 65536, 2, 64, 64, gen)
    out, state = _forward("auto", *x, False)
    want_out, want_state = reference(*x)
    assert rel(out, want_out) <= TOLERANCES["out_rel"]
    assert rel(state, want_state) <= TOLERANCES["state_rel"]


def test_layer_trains(gen):
    """TripleAttention: a training step on the GPU, gradients finite, compiled and eager agree."""
    torch.manual_seed(0)
    layer = altattn.TripleAttention(128, 2, 64, 64, causal=True, normalize=True).cuda()
    layer = layer.to(torch.bfloat16)
    x = torch.randn(2, 300, 128, generator=gen).to("cuda", torch.bfloat16)
    y = layer(x)
    y.float().square().mean().backward()
    assert y.shape == x.shape
    assert all(p.grad is not None and p.grad.isfinite().all() for p in layer.parameters())
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=2e-2, atol=2e-2)

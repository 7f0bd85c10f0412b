"""Remembered calls (launcher.remembered) on the CPU: tensors that say they are on cuda:0
(bench.glue.pretend_cuda), the toy family's torch "kernel" (tests/spine/toy_family.py) or
no-op launches for the real families. A signature's first call runs every check; later calls
replay its plan; whatever a replay would not repeat is never remembered."""
from __future__ import annotations

import pytest
import torch

import altattn
from altattn import launcher, registry
from altattn.spherical import ops as spherical_ops
from bench.glue import pretend_cuda


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry.FAMILIES, "toy", "toy_family")
    monkeypatch.setattr(launcher, "check_device", lambda *a, **k: None)
    validated = []
    fam = registry.get_family("toy")
    real = fam.passes["fwd"].validate
    monkeypatch.setattr(fam.passes["fwd"], "validate",
                        staticmethod(lambda *a: validated.append(1) or real(*a)))

    @launcher.remembered
    def forward(q, k, v, *, out=None, profile=False):
        return launcher.run("toy", "fwd", q, k, v, profile=profile, outputs={"out": out})
    with pretend_cuda(stub=False):
        yield forward, fam, validated
    registry._LOADED.pop("toy", None)


def _x(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def test_a_signature_seen_before_skips_the_checks_and_gives_fresh_right_outputs(toy, gen):
    forward, fam, validated = toy
    q, k, v = (_x(gen, 2, 8, 2, 16) for _ in range(3))
    (first,) = forward(q, k, v)
    q2, k2, v2 = (_x(gen, 2, 8, 2, 16) for _ in range(3))
    (second,) = forward(q2, k2, v2)
    assert len(validated) == 1
    assert second is not first
    torch.testing.assert_close(second, fam.reference(q2, k2, v2)[0], rtol=0, atol=0)
    forward(_x(gen, 2, 8, 2, 8), _x(gen, 2, 8, 2, 8), _x(gen, 2, 8, 2, 8))  # another shape
    assert len(validated) == 2


def test_a_given_output_is_written_and_returned(toy, gen):
    forward, fam, _ = toy
    q, k, v = (_x(gen, 1, 4, 1, 16) for _ in range(3))
    for _ in range(2):
        given = torch.full_like(q, float("nan"))
        (out,) = forward(q, k, v, out=given)
        assert out is given and not out.isnan().any()


def test_errors_are_raised_at_every_call_and_never_remembered(toy, gen):
    forward, _, validated = toy
    q = _x(gen, 1, 4, 1, 16)
    for _ in range(2):
        with pytest.raises(ValueError, match="k must have q's shape"):
            forward(q, _x(gen, 1, 5, 1, 16), q.clone())
        with pytest.raises(TypeError, match="k must be a torch.Tensor"):
            forward(q, [1], q.clone())
    assert len(validated) == 4


def test_what_a_replay_would_not_repeat_is_never_remembered(toy, gen):
    """A strided input (its dense copy is the call's own), the same tensor twice (which
    argument is which?), a profiled launch: every call runs whole, and right."""
    forward, fam, validated = toy
    q = _x(gen, 1, 4, 2, 16)
    strided = _x(gen, 1, 4, 4, 16)[:, :, ::2]
    for _ in range(2):
        (out,) = forward(q, strided, q.clone())
        torch.testing.assert_close(out, fam.reference(q, strided, q)[0], rtol=0, atol=0)
    assert len(validated) == 2
    entries = [e for e in launcher._REMEMBERED if e]
    assert [list(e.values()) for e in entries] == [[launcher._WHOLE]]  # checks, no recording
    q, k = _x(gen, 1, 4, 1, 16), _x(gen, 1, 4, 1, 16)
    forward(q, q, k)
    forward(q, q, k)
    assert len(validated) == 4
    forward(q, k, _x(gen, 1, 4, 1, 16))  # distinct tensors: remembered from here on
    (out,) = forward(q, q, k)
    assert len(validated) == 5
    torch.testing.assert_close(out, fam.reference(q, q, k)[0], rtol=0, atol=0)
    for _ in range(2):
        forward(q, k, _x(gen, 1, 4, 1, 16), profile=True)
    assert len(validated) == 7


def test_the_oldest_signature_goes_first(toy, gen, monkeypatch):
    forward, _, validated = toy
    monkeypatch.setattr(launcher, "MAX_PLANS", 2)
    xs = [[_x(gen, 1, n, 1, 16) for _ in range(3)] for n in (4, 5, 6)]
    for x in (*xs, xs[2], xs[1], xs[0]):
        forward(*x)
    assert len(validated) == 4  # n = 4 forgotten when n = 6 came


def test_cpu_tensors_and_cleared_plans_run_whole(toy, gen, monkeypatch):
    forward, _, validated = toy
    q = _x(gen, 1, 4, 1, 16)
    forward(q, q.clone(), q.clone())
    launcher.clear_plans()
    forward(q, q.clone(), q.clone())
    assert len(validated) == 2
    with monkeypatch.context() as m:  # undone before `toy` leaves pretend_cuda (its own undo)
        m.setattr(torch.Tensor, "is_cuda", property(lambda self: False))
        forward(q, q.clone(), q.clone())
        forward(q, q.clone(), q.clone())
    assert len(validated) == 4


def test_a_call_inside_another_recording_spoils_it(toy, gen):
    """outer's first call replays forward's remembered call, which outer's recording does not
    see: outer is never remembered (its body runs at every call)."""
    forward, fam, _ = toy
    ran = []

    @launcher.remembered
    def outer(q, k, v):
        ran.append(1)
        forward(q, k, v)
        return forward(q, v, k)
    q, k, v = (_x(gen, 1, 4, 1, 16) for _ in range(3))
    forward(q, k, v)
    for _ in range(2):
        (out,) = outer(q, k, v)
    assert len(ran) == 2
    torch.testing.assert_close(out, fam.reference(q, v, k)[0], rtol=0, atol=0)


@pytest.fixture
def counted(monkeypatch):
    """The spherical op on pretend CUDA tensors, its launches no-ops; how often it validates."""
    seen = []
    real = spherical_ops.validate
    monkeypatch.setattr(spherical_ops, "validate", lambda *a, **k: seen.append(1) or real(*a, **k))
    with pretend_cuda():
        yield seen


def _bf16(*shape, grad=False):
    return torch.randn(*shape).to(torch.bfloat16).requires_grad_(grad)


def test_the_op_remembers_with_and_without_grad(counted, monkeypatch):
    backwards = []
    real = launcher.run_call
    monkeypatch.setattr(launcher, "run_call",
                        lambda *a, **k: backwards.append(a[1]) or real(*a, **k))
    q, k, v = (_bf16(1, 8, 2, 64) for _ in range(3))
    with torch.no_grad():
        altattn.spherical_attention(q, k, v)
        out, r = altattn.spherical_attention(q, k, v)
    assert len(counted) == 1 and out.grad_fn is None
    qg, kg, vg = (_bf16(1, 8, 2, 64, grad=True) for _ in range(3))
    for _ in range(2):
        out, r = altattn.spherical_attention(qg, kg, vg)
        assert out.grad_fn is not None and r.grad_fn is not None
        (dq, dk, dv) = torch.autograd.grad(out, (qg, kg, vg), torch.ones_like(out))
        assert dq.shape == qg.shape
    assert len(counted) == 2
    assert backwards == ["bwd"]  # the second backward replayed
    altattn.spherical_attention(q, kg, v)  # another requires_grad: another signature
    assert len(counted) == 3


def test_the_op_still_refuses_what_it_refused(counted):
    q, k, v = (_bf16(1, 8, 2, 64) for _ in range(3))
    with torch.no_grad():
        altattn.spherical_attention(q, k, v)
        for _ in range(2):
            with pytest.raises(ValueError, match="unknown variant"):
                altattn.spherical_attention(q, k, v, variant="nope")
            with pytest.raises(TypeError, match="causal must be a bool"):
                altattn.spherical_attention(q, k, v, causal=1)
            with pytest.raises(TypeError, match="must be torch.bfloat16"):
                altattn.spherical_attention(q.float(), k, v)
    with torch.enable_grad():
        qg = q.clone().requires_grad_()
        altattn.spherical_attention(qg, k, v)
        with pytest.raises(ValueError, match="forward-only and the inputs require grad"):
            altattn.spherical.forward(qg, k, v)
    with torch.no_grad():
        altattn.spherical.forward(qg, k, v)

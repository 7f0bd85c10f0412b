"""Triple attention's state in, state out on the CPU (the fp64 reference path): `initial_state`
starts the sums, so a prefill cut in chunks (each chunk's returned state the next one's
initial_state) equals one call: causal, every output, the final state and every gradient, the
state's included; non-causal (every token reads its own call's whole state), the last chunk's out,
the final state and every gradient through them. The gradient of initial_state against finite
differences and against autograd through the reference, the op's glue (opcheck: test_triple_cpu.py;
torch.compile here), what the passes hand the kernels, and bad input refused naming the argument.
The same equalities on the GPU kernels: test_gpu_triple_state.py."""
from __future__ import annotations

import re
import types

import pytest
import torch

import altattn
from altattn.triple import backward, forward, reference, reference_backward

F64, BF16 = torch.float64, torch.bfloat16
SCALE = 0.3
# chunk lengths of a prefill of N = 7 tokens: one call, two, three ragged ones, a chunk of one
CUTS = [(7,), (3, 4), (2, 4, 1), (1, 1, 5)]


def _x(gen, B=2, N=7, H=2, Dq=2, Dv=3, dtype=F64):
    return [torch.randn(B, N, H, d, generator=gen, dtype=dtype) for d in (Dq, Dq, Dq, Dq, Dv)]


def _state(gen, B=2, H=2, Dq=2, Dv=3, dtype=F64):
    return torch.randn(B, H, Dq, Dv, Dq, generator=gen, dtype=dtype)


def prefill(x, cuts, causal, initial_state=None, scale=SCALE):
    """The chunks' outs (concatenated) and the last state: `cuts` tokens a call, each call's
    state the next one's initial_state."""
    outs, state, a = [], initial_state, 0
    for n in cuts:
        out, state = altattn.triple_attention(*(t[:, a:a + n] for t in x), scale=scale,
                                              causal=causal, initial_state=state)
        outs.append(out)
        a += n
    return torch.cat(outs, 1), state


def _leaves(ts):
    return [t.detach().clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("cuts", CUTS, ids=["-".join(map(str, c)) for c in CUTS])
@pytest.mark.parametrize("with_initial_state", [False, True], ids=["from0", "fromS0"])
def test_chunked_prefill_equals_one_call(causal, cuts, with_initial_state, gen, tiny_dims):
    """One call on all tokens against the chunks, both from the same start (0 or a given S0):
    out, the final state, and the gradients of q1, q2, k1, k2, v (and S0) under one loss.
    Non-causal, a token reads its own call's whole state, so only the last chunk's out is one
    call's: the loss reads it there."""
    x, s0 = _x(gen), (_state(gen) if with_initial_state else None)
    last = slice(7 - cuts[-1], 7) if not causal else slice(0, 7)
    one, many = _leaves([*x, *([s0] if s0 is not None else [])]), None
    many = _leaves(one)
    out, state = altattn.triple_attention(*one[:5], scale=SCALE, causal=causal,
                                          initial_state=one[5] if s0 is not None else None)
    got_out, got_state = prefill(many[:5], cuts, causal, many[5] if s0 is not None else None)
    torch.testing.assert_close(got_out[:, last], out[:, last], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_state, state, rtol=1e-12, atol=1e-12)
    dout = torch.randn(out[:, last].shape, generator=gen, dtype=F64)
    dstate = torch.randn(state.shape, generator=gen, dtype=F64)
    want = torch.autograd.grad((out[:, last], state), one, (dout, dstate))
    got = torch.autograd.grad((got_out[:, last], got_state), many, (dout, dstate))
    for name, g, w in zip(("dq1", "dq2", "dk1", "dk2", "dv", "dinitial_state"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_the_initial_states_gradient_gradchecks(causal, gen, tiny_dims):
    """Central differences in fp64 of out and state, every input and initial_state."""
    x = _leaves([*_x(gen, N=5), _state(gen)])

    def f(*a):
        return altattn.triple_attention(*a[:5], scale=0.7, causal=causal, initial_state=a[5])
    assert torch.autograd.gradcheck(f, x)


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("chunk", [2, 4096])
def test_reference_backward_gives_the_initial_states_gradient(causal, chunk, gen):
    """reference_backward's sixth gradient (and the five) against autograd through reference;
    it is dstate plus sum_n Q1[n] (x) dO[n] (x) Q2[n], the total gradient reaching the state."""
    x = _leaves([*_x(gen), _state(gen)])
    out, state = reference(*x[:5], SCALE, causal, x[5], chunk=chunk)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dstate = torch.randn(state.shape, generator=gen, dtype=F64)
    want = torch.autograd.grad((out, state), x, (dout, dstate))
    got = reference_backward(*(t.detach() for t in x[:5]), dout, dstate, SCALE, causal,
                             x[5].detach(), chunk=chunk)
    assert len(got) == 6
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    q1, q2 = x[0].detach(), x[1].detach()
    total = dstate + torch.einsum("bnhi,bnhj,bnhk->bhijk", q1, dout, q2)
    torch.testing.assert_close(got[5], total, rtol=1e-12, atol=1e-12)


def test_a_zero_initial_state_changes_nothing(gen):
    x = _x(gen, Dq=32, Dv=32)
    for causal in (False, True):
        want = altattn.triple_attention(*x, scale=SCALE, causal=causal)
        got = altattn.triple_attention(*x, scale=SCALE, causal=causal,
                                       initial_state=torch.zeros(2, 2, 32, 32, 32, dtype=F64))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_the_state_keeps_its_dtype_across_chunks(gen):
    """bf16 inputs return an fp32 state, which the next chunk takes; fp64 inputs an fp64 one."""
    x = _x(gen, Dq=32, Dv=64, dtype=BF16)
    out, state = prefill(x, (3, 4), causal=True)
    assert out.dtype == BF16 and state.dtype == torch.float32
    _, want = reference(*x, SCALE, True)
    torch.testing.assert_close(state.double(), want, rtol=1e-5, atol=1e-5)


def test_compiles_fullgraph_with_an_initial_state(gen, tiny_dims):
    def step(*a):
        out, state = altattn.triple_attention(*a[:5], causal=True, scale=0.5, initial_state=a[5])
        return out.square().sum() + state.sum()

    x = _leaves([*_x(gen, B=1, N=6), _state(gen, B=1)])
    want = torch.autograd.grad(step(*x), x)
    loss = torch.compile(step, fullgraph=True)(*x)
    torch.testing.assert_close(loss, step(*x))
    for g, w in zip(torch.autograd.grad(loss, x), want):
        torch.testing.assert_close(g, w)


def test_no_tokens_pass_the_state_through(gen, tiny_dims):
    x, s0 = _leaves(_x(gen, N=0)), _state(gen).requires_grad_()
    out, state = altattn.triple_attention(*x, scale=SCALE, initial_state=s0)
    assert out.shape == (2, 0, 2, 3)
    torch.testing.assert_close(state, s0, rtol=0, atol=0)
    dstate = torch.randn_like(state)
    (g,) = torch.autograd.grad(state, s0, dstate)
    torch.testing.assert_close(g, dstate, rtol=0, atol=0)


def test_the_layer_prefills_in_chunks(gen):
    """A causal TripleAttention fed 3 then 4 tokens, the state carried: one call's y and state,
    and the same parameter gradients."""
    layer = altattn.TripleAttention(48, 2, 32, 64, causal=True, scale=SCALE).double()
    x = torch.randn(2, 7, 48, generator=gen, dtype=F64)
    y, state = layer(x, return_state=True)
    y1, s1 = layer(x[:, :3], return_state=True)
    y2, s2 = layer(x[:, 3:], s1, return_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s2, state, rtol=1e-12, atol=1e-12)
    params = list(layer.parameters())
    want = torch.autograd.grad(y.square().sum() + state.sum(), params)
    got = torch.autograd.grad(torch.cat([y1, y2], 1).square().sum() + s2.sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="scale=None"):
        altattn.TripleAttention(48, 2, 32, 64, causal=True).double()(x, s1)
    with pytest.raises(TypeError, match="return_state must be a bool"):
        layer(x, return_state=1)


# ---------------------------------------------------------------------------------------------
# Bad input, named


def _bf16(B=1, N=4, H=2, D=32):
    return torch.zeros(B, N, H, D, dtype=BF16)


GOOD_STATE = torch.zeros(1, 2, 32, 32, 32)
BAD = [  # (kwargs, error type, words the message must hold)
    (dict(scale=None), ValueError, "scale=None (1/N, the mean over this call's N tokens) "
     "cannot go with an initial_state"),
    (dict(initial_state=[[0.0]]), TypeError, "initial_state must be a torch.Tensor"),
    (dict(initial_state=GOOD_STATE.to(torch.int32)), TypeError,
     "initial_state must be a floating-point tensor"),
    (dict(initial_state=GOOD_STATE.to(BF16)), TypeError, "initial_state must have a dtype in"),
    (dict(initial_state=GOOD_STATE[:, :1]), ValueError,
     "initial_state must have shape (1, 2, 32, 32, 32) [B, H, Dq, Dv, Dq]"),
    (dict(initial_state=GOOD_STATE.transpose(2, 3)[..., :16]), ValueError,
     "initial_state must have shape"),
    (dict(initial_state=GOOD_STATE.to("meta")), ValueError,
     "initial_state is on meta but q1, q2, k1, k2, v are on cpu"),
]


@pytest.mark.parametrize("kwargs, kind, words", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_initial_state_is_refused_naming_it(kwargs, kind, words):
    args = {"scale": 0.5, "initial_state": GOOD_STATE, **kwargs}
    x = [_bf16() for _ in range(5)]
    altattn.triple_attention(*x, scale=0.5, initial_state=GOOD_STATE)  # the good one passes
    with pytest.raises(kind, match=re.escape(words)):
        altattn.triple_attention(*x, **args)
    with pytest.raises(kind, match=re.escape(words)):
        forward(*x, **args)  # the GPU pass refuses it too, before any device check


# ---------------------------------------------------------------------------------------------
# The passes through the launcher: what a kernel module's `launch` gets


@pytest.fixture
def kernels(stand_in_launches):
    """Stand-in kernels for every triple variant that record each launch's arguments."""
    return stand_in_launches("triple")


@pytest.mark.parametrize("causal", [False, True])
def test_the_passes_hand_launch_the_initial_state_and_its_gradient(kernels, causal, gen):
    x = [t.to(BF16) for t in _x(gen, Dq=32, Dv=64)]
    s0 = _state(gen, Dq=32, Dv=64).float()
    out, state = forward(*x, scale=SCALE, causal=causal, initial_state=s0)
    (s, args), = kernels["fwd"]
    assert len(args) == 8 and args[5] is out and args[6] is state and args[7] is s0
    dout, dstate = torch.randn(out.shape, generator=gen), torch.randn_like(state)
    grads = backward(dout, dstate, *x, state, scale=SCALE, causal=causal, initial_state=s0)
    (s, args), = kernels["bwd"]
    assert len(args) == 15 and args[13] is s0
    assert len(grads) == 6 and all(a is g for a, g in zip(args[8:13], grads[:5]))
    assert args[14] is grads[5] and grads[5].shape == s0.shape
    assert grads[5].dtype == torch.float32


def test_without_tokens_the_passes_copy_the_state_through(kernels, gen):
    x = [t.to(BF16) for t in _x(gen, N=0, Dq=32, Dv=64)]
    s0 = _state(gen, Dq=32, Dv=64).float()
    _, state = forward(*x, scale=SCALE, initial_state=s0)
    assert torch.equal(state, s0)
    dstate = torch.randn_like(s0)
    *grads, dinit = backward(torch.zeros(2, 0, 2, 64), dstate, *x, state, scale=SCALE,
                             initial_state=s0)
    assert torch.equal(dinit, dstate) and [g.numel() for g in grads] == [0] * 5
    *_, dinit = backward(torch.zeros(2, 0, 2, 64), None, *x, state, scale=SCALE, initial_state=s0)
    assert not dinit.any()
    assert kernels == {}


def test_forward_refuses_an_initial_state_that_requires_grad(kernels, gen):
    x = [t.to(BF16) for t in _x(gen, Dq=32, Dv=64)]
    s0 = _state(gen, Dq=32, Dv=64).float().requires_grad_()
    with pytest.raises(ValueError, match="forward-only"):
        forward(*x, scale=SCALE, initial_state=s0)


# ---------------------------------------------------------------------------------------------
# The kernels' passes on the CPU: torch stand-ins for the Triton kernels, the host code real


def _einsum(eq, *ts):
    return torch.einsum(eq, *(t.double() for t in ts))


GRADS = ("dq1", "dq2", "dk1", "dk2", "dv")


def _stand_ins(monkeypatch, chunk: int):
    """An `impl` (partials, apply) and the scan and intra kernels as plain torch, in fp64 from
    the bf16 operands the host code hands them; the causal chunk `chunk` tokens."""
    from kernels_triton.triple import causal, host, intra, short

    def prepare_partials(B, N, H, d1, dy, d2, splits, split_len=None, profile=False):
        length = split_len or -(-N // splits)

        def run(x1, y, x2):
            return torch.stack([_einsum("bnhi,bnhj,bnhk->bhijk", *(t[:, s:s + length]
                                        for t in (x1, y, x2)))
                                for s in range(0, splits * length, length)], 2).float()
        return run

    def prepare_apply(B, N, H, dx, dy, do, c, chunk=0, profile=False):
        def run(x, y, w, out):
            if chunk:  # each token's chunk's slab
                w = w[:, :, torch.arange(N) // chunk]
                out.copy_(c * _einsum("bnhx,bnhp,bhnpxo->bnho", x, y, w))
            else:
                out.copy_(c * _einsum("bnhx,bnhp,bhpxo->bnho", x, y, w))
        return run

    def prepare_scan(heads, d1, dy, d2, mode, H=1):  # dense: no Seg, Slot, CS
        def run(P, n_splits, c, S=None, slabs=None, S0=None, CS=None, Seg=None, Slot=None):
            P = P.reshape(heads, n_splits, d1, dy, d2).double()
            s0 = 0 if S0 is None else S0.reshape(heads, 1, d1, dy, d2).double()
            zero = torch.zeros_like(P[:, :1])
            if mode == host.SUM:
                W = total = c * P.sum(1, keepdim=True) + s0
            elif mode == host.PREFIX:  # exclusive prefixes from S0 / c
                inc = P.cumsum(1)
                W = torch.cat((zero, inc[:, :-1]), 1) + s0 / c
                total = c * inc[:, -1:] + s0
            else:  # exclusive suffixes from S0
                inc = P.flip(1).cumsum(1).flip(1)
                W = torch.cat((inc[:, 1:], zero), 1) + s0
                total = inc[:, :1] + s0
            if S is not None:
                S.copy_(total.reshape(S.shape))
            for o, w in (slabs or {}).items():
                w.copy_(host.slab(W.float(), o).reshape(w.shape))
        return run

    def intra_out(q1, q2, k1, k2, v, C, c):
        n = torch.arange(q1.shape[1])
        mask = (n[:, None] // C == n[None, :] // C) & (n[None, :] <= n[:, None])
        s = _einsum("bnhi,bmhi->bhnm", q1, k1) * _einsum("bnhk,bmhk->bhnm", q2, k2)
        return c * torch.einsum("bhnm,bmhj->bnhj", s * mask, v.double())

    def intra_forward(B, N, H, Dq, Dv, C, c):
        def run(q1, q2, k1, k2, v, inter, out):
            out.copy_(inter + intra_out(q1, q2, k1, k2, v, C, c))
        return run

    def intra_backward(B, N, H, Dq, Dv, C, c):
        def run(q1, q2, k1, k2, v, dout, inter, grads):
            x = [t.double().requires_grad_() for t in (q1, q2, k1, k2, v)]
            dx = torch.autograd.grad(intra_out(*x, C, c), x, dout.double())
            for g, i, d in zip(grads, inter, dx):
                g.copy_(i + d)
        return run

    def short_state(B, N, H, d1, dy, d2, c, slab=False, profile=False):
        partials, scan = prepare_partials(B, N, H, d1, dy, d2, 1), prepare_scan(B * H, d1, dy,
                                                                                d2, host.SUM)

        def run(x1, y, x2, S, S0=None):
            w = torch.empty(host.slab_shape((B, H), "ikj", d1, dy, d2), dtype=BF16)
            scan(partials(x1, y, x2), 1, c, S, {"ikj": w}, S0)
            return w if slab else None
        return run

    def quadratic(q1, q2, k1, k2, v, c, causal):
        s = _einsum("bnhi,bmhi->bhnm", q1, k1) * _einsum("bnhk,bmhk->bhnm", q2, k2)
        if causal:
            s = s.tril()
        return c * torch.einsum("bhnm,bmhj->bnhj", s, v.double())

    def short_out(B, N, H, Dq, Dv, c, causal=False):
        def run(q1, q2, k1, k2, v, out):
            out.copy_(quadratic(q1, q2, k1, k2, v, c, causal))
        return run

    def short_grads(B, N, H, Dq, Dv, c, causal=False):
        def run(q1, q2, k1, k2, v, dout, grads):
            x = [t.double().requires_grad_() for t in (q1, q2, k1, k2, v)]
            y = quadratic(*x, c, causal)
            for g, d in zip(grads, torch.autograd.grad(y, x, dout.double())):
                g.copy_(d)
        return run

    monkeypatch.setattr(host, "prepare_scan", prepare_scan)
    monkeypatch.setattr(short, "prepare_grads", short_grads)
    monkeypatch.setattr(short, "prepare_state", short_state)
    monkeypatch.setattr(short, "prepare_out", short_out)
    monkeypatch.setattr(intra, "prepare_forward", intra_forward)
    monkeypatch.setattr(intra, "prepare_backward", intra_backward)
    monkeypatch.setattr(causal, "CHUNK", chunk)
    return types.SimpleNamespace(n_splits=lambda *shape: 2, prepare_partials=prepare_partials,
                                 prepare_apply=prepare_apply)


def short_form(monkeypatch, form: str) -> None:
    """Which form kernels_triton/triple's passes take at any N: "general" (fwd.py, bwd.py,
    causal.py), "one" (short.py, the state in one launch) or "split" (short.py past
    ONE_PASS_N: the split partials' state, the quadratic output)."""
    from kernels_triton.triple import short
    monkeypatch.setattr(short, "takes", lambda spec, pass_="fwd": form != "general")
    monkeypatch.setattr(short, "ONE_PASS_N", 0 if form == "split" else 1 << 30)


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("form", ["general", "one", "split"])
@pytest.mark.parametrize("with_initial_state", [False, True], ids=["from0", "fromS0"])
def test_the_kernels_passes_on_stand_in_kernels(causal, form, with_initial_state,
                                                monkeypatch, gen):
    """kernels_triton/triple's fwd.py, bwd.py and causal.py (the host code both variants run:
    state and slab, prefix and suffix sums from the initial state, its gradient; the short
    forms, short.py) on torch stand-ins of the kernels, against the reference: bf16 slabs, so
    within the tolerances."""
    from altattn.triple.family import TOLERANCES
    from altattn.triple.spec import TripleSpec
    from kernels_triton.triple import bwd, fwd
    impl = _stand_ins(monkeypatch, chunk=4)
    short_form(monkeypatch, form)
    B, N, H, Dq, Dv = 2, 11, 2, 4, 8  # three causal chunks, the last ragged
    x = [t.to(BF16) for t in _x(gen, B, N, H, Dq, Dv)]
    s0 = _state(gen, B, H, Dq, Dv).float() if with_initial_state else None
    spec = TripleSpec(B, N, H, Dq, Dv, causal, SCALE)
    out, state = torch.empty(B, N, H, Dv, dtype=BF16), torch.empty(B, H, Dq, Dv, Dq)
    fwd.prepare(spec, impl=impl)(*x, out, state, s0)
    dout, dstate = torch.randn(out.shape, generator=gen).to(BF16), torch.randn_like(state)
    grads = [torch.empty_like(t) for t in x]
    dinit = torch.empty_like(state) if with_initial_state else None
    bwd.prepare(spec, impl=impl)(*x, state, dout, dstate, *grads, s0, dinit)
    want_out, want_state = reference(*x, SCALE, causal, s0)
    want = reference_backward(*x, dout, dstate, SCALE, causal, s0)

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())
    assert rel(out, want_out) <= TOLERANCES["out_rel"]
    assert rel(state, want_state) <= 1e-6  # fp32 sums
    for name, g, w in zip(("dq1", "dq2", "dk1", "dk2", "dv", "dinitial_state"),
                          (*grads, dinit), want):
        assert rel(g, w) <= (1e-6 if name == "dinitial_state" else TOLERANCES["grad_rel"]), name
    # the state unused (dstate None): short.py's backward where it takes the spec
    grads = [torch.full_like(t, float("nan")) for t in x]
    bwd.prepare(spec, impl=impl)(*x, state, dout, None, *grads, s0, dinit)
    for name, g, w in zip(GRADS, grads, reference_backward(*x, dout, None, SCALE, causal, s0)):
        assert rel(g, w) <= TOLERANCES["grad_rel"], name

"""Triple attention on the CPU: the op against the fp64 reference (dtypes, scale, causal), gradcheck
and opcheck of its two torch.library ops, torch.compile(fullgraph=True), the layer, the passes'
kernel arguments through the launcher (a stand-in kernel module records them), bad input refused
naming the argument, and the FLOP model. The reference itself: tests/triple/test_triple_reference.py."""
from __future__ import annotations

import pytest
import torch

import altattn
from altattn import registry
from altattn.triple import backward, forward, reference, reference_backward, spec
from altattn.triple.shapes import PRESETS, Shape, pass_flops, pass_inputs

F64, BF16 = torch.float64, torch.bfloat16


def _x(gen, B=2, N=7, H=2, Dq=32, Dv=64, dtype=F64, requires_grad=False):
    ts = [torch.randn(B, N, H, d, generator=gen, dtype=dtype) for d in (Dq, Dq, Dq, Dq, Dv)]
    return [t.requires_grad_(requires_grad) for t in ts]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.5])
def test_the_op_on_cpu_is_the_reference(causal, scale, gen):
    x = _x(gen)
    out, state = altattn.triple_attention(*x, scale=scale, causal=causal)
    want_out, want_state = reference(*x, scale, causal)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, want_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype, state_dtype", [(BF16, torch.float32), (torch.float16,
                                                torch.float32), (torch.float32, torch.float32)])
def test_the_op_keeps_the_input_dtype_and_an_fp32_state(dtype, state_dtype, gen):
    x = _x(gen, dtype=dtype)
    out, state = altattn.triple_attention(*x, causal=True)
    assert (out.dtype, state.dtype) == (dtype, state_dtype)
    assert out.shape == (2, 7, 2, 64) and state.shape == (2, 2, 32, 64, 32)
    want, _ = reference(*x, causal=True)
    assert float((out.double() - want).norm() / want.norm()) < 1e-2


def test_empty_shapes(gen):
    out, state = altattn.triple_attention(*_x(gen, N=0))
    assert out.shape == (2, 0, 2, 64) and not state.any()
    out, state = altattn.triple_attention(*_x(gen, H=0))
    assert out.numel() == 0 and state.shape == (2, 0, 32, 64, 32)


def test_meta_tensors_propagate_shapes(gen):
    x = [t.to("meta", BF16) for t in _x(gen)]
    out, state = altattn.triple_attention(*x)
    assert out.device.type == "meta" and out.shape == (2, 7, 2, 64) and out.dtype == BF16
    assert state.shape == (2, 2, 32, 64, 32) and state.dtype == torch.float32


@pytest.mark.parametrize("use_state", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_the_op_gradchecks(causal, use_state, gen, tiny_dims):
    x = _x(gen, B=2, N=5, H=2, Dq=2, Dv=3, requires_grad=True)

    def f(*a):
        out, state = altattn.triple_attention(*a, causal=causal, scale=0.7)
        return (out, state) if use_state else out
    assert torch.autograd.gradcheck(f, x)


def test_gradients_at_the_kernels_dims_are_the_closed_form(gen):
    """The op's autograd at Dq = 32, Dv = 64 (the shapes validate takes) gives
    reference_backward's gradients, causal, with both outputs used."""
    x = _x(gen, N=9, requires_grad=True)
    out, state = altattn.triple_attention(*x, causal=True)
    dout, dstate = torch.randn_like(out), torch.randn_like(state)
    got = torch.autograd.grad((out, state), x, (dout, dstate))
    want = reference_backward(*(t.detach() for t in x), dout, dstate, causal=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_initial_state", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_the_ops_opcheck(causal, with_initial_state, gen, tiny_dims):
    x = _x(gen, B=1, N=5, H=2, Dq=2, Dv=3)
    init = torch.randn(1, 2, 2, 3, 2, generator=gen, dtype=F64) if with_initial_state else None
    args = (*x, 0.3, causal, init, "auto", "auto", False)
    torch.library.opcheck(torch.ops.altattn.triple_fwd.default, args)
    out, state = reference(*x, 0.3, causal, init)
    for dstate in (None, torch.randn_like(state)):
        bwd_args = (torch.randn_like(out), dstate, *x, state, 0.3, causal, init, "auto", False)
        torch.library.opcheck(torch.ops.altattn.triple_bwd.default, bwd_args)


def test_compiles_fullgraph_and_matches_eager(gen, tiny_dims):
    def step(*a):
        out, state = altattn.triple_attention(*a, causal=True, scale=0.5)
        return out.square().sum() + state.sum()

    x = _x(gen, B=1, N=6, H=2, Dq=2, Dv=3, requires_grad=True)
    want = torch.autograd.grad(step(*x), x)
    loss = torch.compile(step, fullgraph=True)(*x)
    torch.testing.assert_close(loss, step(*x))
    for g, w in zip(torch.autograd.grad(loss, x), want):
        torch.testing.assert_close(g, w)


# ---------------------------------------------------------------------------------------------
# The layer


@pytest.mark.parametrize("causal", [False, True])
def test_the_layer_shapes_and_gradients(causal, gen):
    layer = altattn.TripleAttention(48, 2, 32, 64, causal=causal).double()
    x = torch.randn(2, 5, 48, generator=gen, dtype=F64, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == F64
    y.square().sum().backward()
    assert x.grad.shape == x.shape
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.any(), name


def test_normalize_makes_the_layer_blind_to_query_and_key_scale(gen):
    layer = altattn.TripleAttention(32, 2, 32, normalize=True, scale=1.0).double()
    x = torch.randn(1, 6, 32, generator=gen, dtype=F64)
    before = layer(x)
    with torch.no_grad():
        for p in (layer.q1, layer.q2, layer.k1, layer.k2):
            p.weight.mul_(3.0)
    torch.testing.assert_close(layer(x), before)  # ||q|| = ||k|| = 1 whatever the weights
    plain = altattn.TripleAttention(32, 2, 32, scale=1.0).double()
    plain.load_state_dict(layer.state_dict())
    assert not torch.allclose(plain(x), before)
    assert "normalize=True" in repr(layer) and "scale=1.0" in repr(layer)


LAYER_BAD = [
    (dict(head_dim=48), ValueError, "head_dim=48"),
    (dict(v_head_dim=16), ValueError, "v_head_dim=16"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(normalize="yes"), TypeError, "normalize must be a bool"),
    (dict(variant="nope"), ValueError, "unknown variant 'nope'"),
    (dict(n_heads=0), ValueError, "n_heads"),
]


@pytest.mark.parametrize("kwargs, kind, words", LAYER_BAD, ids=[b[2] for b in LAYER_BAD])
def test_the_layer_refuses_bad_configurations(kwargs, kind, words):
    args = {"dim": 32, "n_heads": 2, **kwargs}
    with pytest.raises(kind, match=words):
        altattn.TripleAttention(**args)


def test_the_layer_refuses_a_bad_input():
    layer = altattn.TripleAttention(32, 2)
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.zeros(2, 5, 31))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        layer([[0.0]])


# ---------------------------------------------------------------------------------------------
# Bad input, named


def _bf16(B=1, N=4, H=2, D=32):
    return torch.zeros(B, N, H, D, dtype=BF16)


BAD = [  # (kwargs, error type, words the message must hold)
    (dict(q1=None), TypeError, "q1 must be a torch.Tensor"),
    (dict(k2=torch.zeros(1, 4, 2, 32, 1, dtype=BF16)), ValueError, "k2 must have rank 4"),
    (dict(k1=_bf16(N=5)), ValueError, "k1 must have q1's shape"),
    (dict(q2=_bf16(H=3)), ValueError, "q2 must have q1's shape"),
    (dict(v=_bf16(B=2)), ValueError, "v must be [B, N, H, Dv] with q1's B, N, H"),
    (dict(v=_bf16(N=3)), ValueError, "v must be [B, N, H, Dv] with q1's B, N, H"),
    (dict(q1=_bf16(D=48), q2=_bf16(D=48), k1=_bf16(D=48), k2=_bf16(D=48)), ValueError,
     "head dim Dq=48"),
    (dict(v=_bf16(D=96)), ValueError, "head dim Dv=96"),
    (dict(v=torch.zeros(1, 4, 2, 32, dtype=torch.int32)), TypeError, "v must have a dtype in"),
    (dict(k1=torch.zeros(1, 4, 2, 32)), TypeError, "must share one dtype"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite positive float"),
    (dict(scale=0.0), ValueError, "scale must be a finite positive float"),
    (dict(scale="1"), TypeError, "scale must be a finite float > 0, or None"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(variant="nope"), ValueError, "unknown variant 'nope' of family 'triple'"),
    (dict(bwd_variant="nope"), ValueError, "unknown variant 'nope' of pass 'bwd'"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
]


@pytest.mark.parametrize("kwargs, kind, words", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_refused_naming_the_argument(kwargs, kind, words):
    args = dict(q1=_bf16(), q2=_bf16(), k1=_bf16(), k2=_bf16(), v=_bf16())
    args.update(kwargs)
    x = [args.pop(n) for n in spec.NAMES]
    with pytest.raises(kind, match=words.replace("(", r"\(").replace("[", r"\[")):
        altattn.triple_attention(*x, **args)


# ---------------------------------------------------------------------------------------------
# The passes through the launcher: what a kernel module's `launch` gets


@pytest.fixture
def kernels(stand_in_launches):
    """Stand-in kernels for every triple variant that record each launch's arguments."""
    return stand_in_launches("triple")


def test_forward_hands_launch_the_inputs_and_outputs(kernels, gen):
    x = [t.to(BF16) for t in _x(gen)]
    out, state = forward(*x, causal=True)
    (s, args), = kernels["fwd"]
    assert (s.B, s.N, s.H, s.Dq, s.Dv, s.causal, s.scale) == (2, 7, 2, 32, 64, True, 1 / 7)
    assert len(args) == 8 and all(a is b for a, b in zip(args[:5], x))
    assert args[5] is out and out.shape == (2, 7, 2, 64) and out.dtype == BF16
    assert args[6] is state and state.shape == (2, 2, 32, 64, 32)
    assert state.dtype == torch.float32 and args[7] is None  # no initial_state
    with pytest.raises(ValueError, match="forward-only"):
        forward(*(t.requires_grad_() for t in x))


@pytest.mark.parametrize("with_dstate", [False, True])
def test_backward_hands_launch_fp32_state_and_dstate(kernels, gen, with_dstate):
    x = [t.to(BF16) for t in _x(gen)]
    state = torch.randn(2, 2, 32, 64, 32, generator=gen, dtype=F64)
    dout = torch.randn(2, 7, 2, 64, generator=gen)
    dstate = torch.randn_like(state) if with_dstate else None
    grads = backward(dout, dstate, *x, state, scale=2.0)
    (s, args), = kernels["bwd"]
    assert s.scale == 2.0 and not s.causal and len(args) == 15
    assert all(a is b for a, b in zip(args[:5], x))
    assert args[5].dtype == torch.float32 and torch.equal(args[5], state.float())
    assert args[6].dtype == BF16 and torch.equal(args[6], dout.to(BF16))
    assert (args[7] is None) if dstate is None else torch.equal(args[7], dstate.float())
    assert len(grads) == 5 and all(a is g for a, g in zip(args[8:13], grads))
    assert args[13:] == (None, None)  # no initial_state, no gradient of one
    assert [g.shape for g in grads] == [t.shape for t in x] and grads[0].dtype == BF16


def test_nothing_is_launched_without_tokens_or_heads(kernels, gen):
    x = [t.to(BF16) for t in _x(gen, N=0)]
    out, state = forward(*x, state=torch.full((2, 2, 32, 64, 32), float("nan")))
    assert out.shape == (2, 0, 2, 64) and not state.any()
    grads = backward(torch.zeros(2, 0, 2, 64), None, *x, state)
    assert [g.numel() for g in grads] == [0] * 5
    forward(*(t.to(BF16) for t in _x(gen, H=0)))
    assert kernels == {}


def test_backward_refuses_bad_aux_tensors_naming_them(kernels, gen):
    x = [t.to(BF16) for t in _x(gen)]
    state, dout = torch.zeros(2, 2, 32, 64, 32), torch.zeros(2, 7, 2, 64)
    for args, words in (((dout[:, :3], None, *x, state), "dout must have shape"),
                        ((dout, state[..., :3], *x, state), "dstate must have shape"),
                        ((dout, None, *x, state[:, :1]), "state must have shape"),
                        ((dout, None, *x, state.to(torch.int32)), "state must be a floating"),
                        ((dout, None, *x, state.to("meta")), "state is on meta but q1, q2")):
        with pytest.raises((TypeError, ValueError), match=words):
            backward(*args)
    assert kernels == {}


# ---------------------------------------------------------------------------------------------
# Shapes, FLOPs, registration


def test_flop_model_at_the_presets():
    assert pass_flops(PRESETS["t1"]) == 4 * 8 * 524288 * 32 ** 3 == 549_755_813_888
    assert pass_flops(PRESETS["t2"]) == 4 * 8 * 524288 * 64 ** 3 == 4_398_046_511_104
    assert pass_flops(PRESETS["t2"], "bwd") == 2 * pass_flops(PRESETS["t2"])
    assert pass_flops(PRESETS["t1_causal"]) == pass_flops(PRESETS["t1"])
    assert pass_flops(Shape(2, 100, 3, 32, 64)) == 4 * 2 * 3 * 100 * 32 * 32 * 64


def test_shape_record():
    s = PRESETS["t2_causal"]
    assert s.short() == "B1 N524288 H8 Dq64 Dv64 causal"
    assert s.check_shape() == Shape(1, 8191, 2, 64, 64, causal=True)
    sp = s.spec()
    assert (sp.N, sp.Dq, sp.causal, sp.scale) == (524288, 64, True, 1 / 524288)
    with pytest.raises(ValueError, match="head dim Dq=48"):
        Shape(1, 8, 1, 48, 64).spec()


def test_pass_inputs_match_the_passes(kernels):
    s = Shape(1, 16, 2, 32, 64, causal=True)
    fwd_args = pass_inputs(s, "fwd", device="cpu")
    assert len(fwd_args) == 7 and fwd_args[5:] == (None, True)
    bwd_args = pass_inputs(s, "bwd", device="cpu")
    assert len(bwd_args) == 10 and bwd_args[1] is None and bwd_args[7].shape == (1, 2, 32, 64, 32)
    assert bwd_args[0].shape == (1, 16, 2, 64) and bwd_args[8:] == (None, True)


def test_the_family_is_registered():
    assert altattn.families()["triple"] == "triple attention"
    assert altattn.variants("triple", "fwd") == altattn.triple.variants("fwd")
    assert set(altattn.variants("triple", "bwd")) == {"tlx", "triton"}
    fam = registry.get_family("triple")
    assert set(fam.scopes.values()) <= set(registry.SCOPE_ROLES)
    assert {p.name for p in fam.peers} == {"materialised", "torch_einsum"}

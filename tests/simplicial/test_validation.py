"""Bad input turns into a clear Python error naming the argument, before any device work (CPU)."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from altattn import simplicial as simplicial_attn
from altattn.simplicial import forward, reference, variants
from altattn.simplicial.spec import validate

from conftest import hq_taken_by

B, N, HQ, HK, D = 2, 5, 4, 2, 64


@pytest.fixture
def good(rand):
    """A valid call's arguments as a dict (CPU tensors)."""
    q, k1, k2, v1, v2 = rand(B, N, HQ, HK, D)
    return dict(q=q, k1=k1, k2=k2, v1=v1, v2=v2, w1=3, w2=4)


def t(shape, dtype=torch.bfloat16, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


# name -> (changes to the good call, exception type, message fragment).
# Every case breaks exactly one thing, so it also pins which check runs first.
SHAPE_CASES = {
    "q_not_tensor": (dict(q=[[0.0]]), TypeError, "q must be a torch.Tensor, got list"),
    "k2_str": (dict(k2="k2"), TypeError, "k2 must be a torch.Tensor, got str"),
    "v1_none": (dict(v1=None), TypeError, "v1 must be a torch.Tensor, got NoneType"),
    "q_rank3": (dict(q=t((N, HQ, D))), ValueError, "q must have rank 4"),
    "q_rank5": (dict(q=t((1, B, N, HQ, D))), ValueError, "q must have rank 4"),
    "k1_rank3": (dict(k1=t((B, N, HK * D))), ValueError, "k1 must have rank 4"),
    "v2_rank2": (dict(v2=t((N, D))), ValueError, "v2 must have rank 4"),
    "q_float32": (dict(q=t((B, N, HQ, D), torch.float32)), TypeError, "q must be torch.bfloat16"),
    "q_float16": (dict(q=t((B, N, HQ, D), torch.float16)), TypeError, "q must be torch.bfloat16"),
    "q_int32": (dict(q=t((B, N, HQ, D), torch.int32)), TypeError, "q must be torch.bfloat16"),
    "v1_float32": (dict(v1=t((B, N, HK, D), torch.float32)), TypeError, "v1 must be torch.bfloat16"),
    "v1_float16": (dict(v1=t((B, N, HK, D), torch.float16)), TypeError, "v1 must be torch.bfloat16"),
    "v1_int64": (dict(v1=t((B, N, HK, D), torch.int64)), TypeError, "v1 must be torch.bfloat16"),
    "k1_B": (dict(k1=t((B + 1, N, HK, D))), ValueError, "k1 has B (dim 0) = 3 but q has 2"),
    "v2_N": (dict(v2=t((B, N - 1, HK, D))), ValueError, "v2 has N (dim 1) = 4 but q has 5"),
    "k2_D": (dict(k2=t((B, N, HK, 128))), ValueError, "k2 has D (dim 3) = 128 but q has 64"),
    "v1_Hk": (dict(v1=t((B, N, 1, D))), ValueError, "v1 has Hk (dim 2) = 1 but k1 has 2"),
    "k2_Hk": (dict(k2=t((B, N, 4, D))), ValueError, "k2 has Hk (dim 2) = 4 but k1 has 2"),
    "Hq_not_multiple": (dict(q=t((B, N, 6, D)), k1=t((B, N, 4, D)), k2=t((B, N, 4, D)),
                             v1=t((B, N, 4, D)), v2=t((B, N, 4, D))),
                        ValueError, "Hq=6 must be a multiple of Hk=4"),
    "Hq_zero": (dict(q=t((B, N, 0, D))), ValueError, "head counts must be >= 1"),
    "D96": (dict(q=t((B, N, HQ, 96)), k1=t((B, N, HK, 96)), k2=t((B, N, HK, 96)),
                 v1=t((B, N, HK, 96)), v2=t((B, N, HK, 96))),
            ValueError, "head dim D=96 is not supported"),
    "D256": (dict(q=t((B, N, HQ, 256)), k1=t((B, N, HK, 256)), k2=t((B, N, HK, 256)),
                  v1=t((B, N, HK, 256)), v2=t((B, N, HK, 256))),
             ValueError, "head dim D=256 is not supported"),
    "w1_zero": (dict(w1=0), ValueError, "w1 must be a positive int"),
    "w2_zero": (dict(w2=0), ValueError, "w2 must be a positive int"),
    "w1_negative": (dict(w1=-3), ValueError, "w1 must be a positive int"),
    "w2_negative": (dict(w2=-1), ValueError, "w2 must be a positive int"),
    "w1_float": (dict(w1=3.0), TypeError, "w1 must be a positive int, got float"),
    "w2_float": (dict(w2=2.5), TypeError, "w2 must be a positive int, got float"),
    "w1_bool": (dict(w1=True), TypeError, "w1 must be a positive int, got bool"),
    "w2_bool": (dict(w2=False), TypeError, "w2 must be a positive int, got bool"),
    "w1_none": (dict(w1=None), TypeError, "w1 must be a positive int, got NoneType"),
    "w2_str": (dict(w2="4"), TypeError, "w2 must be a positive int, got str"),
    "w2_tensor": (dict(w2=torch.tensor(4)), TypeError, "w2 must be a positive int, got Tensor"),
    "scale_negative": (dict(sm_scale=-0.1), ValueError, "sm_scale must be a finite positive float"),
    "scale_zero": (dict(sm_scale=0.0), ValueError, "sm_scale must be a finite positive float"),
    "scale_int_zero": (dict(sm_scale=0), ValueError, "sm_scale must be a finite positive float"),
    "scale_nan": (dict(sm_scale=math.nan), ValueError, "sm_scale must be a finite positive float"),
    "scale_inf": (dict(sm_scale=math.inf), ValueError, "sm_scale must be a finite positive float"),
    "scale_str": (dict(sm_scale="0.1"), TypeError, "sm_scale must be a float or None, got str"),
    "scale_bool": (dict(sm_scale=True), TypeError, "sm_scale must be a float or None, got bool"),
    "devices_differ": (dict(q=t((B, N, HQ, D), device="meta")), ValueError,
                       "must be on one device"),
    "form_unknown": (dict(form="plain"), ValueError,
                     "form must be one of 'trilinear', 'det', got 'plain'"),
    "form_upper": (dict(form="DET"), ValueError, "form must be one of"),
    "form_none": (dict(form=None), TypeError, "form must be a str, got NoneType"),
}


def call(fn, args: dict):
    a = dict(args)
    pos = [a.pop(k) for k in ("q", "k1", "k2", "v1", "v2", "w1", "w2")]
    return fn(*pos, **a)


@pytest.mark.parametrize("fn", [forward, reference], ids=["forward", "reference"])
@pytest.mark.parametrize("case", SHAPE_CASES.values(), ids=SHAPE_CASES.keys())
def test_bad_input(case, fn, good):
    change, exc, frag = case
    if fn is reference and frag.endswith("must be torch.bfloat16"):
        # the reference takes bf16, fp16, fp32 and fp64 alike, all of one dtype
        frag = "must share one dtype" if change[frag.split()[0]].is_floating_point() \
            else "must have a dtype in"
    with pytest.raises(exc) as info:
        call(fn, {**good, **change})
    assert frag in str(info.value), f"message {str(info.value)!r} lacks {frag!r}"


def test_devices_message_lists_each_tensor(good):
    with pytest.raises(ValueError) as info:
        call(forward, {**good, "k2": t((B, N, HK, D), device="meta")})
    msg = str(info.value)
    assert "k2:meta" in msg and "q:cpu" in msg, msg


def test_unknown_variant_lists_known(good):
    with pytest.raises(ValueError) as info:
        call(forward, {**good, "variant": "no-such-kernel"})
    msg = str(info.value)
    assert "unknown variant 'no-such-kernel'" in msg, msg
    for name in variants():
        assert name in msg, f"{name!r} missing from {msg!r}"


@pytest.mark.parametrize("bad", [None, 3, ["triton"]])
def test_variant_not_a_string(bad, good):
    with pytest.raises(TypeError, match="variant must be a str"):
        call(forward, {**good, "variant": bad})


@pytest.mark.parametrize("name", list(variants()))
def test_named_variant_cannot_take_g12(name, rand):
    """G = 12 is no power of two: every variant that refuses it says which shape and why."""
    q, k1, k2, v1, v2 = rand(1, 4, 12, 1, 64)
    from altattn import registry
    from altattn.simplicial.spec import validate
    why = registry.get(name, "fwd", "simplicial").cannot_take(validate(q, k1, k2, v1, v2, 2, 2))
    if why is None:
        pytest.skip(f"{name} takes G=12")
    with pytest.raises(ValueError) as info:
        forward(q, k1, k2, v1, v2, 2, 2, variant=name)
    msg = str(info.value)
    assert f"variant {name!r} cannot take" in msg and "Hq=12 Hk=1" in msg, msg
    assert why in msg, msg


def test_auto_cannot_take_g12_says_why(rand):
    q, k1, k2, v1, v2 = rand(1, 4, 12, 1, 64)
    with pytest.raises(ValueError) as info:
        forward(q, k1, k2, v1, v2, 2, 2)
    msg = str(info.value)
    assert "no variant can take" in msg and "Hq=12" in msg and "G = Hq/Hk = 12" in msg, msg


@pytest.mark.parametrize("variant", ["auto", *variants()])
def test_cpu_tensors_need_cuda(variant, good, rand):
    hq = HQ if variant == "auto" else hq_taken_by(variant, B, N, HQ, HK, D, 3, 4)
    if hq != HQ:  # a shape the variant takes (shape errors come before device errors)
        q, k1, k2, v1, v2 = rand(B, N, hq, HK, D)
        good = dict(good, q=q, k1=k1, k2=k2, v1=v1, v2=v2)
    with pytest.raises(ValueError) as info:
        call(forward, {**good, "variant": variant})
    msg = str(info.value)
    assert "CUDA GPU" in msg and "cpu" in msg, msg


def test_meta_tensors_need_cuda(good):
    metas = {k: (torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v)
             for k, v in good.items()}
    with pytest.raises(ValueError, match="CUDA GPU"):
        call(forward, metas)


def test_cpu_empty_inputs_still_need_cuda(rand):
    """Device checks do not depend on the problem being empty."""
    x = rand(0, 4, 4, 2, 64)
    with pytest.raises(ValueError, match="CUDA GPU"):
        forward(*x, 2, 2)


def test_reference_accepts_cpu(good):
    out, lse = call(reference, good)
    assert out.device.type == "cpu" and out.shape == (B, N, HQ, D)
    assert lse.device.type == "cpu" and lse.shape == (B, HQ, N)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_reference_non_contiguous_inputs(rand, gen):
    """q from a transposed [B, Hq, N, D] tensor, k1 a slice of a wider tensor, v2 with a
    token-major batch layout: same result as contiguous copies."""
    q, k1, k2, v1, v2 = rand(B, N, HQ, HK, D)
    q_nc = q.transpose(1, 2).contiguous().transpose(1, 2)
    wide = torch.randn(B, N, HK, 2 * D, generator=gen).bfloat16()
    wide[..., D:] = k1
    k1_nc = wide[..., D:]
    v2_nc = v2.transpose(0, 1).contiguous().transpose(0, 1)
    assert not any(x.is_contiguous() for x in (q_nc, k1_nc, v2_nc))
    assert torch.equal(q_nc, q) and torch.equal(k1_nc, k1) and torch.equal(v2_nc, v2)
    a = reference(q, k1, k2, v1, v2, 3, 4)
    b = reference(q_nc, k1_nc, k2, v1, v2_nc, 3, 4)
    assert (a[0] - b[0]).abs().max() <= 1e-12
    assert (a[1] - b[1]).abs().max() <= 1e-12


def test_public_api():
    assert set(simplicial_attn.__all__) >= {"forward", "reference", "variants", "flops"}


# ------------------------------------------------------------------------------------------------
# A GPU that is not Hopper, simulated on the CPU: FakeTensorMode makes tensors that report a CUDA
# device without any memory or driver, and the capability query answers sm_80.

def _fake_cuda_inputs(Hq, Hk, D=128, B=1, N=8):
    fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
    with fake_tensor.FakeTensorMode():
        return [torch.empty(B, N, h, D, dtype=torch.bfloat16, device="cuda")
                for h in (Hq, Hk, Hk, Hk, Hk)]


@pytest.fixture
def sm80(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (8, 0))


@pytest.mark.parametrize("hq", [128, 64, 8], ids=["G128", "G64", "G8"])
def test_auto_on_sm80_names_the_gpu(sm80, hq):
    """On an sm_80 GPU "auto" says the GPU is the problem, not that no variant takes the shape."""
    x = _fake_cuda_inputs(hq, 1)
    assert x[0].device.type == "cuda"
    with pytest.raises(RuntimeError) as info:
        forward(*x, 2, 4)
    msg = str(info.value)
    assert "sm_80" in msg and "Hopper" in msg and "sm_90" in msg, msg
    assert "no variant can take" not in msg, msg


def test_auto_on_sm80_shape_error_stays_a_shape_error(sm80):
    """A shape no variant takes on any GPU (G = 12) is still reported as the shape's problem."""
    x = _fake_cuda_inputs(12, 1)
    with pytest.raises(ValueError, match="no variant can take .*G = Hq/Hk = 12"):
        forward(*x, 2, 4)


def _det_variants(pass_: str = "fwd") -> list[str]:
    from altattn import registry
    return [v.name for v in registry.all_variants(pass_, "simplicial")
            if "det" in v.accepted("form")]


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_auto_takes_a_det_kernel_on_hopper(pass_):
    """Form "det": "auto" on an sm_90 GPU takes a variant that computes it, the fastest measured:
    the forward's `tlx_pipelined_pingpong` at G = 128 and D = 128, `tlx_pipelined_kv` at G = 128
    and D = 64 (the TLX det build, keys-side), `triton` at other G; the backward's `tlx_pairs` at
    G >= 16, `triton` below; the trilinear pick at the same shape is unchanged."""
    from altattn.launcher import pick
    from altattn.simplicial.spec import validate_shape
    assert "triton" in _det_variants(pass_)
    for hq, hk, d in ((128, 1, 128), (256, 2, 64), (64, 1, 64), (8, 1, 128), (32, 4, 128),
                      (1, 1, 64)):
        spec = dataclasses.replace(validate_shape(1, 300, hq, hk, d, 32, 512), form="det")
        want = "triton"
        if pass_ == "fwd" and hq // hk == 128:
            want = "tlx_pipelined_pingpong" if d == 128 else "tlx_pipelined_kv"
        if pass_ == "bwd" and hq // hk >= 16:
            want = "tlx_pairs"
        assert pick(spec, "auto", True, pass_, family="simplicial").name == want, (hq, hk, d)
        assert pick(dataclasses.replace(spec, form="trilinear"), "auto", True, pass_,
                    family="simplicial").accepted("form")


@pytest.mark.parametrize("pass_, variant", [(p, v) for p in ("fwd", "bwd") for v in variants(p)
                                             if v not in _det_variants(p)])
def test_named_variant_without_det_refuses_it(pass_, variant):
    """A named variant that computes only the trilinear form refuses "det" with a ValueError
    naming the form and the variants that can (before the device check)."""
    from altattn.launcher import pick
    from altattn.simplicial.spec import validate_shape
    spec = dataclasses.replace(validate_shape(1, 300, 128, 1, 128, 32, 512), form="det")
    can = ", ".join(_det_variants(pass_))
    with pytest.raises(ValueError, match=rf"not 'det'.*variants that can: {re.escape(can)}$"):
        pick(spec, variant, True, pass_, family="simplicial")


@pytest.mark.parametrize("bwd_variant", [v for v in variants("bwd") if v not in _det_variants("bwd")])
def test_det_with_a_trilinear_backward_refused_before_any_launch(bwd_variant, monkeypatch):
    """attention(form="det", bwd_variant=<one without det>) on (fake) Hopper tensors: ValueError
    naming the form at the call, before the forward runs (fake tensors: a launch would fail
    otherwise); the backward entry point likewise."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    from altattn.simplicial import passes as backward
    x = [t.requires_grad_() for t in _fake_cuda_inputs(128, 1)]
    with pytest.raises(ValueError, match=r"not 'det'.*variants that can: triton"):
        simplicial_attn.attention(*x, 2, 4, bwd_variant=bwd_variant, form="det")
    x = [t.detach() for t in x]
    fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
    with fake_tensor.FakeTensorMode():
        lse = torch.empty(1, 128, 8, device="cuda")
    with pytest.raises(ValueError, match=r"not 'det'.*variants that can: triton"):
        backward.backward(x[0], None, *x, x[0], lse, 2, 4, variant=bwd_variant, form="det")


def test_det_form_on_hopper_selects_det_kernels_both_passes(monkeypatch):
    """form="det" on (fake) Hopper tensors at G = 128: the launcher selects a TLX det forward
    and the `tlx_pairs` backward, and attention gets past both checks
    (FakeTensorMode runs the op's fake implementation, no kernel)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    from altattn.launcher import select
    x = _fake_cuda_inputs(128, 1)
    spec = validate(*x, 2, 4, form="det")
    assert select(spec, "auto", x[0].device,  # D = 128
                  family="simplicial").name == "tlx_pipelined_pingpong"
    assert select(spec, "auto", x[0].device, "bwd", family="simplicial").name == "tlx_pairs"
    out, lse = simplicial_attn.attention(*x, 2, 4, form="det")
    assert out.shape == x[0].shape and lse.shape == (1, 128, 8)


@pytest.mark.parametrize("name", list(variants()))
def test_named_variant_on_sm80_names_the_gpu(sm80, name):
    from altattn import registry
    if not registry.get(name, "fwd", "simplicial").needs_hopper:
        pytest.skip(f"{name} runs on sm_80")
    hq = hq_taken_by(name, 1, 8, 64, 1, 128, 2, 4)
    x = _fake_cuda_inputs(hq, 1)
    with pytest.raises(RuntimeError, match="needs a Hopper GPU .*this GPU is sm_80"):
        forward(*x, 2, 4, variant=name)

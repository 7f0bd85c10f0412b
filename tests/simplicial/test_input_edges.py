"""Input edge cases found in review: window clamping, numpy scalars, sm_scale overflow, grad inputs;
hostile inputs to `attention` and `backward.backward` (devices, incoming gradients, huge windows,
partial requires_grad, non-finite values). (Grids with B * Hk > 65535 are tested on the GPU in
test_gpu.py; the layer and empty shapes in test_backward_cpu.py.)"""
import math
import warnings

import numpy as np
import pytest
import torch

from altattn import simplicial as sa
from altattn.simplicial.spec import validate


def _x(B=1, N=5, Hq=8, Hk=1, D=64, device="cpu", requires_grad=False):
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(B, N, h, D, generator=g).bfloat16() for h in (Hq, Hk, Hk, Hk, Hk)]
    return [t.to(device).requires_grad_(requires_grad) for t in ts]


def test_windows_longer_than_sequence_are_clamped():
    spec = validate(*_x(N=5), 32, 2**40)
    assert (spec.w1, spec.w2) == (5, 5)


def test_clamped_reference_is_the_same_function():
    x = _x(N=7)
    a = sa.reference(*x, 3, 10**9)
    b = sa.reference(*x, 3, 7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_numpy_scalars_accepted():
    spec = validate(*_x(), np.int64(2), np.int32(3), sm_scale=np.float32(0.25))
    assert (spec.w1, spec.w2, spec.sm_scale) == (2, 3, 0.25)


@pytest.mark.parametrize("bad", [10**400, -(10**400)])
def test_sm_scale_overflow_is_a_value_error(bad):
    with pytest.raises(ValueError, match="sm_scale"):
        validate(*_x(), 2, 3, sm_scale=bad)


def test_inputs_requiring_grad_are_refused():
    with pytest.raises(ValueError, match="forward-only"):
        sa.forward(*_x(requires_grad=True), 2, 3)


def test_inputs_requiring_grad_pass_under_no_grad():
    with torch.no_grad(), pytest.raises(ValueError, match="CUDA GPU"):  # the next check, on CPU
        sa.forward(*_x(requires_grad=True), 2, 3)


# ------------------------------------------------------------------------------------------------
# Hostile inputs to the differentiable API (issue 23), on the CPU: `attention` runs the fp64
# reference and its closed-form backward there; `backward.backward` checks every argument before
# its device check, so its refusals are testable without a GPU.

def _f64(B=1, N=6, Hq=4, Hk=2, D=64, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, N, h, D, generator=g, dtype=torch.float64)
            .requires_grad_(requires_grad) for h in (Hq, Hk, Hk, Hk, Hk)]


def test_mixed_devices_named_before_dtypes():
    """q on 'meta' (the kernels' dtype rules) and the rest on the CPU (the reference's): the
    error is the devices, not "k1 must be bf16"."""
    x = _f64()
    x[0] = torch.empty_like(x[0], device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one device, got q:meta, k1:cpu"):
        sa.attention(*x, 2, 3)


def test_meta_tensors_propagate_shapes():
    """On 'meta' bf16 tensors `attention` gives meta outputs of the right shapes (the op's fake
    implementation, as any torch op on meta); other dtypes are refused as on the GPU."""
    x = [torch.empty_like(t, device="meta", dtype=torch.bfloat16) for t in _f64(B=2, N=7)]
    out, lse = sa.attention(*x, 2, 3)
    assert out.device.type == lse.device.type == "meta"
    assert out.shape == (2, 7, 4, 64) and lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    with pytest.raises(TypeError, match="q must be torch.bfloat16"):
        sa.attention(*[t.float() for t in x], 2, 3)


def test_wrong_incoming_gradient_through_autograd():
    """torch's autograd, not our op, checks the incoming gradient of `attention`'s outputs: a
    wrong shape, a complex dtype or another device is refused naming grad_output; another real
    dtype (fp32, even int) is cast to the output's, exactly as for any torch op."""
    x = _f64(requires_grad=True)
    out, lse = sa.attention(*x, 2, 3)
    for bad, match in ((torch.ones(1, 6, 4, 32, dtype=torch.float64), "Mismatch in shape"),
                       (torch.ones(1, 6, 4, 64, dtype=torch.complex128), "complex"),
                       (torch.ones(1, 6, 4, 64, dtype=torch.float64, device="meta"),
                        "expected device cpu but got meta")):
        with pytest.raises(RuntimeError, match=match):
            torch.autograd.grad(out, x, bad, retain_graph=True)
    with pytest.raises(RuntimeError, match="Mismatch in shape"):  # [B, N, Hq] for [B, Hq, N]
        torch.autograd.grad(lse, x, torch.ones(1, 6, 4, dtype=torch.float64), retain_graph=True)
    want = torch.autograd.grad(out, x, torch.full(out.shape, 2.0, dtype=torch.float64),
                               retain_graph=True)
    for g in (torch.full(out.shape, 2.0), torch.full(out.shape, 2, dtype=torch.int64)):
        got = torch.autograd.grad(out, x, g, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), g.dtype


def _bwd_args():
    """A valid `backward.backward` call on CPU bf16 tensors, as a dict (it then fails only on
    the device: the kernels need CUDA)."""
    x = [t.bfloat16() for t in _f64()]
    out, lse = sa.reference(*x, 2, 3)
    return dict(dout=torch.ones_like(out, dtype=torch.bfloat16), dlse=torch.ones_like(lse).float(),
                q=x[0], k1=x[1], k2=x[2], v1=x[3], v2=x[4], out=out.bfloat16(), lse=lse.float(),
                w1=2, w2=3)


BWD_BAD = {  # name -> (changed arguments, exception, message)
    "dout_shape": (dict(dout=torch.ones(1, 6, 4, 32)), ValueError,
                   r"dout must have shape \(1, 6, 4, 64\) \[B, N, Hq, D\], got \(1, 6, 4, 32\)"),
    "dout_int": (dict(dout=torch.ones(1, 6, 4, 64, dtype=torch.int32)), TypeError,
                 "dout must be a floating-point tensor, got torch.int32"),
    "dout_none": (dict(dout=None), TypeError, "dout must be a torch.Tensor, got NoneType"),
    "dout_meta": (dict(dout=torch.ones(1, 6, 4, 64, device="meta")), ValueError,
                  "dout is on meta but q, k1, k2, v1, v2 are on cpu"),
    # [B, N, Hq] has [B, Hq, N]'s element count: a reshape would take it silently
    "dlse_transposed": (dict(dlse=torch.ones(1, 6, 4)), ValueError,
                        r"dlse must have shape \(1, 4, 6\) \[B, Hq, N\]"),
    "out_shape": (dict(out=torch.ones(1, 6, 2, 64)), ValueError, r"out must have shape"),
    "lse_bool": (dict(lse=torch.ones(1, 4, 6, dtype=torch.bool)), TypeError,
                 "lse must be a floating-point tensor"),
    "lse_list": (dict(lse=[0.0]), TypeError, "lse must be a torch.Tensor, got list"),
    "w1_zero": (dict(w1=0), ValueError, "w1 must be a positive int"),
    "w2_float": (dict(w2=3.0), TypeError, "w2 must be a positive int, got float"),
    "q_fp32": (dict(q=torch.ones(1, 6, 4, 64)), TypeError, "q must be torch.bfloat16"),
    "k2_N": (dict(k2=torch.ones(1, 5, 2, 64, dtype=torch.bfloat16)), ValueError,
             r"k2 has N \(dim 1\) = 5"),
    "variant_int": (dict(variant=1), TypeError, "variant must be a str"),
    "variant_unknown": (dict(variant="nope"), ValueError, "unknown variant 'nope' of pass 'bwd'"),
    "all_good_but_cpu": (dict(), ValueError, "needs the tensors on a CUDA GPU"),
    "form_unknown": (dict(form="nope"), ValueError, "form must be one of"),
    "form_det_tlx": (dict(form="det", variant="tlx_ws"), ValueError,
                     r"variant 'tlx_ws' cannot take .* form=det: .*not 'det'"),
}


@pytest.mark.parametrize("change, exc, match", BWD_BAD.values(), ids=BWD_BAD.keys())
def test_backward_rejects_bad_input(change, exc, match):
    from altattn.simplicial import passes as backward
    a = {**_bwd_args(), **change}
    pos = [a.pop(k) for k in ("dout", "dlse", "q", "k1", "k2", "v1", "v2", "out", "lse", "w1",
                              "w2")]
    with pytest.raises(exc, match=match):
        backward.backward(*pos, **a)


def test_reference_backward_refuses_transposed_dlse():
    """Before the check, dlse as [B, N, Hq] (same element count) gave wrong gradients silently."""
    x = _f64()
    dout = torch.ones(1, 6, 4, 64, dtype=torch.float64)
    sa.reference_backward(*x, 2, 3, dout, torch.ones(1, 4, 6))  # the right shape passes
    with pytest.raises(ValueError, match=r"dlse must have shape \(1, 4, 6\)"):
        sa.reference_backward(*x, 2, 3, dout, torch.ones(1, 6, 4))
    with pytest.raises(ValueError, match="dout must have shape"):
        sa.reference_backward(*x, 2, 3, dout[:, :5])


@pytest.mark.parametrize("w1, w2", [(10**40, 3), (2, 2**63), (10**40, 10**40), (2**62, 1)])
def test_huge_windows_equal_windows_of_n(w1, w2):
    """A window past N (even past int64, which the op's schema takes) gives bitwise the outputs
    and gradients of a window of N, through the differentiable op."""
    N = 6
    runs = []
    for a, b in ((w1, w2), (min(w1, N), min(w2, N))):
        x = _f64(N=N, requires_grad=True)
        out, lse = sa.attention(*x, a, b)
        (out.square().sum() + lse.sum()).backward()
        runs.append([out, lse, *(t.grad for t in x)])
    for name, a, b in zip(("out", "lse", "dq", "dk1", "dk2", "dv1", "dv2"), *runs):
        assert torch.equal(a, b), name


SUBSETS = [("q",), ("k1",), ("v2",), ("k1", "v2"), ("q", "k2", "v1"), ("k1", "k2", "v1", "v2")]


@pytest.mark.parametrize("subset", SUBSETS, ids=["+".join(s) for s in SUBSETS])
def test_requires_grad_on_some_inputs_matches_reference(subset):
    """Gradients for exactly the inputs that require grad, equal to autograd through the fp64
    reference; None for the others (GQA, w1 > w2, a loss through out and lse)."""
    names = ("q", "k1", "k2", "v1", "v2")
    x = _f64(N=7)
    for n, t in zip(names, x):
        t.requires_grad_(n in subset)
    out, lse = sa.attention(*x, 4, 2)
    (out.square().sum() + lse.sum()).backward()
    y = [t.detach().clone().requires_grad_() for t in x]
    o, lse_ = sa.reference(*y, 4, 2)
    (o.square().sum() + lse_.sum()).backward()
    for n, t, r in zip(names, x, y):
        if n in subset:
            torch.testing.assert_close(t.grad, r.grad, rtol=1e-10, atol=1e-12, msg=n)
        else:
            assert t.grad is None, n


@pytest.mark.parametrize("poisoned", ["q", "k1", "k2", "v1", "v2"])
def test_non_finite_input_stays_in_its_window_on_the_reference(poisoned):
    """The CPU path (the reference): inf at token t of batch 1's `poisoned` makes exactly batch
    1's outputs at the queries that see t non-finite (q: query t; K1/V1: i in [t, t + w1);
    K2/V2: i in [t, t + w2)), its LSE at most there (never for V1/V2, which the LSE does not
    read); batch 0's outputs, LSE and gradients stay finite. (The GPU tests,
    test_gpu_bounds.py and test_gpu_bwd.py, check that no value crosses batches in the kernels.)"""
    N, t, w1, w2 = 12, 4, 2, 3
    names = ("q", "k1", "k2", "v1", "v2")
    x = _f64(B=2, N=N, requires_grad=False)
    x[names.index(poisoned)][1, t] = math.inf
    for v in x:
        v.requires_grad_()
    out, lse = sa.attention(*x, w1, w2)
    seen = {"q": 1, "k1": w1, "v1": w1, "k2": w2, "v2": w2}[poisoned]
    bad_rows = (~torch.isfinite(out[1])).flatten(1).any(1).nonzero().flatten().tolist()
    assert bad_rows == list(range(t, t + seen)), bad_rows
    bad_lse = (~torch.isfinite(lse[1])).any(0).nonzero().flatten().tolist()
    assert set(bad_lse) <= set(bad_rows) and (poisoned[0] != "v" or not bad_lse), bad_lse
    assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all()
    (out[0].sum() + lse[0].sum() + out[1][torch.isfinite(out[1])].sum()).backward()
    for name, v in zip(names, x):
        assert torch.isfinite(v.grad[0]).all(), name


@pytest.mark.parametrize("bad", [None, [[1.0]], "numpy"], ids=["None", "list", "numpy"])
@pytest.mark.parametrize("arg", range(5), ids=["q", "k1", "k2", "v1", "v2"])
def test_op_names_a_non_tensor_input(arg, bad):
    """The op (not only the launcher) names the argument that is no tensor: a numpy array as q
    once raised AttributeError ('str' object has no attribute 'type')."""
    x: list = [torch.zeros(1, 4, h, 64) for h in (2, 1, 1, 1, 1)]
    x[arg] = np.zeros((1, 4, 1, 64), dtype=np.float32) if bad == "numpy" else bad
    name = ("q", "k1", "k2", "v1", "v2")[arg]
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor"):
        sa.attention(*x, 2, 4)


def test_cpu_head_ratio_no_kernel_takes_warns():
    x = [torch.zeros(1, 4, h, 64) for h in (3, 1, 1, 1, 1)]
    with pytest.warns(UserWarning, match=r"Hq/Hk = 3/1 = 3 runs on the CPU .* no GPU kernel"):
        sa.attention(*x, 2, 4)
    layer = sa.SimplicialAttention(dim=32, n_heads=3, n_kv_heads=1, head_dim=64, w1=2, w2=4)
    with pytest.warns(UserWarning, match="no GPU kernel takes it"):
        layer(torch.zeros(1, 4, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sa.attention(*[torch.zeros(1, 4, h, 64) for h in (4, 1, 1, 1, 1)], 2, 4)  # G = 4: silent

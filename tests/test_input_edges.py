"""Input edge cases found in review: window clamping, numpy scalars, sm_scale overflow, grad inputs;
hostile inputs to `attention` and `backward.backward` (devices; out, lse, dout and dlse). (Grids
with B * Hk > 65535 are tested on the GPU in test_gpu.py.)"""
import numpy as np
import pytest
import torch

import simplicial_attn as sa
from simplicial_attn.spec import validate


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
}


@pytest.mark.parametrize("change, exc, match", BWD_BAD.values(), ids=BWD_BAD.keys())
def test_backward_rejects_bad_input(change, exc, match):
    from simplicial_attn import backward
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
"""Input edge cases found in review: window clamping, numpy scalars, sm_scale overflow, grad inputs.
(Grids with B * Hk > 65535 are tested on the GPU in test_gpu.py.)"""
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

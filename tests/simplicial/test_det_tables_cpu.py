"""kernels_triton/simplicial/det.py's packings from cached column tables (det_keys, det_keys_side,
det_keys_side_grads) against the rotations they replaced (pi_chunks per call, kept below as
the reference), bit for bit, on the CPU."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from altattn.simplicial.reference import chunk_dims, pi_chunks

pytest.importorskip("triton")
from kernels_triton.simplicial import det as det_mod

DTYPES = [torch.bfloat16, torch.float32, torch.float64]
BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


# the implementations the tables replaced (git history: det.py before the tables)
def _rotations(x, det):
    r = 1 if det > 0 else 2
    return pi_chunks(x, r), pi_chunks(x, 3 - r)


def _det_keys(k1, det):
    k1b, k1a = _rotations(k1, det)
    return torch.stack((k1a, k1b), dim=3)


def _det_keys_side(k1, k2, det):
    k1r, k1s = _rotations(k1, det)
    k2r, k2s = _rotations(k2, det)
    return (torch.stack((k1r, -(chunk_dims(k1) * k1s)), dim=3),
            torch.stack((k2s, k2r), dim=3))


def _det_keys_side_grads(dk1p, dk2p, det):
    chi = chunk_dims(dk1p)
    dk1a, dk1b = dk1p.unbind(-2)
    dk2a, dk2b = dk2p.unbind(-2)
    r1, r2 = _rotations(dk1a, det)[1], _rotations(chi * dk1b, det)[0]
    s1, s2 = _rotations(dk2a, det)[0], _rotations(dk2b, det)[1]
    return r1 - r2, s1 + s2


def _same_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    assert torch.equal(got.view(BITS[got.dtype]), want.view(BITS[want.dtype]))


def _inputs(shape, dtype, gen):
    """Random values with signed zeros sprinkled in (the sign of a zero is part of the bits)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    zero = torch.rand(shape, generator=gen) < 0.1
    x = torch.where(zero, torch.where(x < 0, -0.0, 0.0), x)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 7])
@pytest.mark.parametrize("det", [1, -1])
@pytest.mark.parametrize("lead", [(2, 33, 3), (5,), (1, 4, 2, 1)])
def test_tables_match_the_rotations_bitwise(dtype, D, det, lead):
    gen = torch.Generator().manual_seed(D * 7 + det + len(lead))
    k1, k2 = (_inputs((*lead, D), dtype, gen) for _ in range(2))
    # the rotations stacked at dim 3: [..., 2, D] for the 4-D [B, N, Hk, D] callers pass, so
    # other ranks are compared through a 4-D view
    as4, back = (lambda x: x.reshape(-1, 1, 1, D)), (lambda p: p.reshape(*lead, 2, D))
    _same_bits(det_mod.det_keys(k1, det), back(_det_keys(as4(k1), det)))
    for got, want in zip(det_mod.det_keys_side(k1, k2, det),
                         _det_keys_side(as4(k1), as4(k2), det)):
        _same_bits(got, back(want))
    g1, g2 = (_inputs((*lead, 2, D), dtype, gen) for _ in range(2))
    for got, want in zip(det_mod.det_keys_side_grads(g1, g2, det),
                         _det_keys_side_grads(g1, g2, det)):
        _same_bits(got, want)


def test_non_finite_inputs_give_the_same_values():
    """inf and NaN land where they did (a NaN's sign bit may differ: not compared)."""
    gen = torch.Generator().manual_seed(0)
    k = _inputs((4, 3, 1, 64), torch.float32, gen)
    k[0, 0, 0, ::5], k[1, 2, 0, 1::7], k[3, 1, 0, 62:] = float("inf"), float("-inf"), float("nan")
    g = torch.stack((k, k.flip(0)), dim=-2)
    pairs = [(det_mod.det_keys(k, 1), _det_keys(k, 1)),
             *zip(det_mod.det_keys_side(k, k, -1), _det_keys_side(k, k, -1)),
             *zip(det_mod.det_keys_side_grads(g, g, 1), _det_keys_side_grads(g, g, 1))]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_non_contiguous_inputs_give_contiguous_packings():
    gen = torch.Generator().manual_seed(1)
    k = _inputs((3, 2, 64, 5), torch.bfloat16, gen).transpose(-1, -2)  # [3, 2, 5, 64], strided
    g = _inputs((3, 64, 2, 5), torch.float32, gen).transpose(-1, -3)  # [3, 5, 2, 64]
    _same_bits(det_mod.det_keys(k, -1), _det_keys(k, -1))
    for got, want in zip(det_mod.det_keys_side(k, k, 1), _det_keys_side(k, k, 1)):
        _same_bits(got, want)
    for got, want in zip(det_mod.det_keys_side_grads(g, g, -1), _det_keys_side_grads(g, g, -1)):
        _same_bits(got, want)


def test_meta_tensors_give_the_shapes():
    """host.prepare runs the packing on meta tensors for the packed K2's layout."""
    m = torch.empty(2, 16, 1, 128, dtype=torch.bfloat16, device="meta")
    assert det_mod.det_keys(m, 1).shape == (2, 16, 1, 2, 128)
    assert [p.shape for p in det_mod.det_keys_side(m, m, -1)] == [(2, 16, 1, 2, 128)] * 2


def test_tables_built_in_inference_mode_serve_autograd():
    """A table first built under inference mode is a normal tensor, so autograd may save it."""
    det_mod._TABLES.clear()
    k = torch.randn(2, 3, 1, 66, dtype=torch.float64)
    with torch.inference_mode():
        det_mod.det_keys(k, -1)
        det_mod.det_keys_side(k, k, -1)
    k1 = k.clone().requires_grad_()
    p1 = det_mod.det_keys_side(k1, k, -1)[0]
    (det_mod.det_keys(k1, -1).sum() + p1.sum()).backward()
    assert k1.grad is not None


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_call_is_a_few_ops_once_the_tables_are_built():
    """The host cost the tables buy (were 23, 50 and 95 ATen ops a call): views not counted."""
    k = torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)
    g = torch.randn(1, 8, 1, 2, 128)
    views = {"view", "unbind", "slice", "select", "unsqueeze", "_unsafe_view"}
    for call, most in ((lambda: det_mod.det_keys(k, 1), 1),
                       (lambda: det_mod.det_keys_side(k, k, 1), 3),
                       (lambda: det_mod.det_keys_side_grads(g, g, 1), 4)):
        call()
        with _CountOps() as count:
            call()
        assert len([op for op in count.ops if op not in views]) <= most, count.ops

"""What only the determinant form (form="det") has, on the CPU: its logits against torch.linalg.det
and both cross-product forms, the reference against a row-wise definition with torch.linalg.det,
SO(3) invariance (and a reflection's sign), the antisymmetric pair exchange and the layer. The tests
both forms share are parametrized by form: reference vs brute force (test_reference.py), the
closed-form backward vs autograd, gradcheck and opcheck of the op, torch.compile
(test_backward_cpu.py), bad input (test_validation.py)."""
from __future__ import annotations

import importlib
import math

import pytest
import torch

import simplicial_attn as sa
from simplicial_attn.reference import cross3

from conftest import fp64_inputs

ref_mod = importlib.import_module("simplicial_attn.reference")

TOL = 1e-12  # fp64 computations of the same sums, in another order


def max_err(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def det_logits_by_linalg(q, k1, k2):
    """s[i,j,k] = sum_l det[q_i^(l); k1_j^(l); k2_k^(l)] + leftover trilinear, for q [I, D],
    k1 [J, D], k2 [K, D], with torch.linalg.det (no Sarrus, no cross product)."""
    D = q.shape[-1]
    n = D // 3 * 3
    a, b, c = (t[:, :n].unflatten(-1, (n // 3, 3)) for t in (q, k1, k2))
    rows = torch.broadcast_tensors(a[:, None, None], b[None, :, None], c[None, None, :])
    dets = torch.linalg.det(torch.stack(rows, -2)).sum(-1) if n else 0.0  # [I, J, K]
    return dets + torch.einsum("id,jd,kd->ijk", q[:, n:], k1[:, n:], k2[:, n:])


def orthogonal3(gen, det: int) -> torch.Tensor:
    """A random 3x3 orthogonal matrix with determinant `det` (+1: a rotation; -1: a reflection),
    Haar-distributed: QR of a Gaussian matrix, signs fixed by R's diagonal."""
    Q, R = torch.linalg.qr(torch.randn(3, 3, generator=gen, dtype=torch.float64))
    Q = Q * torch.sign(torch.diagonal(R))
    if torch.linalg.det(Q) * det < 0:
        Q[:, 0] = -Q[:, 0]
    assert abs(torch.linalg.det(Q).item() - det) < 1e-12
    return Q


def rotate_chunks(x, R):
    """Every 3-chunk of x's last dim times R (x_chunk -> R x_chunk); the leftover dims kept."""
    n = x.shape[-1] // 3 * 3
    chunks = x[..., :n].unflatten(-1, (n // 3, 3)) @ R.T
    return torch.cat((chunks.flatten(-2), x[..., n:]), -1)


# ------------------------------------------------------------------------------------------------
# The logits

@pytest.mark.parametrize("D", [1, 2, 6, 8, 9, 64, 128])
def test_sarrus_equals_linalg_det_and_both_cross_product_forms(D, gen):
    """Sarrus (the reference's logits) = torch.linalg.det = (q x3 k1) . k2 = q . (k1 x3 k2); with
    no whole chunk (D < 3) all are the trilinear sum, else they differ from it."""
    q, k1, k2 = (torch.randn(n, D, generator=gen, dtype=torch.float64) for n in (4, 5, 6))
    sarrus = ref_mod._logits("id,jd,kd->ijk", q, k1, k2, "det")
    want = det_logits_by_linalg(q, k1, k2)
    left = torch.einsum("ijd,kd->ijk", cross3(q[:, None], k1[None]), k2)   # (q x3 k1) . k2
    right = torch.einsum("id,jkd->ijk", q, cross3(k1[:, None], k2[None]))  # q . (k1 x3 k2)
    for name, got in (("Sarrus", sarrus), ("(q x k1).k2", left), ("q.(k1 x k2)", right)):
        assert max_err(got, want) <= 1e-12, f"{name}: {max_err(got, want):.3e}"
    trilinear = torch.einsum("id,jd,kd->ijk", q, k1, k2)
    if D < 3:
        assert max_err(sarrus, trilinear) <= 1e-12
    else:
        assert max_err(sarrus, trilinear) > 1e-3


@pytest.mark.parametrize("D", [6, 8, 64])
def test_cross3_is_the_chunkwise_cross_product_and_hadamard_on_leftover_dims(D, gen):
    u, w = (torch.randn(7, D, generator=gen, dtype=torch.float64) for _ in range(2))
    n = D // 3 * 3
    got = cross3(u, w)
    want = torch.linalg.cross(u[:, :n].unflatten(-1, (-1, 3)), w[:, :n].unflatten(-1, (-1, 3)))
    assert max_err(got[:, :n], want.flatten(-2)) <= 1e-15
    assert torch.equal(got[:, n:], u[:, n:] * w[:, n:])


# ------------------------------------------------------------------------------------------------
# The reference

def test_reference_matches_determinant_definition_rowwise(gen, any_head_dim):
    """Rows straight from the definition with torch.linalg.det (w1 > w2, GQA, D = 8)."""
    B, N, Hq, Hk, D, w1, w2 = 2, 12, 4, 2, 8, 7, 3
    q, k1, k2, v1, v2 = x = fp64_inputs(gen, B, N, Hq, Hk, D)
    out, lse = sa.reference(*x, w1, w2, form="det")
    for b, i, h in [(0, 0, 0), (1, 2, 3), (0, 6, 1), (1, 11, 2)]:
        g = h // (Hq // Hk)
        js = torch.arange(max(0, i - w1 + 1), i + 1)
        ks = torch.arange(max(0, i - w2 + 1), i + 1)
        s = det_logits_by_linalg(q[b, i, h][None], k1[b, js, g], k2[b, ks, g])[0] / math.sqrt(D)
        row_lse = torch.logsumexp(s.flatten(), 0)
        row_out = torch.einsum("jk,jd,kd->d", torch.exp(s - row_lse), v1[b, js, g], v2[b, ks, g])
        assert max_err(out[b, i, h], row_out) <= TOL, (b, i, h)
        assert abs(lse[b, h, i].item() - row_lse.item()) <= TOL, (b, i, h)


def test_exchanging_the_pairs_negates_the_determinants(gen, any_head_dim):
    """Exchanging (k1, v1, w1) and (k2, v2, w2) equals negating q's chunk dims (its leftover
    dims kept), unlike the trilinear form, which it leaves unchanged."""
    q, k1, k2, v1, v2 = fp64_inputs(gen, 1, 13, 2, 1, 8)
    flipped = q.clone()
    flipped[..., :6] *= -1
    a = sa.reference(q, k1, k2, v1, v2, 3, 8, form="det")
    b = sa.reference(flipped, k2, k1, v2, v1, 8, 3, form="det")
    assert max_err(a[0], b[0]) <= TOL and max_err(a[1], b[1]) <= TOL
    c = sa.reference(q, k2, k1, v2, v1, 8, 3, form="det")
    assert max_err(a[1], c[1]) > 1e-3


@pytest.mark.parametrize("D", [8, 64])
def test_invariant_under_a_rotation_not_a_reflection(D, gen, any_head_dim):
    """One random R in SO(3) applied to every chunk of q, k1 and k2 leaves out and LSE as they
    are; a reflection (det -1) negates the determinants and changes them. The trilinear form is
    not invariant under the same rotation."""
    x = fp64_inputs(gen, 2, 9, 4, 2, D)
    w1, w2 = 4, 6
    want = sa.reference(*x, w1, w2, form="det")
    for det, invariant in ((1, True), (-1, False)):
        R = orthogonal3(gen, det)
        y = [rotate_chunks(t, R) for t in x[:3]] + x[3:]
        got = sa.reference(*y, w1, w2, form="det")
        err = max(max_err(got[0], want[0]), max_err(got[1], want[1]))
        assert (err <= 1e-10) if invariant else (err > 1e-2), (det, err)
        if invariant:
            trilinear = sa.reference(*x, w1, w2), sa.reference(*y, w1, w2)
            assert max_err(trilinear[0][1], trilinear[1][1]) > 1e-2


def test_layer_det_form_differs_from_trilinear_and_has_gradients(gen):
    torch.manual_seed(0)
    det = sa.SimplicialAttention(32, 4, 2, 64, 2, 4, form="det").double()
    assert "form=det" in repr(det)
    plain = sa.SimplicialAttention(32, 4, 2, 64, 2, 4).double()
    plain.load_state_dict(det.state_dict())
    x = torch.randn(2, 7, 32, generator=gen, dtype=torch.float64)
    y = det(x)
    assert max_err(y, plain(x)) > 1e-6
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in det.parameters())

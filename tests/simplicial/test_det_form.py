"""What only the determinant form (form="det") has, on the CPU: its logits against torch.linalg.det
and both cross-product forms, the reference against a row-wise definition with torch.linalg.det,
SO(3) invariance (and a reflection's sign), the antisymmetric pair exchange, the layer, and
`det_rotary` (relative positions, gradcheck through it). The tests both forms share are parametrized
by form: reference vs brute force (test_reference.py), the closed-form backward vs autograd,
gradcheck and opcheck of the op, torch.compile (test_backward_cpu.py), bad input
(test_validation.py)."""
from __future__ import annotations

import importlib
import math

import pytest
import torch

from altattn import simplicial as sa
from altattn.simplicial.reference import cross3

from conftest import fp64_inputs

ref_mod = importlib.import_module("altattn.simplicial.reference")

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


# ------------------------------------------------------------------------------------------------
# det_rotary

def test_rotary_logits_depend_only_on_relative_positions(gen):
    """s(R(p_i) q_i, R(p_j) k1_j, R(p_k) k2_k) = s(q_i, R(p_j - p_i) k1_j, R(p_k - p_i) k2_k) at
    arbitrary real positions; and they change when a key's relative position does."""
    N, D = 6, 8
    q, k1, k2 = (torch.randn(1, N, 1, D, generator=gen, dtype=torch.float64) for _ in range(3))
    p = torch.randn(N, generator=gen, dtype=torch.float64) * 50

    def logits(a, b, c):
        return ref_mod._logits("id,jd,kd->ijk", a[0, :, 0], b[0, :, 0], c[0, :, 0], "det")

    s = logits(*sa.det_rotary(q, k1, k2, p))
    for i in range(N):
        qi, k1r, k2r = sa.det_rotary(q, k1, k2, p - p[i])
        assert max_err(qi[0, i], q[0, i]) <= 1e-15  # rotated by 0
        assert max_err(s[i], logits(qi, k1r, k2r)[i]) <= 1e-12, i
    moved = p.clone()
    moved[2] += 1.0  # token 2's position relative to every other token changes
    assert max_err(logits(*sa.det_rotary(q, k1, k2, moved))[:, 2], s[:, 2]) > 1e-3


@pytest.mark.parametrize("D", [8, 64])
def test_rotary_out_and_lse_invariant_under_a_position_shift(D, gen, any_head_dim):
    """Shifting every position by one offset (per batch element, [B, N] positions) leaves out and
    LSE of the det form as they are; the trilinear form's change (rotary is for "det" only)."""
    B, N = 2, 9
    q, k1, k2, v1, v2 = fp64_inputs(gen, B, N, 4, 2, D)
    p = torch.arange(N)
    shifted = p + torch.tensor([[977], [-31]])  # [B, N]
    for form, invariant in (("det", True), ("trilinear", False)):
        a = sa.reference(*sa.det_rotary(q, k1, k2), v1, v2, 3, 5, form=form)
        b = sa.reference(*sa.det_rotary(q, k1, k2, shifted), v1, v2, 3, 5, form=form)
        err = max(max_err(a[0], b[0]), max_err(a[1], b[1]))
        assert (err <= 1e-10) if invariant else (err > 1e-3), (form, err)


def test_rotary_rotates_coordinates_0_1_of_each_chunk_by_position_times_theta(gen):
    """The documented map: chunk l of token p turns about its third coordinate by
    p * base^(-l/L); coordinate 2 and the leftover dims kept; dtypes kept; positions default to
    0 .. N-1."""
    B, N, D, base = 1, 5, 11, 500.0  # L = 3 chunks, 2 leftover dims
    q, k1, k2 = (torch.randn(B, N, h, D, generator=gen, dtype=torch.float64) for h in (2, 1, 1))
    rq, rk1, rk2 = sa.det_rotary(q, k1, k2, base=base)
    L = D // 3
    theta = base ** (-torch.arange(L, dtype=torch.float64) / L)
    for x, r in ((q, rq), (k1, rk1), (k2, rk2)):
        xc, rc = (t[..., :3 * L].unflatten(-1, (L, 3)) for t in (x, r))
        assert torch.equal(rc[..., 2], xc[..., 2]) and torch.equal(r[..., 3 * L:], x[..., 3 * L:])
        turn = torch.atan2(rc[..., 1], rc[..., 0]) - torch.atan2(xc[..., 1], xc[..., 0])
        want = torch.arange(N, dtype=torch.float64)[:, None, None] * theta  # [N, 1, L]
        assert max_err(torch.remainder(turn - want + math.pi, 2 * math.pi) - math.pi,
                       torch.zeros_like(turn)) <= 1e-9
        assert max_err(rc.norm(dim=-1), xc.norm(dim=-1)) <= 1e-12
    bf = [t.bfloat16() for t in (q, k1, k2)]
    assert all(t.dtype == torch.bfloat16 for t in sa.det_rotary(*bf))
    explicit = sa.det_rotary(q, k1, k2, torch.arange(N), base=base)
    assert all(torch.equal(a, b) for a, b in zip(explicit, (rq, rk1, rk2)))


def test_gradcheck_op_with_rotary(gen, any_head_dim):
    """Central differences through `det_rotary` and `attention(..., form="det")` (D = 8: two
    leftover dims, w1 > w2, GQA)."""
    x = fp64_inputs(gen, 1, 5, 4, 2, 8)

    def f(q, k1, k2, v1, v2):
        return sa.attention(*sa.det_rotary(q, k1, k2), v1, v2, 3, 2, form="det")

    assert torch.autograd.gradcheck(f, x, fast_mode=True)


@pytest.mark.parametrize("B, N, D", [(2, 0, 8), (0, 3, 8), (1, 3, 2)], ids=["N0", "B0", "D2"])
def test_rotary_empty_or_without_a_chunk(B, N, D, gen):
    """Empty inputs give empty outputs of their shapes; with D < 3 (no 3-chunk) nothing turns."""
    x = [torch.randn(B, N, h, D, generator=gen) for h in (2, 1, 1)]
    for a, b in zip(x, sa.det_rotary(*x, torch.arange(N) + 5)):
        assert torch.equal(a, b), (a.shape, b.shape)


ROTARY_BAD = {  # name -> (changed arguments, exception, message)
    "q_list": (dict(q=[0.0]), TypeError, "q must be a torch.Tensor, got list"),
    "k2_int": (dict(k2=torch.zeros(1, 4, 1, 8, dtype=torch.int32)), TypeError,
               "k2 must be a floating-point tensor"),
    "k1_rank3": (dict(k1=torch.zeros(1, 4, 8)), ValueError, "k1 must have rank 4"),
    "k1_D": (dict(k1=torch.zeros(1, 4, 1, 9)), ValueError, r"k1 must be \[B, N, Hk, D\]"),
    "k2_N": (dict(k2=torch.zeros(1, 3, 1, 8)), ValueError, r"k2 must be \[B, N, Hk, D\]"),
    "positions_shape": (dict(positions=torch.arange(5)), ValueError,
                        r"positions must have shape \(4,\) \[N\] or \(1, 4\) \[B, N\]"),
    "positions_bool": (dict(positions=torch.ones(4, dtype=torch.bool)), TypeError,
                       "positions must be a real torch.Tensor"),
    "positions_list": (dict(positions=[0, 1, 2, 3]), TypeError,
                       "positions must be a real torch.Tensor"),
    "base_zero": (dict(base=0.0), ValueError, "base must be a finite positive float"),
    "base_inf": (dict(base=math.inf), ValueError, "base must be a finite positive float"),
    "base_huge_int": (dict(base=10**400), ValueError, "base must be a finite positive float"),
    "base_str": (dict(base="1e4"), TypeError, "base must be a float, got str"),
}


@pytest.mark.parametrize("change, exc, match", ROTARY_BAD.values(), ids=ROTARY_BAD.keys())
def test_rotary_rejects_bad_input(change, exc, match):
    args = dict(q=torch.zeros(1, 4, 2, 8), k1=torch.zeros(1, 4, 1, 8), k2=torch.zeros(1, 4, 1, 8))
    with pytest.raises(exc, match=match):
        sa.det_rotary(**{**args, **change})


# ------------------------------------------------------------------------------------------------
# The Triton kernel's column bookkeeping, on the CPU (kernels_triton/simplicial/fwd.py: Qa, Qb, det_keys)

@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("det", [1, -1])
def test_triton_det_columns_build_the_cross_product(D, det, gen):
    """fma(Qa, K1a, Qb * K1b) with the kernel's columns (Qa = pi^R Q, Qb = -pi^(3-R) Q with 0 on
    the leftover dims, K1a/K1b from det_keys) is q x3 k1 for DET = +1 and, for DET = -1 (pairs
    swapped), q x3 k1 with q's chunk dims negated (reference._in_spec_order), in fp64."""
    pytest.importorskip("triton")
    from kernels_triton.simplicial.det import det_keys
    q, k1 = (torch.randn(3, D, generator=gen, dtype=torch.float64) for _ in range(2))
    r = 1 if det > 0 else 2
    qa = ref_mod.pi_chunks(q, r)
    qb = -(ref_mod.chunk_dims(q) * ref_mod.pi_chunks(q, 3 - r))
    packed = det_keys(k1[:, None, None], det)[:, 0, 0]  # [3, 2, D]
    assert packed.shape == (3, 2, D)
    a = qa * packed[:, 0] + qb * packed[:, 1]
    want = cross3(q if det > 0 else ref_mod._negate_chunks(q), k1)
    assert max_err(a, want) <= 1e-15


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("det", [1, -1])
def test_keys_side_det_columns_build_the_cross_product(D, det, gen):
    """det_keys_side's packing, as the TLX producer combines it (kernels_tlx/simplicial/ws_kv.py: B_j =
    K1a[j] * K2a + K1b[j] * K2b) is k1 x3 k2 for every (j, k) pair for DET = +1 and, for DET = -1
    (pairs swapped), k1 x3 k2 with its chunk dims negated (the leftover k1 * k2 kept), in fp64."""
    pytest.importorskip("triton")
    from kernels_triton.simplicial.det import det_keys_side
    k1 = torch.randn(3, D, generator=gen, dtype=torch.float64)
    k2 = torch.randn(4, D, generator=gen, dtype=torch.float64)
    p1, p2 = (p[:, 0, 0] for p in det_keys_side(k1[:, None, None], k2[:, None, None], det))
    assert p1.shape == (3, 2, D) and p2.shape == (4, 2, D)
    b = p1[:, None, 0] * p2[None, :, 0] + p1[:, None, 1] * p2[None, :, 1]  # [3, 4, D]
    want = cross3(k1[:, None], k2[None])
    assert max_err(b, want if det > 0 else ref_mod._negate_chunks(want)) <= 1e-15


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("det", [1, -1])
def test_triton_det_backward_columns_are_the_gradient(D, det, gen):
    """The Triton backward's bookkeeping (kernels_triton/simplicial/det.py): with A = Qa * K1a + Qb * K1b as
    the kernels build it and X = dL/dA, dQ = pi^(3-R)(X * K1a) - chi pi^R(X * K1b) (`_dq_kernel`'s
    U and W, read back through permuted columns) and dK1 = pi^R(X * Qa) + pi^(3-R)(X * Qb)
    (`_dkv1_kernel`'s two partials) equal autograd's gradients, in fp64."""
    pytest.importorskip("triton")
    from kernels_triton.simplicial.det import det_keys
    q, k1 = (torch.randn(5, D, generator=gen, dtype=torch.float64, requires_grad=True)
             for _ in range(2))
    x = torch.randn(5, D, generator=gen, dtype=torch.float64)
    r = 1 if det > 0 else 2
    chi = ref_mod.chunk_dims(q)
    qa, qb = ref_mod.pi_chunks(q, r), -(chi * ref_mod.pi_chunks(q, 3 - r))
    packed = det_keys(k1[:, None, None], det)[:, 0, 0]
    k1a, k1b = packed[:, 0], packed[:, 1]
    (qa * k1a + qb * k1b).mul(x).sum().backward()
    with torch.no_grad():
        dq = ref_mod.pi_chunks(x * k1a, 3 - r) - chi * ref_mod.pi_chunks(x * k1b, r)
        dk1 = ref_mod.pi_chunks(x * qa, r) + ref_mod.pi_chunks(x * qb, 3 - r)
    assert max_err(dq, q.grad) <= 1e-14
    assert max_err(dk1, k1.grad) <= 1e-14


@pytest.mark.parametrize("D", [64, 128, 7])
@pytest.mark.parametrize("det", [1, -1])
def test_keys_side_det_gradients_are_the_packings_adjoint(D, det, gen):
    """det_keys_side_grads (how `tlx_pairs` unpacks the sums it forms in the packing's columns)
    is the adjoint of det_keys_side: autograd's gradients of K1 and K2 through the packing, for
    random cotangents of the packed tensors, in fp64."""
    pytest.importorskip("triton")
    from kernels_triton.simplicial.det import det_keys_side, det_keys_side_grads
    k1, k2 = (torch.randn(2, 3, 2, D, generator=gen, dtype=torch.float64, requires_grad=True)
              for _ in range(2))
    p1, p2 = det_keys_side(k1, k2, det)
    g1, g2 = (torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in (p1, p2))
    ((p1 * g1).sum() + (p2 * g2).sum()).backward()
    dk1, dk2 = det_keys_side_grads(g1, g2, det)
    assert max_err(dk1, k1.grad) <= 1e-15 and max_err(dk2, k2.grad) <= 1e-15

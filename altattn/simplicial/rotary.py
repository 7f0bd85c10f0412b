"""Rotary position embeddings for the determinant form (form="det"): `det_rotary`.

Token p's 3-chunk l of q, k1 and k2 is rotated about one fixed axis, the chunk's third coordinate,
by the angle p * theta_l, theta_l = base ** (-l / L) (L = D // 3 chunks: RoPE's geometric
schedule, one frequency per chunk); the D mod 3 leftover dims are left as they are. Rotations
about one axis commute, and det[R a; R b; R c] = det[a; b; c] for every R in SO(3), so with query
i, keys j and k at positions p_i, p_j, p_k

    det[R(p_i) q; R(p_j) k1; R(p_k) k2] = det[q; R(p_j - p_i) k1; R(p_k - p_i) k2]:

the det logits depend on the positions only through p_j - p_i and p_k - p_i (the leftover dims'
trilinear term not at all). Any other fixed axis n gives the same family of models: with U in
SO(3) taking the third coordinate axis to n, R_n(t) = U R(t) U^T, the U^T folds into the
projections and det does not see the U. The trilinear form is not rotation-invariant: rotated
inputs give it logits that depend on absolute positions, so this helper is for form="det" only.
"""
from __future__ import annotations

import torch

from ..checks import check_floating, positive_float
from .spec import NAMES

DEFAULT_BASE = 10000.0  # RoPE's


def _angles(positions: torch.Tensor, L: int, base: float) -> torch.Tensor:
    """positions [..., N] -> angles [..., N, L] = p * base ** (-l / L), in fp64."""
    theta = base ** (-torch.arange(L, dtype=torch.float64, device=positions.device) / L)
    return positions.to(torch.float64)[..., None] * theta


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, H, D] with coordinates (0, 1) of each 3-chunk rotated by the angle whose cos, sin
    ([(B,) N, 1, L], x's compute dtype) are given; coordinate 2 and the leftover dims kept."""
    n = x.shape[-1] // 3 * 3
    t = x.to(cos.dtype)
    chunks = t[..., :n].unflatten(-1, (n // 3, 3))
    a, b, c = chunks.unbind(-1)
    rotated = torch.stack((cos * a - sin * b, sin * a + cos * b, c), -1).flatten(-2)
    return torch.cat((rotated, t[..., n:]), -1).to(x.dtype)


def det_rotary(q: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor,
               positions: torch.Tensor | None = None, *,
               base: float = DEFAULT_BASE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated copies of q [B, N, Hq, D], k1 and k2 [B, N, Hk, D] (the module docstring), each in
    its own dtype (computed in fp32, fp64 for fp64 inputs; angles in fp64), for
    `attention(..., form="det")`.

    positions: [N] or [B, N] token positions (any real dtype; default 0 .. N-1), the same for q,
    k1 and k2; base > 0: the frequencies' base. Differentiable (a linear map of each input)."""
    tensors = (q, k1, k2)
    for name, t in zip(NAMES, tensors):
        check_floating(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 [B, N, H, D], got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    B, N, _, D = q.shape
    for name, t in zip(NAMES[1:3], tensors[1:]):
        if (t.shape[0], t.shape[1], t.shape[3]) != (B, N, D):
            raise ValueError(f"{name} must be [B, N, Hk, D] with q's B, N, D: shapes "
                             f"q{tuple(q.shape)} vs {name}{tuple(t.shape)}")
    base = positive_float("base", base)
    if positions is None:
        positions = torch.arange(N, device=q.device)
    elif not isinstance(positions, torch.Tensor) or positions.is_complex() \
            or positions.dtype == torch.bool:
        raise TypeError(f"positions must be a real torch.Tensor or None, got "
                        f"{getattr(positions, 'dtype', type(positions).__name__)}")
    elif tuple(positions.shape) not in ((N,), (B, N)):
        raise ValueError(f"positions must have shape ({N},) [N] or ({B}, {N}) [B, N], got "
                         f"{tuple(positions.shape)}")
    angles = _angles(positions.to(q.device), D // 3, base)[..., None, :]  # [(B,) N, 1, L]
    out = []
    for t in tensors:
        dtype = torch.promote_types(t.dtype, torch.float32)
        out.append(_rotate(t, angles.cos().to(dtype), angles.sin().to(dtype)))
    return tuple(out)

"""The determinant form's pieces that the Triton forward and backward share (form "det"), and the
host packing of the TLX keys-side det forward (det_keys_side).

pi rotates each 3-chunk of D, (pi x)[3l+m] = x[3l + (m+1) mod 3], and leaves the D mod 3 leftover
columns in place (altattn/simplicial/reference.py states the form). A kernel builds

    A_j = Qa * K1a[j] + Qb * K1b[j],   Qa = pi^R Q, K1a = pi^(3-R) K1, Qb = -chi pi^(3-R) Q, K1b = pi^R K1

(chi: 1 on the chunk columns, 0 on the leftover ones), which is Q x3 K1[j] for R = 1 and its
negation on the chunk columns for R = 2: the launcher passes DET = +1 (R = 1), or DET = -1 (R = 2)
when it has exchanged the pairs, since that negates every determinant (the leftover trilinear
term keeps its sign). Q's two rotations are permuted-column loads of Q (`load_q_det`); K1's are
packed by the host (`det_keys`), two contiguous rows per j (the backward's `k1_rows`).

The backward differentiates that same A (kernels_triton/simplicial/bwd.py), so the sign takes care of itself:
with X = dL/dA_j,
    dQ   = sum_j pi^(3-R)(X * K1a[j]) - chi pi^R(X * K1b[j])
    dK1[j] = pi^R(sum_rows X * Qa) + pi^(3-R)(sum_rows X * Qb)
Each sum is formed on unpermuted columns and the rotation applied when it is read back
(`det_cols` gives the columns).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from altattn.simplicial.spec import ProblemSpec


def det_of(spec: ProblemSpec) -> int:
    """The kernels' DET constexpr: 0 for the trilinear form; for "det" +1, or -1 when the
    launcher exchanged the pairs (R = 1 or 2)."""
    if spec.form != "det":
        return 0
    return -1 if spec.swapped else 1


def det_specs(spec: ProblemSpec) -> list[ProblemSpec]:
    """The form "det" copies of a trilinear compile spec: the spec itself in form "det" and, at
    G = 128, Hk = 1, also with the pairs exchanged (DET = -1, a kernel of its own)."""
    det = replace(spec, form="det")
    return [det, replace(det, swapped=True)] if (spec.G, spec.Hk) == (128, 1) else [det]


def form_suffix(spec: ProblemSpec) -> str:
    """A compile config's name suffix for the spec's form: "", "_det" or "_det_swapped"."""
    if spec.form == "trilinear":
        return ""
    return f"_{spec.form}" + ("_swapped" if spec.swapped else "")


@triton.jit
def det_cols(c, D: tl.constexpr, DET: tl.constexpr):
    """(cols_a, cols_b, in_chunk) at columns c (tl.arange(0, D), or an opaque copy of it that
    keeps the compiler from hoisting what is built from it out of a loop) for DET = +-1 (R = 1 or
    2): the columns of pi^R and pi^(3-R) (x[cols_a] = pi^R x), and which lie in a whole 3-chunk."""
    R: tl.constexpr = 1 if DET > 0 else 2
    in_chunk = c < (D // 3) * 3
    base = c - c % 3
    cols_a = tl.where(in_chunk, base + (c % 3 + R) % 3, c)
    cols_b = tl.where(in_chunk, base + (c % 3 + 3 - R) % 3, c)
    return cols_a, cols_b, in_chunk


@triton.jit
def load_q_cols(Q, b, g, tok, head, N, cols, keep, HQ: tl.constexpr, G: tl.constexpr,
                D: tl.constexpr):
    """load_q's [rows, D] tile of Q with column c read from column cols[c] (0 past N and where
    not keep[c])."""
    off = ((b.to(tl.int64) * N + tok) * (HQ * D) + (g * G + head) * D)[:, None]
    return tl.load(Q + off + cols[None, :], mask=(tok < N)[:, None] & keep[None, :], other=0.0)


@triton.jit
def load_q_det(Q, b, g, tok, head, N, c, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
               DET: tl.constexpr):
    """(Qa, Qb) of the module docstring: load_q's [rows, D] tile of Q twice, with permuted
    columns (0 past N; Qb 0 on the leftover columns); c as for det_cols."""
    cols_a, cols_b, in_chunk = det_cols(c, D, DET)
    qa = load_q_cols(Q, b, g, tok, head, N, cols_a, c >= 0, HQ, G, D)
    qb = -load_q_cols(Q, b, g, tok, head, N, cols_b, in_chunk, HQ, G, D)
    return qa, qb


@triton.jit
def k1_rows(K1, kv_base, j, offs_d, HK: tl.constexpr, D: tl.constexpr, DET: tl.constexpr):
    """K1[j] of one (batch, KV head) whose token 0 is at kv_base, columns offs_d
    (tl.arange(0, D)), twice; DET: (K1a[j], K1b[j]) from det_keys' packed [B, N, HK, 2, D] (two
    contiguous rows). The backward's K1 loads (kernels_triton/simplicial/bwd.py)."""
    if not DET:
        k1j = tl.load(K1 + kv_base + j.to(tl.int64) * (HK * D) + offs_d)
        return k1j, k1j
    row = K1 + 2 * kv_base + j.to(tl.int64) * (2 * HK * D)
    return tl.load(row + offs_d), tl.load(row + D + offs_d)


class _Tables(NamedTuple):
    """The packings of this module as gathers along the last dim, for one (D, DET, device, dtype).
    With pR, pS the columns of pi^R and pi^(3-R) (x[..., pR] = pi^R x; det_cols' cols_a, cols_b)
    and chi the chunk columns, each index is [2, D] (x[..., index] is [..., 2, D] directly):
        keys     (pS, pR)            det_keys' K1, and det_keys_side's K2
        side     (pR, pS)            det_keys_side's K1 ...
        side_mul (1, -chi)           ... times this (-0.0 on the leftover columns: -(chi * x))
        grads1   (pS, D + pR)        det_keys_side_grads' dK1 from the flattened [..., 2D] packing,
        grads1_mul -chi [D]          dK1 = dK1a[pS] + dK1b[pR] * (-chi)  (chi[pR] = chi)
        grads2   (pR, D + pS)        dK2 = dK2a[pR] + dK2b[pS]
    Multiplying by +-1 and +-0 is exact, and x + y * (-1) = x - y, x + y * (-0.0) = x - y * 0,
    so the gathers give the pi_chunks rotations' results bit for bit."""
    keys: torch.Tensor
    side: torch.Tensor
    side_mul: torch.Tensor
    grads1: torch.Tensor
    grads1_mul: torch.Tensor
    grads2: torch.Tensor


def _build_tables(D: int, det: int, device: torch.device, dtype: torch.dtype) -> _Tables:
    """_Tables from plain constructors and elementwise ops on `device` (no host copies, so it
    may also run while a CUDA graph is being captured)."""
    r = 1 if det > 0 else 2
    d = torch.arange(D, device=device)
    chi = d < D // 3 * 3
    p_r, p_s = (torch.where(chi, d - d % 3 + (d % 3 + k) % 3, d) for k in (r, 3 - r))
    minus_chi = torch.where(chi, -1.0, -0.0).to(dtype)
    return _Tables(keys=torch.stack((p_s, p_r)), side=torch.stack((p_r, p_s)),
                   side_mul=torch.stack((torch.ones_like(minus_chi), minus_chi)),
                   grads1=torch.stack((p_s, D + p_r)), grads1_mul=minus_chi,
                   grads2=torch.stack((p_r, D + p_s)))


_TABLES: dict[tuple, _Tables] = {}


def _tables(x: torch.Tensor, det: int) -> _Tables:
    """The _Tables for x's last dim, device and dtype at DET = det, built on the first call and
    kept (a few KB each, never freed, so a CUDA graph may read them at every replay). The rule
    for CUDA graphs: a first call under capture (torch.cuda.is_current_stream_capturing()) builds
    them inside the graph, as the uncached code did, and does not keep them (their memory is the
    graph's, written only by a replay); the next call outside capture keeps its own. Built with
    inference mode off, so autograd may save them (an inference tensor can't be saved)."""
    key = (x.shape[-1], det, x.device, x.dtype)
    tables = _TABLES.get(key)
    if tables is None:
        with torch.inference_mode(False):
            tables = _build_tables(*key)
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            _TABLES[key] = tables
    return tables


def det_keys(k1: torch.Tensor, det: int) -> torch.Tensor:
    """The K1 a kernel reads with DET = det: [B, N, Hk, 2, D] (contiguous), slot 0 = K1a =
    pi^(3-R) K1, slot 1 = K1b = pi^R K1 (module docstring); the leftover columns in place. Two
    contiguous rows per j keep the kernels' K1 loads as cheap as the trilinear ones (permuted-
    column loads of K1[j] in the j loop spilled at D = 64). 2x K1's size: Hk/Hq of Q's. One
    gather of K1's columns (_Tables.keys); any K1 [..., D] gives [..., 2, D]."""
    return k1[..., _tables(k1, det).keys].contiguous()


def det_keys_side(k1: torch.Tensor, k2: torch.Tensor,
                  det: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K1 and K2 a keys-side kernel (one that builds B_j = K1[j] x3 K2 and computes
    S = Q @ B_j^T, kernels_tlx/simplicial/ws_kv.py) reads with DET = det: both [B, N, Hk, 2, D] (contiguous),
    with B_j = K1a[j] * K2a + K1b[j] * K2b for
        K1a = pi^R K1,  K1b = -chi pi^(3-R) K1,  K2a = pi^(3-R) K2,  K2b = pi^R K2
    in slots 0 and 1. For R = 1 that is (pi k1)(pi^2 k2) - (pi^2 k1)(pi k2) = k1 x3 k2, and
    q . (k1 x3 k2) is the determinant; R = 2 negates it on the chunk columns. The leftover
    columns keep k1 * k2 (K1b is 0 there). 2x the size of K1 and of K2. A gather each (K1's
    times its signs), _Tables.side and .keys; any [..., D] gives [..., 2, D]."""
    t1, t2 = _tables(k1, det), _tables(k2, det)
    return (k1[..., t1.side] * t1.side_mul).contiguous(), k2[..., t2.keys].contiguous()


def det_keys_side_grads(dk1p: torch.Tensor, dk2p: torch.Tensor,
                        det: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The adjoint of det_keys_side (linear in k1 and in k2): the gradients of K1 and K2
    [..., D] from those of its packed [..., 2, D] K1 and K2, for a keys-side backward that
    sums dL/dK1a = sum_k dB * K2a (and the other three) in the packing's own columns
    (kernels_tlx/simplicial/bwd_pairs.py):
        dK1 = pi^(3-R) dK1a - pi^R (chi dK1b)      dK2 = pi^R dK2a + pi^(3-R) dK2b.
    Each a gather of both slots' columns (_Tables.grads1, .grads2) and one addcmul or add."""
    t1, t2 = _tables(dk1p, det), _tables(dk2p, det)
    a1, b1 = dk1p.flatten(-2)[..., t1.grads1].unbind(-2)
    a2, b2 = dk2p.flatten(-2)[..., t2.grads2].unbind(-2)
    return torch.addcmul(a1, b1, t1.grads1_mul), a2 + b2

"""Causal triple attention's intra-chunk kernels (kernels_triton/triple/intra.py) against fp64, on
the GPU (Hopper: the kernels read through TMA).

The reference is exactly the intra part, in plain PyTorch, fp64: for each chunk of `chunk` tokens
the masked quadratic form c ((Q1 K1^T) * (Q2 K2^T)).tril() V, and its gradients by
torch.autograd in fp64. The "inter" tensors (fp32, what the inter-chunk kernels hand over) are
random with the RMS of the intra part they are added to, so both halves weigh in the error.
Each check draws fresh inputs (this test's generator), prefills the outputs with NaN, bounds the
relative Frobenius error of every output by REL_BOUND, and runs the kernels a second time into
fresh outputs: results must be bitwise equal (no atomics). Odd shapes: N not a multiple of the
chunk or of any tile, N = 1, several heads and batches, Dq != Dv.
"""
from __future__ import annotations

import pytest
import torch
from conftest import gpu_capability

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(gpu_capability() is not None and gpu_capability() < (9, 0),
                                 reason="needs Hopper (sm_90): the kernels read through TMA")]

REL_BOUND = 1e-2  # relative Frobenius error of every output (bf16 out: ~5e-3 is rounding)
GRADS = ("dq1", "dq2", "dk1", "dk2", "dv")

# (B, N, H, Dq, Dv, chunk)
SHAPES = [
    (1, 1000, 2, 64, 64, 256),
    (2, 333, 3, 32, 32, 128),
    (1, 4096, 1, 64, 64, 1024),
    (1, 1, 1, 32, 64, 256),
    (2, 700, 2, 128, 128, 256),
    (1, 517, 2, 64, 32, 512),
    (1, 600, 1, 32, 128, 256),
]
IDS = [f"B{b}-N{n}-H{h}-Dq{dq}-Dv{dv}-C{c}" for b, n, h, dq, dv, c in SHAPES]


def intra_reference(q1, q2, k1, k2, v, chunk: int, c: float) -> torch.Tensor:
    """c sum_{m in chunk(n), m <= n} (q1[n].k1[m]) (q2[n].k2[m]) v[m], in the inputs' dtype:
    [B, N, H, Dv] from q1, q2, k1, k2 [B, N, H, Dq], v [B, N, H, Dv]."""
    N = q1.shape[1]
    parts = []
    for a in range(0, N, chunk):
        y1, y2, x1, x2, vv = (t[:, a:a + chunk] for t in (q1, q2, k1, k2, v))
        s = torch.einsum("bnhi,bmhi->bhnm", y1, x1) * torch.einsum("bnhi,bmhi->bhnm", y2, x2)
        parts.append(c * torch.einsum("bhnm,bmhj->bnhj", s.tril(), vv))
    return torch.cat(parts, 1)


def _inputs(shape, gen):
    """q1, q2 ~ N(0, 1/Dq), k1, k2, v ~ N(0, 1) in bf16 (so q.k = O(1) and s = O(1)), c = 1/N."""
    B, N, H, Dq, Dv, chunk = shape

    def randn(d, scale=1.0):
        return (torch.randn(B, N, H, d, generator=gen) * scale).to("cuda", torch.bfloat16)

    q1, q2 = randn(Dq, Dq ** -0.5), randn(Dq, Dq ** -0.5)
    k1, k2, v = randn(Dq), randn(Dq), randn(Dv)
    return (q1, q2, k1, k2, v), chunk, 1.0 / N


def _like(ref: torch.Tensor, gen) -> torch.Tensor:
    """A random fp32 "inter" tensor with ref's shape and RMS."""
    rms = ref.square().mean().sqrt().clamp_min(1e-30)
    return (torch.randn(ref.shape, generator=gen, dtype=torch.float64) * rms.cpu()).to(
        "cuda", torch.float32)


def _nan(shape) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert not got.isnan().any(), f"{name}: NaN left (an element not written)"
    err = rel(got, want)
    assert err <= REL_BOUND, f"{name}: rel. error {err:.3g} > {REL_BOUND}"


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_intra_forward_matches_fp64(shape, gen):
    from kernels_triton.triple.intra import intra_forward
    x, chunk, c = _inputs(shape, gen)
    ref = intra_reference(*(t.double() for t in x), chunk, c)
    inter = _like(ref, gen)
    out = intra_forward(*x, inter, _nan(ref.shape), chunk, c)
    check("out", out, inter.double() + ref)
    again = intra_forward(*x, inter, _nan(ref.shape), chunk, c)
    assert torch.equal(out, again), "out: not bitwise repeatable"


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_intra_backward_matches_fp64(shape, gen):
    from kernels_triton.triple.intra import intra_backward
    x, chunk, c = _inputs(shape, gen)
    dout = torch.randn(x[4].shape, generator=gen).to("cuda", torch.bfloat16)
    x64 = [t.double().requires_grad_() for t in x]
    refs = torch.autograd.grad(intra_reference(*x64, chunk, c), x64, dout.double())
    inter = {g: _like(r, gen) for g, r in zip(GRADS, refs)}

    def run():
        return intra_backward(*x, dout, inter, {g: _nan(t.shape) for g, t in zip(GRADS, x)},
                              chunk, c)

    grads = run()
    for g, ref in zip(GRADS, refs):
        check(g, grads[g], inter[g].double() + ref)
    again = run()
    for g in GRADS:
        assert torch.equal(grads[g], again[g]), f"{g}: not bitwise repeatable"

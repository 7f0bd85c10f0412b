"""Triple attention's fp64 reference on the CPU (issue: triple attention; the kernels come later):
the chunked forms against a loop over the math, chunking that changes nothing, the causal form
against its quadratic definition, and FAMILIES.md's backward formulas against autograd."""
from __future__ import annotations

import pytest
import torch

from altattn.triple.reference import reference, reference_backward

F64 = torch.float64


def _x(gen, B=2, N=7, H=2, Dq=3, Dv=4):
    qk = [torch.randn(B, N, H, Dq, generator=gen, dtype=F64) for _ in range(4)]
    return (*qk, torch.randn(B, N, H, Dv, generator=gen, dtype=F64))


def loop_reference(q1, q2, k1, k2, v, c, causal):
    """Y[n] = c sum_{m (<= n)} (Q1[n].K1[m]) (Q2[n].K2[m]) V[m], one (b, h, n) at a time."""
    B, N, H, _ = q1.shape
    out = torch.zeros(B, N, H, v.shape[-1], dtype=F64)
    for b in range(B):
        for h in range(H):
            for n in range(N):
                for m in range(n + 1 if causal else N):
                    w = (q1[b, n, h] @ k1[b, m, h]) * (q2[b, n, h] @ k2[b, m, h])
                    out[b, n, h] += c * w * v[b, m, h]
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [3, 4096])
def test_reference_is_the_math(causal, chunk, gen):
    x = _x(gen)
    out, state = reference(*x, causal=causal, chunk=chunk)
    torch.testing.assert_close(out, loop_reference(*x, 1 / 7, causal), rtol=1e-12, atol=1e-12)
    q1, q2, k1, k2, v = x
    want = torch.einsum("bnhi,bnhj,bnhk->bhijk", k1, v, k2) / 7
    torch.testing.assert_close(state, want, rtol=1e-12, atol=1e-12)
    out1, _ = reference(*x, scale=1.0, causal=causal, chunk=chunk)
    torch.testing.assert_close(out1, 7 * out, rtol=1e-12, atol=1e-12)  # scale=1: the blog's


@pytest.mark.parametrize("with_dstate", [False, True])
def test_backward_formulas_are_autograd(with_dstate, gen):
    x = [t.requires_grad_() for t in _x(gen)]
    out, state = reference(*x, chunk=3)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dstate = torch.randn(state.shape, generator=gen, dtype=F64) if with_dstate else None
    loss = (out * dout).sum() + (0 if dstate is None else (state * dstate).sum())
    want = torch.autograd.grad(loss, x)
    got = reference_backward(*(t.detach() for t in x), dout, dstate, chunk=3)
    for name, g, w in zip(("dq1", "dq2", "dk1", "dk2", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("with_dstate", [False, True])
@pytest.mark.parametrize("chunk", [3, 4096])
def test_causal_backward_is_autograd_of_the_loop(chunk, with_dstate, gen):
    """The causal closed form (prefix states forward, suffix dS backward, the masked quadratic
    form in each chunk) against autograd through the loop over the math, state included."""
    x = [t.requires_grad_() for t in _x(gen)]
    _, _, k1, k2, v = x
    out = loop_reference(*x, 0.3, causal=True)
    state = 0.3 * torch.einsum("bnhi,bnhj,bnhk->bhijk", k1, v, k2)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dstate = torch.randn(state.shape, generator=gen, dtype=F64) if with_dstate else None
    loss = (out * dout).sum() + (0 if dstate is None else (state * dstate).sum())
    want = torch.autograd.grad(loss, x)
    got = reference_backward(*(t.detach() for t in x), dout, dstate, 0.3, causal=True,
                             chunk=chunk)
    for name, g, w in zip(("dq1", "dq2", "dk1", "dk2", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)

"""Triple attention's decoding step on the GPU (kernels_triton/triple/step.py through
altattn.triple.step), against the fp64 step from the same state within the family's TOLERANCES:
one token, a few, more than one launch takes (MAX_T); Dq != Dv; a causal prefill then steps as
one causal call; a step captured in a CUDA graph and replayed equals the eager step bitwise.
The CPU equalities (exact, fp64) and the kernel in Triton's interpreter: test_triple_step.py."""
from __future__ import annotations

import pytest
import torch

import altattn
from altattn.triple import step
from altattn.triple.decode import _step_reference
from altattn.triple.family import TOLERANCES

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _tokens(gen, B, T, H, Dq, Dv):
    return [torch.randn(B, T, H, d, generator=gen).cuda().to(BF16)
            for d in (Dq, Dq, Dq, Dq, Dv)]


@pytest.mark.parametrize("B,T,H,Dq,Dv", [(2, 1, 3, 64, 64), (16, 1, 8, 64, 64),
                                         (1, 3, 2, 32, 64), (2, 11, 2, 128, 32)])
def test_step_matches_fp64(B, T, H, Dq, Dv, gen):
    x = _tokens(gen, B, T, H, Dq, Dv)
    state = torch.randn(B, H, Dq, Dv, Dq, generator=gen).cuda() * 0.1
    want_state = state.double().cpu()
    want = _step_reference(*(t.cpu() for t in x), want_state, 0.02)  # advances want_state
    out = step(*x, state, scale=0.02)
    assert out.shape == (B, T, H, Dv) and out.dtype == BF16 and torch.isfinite(out).all()
    assert rel(out, want) <= TOLERANCES["out_rel"]
    assert rel(state, want_state) <= 1e-5  # fp32 sums of the same products


def test_prefill_then_steps_equal_one_causal_call(gen):
    """A causal prefill's state, then single-token steps: the steps' out are the rows of one
    causal call over all the tokens, and the final state is its state."""
    B, N, T, H, D = 2, 300, 5, 2, 64
    x = _tokens(gen, B, N + T, H, D, D)
    c = 1.0 / (N + T)
    want, want_state = altattn.triple_attention(*x, scale=c, causal=True)
    _, state = altattn.triple_attention(*(t[:, :N] for t in x), scale=c, causal=True)
    outs = [step(*(t[:, N + i:N + i + 1] for t in x), state, scale=c) for i in range(T)]
    assert rel(torch.cat(outs, 1), want[:, N:]) <= TOLERANCES["out_rel"]
    assert rel(state, want_state) <= TOLERANCES["state_rel"]


def test_step_in_a_cuda_graph_equals_eager(gen):
    B, H, D = 4, 2, 64
    x = _tokens(gen, B, 1, H, D, D)
    start = torch.randn(B, H, D, D, D, generator=gen).cuda() * 0.1
    state = start.clone()
    eager = step(*x, state, scale=0.1)
    eager_state = state.clone()
    state.copy_(start)
    step(*x, state, scale=0.1)  # warm-up (compiles, plans) outside the capture
    state.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*x, state, scale=0.1)
    state.copy_(start)
    graph.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(state, eager_state, rtol=0, atol=0)


def test_the_layer_prefills_then_decodes_on_the_gpu(gen):
    layer = altattn.TripleAttention(128, 2, 64, 64, causal=True, scale=1e-2).cuda()
    x = torch.randn(2, 40, 128, generator=gen).cuda()
    with torch.no_grad():
        want, want_state = layer(x, return_state=True)
        _, state = layer(x[:, :37], return_state=True)
        got = torch.cat([layer.step(x[:, t:t + 1], state) for t in range(37, 40)], 1)
    assert rel(got, want[:, 37:]) <= TOLERANCES["out_rel"]
    assert rel(state, want_state) <= TOLERANCES["state_rel"]

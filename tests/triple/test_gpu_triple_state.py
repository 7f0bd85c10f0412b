"""Triple attention's state in, state out on the GPU kernels, both registered variants of each
pass: a prefill cut in chunks (each chunk's returned state the next one's initial_state, the
first one from the state of earlier tokens) against the fp64 reference of one call from that
state, in bf16 within the family's TOLERANCES (altattn/triple/family.py): out (causal: every
token; non-causal: the last chunk's, the one that reads one call's state), the final state, and
the gradients of q1, q2, k1, k2, v and of the first initial_state. Cuts never fall on the causal
chunks (kernels_triton/triple/causal.py's CHUNK), ragged lengths, N = 1 chunks, Dq != Dv. The CPU
equalities (exact, fp64): test_triple_state.py.
"""
from __future__ import annotations

import pytest
import torch

import altattn
from altattn import launcher, registry
from altattn.triple import reference, reference_backward
from altattn.triple.family import TOLERANCES

pytestmark = pytest.mark.gpu

VARIANTS = sorted({v.name for v in registry.all_variants("fwd", "triple")}
                  & {v.name for v in registry.all_variants("bwd", "triple")})
# (B, H, Dq, Dv, causal, chunk lengths)
CASES = [
    (1, 2, 64, 64, False, (1000, 1777, 223)),
    (2, 3, 32, 32, False, (100, 233)),
    (1, 2, 128, 64, False, (1, 699)),
    (1, 2, 64, 64, True, (1000, 1777, 2223)),  # across the 2048-token chunks, raggedly
    (2, 3, 32, 32, True, (100, 233)),
    (1, 2, 128, 64, True, (300, 1, 399)),
    (1, 2, 64, 32, True, (2048, 2048)),  # cuts on the chunks
]
IDS = [f"B{c[0]}-H{c[1]}-Dq{c[2]}-Dv{c[3]}{'-causal' if c[4] else ''}-"
       + "+".join(map(str, c[5])) for c in CASES]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _inputs(B, N, H, Dq, Dv, gen):
    return [torch.randn(B, N, H, d, generator=gen).to("cuda", torch.bfloat16)
            for d in (Dq, Dq, Dq, Dq, Dv)]


def _earlier_state(B, H, Dq, Dv, M, scale, gen):
    """The state M earlier tokens leave (fp32): of the size the call's own sums have."""
    k1, k2, v = (torch.randn(B, M, H, d, generator=gen, dtype=torch.float64).cuda()
                 for d in (Dq, Dq, Dv))
    return (scale * torch.einsum("bnhi,bnhj,bnhk->bhijk", k1, v, k2)).float()


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_equals_one_call(variant, case, gen):
    B, H, Dq, Dv, causal, cuts = case
    N = sum(cuts)
    scale = 1.0 / (2 * N)  # the mean over the earlier N tokens and these N
    x = [t.requires_grad_() for t in _inputs(B, N, H, Dq, Dv, gen)]
    s0 = _earlier_state(B, H, Dq, Dv, N, scale, gen).requires_grad_()
    outs, state, a = [], s0, 0
    for n in cuts:
        out, state = altattn.triple_attention(
            *(t[:, a:a + n] for t in x), scale=scale, causal=causal, initial_state=state,
            variant=variant, bwd_variant=variant)
        outs.append(out)
        a += n
    out = torch.cat(outs, 1)
    last = slice(0, N) if causal else slice(N - cuts[-1], N)
    dout = torch.zeros(B, N, H, Dv, device="cuda", dtype=torch.bfloat16)
    dout[:, last] = torch.randn(dout[:, last].shape, generator=gen).to("cuda", torch.bfloat16)
    dstate = torch.randn(state.shape, generator=gen).cuda()
    got = torch.autograd.grad((out[:, last], state), (*x, s0), (dout[:, last], dstate))

    xd = [t.detach() for t in x]
    want_out, want_state = reference(*xd, scale, causal, s0.detach())
    want = reference_backward(*xd, dout, dstate, scale, causal, s0.detach())
    assert rel(out[:, last], want_out[:, last]) <= TOLERANCES["out_rel"]
    assert rel(state, want_state) <= TOLERANCES["state_rel"]
    assert len(want) == 6
    for name, g, w in zip(("dq1", "dq2", "dk1", "dk2", "dv", "dinitial_state"), got, want):
        assert g.dtype == (torch.float32 if name == "dinitial_state" else torch.bfloat16)
        assert not g.isnan().any(), name
        assert rel(g, w) <= TOLERANCES["grad_rel"], (name, rel(g, w))


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_passes_with_an_initial_state(variant, causal, gen):
    """forward and backward (no autograd) with an initial state: the reference's out, state and
    six gradients within the tolerances, bitwise repeatable, and a zero initial state gives the
    outputs of none, bit for bit."""
    B, N, H, Dq, Dv = 2, 2500, 2, 64, 32
    x = _inputs(B, N, H, Dq, Dv, gen)
    s0 = _earlier_state(B, H, Dq, Dv, 777, 1e-3, gen)

    def fwd(init):
        return launcher.run("triple", "fwd", *x, 1e-3, causal, init, variant=variant)
    out, state = fwd(s0)
    want_out, want_state = reference(*x, 1e-3, causal, s0)
    assert rel(out, want_out) <= TOLERANCES["out_rel"]
    assert rel(state, want_state) <= TOLERANCES["state_rel"]
    dout = torch.randn(out.shape, generator=gen).to("cuda", torch.bfloat16)
    dstate = torch.randn(state.shape, generator=gen).cuda()

    def bwd(init, st):
        return launcher.run("triple", "bwd", dout, dstate, *x, st, 1e-3, causal, init,
                            variant=variant)
    grads = bwd(s0, state)
    want = reference_backward(*x, dout, dstate, 1e-3, causal, s0)
    for name, g, w in zip(("dq1", "dq2", "dk1", "dk2", "dv", "dinitial_state"), grads, want):
        assert rel(g, w) <= TOLERANCES["grad_rel"], (name, rel(g, w))
    again = (*fwd(s0), *bwd(s0, state))
    assert all(torch.equal(a, b) for a, b in zip((out, state, *grads), again))
    zero = torch.zeros_like(s0)
    assert all(torch.equal(a, b) for a, b in zip(fwd(zero), fwd(None)))
    _, plain_state = fwd(None)
    assert all(torch.equal(a, b) for a, b in zip(bwd(zero, plain_state)[:5],
                                                  bwd(None, plain_state)))

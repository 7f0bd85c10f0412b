"""Triple attention over packed sequences on the GPU kernels (kernels_triton/triple/varlen.py),
both registered variants of each pass, against the fp64 path (the reference on each sequence
alone): out, each sequence's final state and the gradients of q1, q2, k1, k2, v and
initial_state, in bf16 within the family's TOLERANCES (altattn/triple/family.py) or, where few
tokens average no rounding away, within `vs_emulation` times the error of the dense kernels on
each sequence alone. Ragged lengths: empty, one token, across the causal chunks (2048), longer
than a split. Also: no value of one sequence reaches another (finite inputs), bitwise
repeatable, a CUDA graph captures a call (no host read of cu_seqlens), the layer.
The CPU semantics (fp64, exact): test_triple_varlen.py.
"""
from __future__ import annotations

import pytest
import torch

import altattn
from altattn import registry
from altattn.triple import attention, attention_varlen, reference, reference_backward
from altattn.triple.family import TOLERANCES

pytestmark = pytest.mark.gpu

VARIANTS = sorted({v.name for v in registry.all_variants("fwd", "triple")}
                  & {v.name for v in registry.all_variants("bwd", "triple")})
FLOOR = 1e-4
# (H, Dq, Dv, causal, scale, with an initial state, lengths)
CASES = [
    (2, 64, 64, False, None, False, (1000, 0, 1, 2049, 63, 4097, 130)),
    (3, 64, 32, False, 1e-3, True, (700, 1, 0, 3000)),
    (2, 64, 64, True, None, False, (1000, 0, 1, 2049, 63, 4097, 130)),
    (3, 64, 32, True, 1e-3, True, (2048, 1, 2100, 0)),
]
IDS = [f"H{c[0]}-Dq{c[1]}-Dv{c[2]}{'-causal' if c[3] else ''}"
       f"{'-scale' if c[4] else ''}{'-state' if c[5] else ''}" for c in CASES]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _packed(gen, H, Dq, Dv, lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    x = [torch.randn(T, H, d, generator=gen).to("cuda", torch.bfloat16)
         for d in (Dq, Dq, Dq, Dq, Dv)]
    return cu.cuda(), x


def _per_sequence(fn, cu, n_outs, tokens, per_seq):
    """fn(*token slices, *per-sequence slices) on each sequence s ([1, n, ...] slices of the
    `tokens` tensors [T, ...], [s:s + 1] of the `per_seq` ones [n, ...], None kept), its outputs
    concatenated: token ones [1, n, ...] along dim 1 -> 0, state ones along dim 0."""
    c = cu.tolist()
    parts = [fn(*(t[a:b][None] for t in tokens),
                *(None if t is None else t[s:s + 1] for t in per_seq))
             for s, (a, b) in enumerate(zip(c, c[1:]))]
    return [torch.cat([p[i][0] if p[i].dim() == 4 else p[i] for p in parts])
            for i in range(n_outs)]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_against_the_fp64_path(variant, case, gen):
    H, Dq, Dv, causal, scale, with_state, lengths = case
    cu, x = _packed(gen, H, Dq, Dv, lengths)
    n = len(lengths)
    init = (0.1 * torch.randn(n, H, Dq, Dv, Dq, generator=gen)).cuda() if with_state else None
    leaves = [t.clone().requires_grad_() for t in x]
    init_leaf = None if init is None else init.clone().requires_grad_()
    out, state = attention_varlen(*leaves, cu, max(lengths), scale=scale, causal=causal,
                                  initial_state=init_leaf, variant=variant,
                                  bwd_variant=variant)
    dout = torch.randn(out.shape, generator=gen).to("cuda", torch.bfloat16)
    dstate = 0.1 * torch.randn(state.shape, generator=gen).cuda()
    wrt = leaves + ([init_leaf] if init_leaf is not None else [])
    got = [out, state, *torch.autograd.grad((out, state), wrt, (dout, dstate))]

    def ref(q1, q2, k1, k2, v, do, ds, i0):
        xs = [t.double() for t in (q1, q2, k1, k2, v)]
        o, st = reference(*xs, scale, causal, i0)
        return (o, st, *reference_backward(*xs, do, ds, scale, causal, i0))

    def dense(q1, q2, k1, k2, v, do, ds, i0):  # the dense kernels on one sequence
        if q1.shape[1] == 0:
            return ref(q1, q2, k1, k2, v, do, ds, i0)
        xs = [t.requires_grad_() for t in (q1, q2, k1, k2, v)]
        i0 = None if i0 is None else i0.clone().requires_grad_()
        o, st = attention(*xs, scale=scale, causal=causal, initial_state=i0, variant=variant,
                          bwd_variant=variant)
        return (o, st, *torch.autograd.grad((o, st), xs + ([i0] if i0 is not None else []),
                                            (do, ds)))

    k = 2 + 5 + with_state
    want = _per_sequence(ref, cu, k, (*x, dout), (dstate, init))
    base = _per_sequence(dense, cu, k, (*x, dout), (dstate, init))
    names = ("out", "state", "dq1", "dq2", "dk1", "dk2", "dv", "dinitial_state")
    bounds = ("out_rel", "state_rel", *["grad_rel"] * 6)
    for name, g, w, b, tol in zip(names, got, want, base, bounds):
        assert g.isfinite().all(), name
        limit = max(TOLERANCES[tol], TOLERANCES["vs_emulation"] * rel(b, w) + FLOOR)
        assert rel(g, w) <= limit, (name, rel(g, w), limit, rel(b, w))
    empty = [s for s, m in enumerate(lengths) if m == 0]
    assert torch.equal(state[empty], init[empty] if with_state
                       else torch.zeros_like(state[empty]))


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_sequences_stay_apart_and_repeat_bitwise(causal, gen):
    """Other inputs in one sequence change no other sequence's out, state or gradients (finite
    values; the maps are the same); a second run is bitwise the first."""
    cu, x = _packed(gen, 2, 64, 64, (3000, 1, 2100, 517))

    def run(inputs):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out, state = attention_varlen(*leaves, cu, 3000, causal=causal)
        (out.float().square().sum() + state.sum()).backward()
        return [out.detach(), state.detach(), *(t.grad for t in leaves)]

    first, again = run(x), run(x)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "not bitwise repeatable"
    other = [t.clone() for t in x]
    for t in other:
        t[3001:5101] = torch.randn(t[3001:5101].shape, generator=gen).to("cuda", t.dtype)
    changed = run(other)
    keep = torch.ones(int(cu[-1]), dtype=torch.bool, device="cuda")
    keep[3001:5101] = False
    for i, (a, b) in enumerate(zip(first, changed)):
        if i == 1:
            assert torch.equal(a[[0, 1, 3]], b[[0, 1, 3]]) and not torch.equal(a[2], b[2])
        else:
            assert torch.equal(a[keep], b[keep]), i


def test_a_cuda_graph_captures_a_call(gen):
    """No host read of cu_seqlens inside the call: a graph captures the forward, and a replay
    with other lengths written into cu_seqlens (same T and n) gives those sequences' result."""
    cu, x = _packed(gen, 2, 64, 64, (1000, 24, 2000))
    with torch.no_grad():
        attention_varlen(*x, cu, 2000, causal=True)  # compile, plan
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, state = attention_varlen(*x, cu, 2000, causal=True)
        cu.copy_(torch.tensor([0, 24, 1024, 3024], dtype=torch.int32))
        graph.replay()
        want_out, want_state = attention_varlen(*x, cu.clone(), 2000, causal=True)
    assert torch.equal(out, want_out) and torch.equal(state, want_state)


def test_the_layer_trains_on_packed_sequences(gen):
    layer = altattn.TripleAttention(128, 2, 64, 64, causal=True, normalize=True).cuda()
    x = torch.randn(3000, 128, generator=gen).cuda()
    cu = torch.tensor([0, 1000, 1001, 3000], dtype=torch.int32, device="cuda")
    y = layer(x, cu_seqlens=cu, max_seqlen=1999)
    y.square().mean().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in layer.parameters())
    parts = torch.cat([layer(x[None, a:b])[0] for a, b in ((0, 1000), (1000, 1001),
                                                           (1001, 3000))])
    assert rel(y, parts) <= 2 * TOLERANCES["out_rel"]

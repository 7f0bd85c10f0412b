"""Packed sequences of spherical attention on a Hopper GPU (skipped elsewhere): every variant that
takes packed input against the fp64 reference run sequence by sequence (the family's TOLERANCES,
or vs_emulation times a bf16 emulation's error where that is larger: test_gpu_spherical.check),
the forward bitwise equal to the dense kernel on each sequence alone, every element written,
no sequence's values reaching another's results, the op end to end (gradient into r too) and
under torch.compile. Odd lengths (0, 1, 7, 130, 333, ...), GQA, D 64 and 128, causal, and
cross-attention (cu_seqlens_q != cu_seqlens_k)."""
from __future__ import annotations

import pytest
import torch
from test_gpu_spherical import check, emulate_bwd, emulate_fwd, rel

from altattn import registry
from altattn.spherical import attention_varlen, backward_varlen, forward_varlen
from altattn.spherical import forward as dense_forward
from altattn.spherical.family import TOLERANCES
from altattn.spherical.reference import reference, reference_backward

pytestmark = pytest.mark.gpu

FWD = [v.name for v in registry.all_variants("fwd", "spherical") if True in v.accepted("packed")]
BWD = [v.name for v in registry.all_variants("bwd", "spherical") if True in v.accepted("packed")]
LENGTHS = [1, 0, 130, 333, 7, 257, 128, 64]
CROSS_K = [300, 1, 0, 64, 19, 129, 2, 200]  # key lengths beside LENGTHS (non-causal)
CASES = [  # (id, Hq, Hk, D, causal, key lengths or None: self-attention)
    ("H8x2-D128", 8, 2, 128, False, None),
    ("H8x2-D128-causal", 8, 2, 128, True, None),
    ("H4x4-D64-causal", 4, 4, 64, True, None),
    ("H8x1-D64", 8, 1, 64, False, None),
    ("H4x2-D128-cross", 4, 2, 128, False, CROSS_K),
]
IDS = [c[0] for c in CASES]
EPS = 1e-6


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def _packed(case, gen, lengths=LENGTHS):
    _, Hq, Hk, D, causal, klens = case
    klens = lengths if klens is None else klens

    def randn(*s):
        return torch.randn(*s, generator=gen).to("cuda", torch.bfloat16)

    q = randn(sum(lengths), Hq, D)
    k, v = randn(sum(klens), Hk, D), randn(sum(klens), Hk, D)
    cu_q = _cu(lengths)
    cu_k = cu_q if klens is lengths else _cu(klens)
    return q, k, v, cu_q, cu_k, causal


def _spans(cu_q, cu_k):
    a, b = cu_q.tolist(), cu_k.tolist()
    return [(a[i], a[i + 1], b[i], b[i + 1]) for i in range(len(a) - 1)]


def _per_sequence(fn, cu_q, cu_k, q_like, k_like):
    """Run fn(q0, q1, k0, k1) -> ([per-row results], [per-key results]) on each sequence and
    scatter: rows into tensors like q_like's, keys like k_like's."""
    rows = [torch.zeros_like(t, dtype=torch.float64) for t in q_like]
    keys = [torch.zeros_like(t, dtype=torch.float64) for t in k_like]
    for q0, q1, k0, k1 in _spans(cu_q, cu_k):
        if q1 == q0:
            continue
        got_rows, got_keys = fn(q0, q1, k0, k1)
        for dst, src in zip(rows, got_rows):
            if dst.dim() == 2:  # r [Hq, T]
                dst[:, q0:q1] = src
            else:
                dst[q0:q1] = src
        for dst, src in zip(keys, got_keys):
            dst[k0:k1] = src
    return rows, keys


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("variant", FWD)
def test_packed_forward_is_each_sequence_alone(variant, case, gen):
    q, k, v, cu_q, cu_k, causal = _packed(case, gen)
    c = q.shape[-1] ** -0.5
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    r = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda")
    forward_varlen(q, k, v, cu_q, cu_k, causal=causal, variant=variant, out=out, r=r)
    assert not out.isnan().any() and not r.isnan().any(), "an element not written"

    def one(q0, q1, k0, k1):
        x = (q[None, q0:q1], k[None, k0:k1], v[None, k0:k1])
        o, rr = reference(*x, causal, None, EPS)
        eo, er = emulate_fwd(*x, causal, None, c, EPS)
        if k1 > k0:  # the dense kernel on this sequence alone: the packed one's every bit
            do, dr = dense_forward(*x, causal=causal, variant=variant)
            assert torch.equal(out[q0:q1], do[0]), f"out of rows {q0}..{q1}"
            assert torch.equal(r[:, q0:q1], dr[0]), f"r of rows {q0}..{q1}"
        return [o[0], rr[0], eo[0].double(), er[0].double()], []
    (ref_o, ref_r, emu_o, emu_r), _ = _per_sequence(
        one, cu_q, cu_k, [q, r, q, r], [])
    check("out", out, ref_o, emu_o, TOLERANCES["out_rel"])
    check("r", r, ref_r, emu_r, TOLERANCES["r_rel"])


@pytest.mark.parametrize("with_dr", [False, True], ids=["no-dr", "dr"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("variant", BWD)
def test_packed_backward_matches_fp64(variant, case, with_dr, gen):
    q, k, v, cu_q, cu_k, causal = _packed(case, gen)
    c = q.shape[-1] ** -0.5
    out, r = forward_varlen(q, k, v, cu_q, cu_k, causal=causal)
    dout = torch.randn(out.shape, generator=gen).to("cuda", torch.bfloat16)
    dr = torch.randn(r.shape, generator=gen).cuda() if with_dr else None
    grads = backward_varlen(dout, dr, q, k, v, out, r, cu_q, cu_k, causal=causal,
                            variant=variant)

    def one(q0, q1, k0, k1):
        x = (q[None, q0:q1], k[None, k0:k1], v[None, k0:k1])
        d_r = None if dr is None else dr[None, :, q0:q1]
        ref = reference_backward(*x, dout[None, q0:q1], d_r, causal, None, EPS)
        emu = emulate_bwd(*x, out[None, q0:q1], r[None, :, q0:q1], dout[None, q0:q1], d_r,
                          causal, None, c, EPS)
        return [ref[0][0], emu[0][0].double()], [ref[1][0], ref[2][0], emu[1][0].double(),
                                                 emu[2][0].double()]
    (ref_dq, emu_dq), (ref_dk, ref_dv, emu_dk, emu_dv) = _per_sequence(
        one, cu_q, cu_k, [q, q], [k, k, k, k])
    for name, g, ref, emu in zip(("dq", "dk", "dv"), grads, (ref_dq, ref_dk, ref_dv),
                                 (emu_dq, emu_dk, emu_dv)):
        assert torch.isfinite(g).all(), f"{name}: not finite (an element not written?)"
        check(name, g, ref, emu, TOLERANCES["grad_rel"])


@pytest.mark.parametrize("variant", sorted(set(FWD) | {"bwd:" + b for b in BWD}))
def test_no_sequence_reaches_another(variant, gen):
    """Finite garbage (1e3) in sequence 3's q, k, v: every other sequence's out, r (and, for the
    deterministic backward, its gradients) bitwise unchanged."""
    case = CASES[1]
    runs = []
    for garbage in (False, True):
        q, k, v, cu_q, cu_k, causal = _packed(case, torch.Generator().manual_seed(7))
        if garbage:
            a, b = cu_q.tolist()[3:5]
            q[a:b], k[a:b], v[a:b] = 1e3, -1e3, 1e3
        name = variant.removeprefix("bwd:")
        out, r = forward_varlen(q, k, v, cu_q, cu_k, causal=causal,
                                variant=name if name == variant else "auto")
        grads = ()
        if name != variant:
            dout = torch.ones_like(out)
            grads = backward_varlen(dout, None, q, k, v, out, r, cu_q, cu_k, causal=causal,
                                    variant=name)
        runs.append((out, r, *grads))
    keep = torch.ones(sum(LENGTHS), dtype=torch.bool, device="cuda")
    keep[a:b] = False
    det = registry.get(variant.removeprefix("bwd:"), "bwd" if variant.startswith("bwd:")
                       else "fwd", "spherical").deterministic
    for i, (x, y) in enumerate(zip(*runs)):
        if i == 1:  # r [Hq, T]
            x, y = x.t(), y.t()
        if det or i < 2:
            assert torch.equal(x[keep], y[keep]), f"output {i} changed outside sequence 3"
        else:  # reduce-added dq: another order of the same sums
            assert rel(x[keep], y[keep]) < 1e-2, f"output {i} changed outside sequence 3"


def test_the_op_trains_like_the_reference(gen):
    """attention_varlen end to end ("auto" both passes; gradients of out and r) against the fp64
    CPU op, eager and under torch.compile(fullgraph=True)."""
    q, k, v, cu_q, cu_k, causal = _packed(CASES[1], gen)
    w = torch.randn(q.shape, generator=gen).cuda()

    def loss(fn, *x):
        out, r = fn(*x, cu_q if x[0].is_cuda else cu_q.cpu(), cu_k if x[0].is_cuda
                    else cu_k.cpu(), 333, 333, causal=causal)
        return (out.float() * w.to(out.device, out.dtype)).sum() + r.sum()

    x64 = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    loss(attention_varlen, *x64).backward()
    for fn in (attention_varlen, torch.compile(attention_varlen, fullgraph=True)):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        loss(fn, *x).backward()
        for a, b in zip(x, x64):
            assert rel(a.grad.cpu(), b.grad) < TOLERANCES["grad_rel"]


def test_auto_takes_a_packed_kernel_and_a_named_batch_only_one_is_refused(gen):
    q, k, v, cu_q, cu_k, causal = _packed(CASES[0], gen)
    out, r = forward_varlen(q, k, v, cu_q, cu_k)
    dq, _, _ = backward_varlen(torch.ones_like(out), None, q, k, v, out, r, cu_q, cu_k,
                               deterministic=True)  # `triton`: the packed deterministic one
    assert torch.isfinite(dq).all()
    with pytest.raises(ValueError, match="tlx_ws_det"):
        backward_varlen(torch.ones_like(out), None, q, k, v, out, r, cu_q, cu_k,
                        variant="tlx_ws_det")

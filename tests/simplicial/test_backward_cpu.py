"""The backward on the CPU: the fp64 reference's gradients, the differentiable op (gradcheck,
opcheck, torch.compile) and the layer, all through the reference path (no GPU needed). The
backward benchmark CLI is tested in test_bench_cli.py."""
from __future__ import annotations

import pytest
import torch

from altattn import simplicial as sa
from altattn.simplicial.spec import FORMS
from conftest import compiled_grads_differ, fp64_inputs, previous_token_losses

# (B, N, Hq, Hk, D, w1, w2): N < w1, w1 <= N < w2, w1 > w2 (swapped), GQA, N = 1; D mod 3 = 0
# and 2 (the `any_head_dim` fixture; D = 64 has 1)
TINY = [(1, 3, 2, 1, 64, 5, 7), (2, 6, 4, 2, 64, 2, 9), (1, 7, 2, 2, 64, 4, 2),
        (1, 1, 2, 1, 64, 3, 3), (1, 7, 4, 2, 6, 5, 3), (1, 6, 2, 1, 8, 2, 4)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", TINY, ids=[str(s) for s in TINY])
def test_reference_backward_matches_autograd(shape, form, gen, any_head_dim):
    """The closed-form gradients equal autograd through `reference` and through `brute_force`
    (which exchanges no pairs)."""
    B, N, Hq, Hk, D, w1, w2 = shape
    x = fp64_inputs(gen, B, N, Hq, Hk, D)
    out, lse = sa.reference(*x, w1, w2, form=form)
    dout, dlse = torch.randn(out.shape, generator=gen, dtype=torch.float64), \
        torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    closed = sa.reference_backward(*[t.detach() for t in x], w1, w2, dout, dlse, form=form)
    for fn in (sa.reference, sa.brute_force):
        y = [t.detach().clone().requires_grad_() for t in x]
        o, lse_ = fn(*y, w1, w2, form=form)
        torch.autograd.backward((o, lse_), (dout, dlse))
        for name, c, t in zip(("dq", "dk1", "dk2", "dv1", "dv2"), closed, y):
            torch.testing.assert_close(c, t.grad, rtol=1e-10, atol=1e-12,
                                       msg=f"{fn.__name__} {name}")


@pytest.mark.parametrize("fn", [sa.reference, sa.brute_force], ids=["reference", "brute_force"])
def test_gradcheck_reference(fn, gen):
    """Central differences agree with autograd for out and lse (GQA, windows smaller than N)."""
    x = fp64_inputs(gen, 1, 4, 2, 1, 64)
    assert torch.autograd.gradcheck(lambda *a: fn(*a, 2, 3), x, fast_mode=True)


@pytest.mark.parametrize("form", FORMS)
def test_gradcheck_op(form, gen):
    """The op's backward (reference_backward on the CPU) against central differences (w1 > w2)."""
    x = fp64_inputs(gen, 1, 5, 4, 2, 64)
    assert torch.autograd.gradcheck(lambda *a: sa.attention(*a, 3, 2, form=form), x,
                                    fast_mode=True)


@pytest.mark.parametrize("form", FORMS)
def test_opcheck(form, gen):
    x = fp64_inputs(gen, 1, 5, 2, 1, 64)
    torch.library.opcheck(torch.ops.altattn.simplicial_fwd.default,
                          (*x, 2, 3, 0.125, form, "auto", "auto", False))
    out, lse = sa.attention(*[t.detach() for t in x], 2, 3, form=form)
    torch.library.opcheck(torch.ops.altattn.simplicial_bwd.default,
                          (torch.randn_like(out), torch.randn_like(lse), *[t.detach() for t in x],
                           out, lse, 2, 3, 0.125, form, "auto", False))


def test_requires_grad_on_some_inputs(gen):
    x = fp64_inputs(gen, 1, 5, 2, 1, 64, requires_grad=False)
    x[2].requires_grad_()
    out, _ = sa.attention(*x, 2, 3)
    out.sum().backward()
    assert x[2].grad is not None and x[2].grad.abs().sum() > 0
    assert all(t.grad is None for i, t in enumerate(x) if i != 2)


@pytest.mark.parametrize("form", FORMS)
def test_compiled_training_step_matches_eager_bitwise(form, gen):
    torch.manual_seed(0)
    model = sa.SimplicialAttention(32, 4, 2, 64, 3, 5, form=form).double()
    x = torch.randn(2, 9, 32, generator=gen, dtype=torch.float64)
    differ = compiled_grads_differ(model, lambda m: m(x).square().sum())
    assert not differ, f"eager and compiled gradients differ: {differ}"


def test_layer_trains_on_cpu(gen):
    torch.manual_seed(0)
    model = sa.SimplicialAttention(32, 4, 1, 64, 2, 4)
    losses = previous_token_losses(model, torch.randn(2, 12, 32, generator=gen), 15, 1e-2)
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("bad, exc, match", [
    (dict(dtype=torch.int32), TypeError, "q must have a dtype"),
    (dict(q_shape=(1, 5, 3, 64), k_shape=(1, 5, 2, 64)), ValueError, "multiple of Hk"),
    (dict(k_shape=(1, 4, 1, 64)), ValueError, "N \\(dim 1\\)"),
    (dict(w1=0), ValueError, "w1 must be a positive int"),
    (dict(w2=-3), ValueError, "w2 must be a positive int"),
    (dict(w1=2.5), TypeError, "w1 must be a positive int"),
    (dict(w2=True), TypeError, "w2 must be a positive int, got bool"),
    (dict(w1=torch.tensor(2)), TypeError, "w1 must be a positive int, got Tensor"),
    (dict(q_shape=(1, 5, 128)), ValueError, "q must have rank 4"),
    (dict(k_shape=(1, 5, 1, 128)), ValueError, r"D \(dim 3\) = 128 but q has 64"),
    (dict(bwd_variant="nope"), ValueError, "unknown variant 'nope' of pass 'bwd'"),
    (dict(bwd_variant=3), TypeError, "bwd_variant must be a str"),
    # the CPU runs the reference whatever the name, but a misspelt one still fails here
    (dict(variant="nope"), ValueError, "unknown variant 'nope' of family 'simplicial'; known: "),
    (dict(variant="triton", bwd_variant="tlx_pipelined_kv"), ValueError,
     "unknown variant 'tlx_pipelined_kv' of pass"),
    (dict(bwd_variant="tlx_pairs", deterministic=True), ValueError,
     "bwd_variant 'tlx_pairs' is not deterministic"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool, got int"),
    (dict(mixed_dtype=True), TypeError, "share one dtype"),
    (dict(form="Det"), ValueError, "form must be one of 'trilinear', 'det', got 'Det'"),
    (dict(form=1), TypeError, "form must be a str, got int"),
])
def test_attention_rejects_bad_input(bad, exc, match):
    q = torch.randn(*bad.get("q_shape", (1, 5, 2, 64))).to(bad.get("dtype", torch.float32))
    k = [torch.randn(*bad.get("k_shape", (1, 5, 1, 64))).to(bad.get("dtype", torch.float32))
         for _ in range(4)]
    if bad.get("mixed_dtype"):
        k[0] = k[0].double()
    with pytest.raises(exc, match=match):
        sa.attention(q, *k, bad.get("w1", 2), bad.get("w2", 3),
                     variant=bad.get("variant", "auto"), bwd_variant=bad.get("bwd_variant", "auto"),
                     form=bad.get("form", "trilinear"),
                     deterministic=bad.get("deterministic", False))


@pytest.mark.parametrize("B, N", [(0, 5), (2, 0), (0, 0)])
def test_empty_batch_or_sequence(B, N):
    """Empty outputs of the right shapes and dtypes, and empty gradients through out and lse
    (windows longer than N included), for the inputs that require grad only."""
    x = [torch.randn(B, N, h, 64, dtype=torch.float64, requires_grad=i != 3)
         for i, h in enumerate((2, 1, 1, 1, 1))]
    out, lse = sa.attention(*x, 2, 10**6)
    assert out.shape == (B, N, 2, 64) and lse.shape == (B, 2, N)
    assert out.dtype == lse.dtype == torch.float64
    (out.sum() + lse.sum()).backward()
    for i, t in enumerate(x):
        assert (t.grad is None) if i == 3 else (t.grad.shape == t.shape), i


@pytest.mark.parametrize("B, N", [(0, 5), (2, 0)])
def test_layer_empty_batch_or_sequence(B, N):
    layer = sa.SimplicialAttention(32, 4, 2, 64, 2, 3)
    x = torch.randn(B, N, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == (B, N, 32)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())


# (positional changes to (dim, n_heads, n_kv_heads, head_dim, w1, w2) = (32, 4, 2, 64, 2, 4), or
# keyword arguments), exception, message
LAYER_BAD = {
    "heads_not_multiple": (dict(n_heads=3), ValueError, "n_heads=3 must be a multiple of "
                                                        "n_kv_heads=2"),
    "w1_zero": (dict(w1=0), ValueError, "w1 must be a positive int"),
    "w2_negative": (dict(w2=-4), ValueError, "w2 must be a positive int"),
    "w2_float": (dict(w2=2.5), TypeError, "w2 must be a positive int, got float"),
    "w1_bool": (dict(w1=True), TypeError, "w1 must be a positive int, got bool"),
    "w1_tensor": (dict(w1=torch.tensor(2)), TypeError, "w1 must be a positive int, got Tensor"),
    "dim_zero": (dict(dim=0), ValueError, "dim must be a positive int"),
    "n_kv_heads_str": (dict(n_kv_heads="2"), TypeError, "n_kv_heads must be a positive int"),
    "head_dim_32": (dict(head_dim=32), ValueError, "head_dim=32 is not supported"),
    "variant_unknown": (dict(variant="nope"), ValueError, "unknown variant 'nope'"),
    "bwd_variant_not_str": (dict(bwd_variant=3), TypeError, "bwd_variant must be a str"),
    "form_unknown": (dict(form="cross"), ValueError, "form must be one of"),
    "form_not_str": (dict(form=3), TypeError, "form must be a str, got int"),
}


@pytest.mark.parametrize("change, exc, match", LAYER_BAD.values(), ids=LAYER_BAD.keys())
def test_layer_rejects_bad_config(change, exc, match):
    """At construction, naming the argument: not at the first forward."""
    args = dict(dim=32, n_heads=4, n_kv_heads=2, head_dim=64, w1=2, w2=4)
    kw = {k: change.pop(k) for k in ("variant", "bwd_variant") if k in change}
    with pytest.raises(exc, match=match):
        sa.SimplicialAttention(**{**args, **change}, **kw)


def test_layer_takes_numpy_ints():
    import numpy as np
    layer = sa.SimplicialAttention(np.int64(32), 4, 2, 64, np.int32(2), np.int64(4))
    assert (layer.dim, layer.w1, layer.w2) == (32, 2, 4) and type(layer.w1) is int


@pytest.mark.parametrize("x, exc, match", [
    ([[0.0] * 32], TypeError, "x must be a torch.Tensor, got list"),
    (torch.zeros(5, 32), ValueError, r"x must be \[B, N, dim\] with dim = 32, got shape \(5, 32\)"),
    (torch.zeros(1, 2, 5, 32), ValueError, r"x must be \[B, N, dim\]"),
    (torch.zeros(1, 5, 16), ValueError, r"with dim = 32, got shape \(1, 5, 16\)"),
])
def test_layer_rejects_bad_input(x, exc, match):
    with pytest.raises(exc, match=match):
        sa.SimplicialAttention(32, 4, 2, 64, 2, 4)(x)


REDUCE_PROBE = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
import torch, triton
from kernels_triton.simplicial import bwd
torch.manual_seed(0)
d = torch.arange(64)
chunk = d < 63
def rot(r):  # the columns of pi^r (kernels_triton/simplicial/det.py): x[rot(r)] = pi^r x
    return torch.where(chunk, d - d % 3 + (d % 3 + r) % 3, d)
for (B, N, Hk, D, w1, L, split), det in [((2, 37, 2, 64, 5, 4, 2), 0), ((1, 50, 1, 64, 8, 8, 1), 0),
                                         ((1, 9, 3, 64, 20, 3, 1), 0), ((2, 37, 2, 64, 5, 4, 2), 1),
                                         ((1, 50, 1, 64, 8, 8, 1), -1)]:
    n_chunks, R = triton.cdiv(N, L), L + w1 - 1
    pk, pkb, pv = torch.randn(3, B * Hk * split * n_chunks * R * D)
    dk1, dv1 = torch.zeros(2, B, N, Hk, D, dtype=torch.bfloat16)
    bwd._dkv1_kernel[(triton.cdiv(N, bwd.DKV1_ROWS) * B * Hk,)](
        pk, pkb, pv, dk1, dv1, N, w1, 0.5, L, n_chunks, HK=Hk, D=D, SPLIT=split,
        ROWS=bwd.DKV1_ROWS, DET=det)
    if det:  # dK1 = pi^R PK1 + pi^(3-R) PK1b, R = 1 (det = +1) or 2
        r = 1 if det > 0 else 2
        pk = pk.view(-1, D)[:, rot(r)].flatten() + pkb.view(-1, D)[:, rot(3 - r)].flatten()
    want_k, want_v = torch.zeros(2, B, N, Hk, D)
    for bg in range(B * Hk):  # chunk c holds rows j = c*L - w1 + 1 + slot, slot < R
        for s in range(split):
            for c in range(n_chunks):
                for slot in range(R):
                    j = c * L - w1 + 1 + slot
                    if 0 <= j < N:
                        at = ((bg * split + s) * n_chunks + c) * R + slot
                        want_k[bg // Hk, j, bg % Hk] += pk[at * D:(at + 1) * D]
                        want_v[bg // Hk, j, bg % Hk] += pv[at * D:(at + 1) * D]
    # bf16 at the store: one bf16 step (2^-7 relative; the interpreter may truncate), where a
    # wrong row or chunk would be off by O(1)
    torch.testing.assert_close(dk1.float(), 0.5 * want_k, rtol=2 ** -6, atol=1e-5)
    torch.testing.assert_close(dv1.float(), want_v, rtol=2 ** -6, atol=1e-5)
print("ok")
"""


def test_dkv1_reduce_kernel_in_the_interpreter():
    """`_dkv1_kernel` (no tensor cores, so Triton's CPU interpreter runs it) sums exactly the
    partial rows that cover each j, against a plain-Python loop over the partial layout; with
    DET = +-1 the two partial buffers through their column rotations (kernels_triton/simplicial/det.py)."""
    import subprocess
    import sys
    from conftest import ROOT
    root = str(ROOT)
    p = subprocess.run([sys.executable, "-c", REDUCE_PROBE.format(root=root)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("hq", [64, 128])
def test_every_row_owner_sizes_its_scratch(hq, form):
    """The host side of each backward variant's launch, without a GPU: every row-owner's scratch
    (`triton`'s and, at G in {64, 128}, the `tlx_ws` one's) is a Scratch whose sizes cover its
    programs, and the k-owner's parts are 1 or 2. (A launcher that fails here fails on the GPU
    before any kernel runs.)"""
    pytest.importorskip("triton")
    from kernels_tlx.simplicial import bwd_dq_ws, bwd_ws
    from kernels_triton.simplicial import bwd
    from altattn.simplicial.spec import ProblemSpec
    for n in (333, 2048, 16384):
        spec = ProblemSpec(B=4, N=n, Hq=hq, Hk=1, D=128, w1=32, w2=512, sm_scale=128 ** -0.5,
                           form=form)
        sizes = [bwd.scratch(spec)] + ([bwd_dq_ws.scratch(spec)] if form == "trilinear" else [])
        for sc in sizes:
            assert sc.n_programs >= 1 and sc.L >= 1 and sc.n_chunks * sc.L >= n
            assert sc.partial > 0 and sc.dq_tiles > 0 and sc.acc_tiles in (1, 2, 3)
        assert bwd.scratch_bytes(spec) > 4 * spec.B * spec.Hq * spec.N
        assert bwd_ws.key_block_parts(spec) == (2 if hq == 128 and n <= 2048 else 1)

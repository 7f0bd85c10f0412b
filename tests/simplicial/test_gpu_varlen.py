"""Packed sequences and KV-cache decoding of 2-simplicial attention on a Hopper GPU (skipped
elsewhere): the packed kernels against the dense path run sequence by sequence, isolation of
sequences (inf / NaN), decoding against one dense call."""
from __future__ import annotations

import math

import pytest
import torch

from altattn import registry
from altattn.simplicial import attention, attention_varlen, attention_with_kvcache
from altattn.simplicial import backward as dense_backward
from altattn.simplicial import forward as dense_forward
from altattn.simplicial.family import TOLERANCES
from altattn.simplicial.reference import reference, reference_backward
from altattn.simplicial.varlen import backward_varlen, forward_varlen

pytestmark = pytest.mark.gpu

# lengths 1, < w1, between w1 and w2, > w2 (not a multiple of the 128-key blocks), empty
W1, W2 = 32, 200
LENGTHS = [1, 0, 20, 130, 333, 7, 257]
PACKED_FWD = [v.name for v in registry.all_variants("fwd", "simplicial")
              if True in v.accepted("varlen")]


def _packed(lengths, Hq, Hk, D, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    q = (torch.randn(T, Hq, D, generator=g, device="cuda") * scale).bfloat16()
    kv = [torch.randn(T, Hk, D, generator=g, device="cuda").bfloat16() for _ in range(4)]
    return cu, q, kv


ULPS = 2  # decoding against one dense call: a split's bf16 share, the merge, another key order


def ulps(x, ref) -> float:
    """The largest difference of x from ref in bf16 ulps of the largest element of ref's row (an
    output row is a weighted sum of value rows: its small elements are cancellations)."""
    r = ref.float()
    ulp = torch.exp2(torch.floor(torch.log2(r.abs().amax(-1, keepdim=True).clamp_min(2 ** -14)))
                     - 7)
    return ((x.float() - r).abs() / ulp).max().item()


def _rel(a, b, floor=1e-30):
    """||a - b|| / max(||b||, floor)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(floor)).item()


@pytest.mark.parametrize("variant", PACKED_FWD + ["triton"])
@pytest.mark.parametrize("form", ["trilinear", "det"])
@pytest.mark.parametrize("swap", [False, True], ids=["w1<w2", "w1>w2"])
def test_packed_forward_equals_dense_per_sequence(variant, form, swap):
    """Bitwise the dense forward of the same variant run on each sequence alone (`triton`, which
    takes no packed launch, runs sequence by sequence), every element written."""
    v = registry.get(variant, "fwd", "simplicial")
    if form not in v.accepted("form"):
        pytest.skip(f"{variant} computes no form {form}")
    w1, w2 = (W2, W1) if swap else (W1, W2)
    cu, q, kv = _packed(LENGTHS, 128, 1, 128, seed=1)
    out, lse = forward_varlen(q, *kv, cu, w1, w2, variant=variant, form=form)
    c = cu.tolist()
    for a, b in zip(c, c[1:]):
        o, l_ = dense_forward(q[a:b][None], *(t[a:b][None] for t in kv), w1, w2,
                              variant=variant, form=form)
        if a == b or (min(w1, b - a) > min(w2, b - a)) == (w1 > w2):
            assert torch.equal(out[a:b], o[0]) and torch.equal(lse[:, a:b], l_[0]), (a, b)
        else:  # windows clamped to the sequence no longer in the same order: the dense call
            # runs the pairs unexchanged (another order of the same sums)
            assert _rel(out[a:b], o[0]) < 1e-2 and (lse[:, a:b] - l_[0]).abs().max() < 1e-3
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("Hq,Hk,D", [(128, 1, 128), (64, 1, 128), (128, 2, 64)])
def test_packed_training_step_against_reference(Hq, Hk, D):
    """attention_varlen forward and backward (the packed forward at G = 128, the packed
    `tlx_pairs` backward at G >= 16; sequence by sequence elsewhere) against the fp64 reference
    of each sequence."""
    cu, q, kv = _packed(LENGTHS, Hq, Hk, D, seed=2)
    x = [t.clone().requires_grad_() for t in (q, *kv)]
    out, lse = attention_varlen(*x, cu, max(LENGTHS), W1, W2)
    g = torch.Generator(device="cuda").manual_seed(3)
    dout = torch.randn(out.shape, generator=g, device="cuda").bfloat16()
    out.backward(dout)
    c = cu.tolist()
    for a, b in zip(c, c[1:]):
        if a == b:
            continue
        xs = [t[a:b][None] for t in (q, *kv)]
        ro, rl = reference(*xs, W1, W2)
        assert _rel(out[a:b], ro[0]) < TOLERANCES["out_rel"], (a, b)
        assert (lse[:, a:b] - rl[0]).abs().max().item() < TOLERANCES["lse_abs"], (a, b)
        grads = reference_backward(*xs, W1, W2, dout[a:b][None])
        for t, rg in zip(x, grads):
            if b - a == 1 and rg.norm() == 0:  # dQ, dK of one token are 0 (P = 1, dS = 0); the
                continue  # kernels give the bf16 residue of dP - Delta there
            assert _rel(t.grad[a:b], rg[0]) < TOLERANCES["grad_rel"], (a, b, rg.norm())


# w2 256 and 280: j's last key block holds 31 and 55 keys, packed 4 and 2 to a program
@pytest.mark.parametrize("form,w2", [("trilinear", W2), ("det", W2), ("trilinear", 256),
                                     ("det", 256), ("trilinear", 280)])
def test_packed_backward_matches_dense_tlx_pairs(form, w2):
    """The packed tlx_pairs backward against the dense tlx_pairs backward per sequence (its
    reduce-adds run in the hardware's order: equal within fp32 summation noise)."""
    cu, q, kv = _packed(LENGTHS, 128, 1, 128, seed=4)
    out, lse = forward_varlen(q, *kv, cu, W1, w2, form=form)
    dout = torch.randn_like(out)
    grads = backward_varlen(dout, None, q, *kv, out, lse, cu, W1, w2, variant="tlx_pairs",
                            form=form)
    c = cu.tolist()
    for a, b in zip(c, c[1:]):
        if a == b:
            continue
        dense = dense_backward(dout[a:b][None], None, q[a:b][None],
                               *(t[a:b][None] for t in kv), out[a:b][None], lse[:, a:b][None],
                               W1, w2, variant="tlx_pairs", form=form)
        for name, g, d in zip("q k1 k2 v1 v2".split(), grads, dense):
            assert _rel(g[a:b], d[0]) < 1e-2, (name, a, b)


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("poisoned", ["q", "k1", "k2", "v1", "v2"])
def test_no_value_crosses_sequences(value, poisoned):
    """inf or NaN in one input of sequence 4: every other sequence's outputs are bitwise those
    of a clean run, and its gradients finite and close to a clean run's."""
    cu, q, kv = _packed(LENGTHS, 128, 1, 128, seed=5)
    x = dict(zip(("q", "k1", "k2", "v1", "v2"), (q, *kv)))
    c = cu.tolist()
    bad = dict(x)
    bad[poisoned] = x[poisoned].clone()
    bad[poisoned][c[4]:c[5]] = value
    out, lse = forward_varlen(*bad.values(), cu, W1, W2)
    clean_out, clean_lse = forward_varlen(*x.values(), cu, W1, W2)
    keep = torch.ones(sum(LENGTHS), dtype=torch.bool, device="cuda")
    keep[c[4]:c[5]] = False
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[:, keep],
                                                                   clean_lse[:, keep])
    dout = torch.randn_like(out)
    grads = backward_varlen(dout, None, *bad.values(), out, lse, cu, W1, W2)
    clean = backward_varlen(dout, None, *x.values(), clean_out, clean_lse, cu, W1, W2)
    for name, g, d in zip(x, grads, clean):
        assert torch.isfinite(g[keep]).all(), f"{name}: non-finite outside the poisoned sequence"
        assert _rel(g[keep], d[keep]) < 1e-2, name


def _decode_against_dense(Hq, Hk, T, slots, w1=32, w2=200, form="trilinear", seed=6, D=128,
                          ref="auto"):
    """Prefill then decode T tokens a call, sequences of different lengths in one batch, caches
    of `slots(w, T)` slots (w + T - 1: a ring wrapping many times; more: a ring whose windows
    wrap at any slot; None: linear), every slot never written NaN: the outputs and LSE those
    of one dense forward over each whole sequence, within bf16 rounding (a split's bf16
    share, the merge, another key order); `ref`: the dense variant (one that rounds as the
    decoding kernel does: K1[j] * K2 in bf16)."""
    prefill, steps = [5, 300, 64, 211], 6
    B = len(prefill)
    n = [p + steps * T for p in prefill]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, max(n), Hq, D, generator=g, device="cuda").bfloat16()
    kv = [torch.randn(B, max(n), Hk, D, generator=g, device="cuda").bfloat16() for _ in range(4)]
    caches = [torch.full((B, slots(w, T) or max(n), Hk, D), math.nan, device="cuda",
                         dtype=torch.bfloat16) for w in (w1, w2, w1, w2)]
    lens = torch.tensor(prefill, dtype=torch.int32, device="cuda")
    for b, p in enumerate(prefill):  # the prefill's keys, in their slots
        for c, t in zip(caches, kv):  # the last R positions (a ring's; one write a slot)
            pos = torch.arange(max(0, p - c.shape[1]), p, device="cuda")
            c[b, pos % c.shape[1]] = t[b, pos]
    for step in range(steps):
        pos = lens.long()[:, None] + torch.arange(T, device="cuda")
        rows = torch.arange(B, device="cuda")[:, None]
        new = [t[rows, pos] for t in kv]
        out, lse = attention_with_kvcache(q[rows, pos], *caches, lens, w1, w2, k1=new[0],
                                          k2=new[1], v1=new[2], v2=new[3], form=form)
        for b in range(B):
            hi = int(pos[b, -1]) + 1
            o, l_ = dense_forward(q[b:b + 1, :hi], *(t[b:b + 1, :hi] for t in kv), w1, w2,
                                  form=form, variant=ref)
            ref_o, ref_l = o[0, hi - T:], l_[0, :, hi - T:]
            assert ulps(out[b], ref_o) <= ULPS, (step, b, ulps(out[b], ref_o))
            assert (lse[b] - ref_l).abs().max() < 1e-3, (step, b)
        lens += T


CACHES = {"ring": lambda w, T: w + T - 1, "ring+77": lambda w, T: w + T + 76,
          "linear": lambda w, T: None}


@pytest.mark.parametrize("Hq,Hk", [(128, 1), (256, 2), (64, 1)])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("cache", list(CACHES))
def test_decode_matches_one_dense_call(Hq, Hk, T, cache):
    _decode_against_dense(Hq, Hk, T, CACHES[cache])


@pytest.mark.parametrize("form", ["trilinear", "det"])
def test_decode_w1_above_w2_and_det(form):
    """The pairs exchanged (w1 > w2: the kernel reads K2's ring as its K1's), and form det
    (gathered windows)."""
    _decode_against_dense(128, 1, 2, CACHES["ring"], w1=200, w2=32, form=form)


def test_decode_d64_gathers():
    """D = 64 at G = 128 (no CACHE mode: gathered windows, the packed kernel); "auto"'s dense
    forward there (`tlx_ws`) rounds Q * K1[j] to bf16 instead, its LSE 4e-3 apart."""
    _decode_against_dense(128, 1, 3, CACHES["ring+77"], D=64, ref="tlx_pipelined_kv")


def test_decode_ring_of_whole_blocks():
    """Rings of 256 = 2 whole key blocks: every window read as the whole ring, no mask."""
    _decode_against_dense(128, 1, 1, CACHES["ring"], w1=32, w2=256)


def test_decode_step_in_a_cuda_graph():
    """A decoding step captured in a CUDA graph and replayed: the eager step's outputs and
    caches, bitwise (no host work in the step: append, attention, merge)."""
    B, Hq, D, w1, w2, p = 8, 128, 128, 32, 512, 700
    g = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(B, 1, Hq, D, generator=g, device="cuda").bfloat16()
    new = [torch.randn(B, 1, 1, D, generator=g, device="cuda").bfloat16() for _ in range(4)]
    caches = [torch.randn(B, w, 1, D, generator=g, device="cuda").bfloat16()
              for w in (w1, w2, w1, w2)]
    lens = torch.full((B,), p, dtype=torch.int32, device="cuda")
    eager_caches = [c.clone() for c in caches]
    ref = attention_with_kvcache(q, *eager_caches, lens, w1, w2, k1=new[0], k2=new[1],
                                 v1=new[2], v2=new[3])

    def step():
        return attention_with_kvcache(q, *caches, lens, w1, w2, k1=new[0], k2=new[1],
                                      v1=new[2], v2=new[3])
    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, ref):
        assert torch.equal(a, b)
    for a, b in zip(caches, eager_caches):
        assert torch.equal(a, b)


def test_decode_fills_the_gpu_by_splits():
    """One token for each of 8 sequences: the j windows are split (several shares a token), and
    the result still that of the dense forward."""
    B, Hq, D, w1, w2, p = 8, 128, 128, 32, 512, 700
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(B, p + 1, Hq, D, generator=g, device="cuda").bfloat16()
    kv = [torch.randn(B, p + 1, 1, D, generator=g, device="cuda").bfloat16() for _ in range(4)]
    caches = [t[:, :p].clone() for t in kv]
    caches = [torch.cat((c, torch.zeros_like(c[:, :1])), 1) for c in caches]  # one free slot
    lens = torch.full((B,), p, dtype=torch.int32, device="cuda")
    new = [t[:, p:] for t in kv]
    out, lse = attention_with_kvcache(q[:, p:], *caches, lens, w1, w2, k1=new[0], k2=new[1],
                                      v1=new[2], v2=new[3])
    o, l_ = attention(q, *kv, w1, w2)
    assert ulps(out[:, 0], o[:, p]) <= ULPS, ulps(out[:, 0], o[:, p])
    assert (lse[:, :, 0] - l_[:, :, p]).abs().max() < 1e-3


@pytest.mark.parametrize("B,T,w1,w2,appended", [(64, 1, 32, 512, True), (8, 1, 200, 32, True),
                                                (132, 1, 32, 512, True), (8, 3, 32, 512, True),
                                                (8, 2, 32, 512, False)])
def test_decode_plan_is_the_general_path_bitwise(monkeypatch, B, T, w1, w2, appended):
    """The step plan (kvcache._Step, which a call of contiguous tensors takes) and the general
    path it skips: the same outputs, LSE and caches, bitwise, also on the plan's second call
    (its shares' scratch reused). B 132: one share, no merge, on a 132-SM GPU; w1 > w2: the
    pairs exchanged."""
    from altattn.simplicial import kvcache
    Hq, D, p = 128, 128, 700
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(B, T, Hq, D, generator=g, device="cuda").bfloat16()
    new = [torch.randn(B, T, 1, D, generator=g, device="cuda").bfloat16() for _ in range(4)]
    caches = [torch.randn(B, w + T - 1, 1, D, generator=g, device="cuda").bfloat16()
              for w in (w1, w2, w1, w2)]
    lens = torch.randint(T, p, (B,), generator=g, device="cuda", dtype=torch.int32)
    kw = dict(zip(("k1", "k2", "v1", "v2"), new)) if appended else {}
    general_caches = [c.clone() for c in caches]
    taken, run = [], kvcache._Step.__call__
    monkeypatch.setattr(kvcache._Step, "__call__",
                        lambda self, *args: taken.append(1) or run(self, *args))
    planned = attention_with_kvcache(q, *caches, lens, w1, w2, **kw)
    # again (the same slots written with the same keys): the shares' scratch kept, reused
    again = attention_with_kvcache(q, *caches, lens, w1, w2, **kw)
    assert taken == [1, 1]
    monkeypatch.setattr(kvcache._Step, "takes", lambda *args: False)
    general = attention_with_kvcache(q, *general_caches, lens, w1, w2, **kw)
    torch.cuda.synchronize()
    assert taken == [1, 1]
    for a, b, c in zip(planned, general, again):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
        assert torch.equal(c, b)
    for a, b in zip(caches, general_caches):
        assert torch.equal(a, b)

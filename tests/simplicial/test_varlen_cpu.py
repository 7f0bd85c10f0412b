"""Packed sequences and KV-cache decoding on the CPU (the fp64 reference path): the semantics
against the dense op run sequence by sequence, gradients, the layer, torch.compile, and the
errors bad input raises."""
from __future__ import annotations

import pytest
import torch

from altattn import SimplicialAttention
from altattn.simplicial import attention, attention_varlen, attention_with_kvcache

H_Q, H_K, D = 4, 2, 64


def _packed(lengths, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()],
                      dtype=torch.int32)
    q = torch.randn(T, H_Q, D, generator=g, dtype=dtype)
    kv = [torch.randn(T, H_K, D, generator=g, dtype=dtype) for _ in range(4)]
    return cu, q, kv


@pytest.mark.parametrize("w1,w2", [(3, 6), (6, 3), (1, 1)])
@pytest.mark.parametrize("form", ["trilinear", "det"])
def test_varlen_is_the_dense_op_per_sequence(w1, w2, form):
    """Lengths 1, 0 (empty), < w1, between the windows, > w2: outputs, LSE and every gradient
    those of `attention` on each sequence alone (fp64: equal to rounding)."""
    lengths = [1, 0, 2, 5, 11, 0]
    cu, q, kv = _packed(lengths)
    x = [t.clone().requires_grad_() for t in (q, *kv)]
    out, lse = attention_varlen(*x, cu, max(lengths), w1, w2, form=form)
    g = torch.Generator().manual_seed(1)
    dout, dlse = torch.randn(out.shape, generator=g, dtype=out.dtype), torch.randn(lse.shape,
                                                                                   generator=g)
    torch.autograd.backward((out, lse), (dout, dlse.double()))
    c = cu.tolist()
    for a, b in zip(c, c[1:]):
        if a == b:
            continue
        xs = [t.detach()[a:b][None].requires_grad_() for t in (q, *kv)]
        o, l_ = attention(*xs, w1, w2, form=form)
        torch.autograd.backward((o, l_), (dout[a:b][None], dlse[:, a:b][None].double()))
        torch.testing.assert_close(out[a:b], o[0])
        torch.testing.assert_close(lse[:, a:b], l_[0])
        for t, s in zip(x, xs):
            torch.testing.assert_close(t.grad[a:b], s.grad[0])


def test_no_value_crosses_sequences():
    """NaN in every input of one sequence: the others' outputs and gradients unchanged."""
    cu, q, kv = _packed([4, 7, 5])
    bad = [t.clone() for t in (q, *kv)]
    for t in bad:
        t[4:11] = float("nan")
    runs = []
    for inputs in ((q, *kv), bad):
        x = [t.clone().requires_grad_() for t in inputs]
        out, _ = attention_varlen(*x, cu, 7, 3, 6)
        out.sum().backward()
        runs.append((out.detach(), [t.grad for t in x]))
    keep = torch.ones(16, dtype=torch.bool)
    keep[4:11] = False
    assert torch.equal(runs[0][0][keep], runs[1][0][keep])
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a[keep], b[keep])


def test_layer_takes_packed_sequences():
    layer = SimplicialAttention(32, H_Q, H_K, D, 3, 5).double()
    x = torch.randn(10, 32, dtype=torch.float64)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    packed = layer(x, cu, 6)
    dense = torch.cat([layer(x[None, :4])[0], layer(x[None, 4:])[0]])
    torch.testing.assert_close(packed, dense)


def test_varlen_compiles_fullgraph():
    cu, q, kv = _packed([3, 5])
    f = torch.compile(lambda *x: attention_varlen(*x, cu, 5, 2, 4)[0], fullgraph=True,
                      backend="aot_eager")
    torch.testing.assert_close(f(q, *kv), attention_varlen(q, *kv, cu, 5, 2, 4)[0])


@pytest.mark.parametrize("bad, err, match", [
    (lambda cu: cu.long(), TypeError, "int32"),
    (lambda cu: cu[None], ValueError, "1-D"),
    (lambda cu: cu + 1, ValueError, "from 0"),
    (lambda cu: cu[:-1], ValueError, "from 0"),
    (lambda cu: torch.tensor([0, 9, 5, 16], dtype=torch.int32), ValueError, "non-decreasing"),
    ("list", TypeError, "cu_seqlens must be a torch.Tensor"),
])
def test_bad_cu_seqlens_are_refused(bad, err, match):
    cu, q, kv = _packed([4, 7, 5])
    arg = cu.tolist() if bad == "list" else bad(cu)
    with pytest.raises(err, match=match):
        attention_varlen(q, *kv, arg, 7, 3, 6)


def test_bad_packed_shapes_and_max_seqlen_are_refused():
    cu, q, kv = _packed([4, 7, 5])
    with pytest.raises(ValueError, match="max_seqlen = 6"):
        attention_varlen(q, *kv, cu, 6, 3, 6)
    with pytest.raises(ValueError, match="k2 has T"):
        attention_varlen(q, kv[0], kv[1][:-1], *kv[2:], cu, 7, 3, 6)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        attention_varlen(q[None], *kv, cu, 7, 3, 6)


def _decode_inputs(B, n, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, H_Q, D, generator=g, dtype=torch.float64)
    kv = [torch.randn(B, n, H_K, D, generator=g, dtype=torch.float64) for _ in range(4)]
    return q, kv


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("ring", [True, False], ids=["ring", "linear"])
@pytest.mark.parametrize("w1,w2", [(3, 5), (5, 3)])
def test_decode_is_the_dense_op(T, ring, w1, w2):
    """Decoding T tokens a call into ring buffers of w + T - 1 slots (wrapping several times)
    or linear caches, sequences of different lengths: each token's output and LSE those of
    `attention` over its whole sequence."""
    B, steps, start = 3, 5, [0, 4, 9]
    n = max(start) + steps * T
    q, kv = _decode_inputs(B, n, T)
    dense = attention(q, *kv, w1, w2)
    r1, r2 = (w1 + T - 1, w2 + T - 1) if ring else (n, n)
    caches = [torch.zeros(B, r, H_K, D, dtype=torch.float64) for r in (r1, r2, r1, r2)]
    lens = torch.tensor(start, dtype=torch.int32)
    for b, p in enumerate(start):
        for c, t in zip(caches, kv):  # the last R positions (a ring's; one write a slot)
            pos = torch.arange(max(0, p - c.shape[1]), p)
            c[b, pos % c.shape[1]] = t[b, pos]
    rows = torch.arange(B)[:, None]
    for _ in range(steps):
        pos = lens.long()[:, None] + torch.arange(T)
        new = [t[rows, pos] for t in kv]
        out, lse = attention_with_kvcache(q[rows, pos], *caches, lens, w1, w2, k1=new[0],
                                          k2=new[1], v1=new[2], v2=new[3])
        torch.testing.assert_close(out, dense[0][rows, pos])
        torch.testing.assert_close(lse, dense[1].transpose(1, 2)[rows, pos].transpose(1, 2))
        lens += T
    # without new keys: the queries are the last T cached tokens
    out, _ = attention_with_kvcache(q[rows, pos], *caches, lens, w1, w2)
    torch.testing.assert_close(out, dense[0][rows, pos])


def test_decode_refuses_bad_input():
    q, kv = _decode_inputs(2, 8, 1)
    caches = [torch.zeros(2, r, H_K, D, dtype=torch.float64) for r in (3, 4, 3, 4)]
    new = dict(k1=kv[0][:, :1], k2=kv[1][:, :1], v1=kv[2][:, :1], v2=kv[3][:, :1])
    lens = torch.tensor([2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="k2_cache has 4 slots, too short for the window w = 6"):
        attention_with_kvcache(q[:, :1], *caches, torch.tensor([2, 5], dtype=torch.int32), 3, 6,
                               **new)
    attention_with_kvcache(q[:, :1], *caches, lens, 3, 6, **new)  # no position past the cache
    with pytest.raises(ValueError, match="cache_seqlens must be >= 1"):
        attention_with_kvcache(q[:, :1], *caches, torch.tensor([0, 1], dtype=torch.int32), 3, 4)
    with pytest.raises(TypeError, match="int32"):
        attention_with_kvcache(q[:, :1], *caches, lens.long(), 3, 4, **new)
    with pytest.raises(ValueError, match="give all four"):
        attention_with_kvcache(q[:, :1], *caches, lens, 3, 4, k1=new["k1"])
    with pytest.raises(ValueError, match="as many slots"):
        attention_with_kvcache(q[:, :1], caches[0], caches[1], caches[1], caches[3], lens, 3, 4)
    with pytest.raises(ValueError, match="k1 must be"):
        attention_with_kvcache(q[:, :1], *caches, lens, 3, 4, **dict(new, k1=kv[0][:, :2]))
    with pytest.raises(ValueError, match="forward-only"):
        attention_with_kvcache(q[:, :1].requires_grad_(), *caches, lens, 3, 4, **new)

"""Triple attention over packed sequences on the CPU (the fp64 reference path): each sequence
alone through `attention` (out, final states, the gradients of the five inputs and of
initial_state), the layer, torch.compile, opcheck, bad input named; and the kernels' device maps
(kernels_triton/triple/varlen.py: which tokens each split and tile covers), checked in plain
torch. The kernels themselves: tests/triple/test_gpu_triple_varlen.py (and, in Triton's CPU
interpreter, test_triple_varlen_interpreter.py)."""
from __future__ import annotations

import pytest
import torch

import altattn
from altattn.triple import attention, attention_varlen

F64 = torch.float64
H, DQ, DV = 2, 32, 64
LENGTHS = [5, 0, 1, 9, 0, 2]   # empty ones (also last), one token, several


def _packed(gen, lengths, Dq=DQ, Dv=DV, H=H):
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()],
                      dtype=torch.int32)
    T = int(cu[-1])
    x = [torch.randn(T, H, d, generator=gen, dtype=F64) for d in (Dq, Dq, Dq, Dq, Dv)]
    return cu, x


def _per_sequence(cu, x, dout, dstate, scale, causal, init):
    """out, state and the gradients of `attention` run on each sequence alone."""
    outs, states, grads = [], [], [[] for _ in range(6)]
    c = cu.tolist()
    for s, (a, b) in enumerate(zip(c, c[1:])):
        xs = [t[a:b][None].detach().requires_grad_() for t in x]
        i0 = None if init is None else init[s:s + 1].detach().requires_grad_()
        o, st = attention(*xs, scale=scale, causal=causal, initial_state=i0)
        outs.append(o[0])
        states.append(st)
        got = torch.autograd.grad((o, st), [*xs, *([i0] if i0 is not None else [])],
                                  (dout[a:b][None], dstate[s:s + 1]), allow_unused=True)
        for i, g in enumerate(got):
            grads[i].append(g[0] if i < 5 else g)
    return (torch.cat(outs), torch.cat(states),
            [torch.cat(g) if g else None for g in grads[:5 + (init is not None)]])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale, with_state", [(None, False), (0.3, False), (0.3, True)],
                         ids=["scale_none", "scale", "scale_and_state"])
def test_varlen_is_attention_per_sequence(causal, scale, with_state, gen):
    """Empty and one-token sequences, Dq != Dv: out, each sequence's final state (an empty
    one's: its initial state, or 0) and every gradient, initial_state's included, equal those
    of `attention` on each sequence alone (scale None: each its own 1/length)."""
    cu, x = _packed(gen, LENGTHS)
    n = len(LENGTHS)
    init = torch.randn(n, H, DQ, DV, DQ, generator=gen, dtype=F64) if with_state else None
    leaves = [t.clone().requires_grad_() for t in x]
    init_leaf = None if init is None else init.clone().requires_grad_()
    out, state = attention_varlen(*leaves, cu, max(LENGTHS), scale=scale, causal=causal,
                                  initial_state=init_leaf)
    assert out.shape == (sum(LENGTHS), H, DV) and state.shape == (n, H, DQ, DV, DQ)
    dout, dstate = torch.randn_like(out), torch.randn_like(state)
    wrt = leaves + ([init_leaf] if init_leaf is not None else [])
    got = torch.autograd.grad((out, state), wrt, (dout, dstate))
    want_out, want_state, want_grads = _per_sequence(cu, x, dout, dstate, scale, causal, init)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, want_state, rtol=1e-12, atol=1e-12)
    for g, w in zip(got, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    empty = [s for s, m in enumerate(LENGTHS) if m == 0]
    torch.testing.assert_close(state[empty], init[empty] if with_state else
                               torch.zeros_like(state[empty]))


def test_scale_none_is_each_sequences_own_mean(gen):
    """scale=None: sequence s's state is the mean of its tokens' outer products (1/its length),
    not the mean over the T packed tokens."""
    cu, x = _packed(gen, [3, 7])
    _, state = attention_varlen(*x, cu, 7)
    for s, (a, b) in enumerate([(0, 3), (3, 10)]):
        k1, v, k2 = x[2][a:b], x[4][a:b], x[3][a:b]
        want = torch.einsum("nhi,nhj,nhk->hijk", k1, v, k2) / (b - a)
        torch.testing.assert_close(state[s], want, rtol=1e-12, atol=1e-12)


def test_no_state_crosses_a_sequence_start(gen):
    """Changing one sequence's inputs changes no other sequence's out or state."""
    cu, x = _packed(gen, [4, 6, 3])
    out, state = attention_varlen(*x, cu, 6, causal=True)
    y = [t.clone() for t in x]
    for t in y:
        t[4:10] = torch.randn(t[4:10].shape, generator=gen, dtype=F64)
    out2, state2 = attention_varlen(*y, cu, 6, causal=True)
    keep = torch.ones(13, dtype=torch.bool)
    keep[4:10] = False
    assert torch.equal(out[keep], out2[keep])
    assert torch.equal(state[[0, 2]], state2[[0, 2]]) and not torch.equal(state[1], state2[1])


def test_dtypes_and_empty_packs(gen):
    cu, x = _packed(gen, [3, 4])
    out, state = attention_varlen(*(t.bfloat16() for t in x), cu, 4)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    none = torch.zeros(1, dtype=torch.int32)
    out, state = attention_varlen(*(t[:0] for t in x), none, 0)
    assert out.shape == (0, H, DV) and state.shape == (0, H, DQ, DV, DQ)
    two_empty = torch.zeros(3, dtype=torch.int32)
    init = torch.randn(2, H, DQ, DV, DQ, generator=gen, dtype=F64, requires_grad=True)
    out, state = attention_varlen(*(t[:0] for t in x), two_empty, 0, scale=1.0,
                                  initial_state=init)
    assert torch.equal(state, init)
    state.sum().backward()
    assert torch.equal(init.grad, torch.ones_like(init))


def test_the_layer_takes_packed_sequences(gen):
    """TripleAttention(x [T, dim], cu_seqlens=, max_seqlen=) is the layer on each sequence;
    return_state gives a state per sequence, initial_state one per sequence."""
    layer = altattn.TripleAttention(48, H, DQ, DV, causal=True, scale=0.25).double()
    x = torch.randn(10, 48, generator=gen, dtype=F64)
    cu = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    y, state = layer(x, cu_seqlens=cu, max_seqlen=6, return_state=True)
    parts = [layer(x[None, a:b], return_state=True) for a, b in ((0, 4), (4, 4), (4, 10))]
    torch.testing.assert_close(y, torch.cat([p[0][0] for p in parts]))
    torch.testing.assert_close(state, torch.cat([p[1] for p in parts]))
    y2 = layer(x, state, cu_seqlens=cu)  # each sequence continues from its state
    want = torch.cat([layer(x[None, a:b], state[s:s + 1])[0]
                      for s, (a, b) in enumerate(((0, 4), (4, 4), (4, 10)))])
    torch.testing.assert_close(y2, want)
    y2.square().sum().backward()
    assert all(p.grad is not None and p.grad.any() for p in layer.parameters())


def test_compiles_fullgraph_and_opchecks(gen, tiny_dims):
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    x = [torch.randn(5, 2, d, generator=gen, dtype=F64, requires_grad=True)
         for d in (2, 2, 2, 2, 3)]

    def step(*a):
        out, state = attention_varlen(*a, cu, 3, causal=True)
        return out.square().sum() + state.sum()

    want = torch.autograd.grad(step(*x), x)
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(*x)
    torch.testing.assert_close(loss, step(*x))
    for g, w in zip(torch.autograd.grad(loss, x), want):
        torch.testing.assert_close(g, w)
    init = torch.randn(3, 2, 2, 3, 2, generator=gen, dtype=F64)
    xd = [t.detach() for t in x]
    for i0, scale in ((None, None), (init, 0.5)):
        torch.library.opcheck(torch.ops.altattn.triple_varlen_fwd.default,
                              (*xd, cu, i0, scale, True, "auto", "auto", False))
        out, state = torch.ops.altattn.triple_varlen_fwd(*xd, cu, i0, scale, True, "auto",
                                                         "auto", False)
        for dstate in (None, torch.randn_like(state)):
            torch.library.opcheck(torch.ops.altattn.triple_varlen_bwd.default,
                                  (torch.randn_like(out), dstate, state, *xd, cu, i0, scale,
                                   True, "auto", False))


def test_the_op_gradchecks(gen, tiny_dims):
    cu = torch.tensor([0, 3, 3, 4], dtype=torch.int32)
    x = [torch.randn(4, 1, d, generator=gen, dtype=F64, requires_grad=True)
         for d in (2, 2, 2, 2, 3)]
    init = torch.randn(3, 1, 2, 3, 2, generator=gen, dtype=F64, requires_grad=True)
    for causal in (False, True):
        assert torch.autograd.gradcheck(lambda *a: attention_varlen(
            *a[:5], cu, 3, scale=0.7, causal=causal, initial_state=a[5]), (*x, init))


BAD_CU = [
    (lambda cu: cu.long(), TypeError, "int32"),
    (lambda cu: cu[None], ValueError, "1-D"),
    (lambda cu: cu + 1, ValueError, "from 0"),
    (lambda cu: cu[:-1], ValueError, "from 0"),
    (lambda cu: torch.tensor([0, 9, 5, 16], dtype=torch.int32), ValueError, "non-decreasing"),
    (lambda cu: cu.tolist(), TypeError, "cu_seqlens must be a torch.Tensor"),
]


@pytest.mark.parametrize("bad, err, match", BAD_CU)
def test_bad_cu_seqlens_are_refused(bad, err, match, gen):
    cu, x = _packed(gen, [4, 7, 5])
    with pytest.raises(err, match=match):
        attention_varlen(*x, bad(cu), 7)


def test_bad_shapes_max_seqlen_state_and_scale_are_refused(gen):
    cu, x = _packed(gen, [4, 7, 5])
    with pytest.raises(ValueError, match="max_seqlen = 6"):
        attention_varlen(*x, cu, 6)
    with pytest.raises(TypeError, match="max_seqlen must be an int"):
        attention_varlen(*x, cu, 7.0)
    with pytest.raises(ValueError, match="k2 must have q1's shape"):
        attention_varlen(*x[:3], x[3][:-1], x[4], cu, 7)
    with pytest.raises(ValueError, match=r"rank 3 \[T, H, Dq\]"):
        attention_varlen(x[0][None], *x[1:], cu, 7)
    with pytest.raises(ValueError, match="head dim Dv=48"):
        attention_varlen(*x[:4], x[4][..., :48], cu, 7)
    with pytest.raises(ValueError, match=r"initial_state must have shape \(3, 2, 32, 64, 32\)"):
        attention_varlen(*x, cu, 7, scale=1.0, initial_state=torch.zeros(2, H, DQ, DV, DQ))
    with pytest.raises(ValueError, match="scale=None"):
        attention_varlen(*x, cu, 7, initial_state=torch.zeros(3, H, DQ, DV, DQ))
    with pytest.raises(ValueError, match="scale must be a finite positive float"):
        attention_varlen(*x, cu, 7, scale=-1.0)
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        altattn.TripleAttention(32, H, DQ).double()(torch.zeros(16, 32, dtype=F64),
                                                    cu_seqlens=cu[None])


def test_values_are_read_once_per_tensor_and_version(gen, monkeypatch):
    """The host read of cu_seqlens' values (a sync on a GPU) happens once per tensor and
    in-place version: a model's layers share one read."""
    from altattn.triple import varlen
    cu, x = _packed(gen, [4, 7, 5])
    reads = []
    check = varlen.check_cu_seqlens
    monkeypatch.setattr(varlen, "check_cu_seqlens", lambda *a, values=True, **k: (
        reads.append(values), check(*a, values=values, **k))[1])
    for _ in range(3):
        attention_varlen(*x, cu, 7)
    assert reads.count(True) == 1
    cu[1:] = cu[1:]  # an in-place write: read again
    attention_varlen(*x, cu, 7)
    assert reads.count(True) == 2


# ---------------------------------------------------------------------------------------------
# The kernels' device maps (kernels_triton/triple/varlen.py), in plain torch


@pytest.mark.parametrize("causal", [False, True])
def test_the_maps_cover_each_sequence_once(causal):
    """Splits: every token of a sequence in exactly one split of that sequence, at most L long,
    longest first; seg/slot list each sequence's splits in order; the padded runs (TLX copy)
    hold each split at a BN-aligned start. Tiles: every token in one tile of its sequence (and
    chunk), slab and sequence right; unused splits and tiles empty."""
    from kernels_triton.triple import varlen as kv
    lengths = [130, 0, 1, 64, 300, 0, 65]
    L = 64 if causal else 128
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T, n = int(cu[-1]), len(lengths)
    C = -(-T // L) + n
    G = -(-T // 32) + n
    maps = kv.build_maps(cu, None, T, n, L, C, (T + C * kv.BN) // kv.BN,
                         {"t": (32, G, causal, "rows" if causal else None)})
    t = maps.tiles["t"].long()
    used = t[:, 2] > t[:, 0]
    assert used.sum() == sum(-(-m // 32) for m in lengths) and not used[used.sum():].any()
    if causal:  # by chunk, each chunk's last tile first
        key = (t[used, 1] * 10 ** 6 - t[used, 0]).tolist()
        assert key == sorted(key)
    seq_of = torch.repeat_interleave(torch.arange(n), torch.tensor(lengths))
    sp = maps.splits.long()
    lens = sp[:, 1] - sp[:, 0]
    assert (lens[:-1] >= lens[1:]).all() and (lens <= L).all()
    hit = torch.zeros(T, dtype=torch.long)
    for s in range(n):
        idx = maps.slot[maps.seg[s]:maps.seg[s + 1]].long()
        starts = [int(sp[i, 0]) for i in idx]
        assert starts == sorted(starts) and all(seq_of[sp[i, 0]:sp[i, 1]].eq(s).all()
                                                for i in idx)
        for i in idx:
            hit[sp[i, 0]:sp[i, 1]] += 1
            assert sp[i, 2] % kv.BN == 0
            if sp[i, 1] > sp[i, 0]:
                assert (maps.runs[sp[i, 2] // kv.BN:(sp[i, 2] + lens[i] - 1) // kv.BN + 1]
                        == i).all()
    assert (hit == 1).all() and int(maps.seg[-1]) == sum(-(-m // L) for m in lengths)
    torch.testing.assert_close(maps.scale, 1 / torch.tensor(lengths).clamp(min=1).float())
    tiles = maps.tiles["t"].long()
    hit.zero_()
    for row0, c0, hi, slab, s in tiles.tolist():
        if hi <= row0:
            continue
        assert seq_of[row0:min(row0 + 32, hi)].eq(s).all()
        hit[row0:min(row0 + 32, hi)] += 1
        if causal:  # the chunk's split: its start c0, the tile inside it
            assert sp[slab, 0] == c0 and c0 <= row0 < hi <= sp[slab, 1] and (row0 - c0) % 32 == 0
        else:
            assert slab == s and c0 == cu[s] and hi == cu[s + 1]
    assert (hit == 1).all()

"""Spherical attention over packed sequences on the CPU (the fp64 reference path, CI): each
sequence's results those of the op on it alone (out, r and the gradients of q, k, v, with a
gradient into r too), causal and not, empty and length-1 sequences, GQA, cross-attention; the
ops under opcheck and torch.compile(fullgraph=True); the layer; the tile map packed launches read
and the row coefficients' slots layout (in Triton's interpreter); which variants take packed
input; and bad input refused naming the argument."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from altattn import SphericalAttention, launcher
from altattn.packing import MAP_COLUMNS, max_tiles, tile_map
from altattn.spherical import attention, attention_varlen
from altattn.spherical.varlen import validate_packed

F64 = torch.float64
HQ, HK, D = 4, 2, 64


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()],
                        dtype=torch.int32)


def _packed(lq, lk=None, seed=0, hq=HQ, hk=HK):
    g = torch.Generator().manual_seed(seed)
    lk = lq if lk is None else lk
    q = torch.randn(sum(lq), hq, D, generator=g, dtype=F64)
    k, v = (torch.randn(sum(lk), hk, D, generator=g, dtype=F64) for _ in range(2))
    cu_q = _cu(lq)
    return q, k, v, cu_q, cu_q if lk is lq else _cu(lk)


CASES = [  # (query lengths, key lengths or None: the same, causal, Hq, Hk)
    ([1, 0, 2, 5, 11, 0], None, False, 4, 2),
    ([1, 0, 2, 5, 11, 0], None, True, 4, 2),
    ([3, 7], None, True, 2, 2),
    ([3, 7, 0, 2], [5, 1, 4, 0], False, 4, 1),   # cross-attention: keys of other lengths
]


@pytest.mark.parametrize("lq, lk, causal, hq, hk", CASES)
def test_varlen_is_the_op_on_each_sequence_alone(lq, lk, causal, hq, hk):
    q, k, v, cu_q, cu_k = _packed(lq, lk, hq=hq, hk=hk)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out, r = attention_varlen(*x, cu_q, cu_k, max(lq), max(lk or lq), causal=causal)
    assert out.shape == q.shape and r.shape == (hq, q.shape[0]) and r.dtype == F64
    g = torch.Generator().manual_seed(1)
    dout, dr = torch.randn(out.shape, generator=g, dtype=F64), torch.randn(r.shape, generator=g,
                                                                           dtype=F64)
    torch.autograd.backward((out, r), (dout, dr))
    a, b = cu_q.tolist(), cu_k.tolist()
    for i in range(len(a) - 1):
        q0, q1, k0, k1 = a[i], a[i + 1], b[i], b[i + 1]
        if q1 == q0:
            continue
        xs = [t.detach()[None, s:e].requires_grad_() for t, (s, e) in
              zip((q, k, v), ((q0, q1), (k0, k1), (k0, k1)))]
        o, rr = attention(*xs, causal=causal)
        torch.autograd.backward((o, rr), (dout[None, q0:q1], dr[None, :, q0:q1]))
        torch.testing.assert_close(out[q0:q1], o[0])
        torch.testing.assert_close(r[:, q0:q1], rr[0])
        for t, s, (lo, hi) in zip(x, xs, ((q0, q1), (k0, k1), (k0, k1))):
            torch.testing.assert_close(t.grad[lo:hi], s.grad[0])
    for t, cu in zip(x, (cu_q, cu_k, cu_k)):  # rows of empty sequences: nothing, no gradient
        assert torch.isfinite(t.grad).all()


def test_no_value_crosses_sequences():
    """NaN in every input of one sequence: the others' outputs and gradients unchanged."""
    q, k, v, cu, _ = _packed([4, 7, 5])
    bad = [t.clone() for t in (q, k, v)]
    for t in bad:
        t[4:11] = float("nan")
    runs = []
    for inputs in ((q, k, v), bad):
        x = [t.clone().requires_grad_() for t in inputs]
        out, r = attention_varlen(*x, cu, cu, 7, 7, causal=True)
        (out.sum() + r.sum()).backward()
        runs.append((out.detach(), r.detach().t(), [t.grad for t in x]))
    keep = torch.ones(16, dtype=torch.bool)
    keep[4:11] = False
    assert torch.equal(runs[0][0][keep], runs[1][0][keep])
    assert torch.equal(runs[0][1][keep], runs[1][1][keep])
    for a, b in zip(runs[0][2], runs[1][2]):
        assert torch.equal(a[keep], b[keep])


@pytest.mark.slow
def test_the_ops_opcheck_gradcheck_and_compile_fullgraph():
    q, k, v, cu_q, cu_k = _packed([3, 0, 2], [2, 1, 3])
    args = (q, k, v, cu_q, cu_k, 3, 3, False, 0.125, 1e-6, "auto", "auto", False)
    torch.library.opcheck(torch.ops.altattn.spherical_varlen_fwd.default, args)
    out, r = torch.ops.altattn.spherical_varlen_fwd(*args)
    bwd = (torch.randn_like(out), torch.randn_like(r), q, k, v, out, r, cu_q, cu_k, 3, 3, False,
           0.125, 1e-6, "auto", False)
    torch.library.opcheck(torch.ops.altattn.spherical_varlen_bwd.default, bwd)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda *t: attention_varlen(*t, cu_q, cu_k, 3, 3), x)
    cu, x = _packed([3, 5])[3], _packed([3, 5])[:3]
    f = torch.compile(lambda *t: attention_varlen(*t, cu, cu, 5, 5, causal=True),
                      fullgraph=True, backend="aot_eager")
    for got, want in zip(f(*x), attention_varlen(*x, cu, cu, 5, 5, causal=True)):
        torch.testing.assert_close(got, want)


def test_the_layer_takes_packed_sequences():
    torch.manual_seed(0)
    layer = SphericalAttention(32, HQ, HK, D, causal=True).double()
    x = torch.randn(10, 32, dtype=F64)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    mult = torch.rand(10, dtype=F64)
    packed = layer(x, cu_seqlens=cu, max_seqlen=6, multiplicity=mult)
    dense = torch.cat([layer(x[None, :4], multiplicity=mult[None, :4])[0],
                       layer(x[None, 4:], multiplicity=mult[None, 4:])[0]])
    torch.testing.assert_close(packed, dense)
    with pytest.raises(ValueError, match="not both"):
        layer(x, torch.tensor([10], dtype=torch.int32), cu_seqlens=cu)


def test_the_tile_map_covers_every_head_and_tile_once_a_sequence_at_a_time():
    lens, block, heads = [1, 0, 130, 333, 7, 257, 128, 64], 128, 3
    cu = _cu(lens)
    for causal in (False, True):
        n = max_tiles(sum(lens), len(lens), block)
        m = tile_map(cu, cu, block, n, heads=heads, causal=causal)
        assert m.shape == (heads * n, len(MAP_COLUMNS))
        real = m[m[:, 2] > 0]
        want = {(a, f, h) for a, ln in zip(cu.tolist(), lens) for f in range(0, ln, block)
                for h in range(heads)}
        assert sorted((int(r[0]), int(r[4]), int(r[5])) for r in real) == sorted(want)
        assert len(real) == len(want) and (m[len(real):, 2:4] == 0).all()
        work = (torch.minimum(real[:, 3], real[:, 4] + block) if causal else real[:, 3]).tolist()
        runs = []  # (sequence start, head) in the order the map visits them, with their works
        for r, w in zip(real.tolist(), work):
            if not runs or runs[-1][0] != (r[0], r[5]):
                runs.append(((r[0], r[5]), []))
            runs[-1][1].append(w)
        assert len(runs) == len({key for key, _ in runs})  # each (sequence, head) in one run
        seqs = [key[0] for key, _ in runs]
        assert all(seqs[i:i + heads] == [seqs[i]] * heads for i in range(0, len(seqs), heads))
        assert [key[1] for key, _ in runs] == list(range(heads)) * (len(runs) // heads)
        tops = [max(w) for _, w in runs]
        assert tops == sorted(tops, reverse=True)  # sequences by their largest tile
        assert all(w == sorted(w, reverse=True) for _, w in runs)  # a head's tiles likewise
    keys = tile_map(cu, cu, 64, max_tiles(sum(lens), len(lens), 64), keys=True)
    assert int((keys[:, 3] > 0).sum()) == sum(-(-ln // 64) for ln in lens)
    # cross-attention: a query tile's work is its sequence's key count, past n_tiles * block
    lk = [9000, 1, 5, 700, 3, 0, 64, 1]
    m = tile_map(cu, _cu(lk), block, max_tiles(sum(lens), len(lens), block), heads=2)
    real = m[m[:, 2] > 0]
    assert len(real) == 2 * sum(-(-ln // block) for ln in lens)
    assert real[:, 3].tolist() == sorted(real[:, 3].tolist(), reverse=True)


SLOTS_PROBE = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
from types import SimpleNamespace
import torch
from kernels_triton import launch
launch.Kernel.__call__ = lambda self, *a, **k: self.fn[self.grid](*a, **k, **self.options)
from kernels_triton.spherical.bwd_common import prepare_row_coeffs, slot_rows
lens, H, D = {lens!r}, 3, 16
T, n = sum(lens), len(lens)
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
spec = SimpleNamespace(B=1, N=T, Hq=H, D=D, sm_scale=0.3, eps=1e-6, varlen=False)
out, dout = (torch.randn(1, T, H, D).bfloat16() for _ in range(2))
r, dr = torch.rand(1, H, T) + 0.5, torch.randn(1, H, T)
r[0, :, 1] = 0.0  # a zero row norm: Bt and R are 0 there
A, R = prepare_row_coeffs(spec, ratio=True)(out, dout, r, dr, None)
SA, SR = prepare_row_coeffs(spec, ratio=True, slots=True)(out, dout, r, dr, cu)
assert SA.shape == SR.shape == (H, slot_rows(T, n))
taken = torch.zeros(SA.shape[1], dtype=torch.int32)
for s in range(n):
    a, ln = int(cu[s]), lens[s]
    s0, end = 64 * (a // 64 + s), 64 * (a // 64 + s) + -(-ln // 64) * 64
    assert s0 % 4 == 0 and end <= SA.shape[1]
    taken[s0:end] += 1
    for got, want in ((SA, A), (SR, R)):
        assert torch.equal(got[:, s0:s0 + ln], want[0, :, a:a + ln])
        assert (got[:, s0 + ln:end] == 0).all()
assert int(taken.max()) <= 1  # no two sequences share a slot
print("ok")
"""


def test_row_coefficients_slots_layout_in_the_interpreter():
    """The TLX backward's A and R of packed rows (row_coeffs(..., slots=True)): each sequence's
    rows bitwise the plain layout's, from 64 * (first row // 64 + sequence) on, zeros to its last
    64-row tile's end, no slot shared; empty, length-1 and 64-multiple sequences, runs of rows
    whose binary search crosses several sequences."""
    for lens in ([1, 0, 130, 333, 7, 257, 128, 64], [64], [0, 5, 0, 0, 200], [3] * 70):
        p = subprocess.run([sys.executable, "-c", SLOTS_PROBE.format(root=str(ROOT), lens=lens)],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0 and p.stdout.strip().endswith("ok"), (lens, p.stderr[-3000:])


def test_auto_takes_only_variants_that_take_packed_input():
    spec = validate_packed(*_packed([3, 4])[:3], _cu([3, 4]), _cu([3, 4]), cpu_reference=True)
    assert spec.packed and spec.B == 1 and spec.N == 7
    assert launcher.pick(spec, "auto", pass_="bwd", deterministic=True,
                         family="spherical").name == "triton"
    assert launcher.pick(spec, "auto", pass_="fwd", family="spherical").name == "tlx_pingpong"
    with pytest.raises(ValueError, match="packed"):
        launcher.pick(spec, "tlx_ws_det", pass_="bwd", family="spherical")


def _bad(**kw):
    q, k, v, cu, _ = _packed([4, 7, 5])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7,
                max_seqlen_k=7)
    args.update(kw)
    return args


BAD = [
    (dict(cu_seqlens_q=_cu([4, 7, 5]).long()), TypeError, "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=_cu([4, 7, 5])[None]), ValueError, "cu_seqlens_k must be 1-D"),
    (dict(cu_seqlens_q=[0, 4, 11, 16]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    (dict(cu_seqlens_q=torch.tensor([0, 9, 5, 16], dtype=torch.int32)), ValueError,
     "non-decreasing"),
    (dict(cu_seqlens_q=_cu([4, 7, 5]) + 1), ValueError, "cu_seqlens_q must run from 0"),
    (dict(cu_seqlens_k=_cu([4, 7, 4])), ValueError, "cu_seqlens_k must run from 0 to the packed "
                                                    "token count T = 16"),
    (dict(max_seqlen_q=6), ValueError, "max_seqlen_q = 6 but the longest sequence has 7"),
    (dict(max_seqlen_k=-1), TypeError, "max_seqlen_k must be an int >= 0"),
    (dict(cu_seqlens_k=_cu([4, 7, 5, 0])), ValueError, "cu_seqlens_k has 5 offsets"),
    (dict(q=torch.zeros(1, 16, HQ, D, dtype=F64)), ValueError, "q must have rank 3 [T, H, D]"),
    (dict(v=torch.zeros(15, HK, D, dtype=F64)), ValueError, "v must have k's shape"),
    (dict(k=torch.zeros(16, HK, 32, dtype=F64), v=torch.zeros(16, HK, 32, dtype=F64)),
     ValueError, "k has D"),
    (dict(q=torch.zeros(16, 3, D, dtype=F64)), ValueError, "multiple of Hk"),
    (dict(k=torch.zeros(15, HK, D, dtype=F64), v=torch.zeros(15, HK, D, dtype=F64),
          cu_seqlens_k=_cu([4, 6, 5]), causal=True), ValueError, "causal=True needs"),
    (dict(k=torch.zeros(16, HK, D, dtype=F64), v=torch.zeros(16, HK, D, dtype=F64),
          cu_seqlens_k=_cu([5, 6, 5]), causal=True), ValueError, "lengths equal"),
]


@pytest.mark.parametrize("kw, kind, words", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_refused_naming_the_argument(kw, kind, words):
    args = _bad(**{k: v for k, v in kw.items() if k != "causal"})
    with pytest.raises(kind, match=words.replace("(", r"\(").replace("[", r"\[")):
        attention_varlen(**args, causal=kw.get("causal", False))

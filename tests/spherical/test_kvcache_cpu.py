"""Spherical attention's decoding with a KV cache (altattn.spherical.attention_with_kvcache) on the
CPU: a causal prefill then steps of any size give the rows of one causal call (fp64, exact);
ragged cache_seqlens; the new keys written in place at their rows and nowhere else;
FlashAttention's visible rows without new keys and non-causal; bad input refused naming it; the
kernels (kernels_triton/spherical/decode.py) in Triton's CPU interpreter against the fp64 math."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from altattn.spherical import attention, attention_with_kvcache

F64 = torch.float64


def _seq(gen, B, N, Hq, Hk, D=64, dtype=F64):
    """q [B, N, Hq, D], k, v [B, N, Hk, D]."""
    return [torch.randn(B, N, h, D, generator=gen, dtype=F64).to(dtype) for h in (Hq, Hk, Hk)]


def _caches(gen, B, R, Hk, D=64, dtype=F64):
    """Caches full of random values (what lies past the lengths must never be read)."""
    return [torch.randn(B, R, Hk, D, generator=gen, dtype=F64).to(dtype) for _ in range(2)]


def _close(got, want, tol=1e-12):
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("cuts", [(1, 1, 1, 1), (3, 2), (1, 4), (5,)], ids=str)
@pytest.mark.parametrize("Hq,Hk", [(4, 2), (3, 3), (4, 1)])
def test_prefill_then_steps_equal_one_causal_call(cuts, Hq, Hk, gen):
    """attention(causal=True) over the first P tokens, their keys into the caches, then steps of
    `cuts` tokens (each writing its keys first): out and r are the rows of one causal call."""
    B, P, R = 2, 6, 16
    N = P + sum(cuts)
    q, k, v = _seq(gen, B, N, Hq, Hk)
    want, want_r = attention(q, k, v, causal=True)
    kc, vc = _caches(gen, B, R, Hk)
    kc[:, :P], vc[:, :P] = k[:, :P], v[:, :P]
    pre, pre_r = attention(q[:, :P], k[:, :P], v[:, :P], causal=True)
    outs, rs, n = [pre], [pre_r], P
    lens = torch.full((B,), P, dtype=torch.int32)
    for T in cuts:
        o, r = attention_with_kvcache(q[:, n:n + T], kc, vc, lens, k=k[:, n:n + T],
                                      v=v[:, n:n + T])
        assert o.shape == (B, T, Hq, 64) and r.shape == (B, Hq, T)
        outs.append(o)
        rs.append(r)
        n += T
        lens += T  # the caller advances cache_seqlens
    _close(torch.cat(outs, 1), want)
    _close(torch.cat(rs, 2), want_r)


def test_prefill_through_an_empty_cache(gen):
    """The prefill itself as one call with cache_seqlens 0 and T = P new tokens."""
    B, N, Hq, Hk, R = 2, 7, 4, 2, 9
    q, k, v = _seq(gen, B, N, Hq, Hk)
    kc, vc = _caches(gen, B, R, Hk)
    want, want_r = attention(q, k, v, causal=True)
    o, r = attention_with_kvcache(q, kc, vc, 0, k=k, v=v)
    _close(o, want)
    _close(r, want_r)


def test_ragged_cache_seqlens(gen):
    """Each sequence with its own length: its rows are those of its own causal call."""
    B, Hq, Hk, R, T = 3, 4, 2, 20, 2
    lens = torch.tensor([0, 7, 18], dtype=torch.int32)
    seqs = [_seq(gen, 1, int(n) + T, Hq, Hk) for n in lens]
    kc, vc = _caches(gen, B, R, Hk)
    for b, (_, k, v) in enumerate(seqs):
        kc[b, :lens[b]], vc[b, :lens[b]] = k[0, :lens[b]], v[0, :lens[b]]
    cat = [torch.cat([s[i][:, -T:] for s in seqs]) for i in range(3)]
    o, r = attention_with_kvcache(cat[0], kc, vc, lens, k=cat[1], v=cat[2])
    for b, (q, k, v) in enumerate(seqs):
        want, want_r = attention(q, k, v, causal=True)
        _close(o[b], want[0, -T:])
        _close(r[b], want_r[0, :, -T:])


def test_new_keys_written_in_place_and_nothing_else(gen):
    B, T, Hq, Hk, R = 3, 2, 4, 2, 10
    lens = torch.tensor([0, 4, 8], dtype=torch.int32)
    q, k, v = _seq(gen, B, T, Hq, Hk, dtype=torch.bfloat16)
    kc, vc = _caches(gen, B, R, Hk, dtype=torch.bfloat16)
    before = kc.clone(), vc.clone()
    ptrs = kc.data_ptr(), vc.data_ptr()
    o, r = attention_with_kvcache(q, kc, vc, lens, k=k, v=v)
    assert o.dtype == torch.bfloat16 and r.dtype == torch.float32
    assert (kc.data_ptr(), vc.data_ptr()) == ptrs
    for new, cache, old in ((k, kc, before[0]), (v, vc, before[1])):
        want = old.clone()
        for b in range(B):
            want[b, lens[b]:lens[b] + T] = new[b]
        assert torch.equal(cache, want)


@pytest.mark.parametrize("T", [1, 3])
def test_without_new_keys_the_queries_are_the_last_positions(T, gen):
    """No k, v: L = cache_seqlens, token t sees rows < L - T + 1 + t (FlashAttention's
    bottom-right causal mask; T = 1: rows < cache_seqlens). Caches untouched."""
    B, Hq, Hk, R = 2, 4, 2, 12
    lens = torch.tensor([T + 1, 9], dtype=torch.int32)
    kc, vc = _caches(gen, B, R, Hk)
    q = torch.randn(B, T, Hq, 64, generator=gen, dtype=F64)
    before = kc.clone()
    o, r = attention_with_kvcache(q, kc, vc, lens)
    assert torch.equal(kc, before)
    for b in range(B):
        L = int(lens[b])
        qb = torch.zeros(1, L, Hq, 64, dtype=F64)
        qb[0, -T:] = q[b]
        want, want_r = attention(qb, kc[b:b + 1, :L], vc[b:b + 1, :L], causal=True)
        _close(o[b], want[0, -T:])
        _close(r[b], want_r[0, :, -T:])


def test_non_causal_tokens_see_every_row(gen):
    B, T, Hq, Hk, R = 2, 3, 2, 1, 8
    lens = torch.tensor([2, 5], dtype=torch.int32)
    kc, vc = _caches(gen, B, R, Hk)
    q, k, v = _seq(gen, B, T, Hq, Hk)
    o, r = attention_with_kvcache(q, kc, vc, lens, k=k, v=v, causal=False, sm_scale=0.3)
    for b in range(B):
        L = int(lens[b]) + T
        want, want_r = attention(q[b:b + 1], kc[b:b + 1, :L], vc[b:b + 1, :L], sm_scale=0.3)
        _close(o[b], want[0])
        _close(r[b], want_r[0])


def test_rows_that_see_nothing_give_zero(gen):
    """An empty cache without new keys: every token sees no row, out = 0 and r = 0."""
    kc, vc = _caches(gen, 2, 4, 1)
    q = torch.randn(2, 2, 2, 64, generator=gen, dtype=F64)
    o, r = attention_with_kvcache(q, kc, vc, 0)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(r, torch.zeros_like(r))


def _args(**change):
    a = dict(q=torch.zeros(2, 1, 4, 64), k_cache=torch.zeros(2, 8, 2, 64),
             v_cache=torch.zeros(2, 8, 2, 64), cache_seqlens=torch.zeros(2, dtype=torch.int32),
             k=torch.zeros(2, 1, 2, 64), v=torch.zeros(2, 1, 2, 64))
    a.update(change)
    return a


@pytest.mark.parametrize("change,kind,words", [
    ({"q": torch.zeros(2, 1, 3, 64)}, ValueError, "multiple of the caches' Hk"),
    ({"q": torch.zeros(2, 0, 4, 64), "k": None, "v": None}, ValueError, "T >= 1"),
    ({"q": torch.zeros(2, 1, 4, 32), "k": None, "v": None}, ValueError, "k_cache must be"),
    ({"v_cache": torch.zeros(2, 7, 2, 64)}, ValueError, "v_cache must have k_cache's shape"),
    ({"k_cache": torch.zeros(2, 8, 2, 64, dtype=F64)}, TypeError, "share one dtype"),
    ({"k_cache": [0.0]}, TypeError, "k_cache must be a torch.Tensor"),
    ({"k": None}, ValueError, "give both"),
    ({"k": torch.zeros(2, 2, 2, 64)}, ValueError, "k must be"),
    ({"v": torch.zeros(2, 1, 2, 64, dtype=F64)}, TypeError, "must have a dtype"),
    ({"cache_seqlens": torch.zeros(2, dtype=torch.int64)}, TypeError, "int32"),
    ({"cache_seqlens": 1.0}, TypeError, "cache_seqlens must be an int"),
    ({"cache_seqlens": torch.zeros(3, dtype=torch.int32)}, ValueError, "cache_seqlens must be"),
    ({"cache_seqlens": 8}, ValueError, "runs past the cache"),
    ({"cache_seqlens": torch.tensor([3, 8], dtype=torch.int32)}, ValueError, "runs past"),
    ({"cache_seqlens": -1}, ValueError, ">= 0"),
    ({"k_cache": torch.zeros(2, 0, 2, 64), "v_cache": torch.zeros(2, 0, 2, 64)}, ValueError,
     "fewer than the T = 1"),
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"sm_scale": -1.0}, ValueError, "sm_scale"),
    ({"eps": -1.0}, ValueError, "eps"),
])
def test_bad_input_is_refused_naming_it(change, kind, words):
    a = _args(**change)
    with pytest.raises(kind, match=words):
        attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"),
                               a.pop("cache_seqlens"), **a)


def test_a_full_cache_without_new_keys_is_allowed():
    o, _ = attention_with_kvcache(*list(_args(cache_seqlens=8).values())[:4])
    assert o.shape == (2, 1, 4, 64)


def test_inputs_that_require_grad_are_refused():
    a = _args(q=torch.zeros(2, 1, 4, 64, requires_grad=True))
    with pytest.raises(ValueError, match="inference only"):
        attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"),
                               a.pop("cache_seqlens"), **a)
    a = _args(q=torch.zeros(2, 1, 4, 64, requires_grad=True))
    with torch.no_grad():
        attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"),
                               a.pop("cache_seqlens"), **a)


# Triton's CPU interpreter: fbtriton's interpreter builder lacks create_dot's two_ctas argument
# and multiplies bf16 (kept as uint16) as integers; the probe gives it a dot that takes both.
PROBE = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
import numpy as np, torch, triton.language as tl
from triton.runtime import interpreter as ip
def f32(x):
    if x.dtype.scalar == tl.bfloat16:
        return ip._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
    return x.data
ip.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: ip.TensorHandle(
    np.matmul(f32(a), f32(b), dtype=d.data.dtype) + d.data, d.dtype.scalar)
from kernels_triton import launch
launch.Kernel.__call__ = lambda self, *a, **k: self.fn[self.grid](*a, **k, **self.options)
launch._recording = True  # sm_count() without a GPU
from kernels_triton.spherical import decode
from altattn.spherical.kvcache import reference_with_kvcache
torch.manual_seed(0)
for B, T, Hq, Hk, D, R, new, causal, splits in {cases!r}:
    x = lambda *s: torch.randn(*s).bfloat16()
    q, kc, vc, k, v = x(B, T, Hq, D), x(B, R, Hk, D), x(B, R, Hk, D), x(B, T, Hk, D), x(B, T, Hk, D)
    top = R - T if new else R
    lens = torch.randint(0, top + 1, (B,), dtype=torch.int32)
    lens[0] = top
    want_k, want_v = kc.clone(), vc.clone()
    for b in range(B * new):
        want_k[b, lens[b]:lens[b] + T], want_v[b, lens[b]:lens[b] + T] = k[b], v[b]
    run = decode.prepare(B, T, Hq, Hk, D, R, new, causal, 0, None, splits)
    out = torch.full((B, T, Hq, D), float("nan")).bfloat16()
    r = torch.full((B, Hq, T), float("nan"))
    run(q, kc, vc, lens, k if new else None, v if new else None, out, r, 0.1, 1e-6)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    wo, wr = reference_with_kvcache(q, kc, vc, lens, new, causal, 0.1, 1e-6)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    assert rel(out, wo) <= 1e-2 and rel(r, wr) <= 1e-5, (B, T, Hq, rel(out, wo), rel(r, wr))
    print(run.n_split, end=" ")
print("ok")
"""


def test_kernels_in_the_interpreter():
    """One split (out and r from decode_kernel) and several (partials, then merge_kernel); T 1
    and more; G 2 to 8, Hq = Hk; D 64 and 128; without new keys; non-causal; ragged lengths;
    outputs poisoned with NaN first. Tolerances: fp32 sums (r), one bf16 rounding of the
    scores and of out (the interpreter truncates to bf16, the GPU rounds to nearest)."""
    cases = [(2, 1, 4, 2, 64, 300, True, True, None), (3, 3, 8, 2, 128, 200, True, True, 3),
             (2, 2, 2, 1, 64, 130, False, True, None), (2, 5, 4, 4, 64, 100, True, False, 1),
             (1, 2, 16, 2, 64, 700, True, True, None)]
    p = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), cases=cases)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
    splits = [int(s) for s in p.stdout.split()[:-1]]
    assert splits[1] == 3 and splits[-1] > 1 and 1 in splits  # both epilogues ran


def test_split_count_is_a_function_of_the_shapes():
    """Enough programs for every SM, each split at least MIN_SPLIT_KEYS of the cache's rows."""
    from kernels_triton.spherical import decode as d
    assert d.n_split(512, 4096, 132) == 1                  # B 64, Hk 8: already two waves
    assert d.n_split(8, 4096, 132) == 4096 // d.MIN_SPLIT_KEYS
    assert d.n_split(8, 100, 132) == 1
    run = d.prepare(1, 1, 8, 2, 64, 1024, True, True, 0, None, 2)  # splits given: no GPU asked
    assert run.n_split == 2 and run is d.prepare(1, 1, 8, 2, 64, 1024, True, True, 0, None, 2)
    assert [d.config(G, T, 128)["BLOCK_M"] for G, T in ((4, 1), (8, 4), (32, 8))] == [16, 32, 128]

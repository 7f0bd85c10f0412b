"""Spherical attention's decoding step on the GPU (kernels_triton/spherical/decode.py through
altattn.spherical.attention_with_kvcache), against the fp64 math within the family's TOLERANCES:
one split and several, T = 1 and more, GQA (G 1 to 128), D 64 and 128, ragged cache_seqlens,
without new keys, non-causal; the new keys written at their rows and nowhere else; a causal
prefill (the forward kernel) then steps equal to one causal call; a step captured in a CUDA
graph and replayed equals eager bitwise, also with cache_seqlens changed between replays.
The CPU equalities (exact, fp64) and the kernels in Triton's interpreter: test_kvcache_cpu.py."""
from __future__ import annotations

import pytest
import torch

import altattn
from altattn.spherical import attention_with_kvcache
from altattn.spherical.family import TOLERANCES
from altattn.spherical.kvcache import reference_with_kvcache

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen).to(BF16).cuda()


def _problem(gen, B, T, Hq, Hk, D, R, new):
    """q, caches full of random values, k, v (None unless new), ragged lengths (the first at
    the cache's end)."""
    q, kc, vc = _randn(gen, B, T, Hq, D), _randn(gen, B, R, Hk, D), _randn(gen, B, R, Hk, D)
    k, v = (_randn(gen, B, T, Hk, D), _randn(gen, B, T, Hk, D)) if new else (None, None)
    top = R - T if new else R
    lens = torch.randint(0, top + 1, (B,), generator=gen, dtype=torch.int32)
    lens[0] = top
    return q, kc, vc, k, v, lens.cuda()


CASES = [  # B, T, Hq, Hk, D, R, new keys, causal
    (64, 1, 32, 8, 128, 512, True, True),      # the target's heads: one split
    (4, 1, 32, 8, 128, 4096, True, True),      # several splits
    (3, 3, 8, 2, 64, 333, True, True),         # T > 1, rows past a tile
    (2, 1, 128, 1, 128, 5000, True, True),     # G 128: 128-row tiles, 8 warps
    (2, 5, 64, 2, 64, 600, True, True),        # G T = 160 rows: two row tiles
    (5, 2, 6, 6, 128, 257, False, True),       # Hq = Hk, queries already cached
    (3, 4, 8, 4, 64, 200, True, False),        # non-causal
]


@pytest.mark.parametrize("B,T,Hq,Hk,D,R,new,causal", CASES, ids=str)
def test_step_matches_fp64(B, T, Hq, Hk, D, R, new, causal, gen):
    q, kc, vc, k, v, lens = _problem(gen, B, T, Hq, Hk, D, R, new)
    want_k, want_v = kc.clone(), vc.clone()
    if new:
        for b, n in enumerate(lens.tolist()):
            want_k[b, n:n + T], want_v[b, n:n + T] = k[b], v[b]
    want, want_r = reference_with_kvcache(q.cpu(), want_k.cpu(), want_v.cpu(), lens.cpu(), new,
                                          causal, 0.125, 1e-6)
    out, r = attention_with_kvcache(q, kc, vc, lens, k=k, v=v, causal=causal, sm_scale=0.125)
    assert out.shape == (B, T, Hq, D) and out.dtype == BF16 and r.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(r).all()
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)  # the new rows, nothing else
    assert rel(out, want) <= TOLERANCES["out_rel"]
    assert rel(r, want_r) <= TOLERANCES["r_rel"]


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_every_split_count_gives_the_same_rows(splits, gen):
    """prepare's split count is the shapes'; any other gives the same rows (fp32 sums in
    another order) and, for one, the rows of the default."""
    from kernels_triton.spherical.decode import prepare
    B, T, Hq, Hk, D, R = 2, 2, 16, 4, 128, 4096
    q, kc, vc, k, v, lens = _problem(gen, B, T, Hq, Hk, D, R, True)
    outs = []
    for s in (None, splits):
        out, r = torch.full_like(q, float("nan")), torch.full((B, Hq, T), float("nan"),
                                                              device="cuda")
        prepare(B, T, Hq, Hk, D, R, True, True, 0, None, s)(q, kc, vc, lens, k, v, out, r,
                                                             0.1, 1e-6)
        outs.append((out, r))
    assert rel(outs[1][0], outs[0][0]) <= 1e-2 and rel(outs[1][1], outs[0][1]) <= 1e-5


def test_prefill_then_steps_equal_one_causal_call(gen):
    """The forward kernel's causal prefill, its keys into the caches, then single-token steps
    and one of three: the rows of one causal call (both bf16 kernels, each within the
    tolerance of the fp64 call)."""
    B, P, Hq, Hk, D, R = 3, 500, 16, 4, 128, 1024
    cuts = (1, 1, 3)
    N = P + sum(cuts)
    q, k, v = _randn(gen, B, N, Hq, D), _randn(gen, B, N, Hk, D), _randn(gen, B, N, Hk, D)
    want, want_r = altattn.spherical.reference(q.cpu(), k.cpu(), v.cpu(), causal=True)
    full, full_r = altattn.spherical_attention(q, k, v, causal=True)
    kc, vc = _randn(gen, B, R, Hk, D), _randn(gen, B, R, Hk, D)
    kc[:, :P], vc[:, :P] = k[:, :P], v[:, :P]
    outs, rs, n = [], [], P
    lens = torch.full((B,), P, dtype=torch.int32, device="cuda")
    with torch.no_grad():
        for T in cuts:
            o, r = attention_with_kvcache(q[:, n:n + T], kc, vc, lens, k=k[:, n:n + T],
                                          v=v[:, n:n + T])
            outs.append(o)
            rs.append(r)
            lens += T
            n += T
    out, r = torch.cat(outs, 1), torch.cat(rs, 2)
    assert rel(out, want[:, P:]) <= TOLERANCES["out_rel"]
    assert rel(r, want_r[:, :, P:]) <= TOLERANCES["r_rel"]
    assert rel(out, full[:, P:]) <= TOLERANCES["out_rel"]
    assert rel(r, full_r[:, :, P:]) <= TOLERANCES["r_rel"]


@pytest.mark.parametrize("B,R", [(64, 1024), (2, 4096)], ids=["one_split", "splits"])
def test_step_in_a_cuda_graph_equals_eager(B, R, gen):
    """Captured once; replayed with cache_seqlens changed in place, it equals the eager step
    at those lengths bitwise (out, r and the caches)."""
    T, Hq, Hk, D = 1, 32, 8, 128
    q, kc, vc, k, v, lens = _problem(gen, B, T, Hq, Hk, D, R, True)
    start_k, start_v = kc.clone(), vc.clone()
    attention_with_kvcache(q, kc, vc, lens, k=k, v=v)  # warm-up: compiles, plans
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, r = attention_with_kvcache(q, kc, vc, lens, k=k, v=v)
    for shift in (0, -1, -7):
        lens.add_(shift).clamp_(min=0)
        kc.copy_(start_k)
        vc.copy_(start_v)
        graph.replay()
        got = out.clone(), r.clone(), kc.clone(), vc.clone()
        kc.copy_(start_k)
        vc.copy_(start_v)
        want = (*attention_with_kvcache(q, kc, vc, lens, k=k, v=v), kc, vc)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_lengths_past_the_cache_touch_nothing_outside_it(gen):
    """A CUDA cache_seqlens is not read on the host: lengths past R are clamped, and no row
    outside [0, R) is written (the caches sit inside a larger buffer whose tail must stay)."""
    B, T, Hq, Hk, D, R = 2, 2, 8, 2, 64, 64
    buf_k, buf_v = _randn(gen, B * R + 512, Hk, D), _randn(gen, B * R + 512, Hk, D)
    tail = buf_k[B * R:].clone(), buf_v[B * R:].clone()
    want_k = buf_k[:B * R].view(B, R, Hk, D).clone()
    kc, vc = buf_k[:B * R].view(B, R, Hk, D), buf_v[:B * R].view(B, R, Hk, D)
    q, k, v = _randn(gen, B, T, Hq, D), _randn(gen, B, T, Hk, D), _randn(gen, B, T, Hk, D)
    lens = torch.tensor([R - 1, R + 100], dtype=torch.int32, device="cuda")
    out, r = attention_with_kvcache(q, kc, vc, lens, k=k, v=v)
    torch.cuda.synchronize()
    assert torch.equal(buf_k[B * R:], tail[0]) and torch.equal(buf_v[B * R:], tail[1])
    want_k[0, R - 1] = k[0, 0]  # the one new row inside the cache; sequence 1 wrote none
    assert torch.equal(kc, want_k)
    assert torch.isfinite(out).all() and torch.isfinite(r).all()


def test_an_int_cache_seqlens_is_a_tensor_of_it(gen):
    B, T, Hq, Hk, D, R = 3, 2, 8, 2, 128, 300
    q, kc, vc, k, v, _ = _problem(gen, B, T, Hq, Hk, D, R, True)
    lens = torch.full((B,), 123, dtype=torch.int32, device="cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    want = attention_with_kvcache(q, kc, vc, lens, k=k, v=v)
    got = attention_with_kvcache(q, kc2, vc2, 123, k=k, v=v)
    for g, w in zip((*got, kc2, vc2), (*want, kc, vc)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_caches_that_cannot_be_written_in_place_are_refused(gen):
    """Non-contiguous or misaligned caches raise (a copy would drop the new rows)."""
    B, T, Hq, Hk, D, R = 2, 1, 4, 2, 64, 16
    q, kc, vc, k, v, lens = _problem(gen, B, T, Hq, Hk, D, R, True)
    strided = _randn(gen, B, 2 * R, Hk, D)[:, ::2]
    shifted = _randn(gen, B * R * Hk * D + 1)[1:].view(B, R, Hk, D)
    for bad in (strided, shifted):
        with pytest.raises(ValueError, match="k_cache must be contiguous"):
            attention_with_kvcache(q, bad, vc, lens, k=k, v=v)

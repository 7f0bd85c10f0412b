"""One long sequence on a CUDA GPU: B = 1, N = 131,072, Hq = 128, Hk = 1, D = 128, w 32 x 512,
forward and backward through `attention` (`auto`), with the peak memory printed (skipped without a
GPU; about 20 GB).

Checks:
- forward: out and LSE of sampled rows (the first, the last, and rows past 2^16) against an fp64
  evaluation of those rows alone;
- backward: dQ of the same rows against fp64 (a row's dQ needs only its own window);
- backward: every gradient of the tokens inside a slice of 2048 tokens (those whose rows and keys
  see only the slice) equals the same variant's gradients of the slice run alone: the long run's
  int64 offsets, grids and chunking reach the same numbers as a short run, which the reference
  tests check (test_gpu_bwd.py).
"""
from __future__ import annotations

import pytest
import torch

from altattn import simplicial as sa

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

B, N, HQ, HK, D, W1, W2 = 1, 131072, 128, 1, 128, 32, 512
ROWS = (0, 1, 511, 65535, 65536, 100000, N - 1)
SLICES = (70000, N - 2048)   # a middle slice and the last one, each 2048 tokens
TOL = 2e-2                   # of max |fp64|: a few bf16 steps (A_j, P, dS, the output rounded)


def row_reference(q, k1, k2, v1, v2, dout, i: int):
    """out, LSE and dQ of token i's HQ rows in fp64 (dLSE = 0), from its windows alone."""
    c = D ** -0.5
    j = torch.arange(max(0, i - W1 + 1), i + 1, device=q.device)
    k = torch.arange(max(0, i - W2 + 1), i + 1, device=q.device)
    qi, doi = q[0, i].double(), dout[0, i].double()              # [HQ, D]
    K1, V1 = k1[0, j, 0].double(), v1[0, j, 0].double()          # [J, D]
    K2, V2 = k2[0, k, 0].double(), v2[0, k, 0].double()          # [K, D]
    s = c * torch.einsum("hd,jd,kd->hjk", qi, K1, K2)
    lse = torch.logsumexp(s.flatten(1), 1)
    p = torch.exp(s - lse[:, None, None])
    out = torch.einsum("hjk,jd,kd->hd", p, V1, V2)
    dp = torch.einsum("hd,jd,kd->hjk", doi, V1, V2)
    ds = p * (dp - (doi * out).sum(1)[:, None, None])
    dq = c * torch.einsum("hjk,jd,kd->hd", ds, K1, K2)
    return out, lse, dq


def close(got, ref, top: float, label: str):
    err = (got.double() - ref).abs().max().item()
    assert err <= TOL * top, f"{label}: max error {err:.3e} > {TOL} x {top:.3e}"


def test_long_sequence(gen):
    torch.cuda.reset_peak_memory_stats()
    cuda_gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(2**31, (1,),
                                                                            generator=gen)))
    x = [torch.randn(B, N, h, D, generator=cuda_gen, device="cuda", dtype=torch.bfloat16)
         for h in (HQ, HK, HK, HK, HK)]
    dout = torch.randn(B, N, HQ, D, generator=cuda_gen, device="cuda", dtype=torch.bfloat16)
    xs = [t.clone().requires_grad_() for t in x]
    out, lse = sa.attention(*xs, W1, W2)
    out.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    print(f"B{B} N{N} Hq{HQ} D{D} w{W1}x{W2}: peak memory {peak / 2**30:.1f} GiB "
          f"(inputs, out, lse, dout, gradients: "
          f"{sum(t.numel() * t.element_size() for t in (*x, out, lse, dout, *x)) / 2**30:.1f} GiB)")
    grads = [t.grad for t in xs]
    for g in grads:
        assert torch.isfinite(g).all()
    refs = [row_reference(*x, dout, i) for i in ROWS]
    # (tolerances relative to the largest reference over the sampled rows: row 0's exact dQ is 0,
    # its single pair's dS = P (dP - Delta) is rounding noise of the bf16 O in Delta)
    top_out = max(r[0].abs().max().item() for r in refs)
    top_dq = max(r[2].abs().max().item() for r in refs)
    for i, (ref_out, ref_lse, ref_dq) in zip(ROWS, refs):
        close(out[0, i], ref_out, top_out, f"out row {i}")
        assert (lse[0, :, i].double() - ref_lse).abs().max() < 1e-2, f"lse row {i}"
        close(grads[0][0, i], ref_dq, top_dq, f"dq row {i}")
    for s in SLICES:
        e = s + 2048
        part = [t[:, s:e].detach().clone().requires_grad_() for t in x]
        o, _ = sa.attention(*part, W1, W2)
        o.backward(dout[:, s:e])
        # rows from s + W2 - 1 see only the slice; keys up to e - W2 are seen only by such rows
        lo, hi = W2 - 1, 2048 - W2 + 1
        for name, g, p in zip(("dq", "dk1", "dk2", "dv1", "dv2"), grads, part):
            a, b = g[0, s + lo:s + hi].float(), p.grad[0, lo:hi].float()
            err = (a - b).abs().max().item()
            assert err <= TOL * b.abs().max().item(), f"slice {s}: {name} differs by {err:.3e}"

"""The TLX triple-attention contractions (kernels_tlx/triple/) against the plain-Triton ones they
replace, on the GPU (Hopper): the same contraction of the same bf16 products.

- `apply` with the resident state (apply.py) rounds every product as core.py's apply and sums in
  the same order: outputs bitwise equal.
- `partials` (partials.py, partials_pairs.py) sums the same bf16 products in another order: each
  split's partial sums within REL_BOUND of the Triton kernel's, and against fp64.
- `permute_x1` is the token permutation its docstring states, zeros past N.
Fresh inputs per check, outputs prefilled with NaN, ragged N (below one tile, one token, not a
multiple of the tile or the split), several heads and batches; every width the kernels take.
"""
from __future__ import annotations

import pytest
import torch
from conftest import gpu_capability

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(gpu_capability() is not None and gpu_capability() < (9, 0),
                                 reason="needs Hopper (sm_90): TMA, wgmma, warp specialization")]

REL_BOUND = 1e-5  # fp32 sums of the same products in another order


def _randn(shape, gen):
    return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("B,N,H", [(1, 1000, 2), (2, 333, 3), (1, 1, 1), (1, 130, 1), (3, 4099, 2)])
def test_resident_apply_equals_triton_apply(B, N, H, gen):
    from kernels_tlx.triple import apply as resident
    from kernels_triton.triple import host
    x, y = _randn((B, N, H, 32), gen), _randn((B, N, H, 32), gen)
    w = (0.1 * torch.randn(B, H, 32, 32, 32, generator=gen)).to("cuda", torch.bfloat16)
    got = torch.full((B, N, H, 32), float("nan"), device="cuda", dtype=torch.bfloat16)
    want = torch.full_like(got, float("nan"))
    resident.apply(x, y, w, got, 0.37)
    host.apply(x, y, w, want, 0.37)
    assert torch.equal(got, want)
    exact = 0.37 * torch.einsum("bnhx,bnhp,bhpxo->bnho", x.double(), y.double(), w.double())
    assert rel(got, exact) < 1e-2


# (B, N, H, D1, DY, D2, splits, split_len): split_len None = N / splits; 2048 = the causal chunks
PARTIALS = [
    (1, 1000, 2, 64, 64, 64, 3, None),
    (2, 333, 3, 32, 32, 32, 2, None),
    (1, 1, 1, 32, 32, 32, 1, None),
    (1, 5000, 2, 128, 128, 128, 3, 2048),
    (1, 777, 2, 64, 32, 64, 1, None),
    (1, 4099, 2, 64, 128, 64, 2, None),
    (1, 700, 1, 128, 64, 128, 1, None),
    (2, 2100, 1, 32, 64, 32, 2, 2048),
]


@pytest.mark.parametrize("B,N,H,D1,DY,D2,splits,split_len", PARTIALS)
def test_partials_match_triton(B, N, H, D1, DY, D2, splits, split_len, gen):
    from kernels_tlx.triple import partials
    from kernels_triton.triple import host
    x1, y, x2 = _randn((B, N, H, D1), gen), _randn((B, N, H, DY), gen), _randn((B, N, H, D2), gen)
    assert partials.takes(DY)
    if split_len is None:
        split_len = -(-(-(-N // splits)) // 64) * 64
    got = partials.partials(x1, y, x2, splits, split_len)
    want = host.partials(x1, y, x2, splits, split_len)
    assert not got.isnan().any()
    assert rel(got, want) < REL_BOUND, rel(got, want)
    exact = torch.einsum("bnhi,bnhj,bnhk->bhijk", x1.double(), y.double(), x2.double())
    assert rel(got.sum(2), exact) < 1e-2
    again = partials.partials(x1, y, x2, splits, split_len)
    assert torch.equal(got, again), "not bitwise repeatable"


@pytest.mark.parametrize("B,N,H,D", [(2, 70, 3, 32), (1, 1000, 2, 64), (1, 64, 1, 128),
                                     (1, 1, 1, 32)])
def test_permute_x1(B, N, H, D, gen):
    from kernels_tlx.triple.partials import permute_x1
    x = _randn((B, N, H, D), gen)
    got = permute_x1(x)
    NP = -(-N // 64) * 64
    padded = torch.zeros(B, NP, H, D, device="cuda", dtype=x.dtype)
    padded[:, :N] = x
    # token 16 ks + 8 hi + 2 g + e of each 64-token run goes to position 16 g + 4 ks + 2 hi + e
    want = padded.view(B, NP // 64, 4, 2, 4, 2, H, D).permute(0, 6, 7, 1, 4, 2, 3, 5)
    assert torch.equal(got, want.reshape(B, H, D, NP))

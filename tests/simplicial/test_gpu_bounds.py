"""The out-of-bounds contract of the K2/V2 descriptors (kernels_triton/simplicial/host.py: kv_layout) on a
CUDA GPU: a key block that runs past a batch's last token reads zeros, so no value of one batch
element, not even inf or NaN in any input, reaches another's output (skipped without a GPU). The
backward's counterpart is tests/simplicial/test_gpu_bwd.py::test_no_value_crosses_batches."""
from __future__ import annotations

import math

import pytest
import torch

from altattn import registry
from altattn.simplicial.passes import forward as run
from altattn.simplicial.spec import validate_shape

from conftest import hq_taken_by

pytestmark = pytest.mark.gpu

# every variant in each logits' form it computes (form "det" packs K1 and K2 on the host)
CASES = [(v, form) for v in registry.all_variants("fwd", "simplicial")
         for form in v.accepted("form")]


@pytest.mark.parametrize("v, form", CASES, ids=[f"{v.name}-{form}" for v, form in CASES])
@pytest.mark.parametrize("poisoned", ["q", "k1", "k2", "v1", "v2"])
@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_no_value_crosses_batches(v, form, poisoned, value, rand, seed):
    """B = 2, N = 700, w1 x w2 = 32 x 200 (the last key block of a tile passes N: 200 is no
    multiple of the 128-key blocks, and G = 16 packs 4 tokens per tile), inf or NaN in one input
    at batch 1's first 64 tokens: batch 0's outputs are finite and bitwise those of batch 0 run
    alone."""
    B, N, Hk, D, w1, w2 = 2, 700, 1, 64, 32, 200
    Hq = hq_taken_by(v.name, B, N, 16, Hk, D, w1, w2)
    spec = validate_shape(B, N, Hq, Hk, D, w1, w2)
    why = v.cannot_take(spec)
    if why is not None:
        pytest.skip(f"{v.name} does not take {spec.short()}: {why}")
    if v.needs_hopper and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"{v.name} needs sm_90")
    q, k1, k2, v1, v2 = rand(B, N, Hq, Hk, D, device="cuda")
    x = dict(q=q, k1=k1, k2=k2, v1=v1, v2=v2)
    x[poisoned][1, :64] = value
    out, lse = run(*x.values(), w1, w2, variant=v.name, form=form)
    alone_out, alone_lse = run(*(t[:1] for t in x.values()), w1, w2, variant=v.name, form=form)
    label = (f"variant={v.name} form={form} {spec.short()} {value} in batch 1's {poisoned}, "
             f"seed={seed}")
    bad = int((~torch.isfinite(out[0])).sum())
    assert bad == 0, f"{label}: {bad} non-finite outputs in batch 0"
    assert torch.isfinite(lse[0]).all(), f"{label}: non-finite LSE in batch 0"
    assert torch.equal(out[0], alone_out[0]) and torch.equal(lse[0], alone_lse[0]), (
        f"{label}: batch 0 differs from batch 0 run alone")

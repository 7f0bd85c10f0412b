"""2-simplicial forward variants on a CUDA GPU with odd inputs: empty batches or sequences,
non-contiguous or misaligned tensors, mixed devices, a Hopper-only variant elsewhere, and offsets
or grids past 32-bit and 16-bit limits (slow). The accuracy matrix and its yardstick are
test_gpu.py's; this file reuses its helpers."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from altattn import registry
from altattn.simplicial import forward
from altattn.simplicial.spec import validate, validate_shape

from conftest import Shape, hq_taken_by
from test_gpu import VARIANTS, VIDS, check_accuracy, inputs, roundings, skip_reason, taken_by

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmul")]


@pytest.mark.parametrize("B,N", [(0, 100), (2, 0), (0, 0)])
@pytest.mark.parametrize("variant", ["auto", *VIDS])
def test_empty(variant, B, N, rand):
    Hq, Hk, D = 16, 2, 128
    if variant != "auto":
        Hq = hq_taken_by(variant, B, N, Hq, Hk, D, 4, 8)
    x = rand(B, N, Hq, Hk, D, device="cuda")
    if variant != "auto":
        why = skip_reason(registry.get(variant, "fwd", "simplicial"), validate(*x, 4, 8))
        if why:
            pytest.skip(why)
    out, lse = forward(*x, 4, 8, variant=variant)
    assert out.shape == (B, N, Hq, D) and out.dtype == torch.bfloat16 and out.is_cuda
    assert lse.shape == (B, Hq, N) and lse.dtype == torch.float32 and lse.is_cuda


@pytest.mark.parametrize("v", VARIANTS, ids=VIDS)
def test_non_contiguous_inputs(v, rand, gen, seed):
    """q from a transposed [B, Hq, N, D] tensor, k1 the second half of a wider tensor, v2 with
    the token dimension outermost: same bits as contiguous copies."""
    shape = taken_by(v, Shape(2, 333, 16, 2, 128, 16, 100))
    q, k1, k2, v1, v2 = x = inputs(rand, shape)
    why = skip_reason(v, validate(*x, shape.w1, shape.w2))
    if why:
        pytest.skip(why)
    q_nc = q.transpose(1, 2).contiguous().transpose(1, 2)
    wide = torch.zeros(*k1.shape[:3], 2 * shape.D, dtype=k1.dtype, device=k1.device)
    wide[..., shape.D:] = k1
    k1_nc = wide[..., shape.D:]
    v2_nc = v2.transpose(0, 1).contiguous().transpose(0, 1)
    assert not any(t.is_contiguous() for t in (q_nc, k1_nc, v2_nc))
    a = forward(q, k1, k2, v1, v2, shape.w1, shape.w2, variant=v.name)
    b = forward(q_nc, k1_nc, k2, v1, v2_nc, shape.w1, shape.w2, variant=v.name)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (
        f"variant={v.name} {shape} seed={seed}: non-contiguous inputs changed the result")


def misaligned_copy(t: torch.Tensor, offset: int = 1) -> torch.Tensor:
    """A contiguous copy of t whose data starts `offset` elements into its storage."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = buf[offset:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("v", VARIANTS, ids=VIDS)
def test_storage_offset_inputs(v, rand, seed):
    """Contiguous inputs that do not start on a 16-byte boundary (views at an odd element offset
    into a larger buffer) are legal torch tensors: same result as aligned copies, or at the
    least a clear ValueError (TMA descriptors need a 16-byte aligned start)."""
    shape = taken_by(v, Shape(1, 200, 16, 1, 64, 8, 64))
    x = inputs(rand, shape)
    why = skip_reason(v, validate(*x, shape.w1, shape.w2))
    if why:
        pytest.skip(why)
    a = forward(*x, shape.w1, shape.w2, variant=v.name)
    xm = [misaligned_copy(t) for t in x]
    assert all(t.is_contiguous() and t.data_ptr() % 16 for t in xm)
    try:
        b = forward(*xm, shape.w1, shape.w2, variant=v.name)
    except ValueError:
        return  # refused with a clear error: acceptable
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (
        f"variant={v.name} {shape} seed={seed}: inputs at a storage offset changed the result")


def test_mixed_devices_rejected(rand):
    q, k1, k2, v1, v2 = rand(1, 8, 8, 1, 64, device="cuda")
    with pytest.raises(ValueError, match="must be on one device"):
        forward(q, k1.cpu(), k2, v1, v2, 2, 4)


def test_hopper_variant_on_other_gpu_refused(rand):
    major, minor = torch.cuda.get_device_capability()
    hop = [v for v in VARIANTS if v.needs_hopper]
    if major == 9 or not hop:
        pytest.skip("only meaningful on a non-Hopper GPU with a Hopper-only variant registered")
    x = rand(1, 8, 8, 1, 64, device="cuda")
    with pytest.raises(RuntimeError, match="sm_90"):
        forward(*x, 2, 4, variant=hop[0].name)


# A tight check with offsets past 2^31 elements per batch: with w1 = w2 = 1 every query sees only
# the pair (i, i), so out = V1[i] * V2[i] and lse = the one score. Not bitwise: the kernels fold the
# softmax scale into the exp2 argument (one FFMA, s*c - m), which for the lone score leaves the
# rounding error of m (<= 2^-24 relative) instead of an exact 0, so the softmax sum is 1 + O(2^-24)
# and an output may round to the neighbouring bf16 value. A wrapped 32-bit offset reads another
# token's data: errors of order 1, far above the bound checked here (2^-6 relative, two bf16 ulps).
# The shape puts K/V (and Q/O) past 2^31 (Hq = Hk = 256); a G = 128-only variant gets Hk = 1,
# Hq = 128 and N = 2^17 + 200 instead, which puts Q/O past 2^31 (K/V of that size would need a
# 550 GB Q). Run in a child process so that an illegal address cannot poison this process's CUDA
# context.
BIG_CODE = """
import sys, torch
from altattn import registry
from altattn.simplicial import forward
v = registry.get(sys.argv[1], "fwd", "simplicial")
N, HQ, HK, D = (int(a) for a in sys.argv[3:7])
keys_side = sys.argv[7] == "1"
G = HQ // HK
g = torch.Generator(device="cuda").manual_seed(int(sys.argv[2]))
q = torch.randn(1, N, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
k1, k2, v1, v2 = (torch.randn(1, N, HK, D, device="cuda", dtype=torch.bfloat16, generator=g)
                  for _ in range(4))
out, lse = forward(q, k1, k2, v1, v2, 1, 1, variant=v.name)
torch.cuda.synchronize()
bad, worst = 0, 0.0
for i0 in range(0, N, 4096):
    sl = slice(i0, i0 + 4096)
    want = (v1[:, sl].float() * v2[:, sl].float()).repeat_interleave(G, dim=2)
    bad += int(((out[:, sl].float() - want).abs() > 2.0 ** -6 * want.abs()).sum())
    qf, k1f, k2f = (t[:, sl].float() for t in (q, k1, k2))
    k1f, k2f = (t.repeat_interleave(G, dim=2) for t in (k1f, k2f))
    if keys_side:
        s = (qf * (k1f * k2f).to(torch.bfloat16).float()).sum(-1) * D ** -0.5      # [1, C, HQ]
    else:
        s = ((qf * k1f).to(torch.bfloat16).float() * k2f).sum(-1) * D ** -0.5
    worst = max(worst, (lse[:, :, sl] - s.transpose(1, 2)).abs().max().item())
print(f"RESULT bad_out={bad} lse_err={worst:.3e}")
sys.exit(0 if bad == 0 and worst < 1e-3 else 1)
"""


@pytest.mark.slow  # several GiB per case
@pytest.mark.parametrize("v", VARIANTS, ids=VIDS)
def test_offsets_past_2_31(v, seed):
    N, HQ, HK, D = 65536 + 200, 256, 256, 128
    if v.cannot_take(validate_shape(1, N, HQ, HK, D, 1, 1)) is not None:
        N, HQ, HK = (1 << 17) + 200, 128, 1
    spec = validate_shape(1, N, HQ, HK, D, 1, 1)
    why = skip_reason(v, spec)
    if why:
        pytest.skip(why)
    need = (3 * N * HQ + 4 * N * HK) * D * 2 + (2 << 30)
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB free on the GPU, {free / 2**30:.0f} GiB free")
    from conftest import ROOT
    keys = roundings(v)["keys_side"]
    args = [v.name, str(seed), str(N), str(HQ), str(HK), str(D), str(int(keys))]
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(BIG_CODE), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (f"variant={v.name} B=1 N={N} Hq={HQ} Hk={HK} D={D} w1=w2=1 "
                               f"seed={seed}: {p.stdout[-2000:]} {p.stderr[-3000:]}")


@pytest.mark.slow  # several GiB per case
@pytest.mark.parametrize("v", VARIANTS, ids=VIDS)
def test_batch_times_kv_heads_past_65535(v, rand, seed):
    """B * Hk = 65536: more programs than a CUDA grid's y axis holds (the grid is one flat axis)."""
    shape = Shape(B=2, N=3, Hq=32768, Hk=32768, D=64, w1=2, w2=3)
    if v.cannot_take(validate_shape(*shape)) is not None:  # G = 128 only: B = 65536 instead
        shape = Shape(B=65536, N=2, Hq=128, Hk=1, D=64, w1=2, w2=3)
    x = inputs(rand, shape)
    why = skip_reason(v, validate(*x, shape.w1, shape.w2))
    if why:
        pytest.skip(why)
    out, lse = forward(*x, shape.w1, shape.w2, variant=v.name)
    check_accuracy(out, lse, x, shape, f"variant={v.name} {shape} seed={seed}", roundings(v))

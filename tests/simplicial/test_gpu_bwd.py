"""The backward variants on a CUDA GPU against the fp64 reference (skipped without a GPU). Every
registered backward variant runs every shape of SHAPES it takes.

Yardstick, as for the forward (tests/simplicial/test_gpu.py): `emulate_bwd_bf16` evaluates the gradients
exactly except for the roundings the backward variant makes on purpose (A_j = Q*K1[j] and
dO_j = dO*V1[j] to bf16, or for a variant registered with `rounds_keys_side` (`tlx_pairs`)
K1[j]*K2[k] and V1[j]*V2[k] instead; P and dS to bf16 as GEMM operands, each gradient to bf16 at
the store), from the kernel forward's own bf16 O and fp32 LSE. For each gradient

    err(kernel) <= BUDGET * err(emulation) + FLOOR_MAX or FLOOR_MEAN * max|reference|

for the max and the mean absolute error, against `reference_backward` in fp64.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from altattn import simplicial as sa
from conftest import Shape, compiled_grads_differ, previous_token_losses
from altattn.simplicial import passes as bwd_launcher
from altattn import registry
from altattn.simplicial.reference import chunk_dims, pi_chunks, _window
from altattn.simplicial.spec import validate, validate_shape

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmul")]

BUDGET = 2.0          # as in tests/simplicial/test_gpu.py
# Floors relative to max|ref|. Mean: fp32 accumulation noise over up to G*w1*(w2+BLOCK) terms.
# Max: the kernel rounds its fp32 sum, the emulation its fp64 one, to bf16: where the exact value
# sits near a rounding midpoint they round to neighbours, so the kernel's largest error may exceed
# the emulation's by half a bf16 step at the largest magnitude (seen: dv2 at G = 128, N = 1100,
# 0.304 against an emulation max of 0.133).
FLOOR_MEAN = 2.0 ** -16
FLOOR_MAX = 2.0 ** -9
GRAD_NAMES = ("dq", "dk1", "dk2", "dv1", "dv2")


SHAPES = {
    "N1_G16": Shape(1, 1, 16, 1, 64, 32, 512),
    "N5_lt_w1_G128": Shape(1, 5, 128, 1, 128, 16, 64),
    "N7_Hq32Hk2": Shape(2, 7, 32, 2, 64, 16, 64),
    "w1_le_N_lt_w2_G64": Shape(2, 100, 64, 1, 128, 32, 512),
    "w1_le_N_lt_w2_Hk4": Shape(1, 129, 32, 4, 64, 32, 512),
    "ragged_N333_G128": Shape(2, 333, 128, 1, 128, 32, 96),
    "ragged_N300_G128_Hk2": Shape(1, 300, 256, 2, 64, 7, 129),
    "swap_N300_G16": Shape(2, 300, 16, 1, 64, 256, 16),
    "swap_N257_G128": Shape(1, 257, 128, 1, 64, 300, 5),
    "swap_N300_G64_D128": Shape(1, 300, 64, 1, 128, 100, 20),
    "G16_N257_D128": Shape(2, 257, 16, 1, 128, 32, 96),  # tiles of 4 tokens, the last partial
    "G32_Hk2_N301_D128": Shape(1, 301, 64, 2, 128, 20, 130),  # tiles of 2 tokens, Hk = 2
    "G1_N300": Shape(1, 300, 4, 4, 64, 8, 70),
    "G1_N129_D128": Shape(2, 129, 2, 2, 128, 3, 7),
    "G2_N260": Shape(1, 260, 4, 2, 64, 130, 130),
    "G8_N500": Shape(1, 500, 8, 1, 128, 32, 256),
    "G64_N700_D64": Shape(1, 700, 64, 1, 64, 32, 256),
    "ragged_N333_G64": Shape(2, 333, 64, 1, 128, 32, 96),  # odd N: a last tile of one token
    "G64_N1601_Hk2": Shape(1, 1601, 128, 2, 128, 32, 512),  # chunks of 4 tokens, odd N
    "G128_N1100": Shape(1, 1100, 128, 1, 128, 32, 512),
    "w1eq1_G64": Shape(1, 150, 64, 1, 128, 1, 2),
    "B3_Hq16Hk2": Shape(3, 96, 16, 2, 64, 8, 33),
}


VARIANTS = registry.all_variants("bwd", "simplicial")


def cases(shapes: dict) -> list:
    """(variant name, shape) for every registered backward variant and every shape it takes."""
    return [pytest.param(v.name, s, id=f"{v.name}-{name}") for v in VARIANTS
            for name, s in shapes.items() if v.cannot_take(validate_shape(*s)) is None]


def emulate_bwd_bf16(q, k1, k2, v1, v2, w1, w2, out, lse, dout, dlse, sm_scale,
                     form="trilinear", keys_side=False):
    """The backward variants' arithmetic in fp64 with their bf16 roundings (module docstring).
    form="det": A_j = bf16(Qa * K1a + bf16(Qb * K1b)) as the forward builds it
    (tests/simplicial/test_gpu.py emulate_bf16, kernels_triton/simplicial/det.py), r = 2 when the pairs are exchanged,
    and dQ, dK1 through the rotations of kernels_triton/simplicial/det.py, unrounded. keys_side:
    the pairs' products K1[j]*K2[k] (form "det": bf16(K1a*K2a + bf16(K1b*K2b)) of the keys-side
    packing's slots, written here from its formulas, not imported from the kernels' det.py) and
    V1[j]*V2[k] rounded
    (kernels_tlx/simplicial/bwd_pairs.py), Q*K1[j] and dO*V1[j] not."""
    spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, form=form)
    B, N, Hq, Hk, D, G = spec.B, spec.N, spec.Hq, spec.Hk, spec.D, spec.G
    w1, w2, c = spec.w1, spec.w2, spec.sm_scale
    r = 2 if spec.swapped else 1
    if spec.swapped:
        k1, v1, k2, v2 = k2, v2, k1, v1

    def bf16(t):
        return t.to(torch.bfloat16).double()

    q, k1, k2, v1, v2, dout = (t.double() for t in (q, k1, k2, v1, v2, dout))
    dq = torch.zeros_like(q)
    dk1, dk2, dv1, dv2 = (torch.zeros_like(k1) for _ in range(4))
    # keys side: K1, K2 and their gradients in slots, B = sum_s K1_s[j] * K2_s[k] (the trilinear
    # form one slot; form "det" two: K1a = pi^r K1, K1b = -chi pi^(3-r) K1, K2a = pi^(3-r) K2,
    # K2b = pi^r K2, so that sum_s K1_s * K2_s = K1 x3 K2, negated on the chunk dims for r = 2)
    if form == "det":
        k1s = torch.stack((pi_chunks(k1, r), -(chunk_dims(k1) * pi_chunks(k1, 3 - r))), dim=-2)
        k2s = torch.stack((pi_chunks(k2, 3 - r), pi_chunks(k2, r)), dim=-2)
    else:
        k1s, k2s = k1[..., None, :], k2[..., None, :]
    dk1s, dk2s = torch.zeros_like(k1s), torch.zeros_like(k2s)
    delta = (dout * out.double()).sum(-1).transpose(1, 2)  # [B, Hq, N]
    if dlse is not None:
        delta = delta - dlse.double()
    chunk = max(1, (1 << 24) // (B * Hq * w1 * max(w2, D)))
    if keys_side:  # the [C, w1, w2, D] products per KV head
        chunk = max(1, min(chunk, (1 << 24) // (B * Hk * w1 * w2 * D)))
    for i0 in range(0, N, chunk):
        i1 = min(N, i0 + chunk)
        C = i1 - i0
        qc = q[:, i0:i1].reshape(B, C, Hk, G, D)
        do = dout[:, i0:i1].reshape(B, C, Hk, G, D)
        k1w, ok1 = _window(k1, i0, i1, w1)
        v1w, _ = _window(v1, i0, i1, w1)
        k2w, ok2 = _window(k2, i0, i1, w2)
        v2w, _ = _window(v2, i0, i1, w2)
        k1g = k1w.permute(0, 1, 3, 2, 4)[:, :, :, None]  # [B, C, Hk, 1, w1, D]
        l2 = lse.double()[:, :, i0:i1].transpose(1, 2).reshape(B, C, Hk, G)
        dl = delta[:, :, i0:i1].transpose(1, 2).reshape(B, C, Hk, G)
        valid = (ok1[:, :, None] & ok2[:, None, :])[None, :, None, None]
        pos1 = (torch.arange(i0, i1)[:, None] - w1 + 1 + torch.arange(w1)).clamp(min=0)
        pos2 = (torch.arange(i0, i1)[:, None] - w2 + 1 + torch.arange(w2)).clamp(min=0)
        pos1, pos2 = pos1.flatten().to(q.device), pos2.flatten().to(q.device)
        if keys_side:
            ks = [(_window(k1s[..., s, :], i0, i1, w1)[0], _window(k2s[..., s, :], i0, i1, w2)[0])
                  for s in range(k1s.shape[-2])]
            Bp = ks[-1][0][:, :, :, None] * ks[-1][1][:, :, None]  # bcjkgd, the build's
            for a1, a2 in reversed(ks[:-1]):  # roundings: bf16(x * row + bf16(xb * row_b))
                Bp = a1[:, :, :, None] * a2[:, :, None] + bf16(Bp)
            Bp = bf16(Bp)
            Cp = bf16(v1w[:, :, :, None] * v2w[:, :, None])
            s = c * torch.einsum("bcghd,bcjkgd->bcghjk", qc, Bp)
            p = torch.where(valid, torch.exp(s - l2[..., None, None]), 0.0)
            ds = p * (torch.einsum("bcghd,bcjkgd->bcghjk", do, Cp) - dl[..., None, None])
            dq[:, i0:i1] = (c * torch.einsum("bcghjk,bcjkgd->bcghd", bf16(ds),
                                             Bp)).reshape(B, C, Hq, D)
            for s, (a1, a2) in enumerate(ks):
                for grad, pos, part in (
                        (dk1s[..., s, :], pos1,
                         c * torch.einsum("bcghjk,bcghd,bckgd->bcjgd", bf16(ds), qc, a2)),
                        (dk2s[..., s, :], pos2,
                         c * torch.einsum("bcghjk,bcghd,bcjgd->bckgd", bf16(ds), qc, a1))):
                    grad.index_add_(1, pos, part.flatten(1, 2))
            for grad, pos, part in (
                    (dv1, pos1, torch.einsum("bcghjk,bcghd,bckgd->bcjgd", bf16(p), do, v2w)),
                    (dv2, pos2, torch.einsum("bcghjk,bcghd,bcjgd->bckgd", bf16(p), do, v1w))):
                grad.index_add_(1, pos, part.flatten(1, 2))
            continue
        if form == "det":
            qa, qb = pi_chunks(qc, r), -(chunk_dims(qc) * pi_chunks(qc, 3 - r))
            k1a, k1b = pi_chunks(k1g, 3 - r), pi_chunks(k1g, r)
            A = bf16(qa[:, :, :, :, None] * k1a + bf16(qb[:, :, :, :, None] * k1b))  # bcghjd
        else:
            A = bf16(qc[:, :, :, :, None] * k1g)  # bcghjd
        dOj = bf16(do[:, :, :, :, None] * v1w.permute(0, 1, 3, 2, 4)[:, :, :, None])
        s = c * torch.einsum("bcghjd,bckgd->bcghjk", A, k2w)
        p = torch.where(valid, torch.exp(s - l2[..., None, None]), 0.0)
        dp = torch.einsum("bcghjd,bckgd->bcghjk", dOj, v2w)
        ds = p * (dp - dl[..., None, None])
        X = torch.einsum("bcghjk,bckgd->bcghjd", bf16(ds), k2w)
        Z = torch.einsum("bcghjk,bckgd->bcghjd", bf16(p), v2w)
        if form == "det":
            k1a, k1b = pi_chunks(k1w, 3 - r), pi_chunks(k1w, r)
            dqc = (pi_chunks(torch.einsum("bcghjd,bcjgd->bcghd", X, k1a), 3 - r)
                   - chunk_dims(X) * pi_chunks(torch.einsum("bcghjd,bcjgd->bcghd", X, k1b), r))
            dk1c = (pi_chunks(torch.einsum("bcghjd,bcghd->bcjgd", X, qa), r)
                    + pi_chunks(torch.einsum("bcghjd,bcghd->bcjgd", X, qb), 3 - r))
        else:
            dqc = torch.einsum("bcghjd,bcjgd->bcghd", X, k1w)
            dk1c = torch.einsum("bcghjd,bcghd->bcjgd", X, qc)
        dq[:, i0:i1] = (c * dqc).reshape(B, C, Hq, D)
        for grad, pos, part in (
                (dk1, pos1, c * dk1c),
                (dv1, pos1, torch.einsum("bcghjd,bcghd->bcjgd", Z, do)),
                (dk2, pos2, c * torch.einsum("bcghjk,bcghjd->bckgd", bf16(ds), A)),
                (dv2, pos2, torch.einsum("bcghjk,bcghjd->bckgd", bf16(p), dOj))):
            grad.index_add_(1, pos, part.flatten(1, 2))
    if keys_side:
        if form == "det":  # the slots' gradients through the packing's transpose
            dk1 = (pi_chunks(dk1s[..., 0, :], 3 - r)
                   - pi_chunks(chunk_dims(k1) * dk1s[..., 1, :], r))
            dk2 = pi_chunks(dk2s[..., 0, :], r) + pi_chunks(dk2s[..., 1, :], 3 - r)
        else:
            dk1, dk2 = dk1s[..., 0, :], dk2s[..., 0, :]
    if spec.swapped:
        dk1, dv1, dk2, dv2 = dk2, dv2, dk1, dv1
    return tuple(bf16(g) for g in (dq, dk1, dk2, dv1, dv2))


def draw(shape: Shape, gen, device="cuda"):
    def rnd(*size, dtype=torch.bfloat16):
        return torch.randn(*size, generator=gen, dtype=torch.float32).to(dtype).to(device)
    x = [rnd(shape.B, shape.N, h, shape.D) for h in (shape.Hq,) + (shape.Hk,) * 4]
    dout = rnd(shape.B, shape.N, shape.Hq, shape.D)
    dlse = rnd(shape.B, shape.Hq, shape.N, dtype=torch.float32)
    return x, dout, dlse


def check_grads(grads, x, out, lse, dout, dlse, shape: Shape, label: str, form="trilinear",
                keys_side=False):
    ref = sa.reference_backward(*x, shape.w1, shape.w2, dout, dlse, form=form)
    emu = emulate_bwd_bf16(*x, shape.w1, shape.w2, out, lse, dout, dlse, None, form, keys_side)
    lines, ok = [label], True
    for name, g, r, e in zip(GRAD_NAMES, grads, ref, emu):
        assert g.shape == r.shape and g.dtype == torch.bfloat16, f"{label}: {name} shape/dtype"
        kern, emu_err = (g.double() - r).abs(), (e - r).abs()
        top = r.abs().max().item()
        km, em = kern.max().item(), emu_err.max().item()
        ka, ea = kern.mean().item(), emu_err.mean().item()
        allow_max, allow_mean = BUDGET * em + FLOOR_MAX * top, BUDGET * ea + FLOOR_MEAN * top
        good = km <= allow_max and ka <= allow_mean
        ok &= good
        lines.append(f"  {name}: max {km:.3e} (allowed {allow_max:.3e}), mean {ka:.3e} "
                     f"(allowed {allow_mean:.3e}), max|ref| {top:.3e}"
                     + ("" if good else "  <-- FAIL"))
    report = "\n".join(lines)
    print(report)
    assert ok, report


@pytest.mark.parametrize("variant,shape", cases(SHAPES))
def test_gradients_match_reference(variant, shape, gen, seed):
    x, dout, dlse = draw(shape, gen)
    xs = [t.clone().requires_grad_() for t in x]
    out, lse = sa.attention(*xs, shape.w1, shape.w2, bwd_variant=variant)
    torch.autograd.backward((out, lse), (dout, dlse))
    grads = [t.grad for t in xs]
    for name, g in zip(GRAD_NAMES, grads):
        assert torch.isfinite(g).all(), f"{shape} seed={seed}: non-finite {name}"
    check_grads(grads, x, out.detach(), lse.detach(), dout, dlse, shape,
                f"{variant} backward {shape} seed={seed}",
                keys_side="rounds_keys_side" in registry.get(variant, "bwd", "simplicial").traits)


# Form "det" (the determinant logits) on the backward variants that compute it: N < w1,
# w1 <= N < w2, ragged N, Hk > 1, G from 1 to 128, D 64 and 128, the pairs exchanged (the
# determinants change sign), w1 = 1.
DET_FORM_SHAPES = ("N5_lt_w1_G128", "N7_Hq32Hk2", "w1_le_N_lt_w2_G64", "ragged_N333_G128",
                   "ragged_N300_G128_Hk2", "swap_N300_G16", "swap_N257_G128", "G1_N129_D128",
                   "G8_N500", "G64_N700_D64", "ragged_N333_G64", "w1eq1_G64", "B3_Hq16Hk2",
                   "swap_N300_G64_D128", "G16_N257_D128")
DET_VARIANTS = [v for v in VARIANTS if "det" in v.accepted("form")]


def det_cases(names) -> list:
    return [pytest.param(v.name, SHAPES[n], id=f"{v.name}-{n}") for v in DET_VARIANTS
            for n in names if v.cannot_take(replace(validate_shape(*SHAPES[n]), form="det")) is None]


@pytest.mark.parametrize("variant,shape", det_cases(DET_FORM_SHAPES))
def test_det_gradients_match_reference(variant, shape, gen, seed):
    """form="det" through `attention` (forward `auto`, which takes a det forward): gradients
    against the fp64 reference with the bf16 yardstick of the det build, finite, and unlike the
    trilinear form's."""
    x, dout, dlse = draw(shape, gen)
    xs = [t.clone().requires_grad_() for t in x]
    out, lse = sa.attention(*xs, shape.w1, shape.w2, bwd_variant=variant, form="det")
    torch.autograd.backward((out, lse), (dout, dlse))
    grads = [t.grad for t in xs]
    for name, g in zip(GRAD_NAMES, grads):
        assert torch.isfinite(g).all(), f"{shape} seed={seed}: non-finite {name}"
    check_grads(grads, x, out.detach(), lse.detach(), dout, dlse, shape,
                f"{variant} det backward {shape} seed={seed}", form="det",
                keys_side="rounds_keys_side" in registry.get(variant, "bwd", "simplicial").traits)
    plain = bwd_launcher.backward(dout, dlse, *x, *sa.forward(*x, shape.w1, shape.w2),
                                  shape.w1, shape.w2, variant=variant)
    assert not torch.equal(grads[0], plain[0]), f"{shape}: det dq equals the trilinear one"


REPRO_SHAPES = {k: SHAPES[k] for k in ("ragged_N333_G128", "swap_N300_G16", "G1_N300",
                                        "ragged_N333_G64", "G16_N257_D128")}
REPRO_CASES = ([pytest.param(*c.values, "trilinear", id=f"{c.id}-trilinear")
                for c in cases(REPRO_SHAPES)]
               + [pytest.param(*c.values, "det", id=f"{c.id}-det")
                  for c in det_cases(REPRO_SHAPES)])


@pytest.mark.parametrize("variant,shape,form", REPRO_CASES)
def test_bitwise_reproducible_and_every_element_written(variant, shape, form, gen, seed):
    """Three runs agree bit for bit (a variant registered as deterministic); gradients launched
    into NaN-filled buffers have no NaN (every variant)."""
    x, dout, dlse = draw(shape, gen)
    out, lse = sa.forward(*x, shape.w1, shape.w2, form=form)
    if registry.get(variant, "bwd", "simplicial").deterministic:
        runs = [bwd_launcher.backward(dout, dlse, *x, out, lse, shape.w1, shape.w2,
                                      variant=variant, form=form)
                for _ in range(3)]
        for i, r in enumerate(runs[1:], 1):
            for name, a, b in zip(GRAD_NAMES, runs[0], r):
                assert torch.equal(a, b), f"{shape} seed={seed}: run {i} {name} differs from run 0"
    spec = validate(*x, shape.w1, shape.w2, form=form)
    q, k1, k2, v1, v2 = x
    if spec.swapped:
        k1, v1, k2, v2 = k2, v2, k1, v1
    grads = [torch.full_like(t, math.nan) for t in (q, k1, k2, v1, v2)]
    registry.get(variant, "bwd", "simplicial").load().launch(
        spec, q, k1, k2, v1, v2, out, lse, dout, dlse, *grads)
    torch.cuda.synchronize()
    for name, g in zip(GRAD_NAMES, grads):
        assert not torch.isnan(g).any(), f"{shape}: {name} has {int(torch.isnan(g).sum())} NaN"


def test_deterministic_mode_is_bitwise_repeatable(gen, seed):
    """attention(..., deterministic=True) at a shape where "auto" takes the reduce-adding
    `tlx_pairs`: the gradients of two steps agree bit for bit."""
    shape = SHAPES["ragged_N333_G128"]
    x, dout, _ = draw(shape, gen)
    grads = []
    for _ in range(2):
        xs = [t.clone().requires_grad_() for t in x]
        out, _ = sa.attention(*xs, shape.w1, shape.w2, deterministic=True)
        out.backward(dout)
        grads.append([t.grad for t in xs])
    for name, a, b in zip(GRAD_NAMES, *grads):
        assert torch.equal(a, b), f"{shape} seed={seed}: {name} differs between two steps"


def test_non_contiguous_and_stride0_dout(gen):
    """`.sum().backward()` gives a stride-0 dout; a transposed view a non-contiguous one."""
    shape = SHAPES["B3_Hq16Hk2"]
    x, _, _ = draw(shape, gen)
    xs = [t.clone().requires_grad_() for t in x]
    out, _ = sa.attention(*xs, shape.w1, shape.w2)
    out.float().sum().backward()
    ones = torch.ones_like(out)
    check_grads([t.grad for t in xs], x, out.detach(), sa.forward(*x, shape.w1, shape.w2)[1],
                ones, None, shape, "stride-0 dout")
    xs = [t.clone().requires_grad_() for t in x]
    out, _ = sa.attention(*xs, shape.w1, shape.w2)
    dT = torch.randn(shape.B, shape.N, shape.D, shape.Hq, generator=gen).to("cuda", torch.bfloat16)
    out.backward(dT.transpose(2, 3))
    check_grads([t.grad for t in xs], x, out.detach(), sa.forward(*x, shape.w1, shape.w2)[1],
                dT.transpose(2, 3).contiguous(), None, shape, "non-contiguous dout")


def small_model(dim=256, deterministic=False):
    """Projections without bias: a bias gradient is a reduction over tokens, which inductor and
    eager order differently (not bitwise equal, and not ours); every other gradient is a GEMM.
    G = 16, D = 64: "auto" takes `tlx_pairs` (reduce-adds), deterministic=True a bitwise one."""
    return torch.nn.Sequential(torch.nn.Linear(dim, dim, bias=False),
                               sa.SimplicialAttention(dim, 16, 1, 64, 8, 32,
                                                      deterministic=deterministic),
                               torch.nn.Linear(dim, dim, bias=False))


def test_layer_trains(gen):
    """A few Adam steps on "output the previous token's features" reduce the loss."""
    torch.manual_seed(seed_from(gen))
    model = small_model().cuda()
    losses = previous_token_losses(model, torch.randn(2, 200, 256, generator=gen).cuda(), 30, 2e-3)
    assert losses[-1] < 0.9 * losses[0], f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}"


def test_compiled_step_matches_eager_bitwise(gen):
    torch.manual_seed(seed_from(gen))
    model = small_model(deterministic=True).cuda()
    x = torch.randn(2, 200, 256, generator=gen).cuda()
    w = torch.randn(2, 200, 256, generator=gen).cuda()
    differ = compiled_grads_differ(model, lambda m: (m(x) * w).sum())
    assert not differ, f"eager and compiled gradients differ: {differ}"


def seed_from(gen) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


# N = 333 is ragged for every tile and key block; the first shape each variant takes (w 32 x 128:
# `tlx_pairs` packs j's last key blocks, 31 keys, four j to a program)
POISON_SHAPES = {"G16": Shape(2, 333, 16, 1, 64, 32, 128),
                 "G16_D128": Shape(2, 333, 16, 1, 128, 32, 96),
                 "G64_D128": Shape(2, 333, 64, 1, 128, 32, 96)}
POISON_CASES = [next(c for c in cases(POISON_SHAPES) if c.values[0] == v.name) for v in VARIANTS]


@pytest.mark.parametrize("variant,shape", POISON_CASES)
@pytest.mark.parametrize("poisoned", ["q", "k1", "k2", "v1", "v2", "dout"])
@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_no_value_crosses_batches(variant, shape, poisoned, value, gen, seed):
    """inf or NaN in one input of batch 1 (its first 64 tokens): batch 0's gradients are finite
    and equal to batch 0's run alone (to rounding: the dK1/dV1 partial chunks depend on B)."""
    x, dout, _ = draw(shape, gen)
    names = ("q", "k1", "k2", "v1", "v2")
    out, lse = sa.forward(*x, shape.w1, shape.w2)
    alone_out, alone_lse = sa.forward(*(t[:1] for t in x), shape.w1, shape.w2)
    alone = bwd_launcher.backward(dout[:1], None, *(t[:1] for t in x), alone_out, alone_lse,
                                  shape.w1, shape.w2, variant=variant)
    x = [t.clone() for t in x]
    (dout if poisoned == "dout" else x[names.index(poisoned)])[1, :64] = value
    out, lse = sa.forward(*x, shape.w1, shape.w2)
    grads = bwd_launcher.backward(dout, None, *x, out, lse, shape.w1, shape.w2, variant=variant)
    for name, g, a in zip(GRAD_NAMES, grads, alone):
        label = f"{variant}: {value} in batch 1's {poisoned}, seed={seed}: {name}"
        assert torch.isfinite(g[0]).all(), f"{label}: non-finite values in batch 0"
        torch.testing.assert_close(g[0].float(), a[0].float(), rtol=2e-2, atol=2e-2, msg=label)

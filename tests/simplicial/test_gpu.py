"""Every registered variant on a CUDA GPU against the fp64 reference (skipped without a GPU).

Accuracy is judged against what a bf16 computation of the same function can do: `emulate_bf16`
below evaluates the function exactly except for the roundings the kernels make on purpose
(Q*K1 and P to bf16, the output to bf16). Its error against the reference is the yardstick:

    err(kernel) <= BUDGET * err(emulation) + FLOOR * max|reference|

for both the max and the mean absolute error of `out`. Every element is checked to be written
(direct launch into NaN-filled buffers with NaN guard zones around them), repeated runs must be
bitwise equal, and failure messages carry the shape, variant, seed and measured vs allowed error.
The variants that "auto" takes run the whole shape matrix, the ablations a reduced one (Tiers).
Odd inputs (empty, non-contiguous, misaligned, past 32-bit offsets): test_gpu_inputs.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from altattn import registry
from altattn.simplicial import flops, forward, reference
from altattn.launcher import pick
from altattn.simplicial.passes import forward as run
from altattn.simplicial.reference import chunk_dims, pi_chunks
from altattn.simplicial.spec import validate, validate_shape

from conftest import Shape, hq_taken_by

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmul")]

# Kernel error may be at most BUDGET x the bf16 emulation's error: the kernel rounds P against a
# running maximum and accumulates in fp32 in its own order, so its rounding noise is another draw
# of the same size. Measured on H200 over all SHAPES (both variants): kernel/emulation = 0.87-1.12
# for the max error, 0.97-1.00 for the mean error; 2 leaves room for other seeds, not for bugs.
# FLOOR x max|ref| stands for fp32 accumulation noise (2^-20, far below bf16's 2^-9); it only
# matters where the emulation happens to be exact.
BUDGET = 2.0
FLOOR = 2.0 ** -20
# LSE is kept in fp32 from unrounded P, so its only bf16 error comes from rounding A = Q*K1 (or
# K1*K2 in a keys-side kernel, the same size of error): each
# score moves by about 2^-9 * sm_scale * |sum_d A K2| (~2e-3 for unit-variance scores; measured
# up to 7e-3 at the default scale). LSE_TOL = 1e-2 still catches a lost or extra (j, k) pair among
# up to ~50 visible pairs (|log(1 +- 1/50)| = 2e-2) and any log2/ln mix-up (factor 0.69); `out`
# is the main check for the larger windows. Larger scores make A's rounding matter more
# (sm_scale = 0.25 here: 2.7e-2 in the emulation and the kernel alike), so the emulation's own LSE
# error times BUDGET is allowed where it exceeds LSE_TOL.
LSE_TOL = 1e-2
FP64_MAX_FLOPS = 3e12      # reference and emulation in fp64 up to this size, fp32 above
EMU_CHUNK_ELEMENTS = 1 << 25

VARIANTS = registry.all_variants("fwd", "simplicial")
VIDS = [v.name for v in VARIANTS]


SHAPES = {
    # N < w1 <= w2
    "N1_G16": Shape(1, 1, 16, 1, 64, 32, 512),
    "N2_G8_D128": Shape(2, 2, 8, 1, 128, 4, 8),
    "N7_Hq32Hk2": Shape(2, 7, 32, 2, 64, 16, 64),
    "N63_G128": Shape(1, 63, 128, 1, 128, 64, 512),
    # w1 <= N < w2
    "N65_Hq16Hk2": Shape(1, 65, 16, 2, 64, 64, 128),
    "N129_Hq128Hk4": Shape(1, 129, 128, 4, 128, 32, 512),
    "N257_w1_w1024": Shape(1, 257, 8, 1, 128, 1, 1024),
    "N1000_Hq32Hk2_w1024": Shape(1, 1000, 32, 2, 128, 32, 1024),
    # N >= w2
    "N129_G64_w128": Shape(3, 129, 64, 1, 64, 128, 128),
    "N1537_G128_w1024": Shape(1, 1537, 128, 1, 128, 32, 1024),
    "N1000_Hq16Hk2": Shape(2, 1000, 16, 2, 128, 48, 512),
    "N4096_G8": Shape(1, 4096, 8, 1, 128, 32, 512),
    "N4096_G64_D64": Shape(1, 4096, 64, 1, 64, 32, 512),
    "N2048_Hq128Hk4": Shape(1, 2048, 128, 4, 64, 16, 256),
    "N16384_S": Shape(1, 16384, 128, 1, 128, 32, 512),
    # w1 > w2: the launcher swaps the pairs
    "swap_N300_G16": Shape(2, 300, 16, 1, 64, 256, 16),
    "swap_N777_Hq128Hk4": Shape(1, 777, 128, 4, 128, 512, 32),
    "swap_N100_w2eq1": Shape(1, 100, 32, 1, 64, 9, 1),
    # w1 == w2
    "eq3_N100_Hq16Hk2": Shape(1, 100, 16, 2, 64, 3, 3),
    "eq128_N4096_G32": Shape(1, 4096, 32, 1, 128, 128, 128),
    # tiny windows
    "w1w2eq1_N200_G8": Shape(1, 200, 8, 1, 64, 1, 1),
    "w1eq1_w2eq2_N150_G64": Shape(1, 150, 64, 1, 128, 1, 2),
    "w2_lt_tokens_per_tile_G8": Shape(1, 100, 8, 1, 64, 1, 5),
    # small G: many tokens per tile, masks on j as well as k
    "G1_N300": Shape(1, 300, 4, 4, 64, 8, 70),
    "G1_N129_w3_7": Shape(2, 129, 2, 2, 128, 3, 7),
    "G2_N260_w130": Shape(1, 260, 4, 2, 64, 130, 130),
    "G4_N511": Shape(1, 511, 8, 2, 128, 5, 200),
    # batches
    "B3_N96_Hq16Hk2": Shape(3, 96, 16, 2, 64, 8, 33),
    "B2_N513_Hq32Hk2": Shape(2, 513, 32, 2, 128, 32, 512),
    # exact multiples of the tile sizes
    "N64_w64_G8": Shape(1, 64, 8, 1, 128, 64, 64),
    "N128_Hq128Hk2": Shape(1, 128, 128, 2, 64, 2, 127),
    # one token per tile and a 2- or 3-row window over several key blocks: each TLX consumer has
    # one j (or consumer 1 an extra masked one) and its A pipeline wraps from block to block
    "w1eq2_G64_N300_w300": Shape(1, 300, 64, 1, 64, 2, 300),
    "w1eq3_G128_N300_w300": Shape(2, 300, 128, 1, 64, 3, 300),
    "N1024_w17_333": Shape(1, 1024, 16, 1, 64, 17, 333),
    # softmax temperature
    "scale0.25_N640": Shape(1, 640, 16, 1, 128, 16, 128, 0.25),
    "scale0.01_N300": Shape(1, 300, 32, 1, 64, 8, 64, 0.01),
    "w2eq1024_N2000_Hq16Hk2": Shape(1, 2000, 16, 2, 64, 48, 1024),
    # G = 128 (one token's heads fill a 128-row tile: the only G of tlx_ws_keys) at odd sizes
    "G128_N5_lt_w1": Shape(1, 5, 128, 1, 128, 16, 64),
    "G128_N100_w1_le_N_lt_w2": Shape(2, 100, 128, 1, 64, 32, 512),
    "G128_Hk2_N300_w7_129": Shape(1, 300, 256, 2, 128, 7, 129),
    "swap_G128_N257": Shape(1, 257, 128, 1, 64, 300, 5),
    "G128_w1eq2_N300_w300": Shape(1, 300, 128, 1, 64, 2, 300),
    "G128_w1w2eq1_N50": Shape(2, 50, 128, 1, 128, 1, 1),
}


# ------------------------------------------------------------------------------------------------
# Tiers. The rule, stated once: a variant that "auto" takes (launcher.pick on a Hopper GPU) at one
# or more shapes of SHAPES is what users run, and gets the whole matrix; every other registered
# variant is an ablation, reached only by name, and gets REDUCED_SHAPES (each shape, or its
# G = 128 twin where the variant takes only G = 128). Derived from the registry's ranks, so a
# variant added or re-ranked lands in its tier without an edit here. Today: tlx_pipelined_kv
# (G = 128, D = 128), tlx_ws (G >= 16 otherwise), triton (G < 16) get the matrix.
REDUCED_SHAPES = (
    "B3_N96_Hq16Hk2",          # batches, Hk > 1, G = 8
    "swap_N300_G16",           # w1 > w2: the pairs swapped; D = 64
    "N63_G128",                # N < w1 <= w2
    "G1_N129_w3_7",            # the odd one: G = 1 (64 tokens per tile), N = 129, windows 3 and 7
    "G128_Hk2_N300_w7_129",    # G = 128 at Hk = 2, windows just past a block
    "w1eq1_w2eq2_N150_G64",    # tiny windows
)
# Cases over this many useful FLOPs (reference and bf16 emulation on the GPU, the largest
# compiles) carry the `slow` marker: `pytest -m "gpu and not slow"` is the quick GPU pass.
SLOW_FLOPS = 5e11


def takes_on_hopper(shape: Shape) -> str | None:
    try:
        return pick(validate_shape(*shape), "auto", True, family="simplicial").name
    except ValueError:
        return None


AUTO_VARIANTS = {takes_on_hopper(s) for s in SHAPES.values()} - {None}


def is_slow(shape: Shape) -> bool:
    return flops(shape.B, shape.N, shape.Hq, shape.D, shape.w1, shape.w2) > SLOW_FLOPS


def matrix_cases() -> list:
    """(variant, shape) for test_matches_reference: the whole matrix for AUTO_VARIANTS, the
    reduced one (G = 128 twins where needed) for the ablations."""
    cases = []
    for v in VARIANTS:
        if v.name in AUTO_VARIANTS:
            shapes = list(SHAPES.items())
        else:
            shapes = []
            for name in REDUCED_SHAPES:
                twin = taken_by(v, SHAPES[name])
                shapes.append((name if twin == SHAPES[name] else f"{name}-as-Hq{twin.Hq}", twin))
        for name, shape in shapes:
            marks = [pytest.mark.slow] if is_slow(shape) else []
            cases.append(pytest.param(v, shape, id=f"{v.name}-{name}", marks=marks))
    return cases


def skip_reason(v: registry.Variant, spec) -> str | None:
    major, minor = torch.cuda.get_device_capability()
    if v.needs_hopper and major != 9:
        return f"{v.name} needs sm_90; this GPU is sm_{major}{minor}"
    why = v.cannot_take(spec)
    return None if why is None else f"{v.name} does not take {spec.short()}: {why}"


def taken_by(v: registry.Variant, shape: Shape) -> Shape:
    """`shape`, or its G = 128 twin when only that one is taken by the variant."""
    return shape._replace(Hq=hq_taken_by(v.name, *shape[:7]))


def inputs(rand, shape: Shape):
    return rand(shape.B, shape.N, shape.Hq, shape.Hk, shape.D, device="cuda")


# ------------------------------------------------------------------------------------------------
# The bf16 yardstick

def emulate_bf16(q, k1, k2, v1, v2, w1, w2, sm_scale, dtype=torch.float64, keys_side=False,
                 values_side=False, form="trilinear"):
    """The function as the kernels evaluate it, exact except for the roundings they make on purpose:

        A[i,h,j,:]  = bf16(Q[i,h,:] * K1[j,g,:])                  Q*K1 on CUDA cores, in bf16
        s[i,h,j,k]  = sm_scale * sum_d A[i,h,j,d] K2[k,g,d]        tensor cores, exact sum
        (keys_side: s = sm_scale * sum_d Q[i,h,d] bf16(K1[j,g,d] K2[k,g,d]), the rounding of a
         kernel that builds K1[j]*K2 instead, e.g. tlx_ws_keys)
        P[i,h,j,k]  = exp(s - max_jk s),   l = sum_jk P            l from unrounded P
        O[i,h,:]    = sum_jk bf16(P)[i,h,j,k] V1[j,g,:] V2[k,g,:] / l
        (values_side: O = sum_jk bf16(P) bf16(V1[j,g,:] V2[k,g,:]) / l, the rounding of a kernel
         that builds V1[j]*V2 instead of multiplying P @ V2 by V1[j], e.g. tlx_ws_kv)
        out = bf16(O),  lse = max_jk s + log l

    form="det" (the `triton` kernel's build, kernels_triton/simplicial/fwd.py): A = bf16(Qa * K1a + bf16(Qb
    * K1b)), Qa = pi^r Q, K1a = pi^(3-r) K1, Qb = -pi^(3-r) Q (0 on the leftover dims), K1b = pi^r
    K1, r = 1, or r = 2 when the pairs are exchanged (the determinants' sign flips). With
    keys_side (the producer's build, kernels_tlx/simplicial/ws_kv.py): bf16(K1a[j] * K2a + bf16(K1b[j] *
    K2b)) in place of bf16(K1[j] * K2), K1a = pi^r K1, K1b = -pi^(3-r) K1 (0 on the leftover
    dims), K2a = pi^(3-r) K2, K2b = pi^r K2.
    (K1, V1) is the pair with the smaller window, as the launcher arranges. Returns (out, lse) in
    `dtype`, out holding bf16-representable values."""
    r = 1
    if w1 > w2:
        k1, v1, k2, v2, w1, w2 = k2, v2, k1, v1, w2, w1
        r = 2
    B, N, Hq, D = q.shape
    Hk = k1.shape[2]
    G = Hq // Hk
    dev = q.device

    def bf16(t):
        return t.to(torch.bfloat16).to(dtype)

    q, k1, k2, v1, v2 = (t.to(dtype) for t in (q, k1, k2, v1, v2))
    out = torch.empty(B, N, Hq, D, dtype=dtype, device=dev)
    lse = torch.empty(B, Hq, N, dtype=dtype, device=dev)
    per_token = max(Hq * w1 * max(w2, D), Hk * w2 * D * (w1 if keys_side or values_side else 1))
    C = max(1, EMU_CHUNK_ELEMENTS // (max(1, B) * per_token))
    for i0 in range(0, N, C):
        i = torch.arange(i0, min(N, i0 + C), device=dev)
        j = i[:, None] - w1 + 1 + torch.arange(w1, device=dev)  # [C, w1]: window of K1/V1
        k = i[:, None] - w2 + 1 + torch.arange(w2, device=dev)  # [C, w2]: window of K2/V2
        K1 = k1[:, j.clamp(min=0)].permute(0, 1, 3, 2, 4)  # [B, C, Hk, w1, D]
        V1 = v1[:, j.clamp(min=0)].permute(0, 1, 3, 2, 4)
        K2 = k2[:, k.clamp(min=0)].permute(0, 1, 3, 2, 4)  # [B, C, Hk, w2, D]
        V2 = v2[:, k.clamp(min=0)].permute(0, 1, 3, 2, 4)
        Q = q[:, i].unflatten(2, (Hk, G))                  # [B, C, Hk, G, D]
        if keys_side and form == "det":
            K1a, K1b = pi_chunks(K1, r), -(chunk_dims(K1) * pi_chunks(K1, 3 - r))
            K2a, K2b = pi_chunks(K2, 3 - r), pi_chunks(K2, r)
            KK = bf16(K1a[:, :, :, :, None] * K2a[:, :, :, None]
                      + bf16(K1b[:, :, :, :, None] * K2b[:, :, :, None]))
            s = sm_scale * torch.einsum("bchgd,bchjkd->bchgjk", Q, KK)
        elif keys_side:
            KK = bf16(K1[:, :, :, :, None] * K2[:, :, :, None])   # [B, C, Hk, w1, w2, D]
            s = sm_scale * torch.einsum("bchgd,bchjkd->bchgjk", Q, KK)
        elif form == "det":
            Qa, Qb = pi_chunks(Q, r), -(chunk_dims(Q) * pi_chunks(Q, 3 - r))
            K1a, K1b = pi_chunks(K1, 3 - r), pi_chunks(K1, r)
            A = bf16(Qa[:, :, :, :, None, :] * K1a[:, :, :, None]
                     + bf16(Qb[:, :, :, :, None, :] * K1b[:, :, :, None]))
            s = sm_scale * (A.flatten(3, 4) @ K2.transpose(-1, -2)).unflatten(3, (G, w1))
        else:
            A = bf16(Q[:, :, :, :, None, :] * K1[:, :, :, None])  # [B, C, Hk, G, w1, D]
            s = sm_scale * (A.flatten(3, 4) @ K2.transpose(-1, -2)).unflatten(3, (G, w1))
        valid = (j >= 0)[:, :, None] & (k >= 0)[:, None, :]  # [C, w1, w2]
        s = s.masked_fill(~valid[None, :, None, None], -math.inf)  # [B, C, Hk, G, w1, w2]
        m = s.amax(dim=(-2, -1))                                   # [B, C, Hk, G]
        P = torch.exp(s - m[..., None, None])
        l = P.sum(dim=(-2, -1))
        if values_side:
            VV = bf16(V1[:, :, :, :, None] * V2[:, :, :, None])   # [B, C, Hk, w1, w2, D]
            O = torch.einsum("bchgjk,bchjkd->bchgd", bf16(P), VV) / l[..., None]
        else:
            PV2 = (bf16(P).flatten(3, 4) @ V2).unflatten(3, (G, w1))   # [B, C, Hk, G, w1, D]
            O = (PV2 * V1[:, :, :, None]).sum(-2) / l[..., None]       # [B, C, Hk, G, D]
        out[:, i0:i0 + len(i)] = bf16(O).flatten(2, 3)
        lse[:, :, i0:i0 + len(i)] = (m + torch.log(l)).flatten(2, 3).transpose(1, 2)
    return out, lse


# ------------------------------------------------------------------------------------------------
# Helpers

GUARD = 4096  # elements of NaN before and after each output buffer (16-byte multiple either way)


def launch_into_nan(v: registry.Variant, spec, x, w1, w2, sm_scale, form="trilinear"):
    """Run the variant (launcher.run) into NaN-filled out/lse that sit between NaN guard zones.
    Returns (out, lse, guards_intact)."""
    q = x[0]
    n_out = spec.B * spec.N * spec.Hq * spec.D
    n_lse = spec.B * spec.Hq * spec.N
    ob = torch.full((GUARD + n_out + GUARD,), math.nan, dtype=torch.bfloat16, device=q.device)
    lb = torch.full((GUARD + n_lse + GUARD,), math.nan, dtype=torch.float32, device=q.device)
    out = ob[GUARD:GUARD + n_out].view(spec.B, spec.N, spec.Hq, spec.D)
    lse = lb[GUARD:GUARD + n_lse].view(spec.B, spec.Hq, spec.N)
    run(*x, w1, w2, variant=v.name, sm_scale=sm_scale, out=out, lse=lse, form=form)
    torch.cuda.synchronize()
    guards = torch.cat([ob[:GUARD].float(), ob[-GUARD:].float(), lb[:GUARD], lb[-GUARD:]])
    return out, lse, bool(torch.isnan(guards).all())


def where_max(err: torch.Tensor, names="b i h d") -> str:
    idx = torch.unravel_index(err.argmax(), err.shape)
    return ",".join(f"{n}={int(t)}" for n, t in zip(names.split(), idx))


def roundings(v: registry.Variant) -> dict:
    """emulate_bf16's keywords for the variant: whether it rounds K1[j]*K2 to bf16 instead of Q*K1
    and V1[j]*V2 instead of (P@V2)*V1[j] (its record's rounds_keys_side, rounds_values_side)."""
    return dict(keys_side="rounds_keys_side" in v.traits, values_side="rounds_values_side" in v.traits)


def check_accuracy(out, lse, x, shape: Shape, label: str, rounding: dict | None = None,
                   form: str = "trilinear"):
    """Compare (out, lse) with the reference; the tolerance comes from the bf16 emulation of the
    same roundings (`rounding`: emulate_bf16's keys_side / values_side, see roundings) and form."""
    q, k1, k2, v1, v2 = x
    f = flops(shape.B, shape.N, shape.Hq, shape.D, shape.w1, shape.w2)
    dtype = torch.float64 if f <= FP64_MAX_FLOPS else torch.float32
    scale = shape.sm_scale if shape.sm_scale is not None else shape.D ** -0.5
    ref_o, ref_l = reference(q, k1, k2, v1, v2, shape.w1, shape.w2, sm_scale=shape.sm_scale,
                             dtype=dtype, form=form)
    emu_o, emu_l = emulate_bf16(q, k1, k2, v1, v2, shape.w1, shape.w2, scale, dtype,
                                **(rounding or {}), form=form)
    ref_o, ref_l, emu_o, emu_l = (t.double() for t in (ref_o, ref_l, emu_o, emu_l))
    kern = (out.double() - ref_o).abs()
    emu = (emu_o - ref_o).abs()
    floor = FLOOR * ref_o.abs().max().item()
    k_max, e_max = kern.max().item(), emu.max().item()
    k_mean, e_mean = kern.mean().item(), emu.mean().item()
    lse_err = (lse.double() - ref_l).abs()
    l_max, le_max = lse_err.max().item(), (emu_l - ref_l).abs().max().item()
    allowed_max = BUDGET * e_max + floor
    allowed_mean = BUDGET * e_mean + floor
    allowed_lse = max(LSE_TOL, BUDGET * le_max)
    report = (f"{label}: reference in {str(dtype)[6:]}\n"
              f"  out max abs err  {k_max:.3e} (at {where_max(kern)}) allowed {allowed_max:.3e}"
              f" = {BUDGET} x bf16 emulation {e_max:.3e} + floor {floor:.1e}\n"
              f"  out mean abs err {k_mean:.3e} allowed {allowed_mean:.3e}"
              f" = {BUDGET} x bf16 emulation {e_mean:.3e} + floor {floor:.1e}\n"
              f"  lse max abs err  {l_max:.3e} (at {where_max(lse_err, 'b h i')}) allowed "
              f"{allowed_lse:.3e} (LSE_TOL {LSE_TOL}, emulation {le_max:.3e})")
    print(report)  # shown with -rP / -s: the margins of passing cases too
    assert k_max <= allowed_max and k_mean <= allowed_mean and l_max <= allowed_lse, report
    return report


def assert_written_and_repeatable(out, lse, out2, lse2, guards_ok: bool, label: str) -> None:
    """out2/lse2 (a launch into NaN-filled buffers, launch_into_nan) have every element written,
    nothing outside them was, and they equal out/lse of an earlier call bit for bit."""
    n_out, n_lse = int(torch.isnan(out2).sum()), int(torch.isnan(lse2).sum())
    assert n_out == 0 and n_lse == 0, (f"{label}: the kernel left {n_out} of {out2.numel()} out "
                                       f"and {n_lse} of {lse2.numel()} lse elements unwritten")
    assert guards_ok, f"{label}: the kernel wrote outside out/lse"
    assert torch.equal(out, out2) and torch.equal(lse, lse2), (
        f"{label}: two runs on the same inputs differ (not bitwise reproducible)")


# ------------------------------------------------------------------------------------------------
# Tests

@pytest.mark.parametrize("v, shape", matrix_cases())
def test_matches_reference(v, shape, rand, seed):
    x = inputs(rand, shape)
    spec = validate(*x, shape.w1, shape.w2, shape.sm_scale)
    why = skip_reason(v, spec)
    if why:
        pytest.skip(why)
    label = f"variant={v.name} {shape} seed={seed}"
    out, lse = forward(*x, shape.w1, shape.w2, variant=v.name, sm_scale=shape.sm_scale)
    assert out.shape == (shape.B, shape.N, shape.Hq, shape.D) and out.dtype == torch.bfloat16
    assert lse.shape == (shape.B, shape.Hq, shape.N) and lse.dtype == torch.float32
    assert out.device == x[0].device and lse.device == x[0].device

    out2, lse2, guards_ok = launch_into_nan(v, spec, x, shape.w1, shape.w2, shape.sm_scale)
    assert_written_and_repeatable(out, lse, out2, lse2, guards_ok, label)
    check_accuracy(out, lse, x, shape, label, roundings(v))


# Form "det" (the determinant logits) on the variants that compute it: N < w1, w1 <= N < w2,
# ragged N, Hk > 1, D = 64 and 128, small G (masks on j), w1 > w2 (the pairs swapped: the
# determinants change sign), a larger softmax temperature.
DET_FORM_SHAPES = ("N7_Hq32Hk2", "N63_G128", "N65_Hq16Hk2", "N129_Hq128Hk4", "N1000_Hq16Hk2",
                   "N4096_G64_D64", "G1_N129_w3_7", "G4_N511", "swap_N300_G16",
                   "swap_N777_Hq128Hk4", "swap_G128_N257", "swap_N100_w2eq1", "scale0.25_N640")
DET_VARIANTS = [v for v in VARIANTS if "det" in v.accepted("form")]


@pytest.mark.parametrize("name", DET_FORM_SHAPES)
@pytest.mark.parametrize("v", DET_VARIANTS, ids=[v.name for v in DET_VARIANTS])
def test_det_form_matches_reference(v, name, rand, seed):
    """form="det" against the fp64 reference with the bf16 yardstick of the kernel's own
    roundings (emulate_bf16(form="det")), into NaN-filled outputs, bitwise repeatable; "auto"
    takes the same variant."""
    shape = SHAPES[name]
    x = inputs(rand, shape)
    spec = validate(*x, shape.w1, shape.w2, shape.sm_scale, form="det")
    why = skip_reason(v, spec)
    if why:
        pytest.skip(why)
    label = f"variant={v.name} form=det {shape} seed={seed}"
    out, lse = forward(*x, shape.w1, shape.w2, variant=v.name, sm_scale=shape.sm_scale,
                       form="det")
    out2, lse2, guards_ok = launch_into_nan(v, spec, x, shape.w1, shape.w2, shape.sm_scale,
                                            form="det")
    assert_written_and_repeatable(out, lse, out2, lse2, guards_ok, label)
    if pick(spec, "auto", True, family="simplicial").name == v.name:
        auto = forward(*x, shape.w1, shape.w2, sm_scale=shape.sm_scale, form="det")
        assert torch.equal(out, auto[0]) and torch.equal(lse, auto[1]), label
    check_accuracy(out, lse, x, shape, label, roundings(v), form="det")
    plain = forward(*x, shape.w1, shape.w2, variant=v.name, sm_scale=shape.sm_scale)
    assert not torch.equal(lse, plain[1]), f"{label}: the det logits equal the trilinear ones"


REPRO_SHAPES = {k: SHAPES[k] for k in ("N1000_Hq16Hk2", "swap_N300_G16", "G1_N300",
                                     "G128_Hk2_N300_w7_129")}


@pytest.mark.parametrize("shape", REPRO_SHAPES.values(), ids=REPRO_SHAPES.keys())
@pytest.mark.parametrize("v", VARIANTS, ids=VIDS)
def test_bitwise_reproducible(v, shape, rand, seed):
    x = inputs(rand, shape)
    why = skip_reason(v, validate(*x, shape.w1, shape.w2))
    if why:
        pytest.skip(why)
    runs = [forward(*x, shape.w1, shape.w2, variant=v.name) for _ in range(3)]
    for i, (o, l) in enumerate(runs[1:], 1):
        assert torch.equal(o, runs[0][0]) and torch.equal(l, runs[0][1]), (
            f"variant={v.name} {shape} seed={seed}: run {i} differs from run 0")


@pytest.mark.parametrize("name", ["N1000_Hq16Hk2", "N129_G64_w128", "N63_G128"])
def test_auto(name, rand, seed):
    """variant="auto" runs, takes the variant pick() names, and is accurate (at shapes where the
    ranks pick triton, tlx_ws and tlx_pipelined_kv on an H100/H200)."""
    shape = SHAPES[name]
    x = inputs(rand, shape)
    spec = validate(*x, shape.w1, shape.w2)
    hopper = torch.cuda.get_device_capability()[0] == 9
    try:
        chosen = pick(spec, "auto", hopper, family="simplicial")
    except ValueError as e:
        pytest.skip(f"no variant for this GPU: {e}")
    out, lse = forward(*x, shape.w1, shape.w2)
    named = forward(*x, shape.w1, shape.w2, variant=chosen.name)
    assert torch.equal(out, named[0]) and torch.equal(lse, named[1])
    check_accuracy(out, lse, x, shape, f"variant=auto ({chosen.name}) {shape} seed={seed}",
                   roundings(chosen))

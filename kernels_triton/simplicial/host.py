"""The host side every forward kernel module shares (Triton and TLX): the TMA layouts of K2/V2
and Q, the launch of a kernel with the common signature, and its compile configs.

The common signature: kernel(Q, K1, K2, V1, V2, Out, Lse, N, w1, w2, qk_scale, HQ, HK, G, D,
<the config's constexprs>, PROFILE). A variant module gets its `prepare`, `launch` and
`compile_configs` (altattn/registry.py) from `entry_points(kernel, config, supports)`.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace

import torch

from altattn.registry import CompileConfig
from altattn.simplicial.spec import ProblemSpec
from kernels_triton.launch import Desc, Kernel, meta
from kernels_triton.launch import compile_configs as launch_configs
from kernels_triton.simplicial.det import det_of, det_specs, form_suffix
from kernels_triton.simplicial.tiling import COMPILE_SHAPES, LOG2E, grid

Config = Callable[[ProblemSpec], dict]   # spec -> the kernel's constexprs + num_warps, num_stages
Supports = Callable[[ProblemSpec], str | None]
# form "det": (k1, k2, DET) -> the (k1, k2) the kernel reads (kernels_triton/simplicial/det.py packs them)
DetPack = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def kv_layout(spec: ProblemSpec, block_n: int, shape=None) -> Desc:
    """TMA layout of a contiguous K2 or V2 of `shape` [B, N, ...] (default the spec's
    [B, N, Hk, D]; form "det"'s packed [B, N, Hk, 2, D] K2; a packed launch's keys or caches)
    viewed as [B, N, the rest]; a block is one head's [1, block_n, D] token run, at coordinates
    [b, first token, g*D] (of the packed K2: 2g*D and (2g + 1)*D).
    Rows past N: a block that runs past a batch's last token reads zeros there (TMA fills what
    lies outside the view), never the next batch's rows. Their scores are masked (P = 0), and
    P = 0 times a zero is 0, so no value of one batch element, not even inf or NaN, reaches
    another's output."""
    B, N, *rest = shape if shape is not None else (spec.B, spec.N, spec.Hk, spec.D)
    hd = math.prod(rest)
    return Desc([B, N, hd], [N * hd, hd, 1], [1, block_n, spec.D])


def q_rows(G: int, block_m: int) -> int:
    """Rows of one TMA box of Q: the heads of one token that a tile holds."""
    return min(G, block_m)


def q_layout(spec: ProblemSpec, block_m: int) -> Desc:
    """TMA layout of a contiguous [B, N, Hq, D] Q as [B*N*Hq, D]; a box is the q_rows heads of
    one token. Rows of a token past N are the next batch's (or zero past the end): they only
    reach output rows that are never stored."""
    return Desc([spec.B * spec.N * spec.Hq, spec.D], [spec.D, 1],
                [q_rows(spec.G, block_m), spec.D])


def _options(spec: ProblemSpec, cfg: dict, profile: bool) -> dict:
    """A launch's constexprs and num_warps / num_stages: the common ones and `cfg`'s."""
    return dict(HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=spec.D, PROFILE=bool(profile), **cfg)


def prepare(kernel, cfg: dict, spec: ProblemSpec, profile: bool = False, q_tma: bool = False,
            det_pack: DetPack | None = None):
    """The launch of a forward kernel with the common signature at `spec`, made once: run(q, k1,
    k2, v1, v2, out, lse) writes out [B, N, Hq, D] bf16 and lse [B, Hq, N] fp32 from q
    [B, N, Hq, D] and k1, k2, v1, v2 [B, N, Hk, D] (bf16, contiguous). `cfg` holds the kernel's
    constexprs plus num_warps/num_stages. q_tma: the kernel takes Q as a TMA descriptor
    (q_layout). profile=True compiles the Proton-scoped copy (profiling/trace_capture.py).
    det_pack (form "det"): how K1 and K2 are packed for the kernel, per call; the packed K2's
    layout comes from det_pack run once on meta tensors (shapes, no data)."""
    det = det_of(spec)
    k2_shape = None
    if det:
        meta = torch.empty(spec.B, spec.N, spec.Hk, spec.D, dtype=torch.bfloat16, device="meta")
        k2_shape = det_pack(meta, meta, det)[1].shape
    k2_layout = kv_layout(spec, cfg["BLOCK_N"], k2_shape)
    v2_layout = kv_layout(spec, cfg["BLOCK_N"])
    rows = q_layout(spec, cfg["BLOCK_M"]) if q_tma else None
    launch_kernel = Kernel(kernel, grid(spec, cfg["BLOCK_M"]), **_options(spec, cfg, profile))
    N, w1, w2, qk_scale = spec.N, spec.w1, spec.w2, spec.sm_scale * LOG2E

    def run(q, k1, k2, v1, v2, out, lse) -> None:
        if det:
            k1, k2 = det_pack(k1, k2, det)
        launch_kernel(rows(q) if q_tma else q, k1, k2_layout(k2), v1, v2_layout(v2), out, lse,
                      N, w1, w2, qk_scale)

    return run


def prepare_packed(kernel, cfg: dict, spec: ProblemSpec, profile: bool, q_tma: bool,
                   n_split: int, cache: tuple | None, k2_shape: tuple, v2_shape: tuple):
    """The launch over packed sequences (spec.varlen: altattn/simplicial/packing.py's Packed),
    made once: run(q, k1, k2, v1, v2, out, lse, seq) with `seq` each query token's key row and
    sequence start (`Seq`), out and lse with a plane per split of the j window (n_split). With
    `cache` = (tokens, shift, R1, R2) (decoding), k1..v2 are the caches [B, R, Hk, D] and `seq`
    the cached lengths (the kernel's CACHE mode). k2_shape, v2_shape: the keys' (their count, or
    the caches' slots, is no part of the spec). Otherwise as `prepare`'s run."""
    k2_layout, v2_layout = (kv_layout(spec, cfg["BLOCK_N"], sh) for sh in (k2_shape, v2_shape))
    rows = q_layout(spec, cfg["BLOCK_M"]) if q_tma else None
    runtime = {"n_split": n_split}
    opts = dict(cfg, VARLEN=True)
    if cache is not None:
        runtime.update(zip(("T_new", "shift", "R1", "R2"), cache))
        opts["CACHE"] = True
    launch_kernel = Kernel(kernel, (spec.N * n_split * spec.Hk,), **_options(spec, opts, profile))
    N, w1, w2, qk_scale = spec.N, spec.w1, spec.w2, spec.sm_scale * LOG2E

    def run(q, k1, k2, v1, v2, out, lse, seq) -> None:
        launch_kernel(rows(q) if q_tma else q, k1, k2_layout(k2), v1, v2_layout(v2), out, lse,
                      N, w1, w2, qk_scale, Seq=seq, **runtime)

    return run


def _compile_specs(forms: tuple[str, ...]):
    """(name suffix, spec) at every (Hq, Hk, D) of tiling.COMPILE_SHAPES for each of `forms`
    (form "det": det.det_specs, the pairs also exchanged at G = 128, Hk = 1)."""
    for form in forms:
        for hq, hk, d in COMPILE_SHAPES:
            base = ProblemSpec(B=1, N=4096, Hq=hq, Hk=hk, D=d, w1=32, w2=512, sm_scale=d ** -0.5)
            for spec in [base] if form == "trilinear" else det_specs(base):
                yield form_suffix(spec), spec


def compile_configs(kernel, config: Config, supports: Supports, q_tma: bool = False,
                    forms: tuple[str, ...] = ("trilinear",), det_pack: DetPack | None = None,
                    packed: bool = False) -> list[CompileConfig]:
    """The launches of `kernel` (recorded on meta tensors) at every (Hq, Hk, D) of
    tiling.COMPILE_SHAPES that `supports` takes, for each form of `forms` (the variant's `forms`;
    q_tma, det_pack: as in prepare); packed: each trilinear one packed (VARLEN, one split of the
    window) and decoding (CACHE: D = 128) too."""
    out = []
    specs = list(_compile_specs(forms))
    if packed:
        specs += [(mode, replace(spec, varlen=True)) for suffix, spec in specs if not suffix
                  for mode in ("_packed", "_cache") if mode == "_packed" or spec.D == 128]
    for suffix, spec in specs:
        if supports(spec) is not None:
            continue
        cfg = config(spec)
        q, kv = meta(spec.B, spec.N, spec.Hq, spec.D), meta(spec.B, spec.N, spec.Hk, spec.D)
        lse = meta(spec.B, spec.Hq, spec.N, dtype=torch.float32)
        args = (q, kv, kv, kv, kv, q, lse)
        if spec.varlen:  # one sequence; decoding: T_new, shift, R1, R2 of a cache of N slots
            cache = (1, 0, spec.N, spec.N) if suffix == "_cache" else None
            args += (meta(spec.N, 2, dtype=torch.int32),)

            def prepared(s=spec, c=cache, cfg=cfg):
                return prepare_packed(kernel, cfg, s, False, q_tma, 1, c, kv.shape, kv.shape)
        else:
            def prepared(s=spec, cfg=cfg):
                return prepare(kernel, cfg, s, False, q_tma, det_pack)
        name = (f"G{spec.G}_Hk{spec.Hk}_D{spec.D}_M{cfg['BLOCK_M']}_N{cfg['BLOCK_N']}{suffix}")
        out += launch_configs(prepared, args, lambda launch, n=name: n)
    return out


def entry_points(kernel, config: Config, supports: Supports, q_tma: bool = False,
                 forms: tuple[str, ...] = ("trilinear",), det_pack: DetPack | None = None,
                 packed: bool = False):
    """A variant module's `prepare`, `launch` and `compile_configs` (altattn/registry.py) for
    `kernel` run with `config(spec)` (q_tma: as in prepare; forms: the logits' forms it
    computes, its registry record's `forms`, each of which gets compile configs; det_pack: how
    form "det" packs K1 and K2 for the kernel, given DET = det.det_of(spec); packed: it takes
    packed sequences, `launch`'s `packed`: prepare_packed, made once per problem, also
    `launch.prepared_packed(spec, profile, n_split, cache, k2_shape, v2_shape)`)."""
    assert ("det" in forms) == (det_pack is not None), "form 'det' needs its packing"

    def prepare_variant(spec: ProblemSpec, profile: bool = False):
        return prepare(kernel, config(spec), spec, profile, q_tma, det_pack)

    @functools.lru_cache(maxsize=256)
    def prepared_packed(spec: ProblemSpec, profile, n_split: int, cache, k2_shape, v2_shape):
        return prepare_packed(kernel, config(spec), spec, profile, q_tma, n_split, cache,
                              k2_shape, v2_shape)

    def launch_variant(spec: ProblemSpec, q, k1, k2, v1, v2, out, lse, profile: bool = False,
                       packed=None) -> None:
        if packed is None:
            prepare_variant(spec, profile)(q, k1, k2, v1, v2, out, lse)
            return
        if spec.form == "det":
            k1, k2 = det_pack(k1, k2, det_of(spec))
        cache = None if packed.lens is None else (packed.tokens, packed.shift, k1.shape[1],
                                                  k2.shape[1])
        run = prepared_packed(spec, profile, packed.n_split, cache, tuple(k2.shape),
                              tuple(v2.shape))
        run(q, k1, k2, v1, v2, out, lse, packed.seq if cache is None else packed.lens)

    # the packed launch made once, for a caller that keeps it (a decoding step's plan, kvcache.py)
    launch_variant.prepared_packed = prepared_packed

    def variant_compile_configs() -> list[CompileConfig]:
        return compile_configs(kernel, config, supports, q_tma, forms, det_pack, packed)

    return prepare_variant, launch_variant, variant_compile_configs

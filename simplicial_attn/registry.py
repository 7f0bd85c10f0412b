"""The variant registry: one record per kernel variant, keyed by (pass, name). Kernel modules are
imported only when used.

Everything the code knows about a variant is a field of its `Variant` record or a function of its
module, read through the record. A variant module defines:
    supports(spec: ProblemSpec) -> str | None   # None when it can run the shape, else the reason
    launch(spec, ..., profile=False)            # the forward's: launch(spec, q, k1, k2, v1, v2,
                                                # out, lse, profile=False) fills out [B,N,Hq,D] bf16
                                                # and lse [B,Hq,N] fp32; profile=True: the
                                                # Proton-scoped copy of the same kernel
    compile_configs() -> list[CompileConfig]    # default configs, compiled by profiling.resources
and, where its launch runs several Proton-scoped kernels (the backward),
    profiled_kernels(spec) -> dict[str, int]    # their names for launch(..., profile=name), and
                                                # their warps per CTA (Variant.profiled_kernels)
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from .spec import ProblemSpec

PASSES = ("fwd", "bwd")  # forward, backward: a variant is identified by (pass, name)

# Proton scopes (profiling/trace_capture.py, docs/profiling.md): every name, in kernel order, then
# the set a full trace of each kind of kernel holds. A consumer step of every kernel is a QK GEMM,
# the softmax and a PV GEMM.
SCOPES = ("load_kv", "build_a", "build_b", "build_c", "wait_kv", "qk_gemm", "softmax", "pv_gemm",
          "v1_mul", "epilogue")
_STEP = ("qk_gemm", "softmax", "pv_gemm")
TRITON_SCOPES = ("load_kv", *_STEP, "v1_mul", "epilogue")         # one warp group does it all
WS_SCOPES = ("load_kv", "wait_kv", *_STEP, "v1_mul", "epilogue")  # a producer; consumers wait
KEYS_SCOPES = ("load_kv", "build_b", *WS_SCOPES[1:])  # the producer builds B_j = K1[j] * K2
# producers build B_j and C_j = V1[j] * V2: consumers wait for no K2/V2 slot, multiply by no V1 row
KV_SCOPES = ("load_kv", "build_b", "build_c", *_STEP, "epilogue")
BWD_SCOPES = ("load_kv", *_STEP, "epilogue")  # backward: recompute S (qk), dS (softmax), dK/dV/X/Z
BWD_WS_SCOPES = ("load_kv", "build_a", *_STEP, "epilogue")  # a producer builds A_j and dO_j


@dataclass(frozen=True, kw_only=True)
class Variant:
    name: str
    pass_: str           # which pass it implements: "fwd" or "bwd" (PASSES)
    module: str          # import path of the kernel module
    needs_hopper: bool   # uses TMA descriptors / wgmma / setmaxnreg: sm_90 only
    # "auto" tries variants from the highest rank down (measured speed order); a function of the
    # shape where that order changes with it
    rank: int | Callable[[ProblemSpec], int]
    supports: str        # one line: which shapes it takes (the module's `supports` decides)
    # warps per CTA, every warp group counted (threads per CTA = 32 * warps); a pass of several
    # kernels (the backward) records its widest kernel's
    warps: int
    scopes: tuple[str, ...]  # Proton scopes of its profile=True kernel
    # rounds K1[j] * K2 to bf16 (instead of Q * K1[j]) / V1[j] * V2 (instead of multiplying P @ V2
    # by V1[j]); tests/test_gpu.py's bf16 yardstick emulates the same roundings
    rounds_keys_side: bool = False
    rounds_values_side: bool = False
    # waits for one wgmma while another is in flight and runs its exp2 under it (the forward:
    # QK(c) issued with PV(c - 1); the tlx_ws backward: S^T waited for, dP^T in flight;
    # profiling.resources: its "ex2 under wgmma" is a number)
    pipelined: bool = False
    # the logits' forms it computes (spec.FORMS); "auto" and a named variant both refuse others
    forms: tuple[str, ...] = ("trilinear",)
    # bitwise-identical results from run to run (every sum in a fixed order); a backward with
    # unordered reduce-adds says False, and `deterministic=True` makes "auto" skip it
    deterministic: bool = True

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def rank_for(self, spec: ProblemSpec) -> int:
        return self.rank(spec) if callable(self.rank) else self.rank

    def cannot_take(self, spec: ProblemSpec) -> str | None:
        """None when the variant runs `spec`, else why not (`forms`, then its module's
        `supports`)."""
        if spec.form not in self.forms:
            return f"computes form {' / '.join(self.forms)} only, not {spec.form!r}"
        return self.load().supports(spec)

    def compile_configs(self) -> list[CompileConfig]:
        return self.load().compile_configs()

    def profiled_kernels(self, spec: ProblemSpec) -> dict[str | bool, int]:
        """What a trace of `spec` captures, one Proton session each: {launch's `profile`
        argument: warps per CTA of the kernel it scopes}. Proton samples one warp list per
        session, and a kernel must have every warp named. The module's `profiled_kernels` where
        it has one (several scoped kernels, of different widths), else {True: warps}."""
        kernels = getattr(self.load(), "profiled_kernels", None)
        return kernels(spec) if kernels else {True: self.warps}


_REGISTRY: dict[tuple[str, str], Variant] = {}


def _check_pass(pass_: str) -> None:
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}; passes: {', '.join(PASSES)}")


def register(v: Variant) -> None:
    _check_pass(v.pass_)
    if (v.pass_, v.name) in _REGISTRY:
        raise ValueError(f"variant {v.name!r} ({v.pass_}) registered twice")
    _REGISTRY[(v.pass_, v.name)] = v


# Forward ranks: the speed order at S* (G = 128, D = 128) and Hq = 64 on the lent H100 and H200
# (docs/perf.md; measured in docs/history/perf-notes.md, session 11). tlx_ws is ahead of triton
# at 7 of 8 shapes timed with G from 16 to 128 and D = 64 or 128; at D = 64 it is also ahead of
# tlx_pipelined_kv (450 vs 417 at G = 128).
# tlx_pipelined_pingpong is on par with tlx_pipelined_kv in the trilinear form: it stays below the
# rest there. In form "det" at D = 128 it is the fastest (575.4 against tlx_pipelined_kv's 545.6
# and triton's 490.9 at S*, H100, session 19), so "auto" takes it for det; det at D = 64 (G = 128)
# is tlx_pipelined_kv's (383.0 against triton's 352.1; pingpong not timed there).
_G128 = "G = Hq/Hk = 128; any B, N, Hk, w1, w2; D in {64, 128}"
_G16 = "any B, N, Hk, w1, w2; G = Hq/Hk in {16, 32, 64, 128}; D in {64, 128}"
register(Variant(name="tlx_pipelined_kv", pass_="fwd", module="kernels_tlx.pipelined_kv",
                 needs_hopper=True, rank=lambda spec: 8 if spec.D == 128 else 6, supports=_G128,
                 warps=16, scopes=KV_SCOPES, rounds_keys_side=True, rounds_values_side=True,
                 pipelined=True, forms=("trilinear", "det")))
register(Variant(name="tlx_ws", pass_="fwd", module="kernels_tlx.ws", needs_hopper=True, rank=7,
                 supports=_G16, warps=12, scopes=WS_SCOPES))
register(Variant(name="tlx_ws_kv", pass_="fwd", module="kernels_tlx.ws_kv", needs_hopper=True,
                 rank=5, supports=_G128, warps=16, scopes=KV_SCOPES, rounds_keys_side=True,
                 rounds_values_side=True))
register(Variant(name="tlx_ws_keys", pass_="fwd", module="kernels_tlx.ws_keys",
                 needs_hopper=True, rank=4, supports=_G128, warps=12, scopes=KEYS_SCOPES,
                 rounds_keys_side=True))
register(Variant(name="tlx_pingpong", pass_="fwd", module="kernels_tlx.pingpong",
                 needs_hopper=True, rank=3, supports=_G16, warps=12, scopes=WS_SCOPES))
register(Variant(name="triton", pass_="fwd", module="kernels_triton.fwd", needs_hopper=True,
                 rank=2, warps=4, scopes=TRITON_SCOPES, forms=("trilinear", "det"),
                 supports="any B, N, Hk, w1, w2; G = Hq/Hk a power of two <= 128; D in {64, 128}"))
register(Variant(name="tlx_pipelined_pingpong", pass_="fwd",
                 module="kernels_tlx.pipelined_pingpong", needs_hopper=True,
                 rank=lambda spec: 9 if spec.form == "det" and spec.D == 128 else -3,
                 supports=_G128, warps=16, scopes=KV_SCOPES, rounds_keys_side=True,
                 rounds_values_side=True, pipelined=True, forms=("trilinear", "det")))


# Backward ranks: "auto" takes the highest that supports the shape.
register(Variant(name="triton", pass_="bwd", module="kernels_triton.bwd", needs_hopper=True,
                 rank=1, supports="any B, N, Hk, w1, w2; G = Hq/Hk a power of two <= 128; "
                 "D in {64, 128}", warps=8, scopes=BWD_SCOPES, forms=("trilinear", "det")))
register(Variant(name="tlx_ws", pass_="bwd", module="kernels_tlx.bwd_ws", needs_hopper=True,
                 rank=lambda s: 2 if s.D == 128 else 0,  # measured: ahead at D = 128 only
                 supports="as `triton`, with G = Hq/Hk in {64, 128}", warps=12,
                 scopes=BWD_WS_SCOPES, pipelined=True))
register(Variant(name="tlx_pairs", pass_="bwd", module="kernels_tlx.bwd_pairs", needs_hopper=True,
                 rank=3, supports="D = 128 with G = Hq/Hk >= 16; the trilinear form",
                 warps=12, scopes=BWD_WS_SCOPES, pipelined=True, rounds_keys_side=True,
                 rounds_values_side=True, deterministic=False))


def refuse_nondeterministic(v: Variant, arg: str = "variant") -> None:
    """ValueError when `deterministic=True` names (as argument `arg`) a variant that is not
    bitwise repeatable, listing the ones that are."""
    if not v.deterministic:
        able = ", ".join(o.name for o in all_variants(v.pass_) if o.deterministic)
        raise ValueError(f"{arg} {v.name!r} is not deterministic (its sums are reduce-adds in the "
                         f"hardware's order); with deterministic=True use 'auto' or one of: {able}")


def get(name: str, pass_: str = "fwd") -> Variant:
    """The record of variant `name` of pass `pass_`; ValueError naming the known ones if none."""
    v = _REGISTRY.get((pass_, name))
    if v is None:
        _check_pass(pass_)
        where = "" if pass_ == "fwd" else f" of pass {pass_!r}"
        known = ", ".join(o.name for o in all_variants(pass_)) or "none"
        raise ValueError(f"unknown variant {name!r}{where}; known: {known} (or 'auto')")
    return v


def all_variants(pass_: str | None = "fwd") -> list[Variant]:
    """The records of pass `pass_` (None: every pass), in registration order."""
    if pass_ is not None:
        _check_pass(pass_)
    return [v for v in _REGISTRY.values() if pass_ is None or v.pass_ == pass_]


def variants(pass_: str = "fwd") -> dict[str, str]:
    """Registered variant names of a pass, each with the shapes it supports."""
    return {v.name: v.supports for v in all_variants(pass_)}


def compile_configs(pass_: str | None = "fwd") -> list[tuple[Variant, CompileConfig]]:
    """(variant, config) for every default config of pass `pass_` (None: every pass)."""
    return [(v, c) for v in all_variants(pass_) for c in v.compile_configs()]


@dataclass(frozen=True)
class CompileConfig:
    """One default config of a variant, compilable for sm_90a without a GPU
    (profiling.resources)."""

    name: str
    fn: object            # the @triton.jit kernel
    signature: dict       # argument name -> Triton type ("*bf16", "i32", "fp32", "constexpr")
    constexprs: dict      # argument name -> value
    num_warps: int
    num_stages: int

    def key(self) -> tuple:
        """Everything that decides the compiled kernel (a config compiles once per process)."""
        return (self.fn, tuple(self.signature.items()), tuple(self.constexprs.items()),
                self.num_warps, self.num_stages)

    def source(self):
        """The kernel as Triton compiles it at launch: every pointer argument 16-byte aligned (the
        launcher guarantees it, and Triton specializes on it), so vector widths and registers match
        the running kernel."""
        import triton

        names = list(self.fn.arg_names)
        attrs = {(names.index(n),): [["tt.divisibility", 16]]
                 for n, t in self.signature.items() if t.startswith("*")}
        return triton.compiler.ASTSource(fn=self.fn, signature=self.signature,
                                         constexprs=self.constexprs, attrs=attrs)

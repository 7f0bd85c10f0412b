"""The variant registry: one line per forward kernel. Modules are imported only when used.

A variant module (e.g. `kernels_triton/fwd.py`) defines:
    supports(spec: ProblemSpec) -> str | None   # None when it can run the shape, else the reason
    launch(spec, q, k1, k2, v1, v2, out, lse, profile=False)
                                                # fills out [B,N,Hq,D] bf16 and lse [B,Hq,N] fp32;
                                                # profile=True: the Proton-scoped copy
    compile_configs() -> list[CompileConfig]    # default configs, compiled by profiling.resources
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from .spec import ProblemSpec


@dataclass(frozen=True)
class Variant:
    name: str
    module: str          # import path of the kernel module
    needs_hopper: bool   # uses TMA descriptors / wgmma / setmaxnreg: sm_90 only
    # "auto" tries variants from the highest rank down (measured speed order); a function of the
    # shape where that order changes with it
    rank: int | Callable[[ProblemSpec], int]
    supports: str        # one line: which shapes it takes

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def rank_for(self, spec: ProblemSpec) -> int:
        return self.rank(spec) if callable(self.rank) else self.rank


_REGISTRY: dict[str, Variant] = {}


def register(v: Variant) -> None:
    if v.name in _REGISTRY:
        raise ValueError(f"variant {v.name!r} registered twice")
    _REGISTRY[v.name] = v


# Ranks: the speed order at S* (G = 128, D = 128) and Hq = 64 on the lent H100 and H200
# (docs/perf-notes.md, session 11). tlx_ws is ahead of triton at 7 of 8 shapes timed with G from
# 16 to 128 and D = 64 or 128; at D = 64 it is also ahead of tlx_pipelined_kv (450 vs 417 at
# G = 128).
# tlx_pipelined_pingpong is on par with tlx_pipelined_kv: it stays below the rest, so "auto" never
# takes it.
register(Variant("tlx_pipelined_kv", "kernels_tlx.pipelined_kv", needs_hopper=True,
                 rank=lambda spec: 8 if spec.D == 128 else 6,
                 supports="G = Hq/Hk = 128; any B, N, Hk, w1, w2; D in {64, 128}"))
register(Variant("tlx_ws", "kernels_tlx.ws", needs_hopper=True, rank=7,
                 supports="any B, N, Hk, w1, w2; G = Hq/Hk in {16, 32, 64, 128}; D in {64, 128}"))
register(Variant("tlx_ws_kv", "kernels_tlx.ws_kv", needs_hopper=True, rank=5,
                 supports="G = Hq/Hk = 128; any B, N, Hk, w1, w2; D in {64, 128}"))
register(Variant("tlx_ws_keys", "kernels_tlx.ws_keys", needs_hopper=True, rank=4,
                 supports="G = Hq/Hk = 128; any B, N, Hk, w1, w2; D in {64, 128}"))
register(Variant("tlx_pingpong", "kernels_tlx.pingpong", needs_hopper=True, rank=3,
                 supports="any B, N, Hk, w1, w2; G = Hq/Hk in {16, 32, 64, 128}; D in {64, 128}"))
register(Variant("triton", "kernels_triton.fwd", needs_hopper=True, rank=2,
                 supports="any B, N, Hk, w1, w2; G = Hq/Hk a power of two <= 128; D in {64, 128}"))
register(Variant("tlx_pipelined_pingpong", "kernels_tlx.pipelined_pingpong", needs_hopper=True,
                 rank=-3, supports="G = Hq/Hk = 128; any B, N, Hk, w1, w2; D in {64, 128}"))


def get(name: str) -> Variant:
    if name not in _REGISTRY:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(_REGISTRY)} (or 'auto')")
    return _REGISTRY[name]


def all_variants() -> list[Variant]:
    return list(_REGISTRY.values())


def variants() -> dict[str, str]:
    """Registered variant names, each with the shapes it supports."""
    return {v.name: v.supports for v in _REGISTRY.values()}


@dataclass(frozen=True)
class CompileConfig:
    """One default config of a variant, compilable for sm_90a without a GPU (profiling.resources)."""

    name: str
    fn: object            # the @triton.jit kernel
    signature: dict       # argument name -> Triton type string ("*bf16", "i32", "fp32", "constexpr")
    constexprs: dict      # argument name -> value
    num_warps: int
    num_stages: int

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

"""What every family's kernels share to be traced: Proton scopes behind a constexpr flag
(profiling/trace.py compiles the PROFILE=True copy; timed kernels carry no instrumentation) and the
byte size TMA transaction counts use."""
from collections.abc import Sequence

import triton
import triton.language as tl

from triton.profiler import language as pl

pl.enable_semantic("triton")  # Proton scopes in Triton-DSL kernels (off unless PROFILE is set)

BF16_BYTES = tl.constexpr(2)  # bytes of one bf16 element (TMA transaction counts)


def profiled(profile: bool | str, kernel: str, kernels: Sequence[str]) -> bool:
    """Whether `kernel` runs its Proton-scoped copy under a pass's `profile`: True (every scoped
    kernel of the pass), False, or one name of `kernels` (the pass's profiled_kernels: a trace
    samples one kernel's warps at a time); ValueError naming them for another name."""
    if isinstance(profile, str):
        if profile not in kernels:
            raise ValueError(f"profile={profile!r}: the scoped kernels are "
                             f"{', '.join(map(repr, kernels))}")
        return profile == kernel
    return bool(profile)


@triton.jit
def enter(NAME: tl.constexpr, PROFILE: tl.constexpr):
    """Open Proton scope NAME when the kernel is compiled with PROFILE (profiling/trace.py);
    timed kernels are compiled without it and carry no instrumentation."""
    if PROFILE:
        pl.enter_scope(NAME)


@triton.jit
def leave(NAME: tl.constexpr, PROFILE: tl.constexpr):
    if PROFILE:
        pl.exit_scope(NAME)

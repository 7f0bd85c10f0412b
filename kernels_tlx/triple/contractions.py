"""The two contractions (kernels_triton/triple/core.py) as the TLX variants run them: the TLX
kernel where it takes the shape, the plain-Triton one elsewhere. The Triton passes
(kernels_triton/triple/fwd.py, bwd.py, causal.py) take this module as their `impl`, as they take
kernels_triton/triple/host.py: `n_splits`, and `prepare_partials` / `prepare_apply`, each a launch
made once per shape that returns its `run`. The `tlx` variants of both passes are those passes
with this `impl` (`variant`, altattn/registry.py: Variant.switches): the state, dS and the causal
chunk states from the warp-specialized `partials`; the output and the five input gradients from
the resident-state `apply` at Dq = Dv = 32 and from the Triton `apply` elsewhere.

    partials   partials.py (Y 64 or 128 wide), partials_pairs.py (32); Triton otherwise
    apply      apply.py at Dx = Dy = Do = 32, non-causal; Triton otherwise
"""
from __future__ import annotations

from kernels_triton.triple import host
from kernels_tlx.consumers import NUM_CONSUMERS
from kernels_tlx.triple import apply as resident
from kernels_tlx.triple.partials import (n_splits, padded_varlen,  # noqa: F401
                                         prepare_partials, prepare_partials_varlen,
                                         split_blocks, takes)

# packed sequences (kernels_triton/triple/varlen.py): the Triton `apply` (the resident one walks
# a head's tiles of one batch element)
prepare_apply_varlen = host.prepare_apply_varlen


def prepare_apply(B: int, N: int, H: int, dx: int, dy: int, do: int, c: float, chunk: int = 0,
                  profile: bool = False):
    """kernels_triton.triple.host.prepare_apply's contract (`profile`: the Proton-scoped
    copy)."""
    if resident.takes(dx, dy, do, chunk):
        return resident.prepare_apply(B, N, H, c, profile)
    return host.prepare_apply(B, N, H, dx, dy, do, c, chunk, profile)


def partials_warps(d1: int, dy: int, d2: int) -> int:
    """Warps per CTA of the `partials` kernel: a producer and the consumer warp groups (and
    partials_pairs.py's copier), or the Triton kernel's."""
    if not takes(dy):
        return host.partials_warps(d1, dy, d2)
    return 4 * (1 + int(NUM_CONSUMERS) + (dy == 32))


def apply_warps(dx: int, dy: int, do: int, chunk: int) -> int:
    if resident.takes(dx, dy, do, chunk):
        return 4 * (1 + int(NUM_CONSUMERS))
    return host.apply_warps(dx, dy, do, chunk)


def compile_configs():
    import sys

    from kernels_tlx.triple import partials as ws
    from kernels_triton.triple import varlen
    return (ws.compile_configs() + resident.compile_configs()
            + [c for c in varlen.compile_configs(sys.modules[__name__])
               if "partials" in c.name or "permute" in c.name])


def variant(pass_: str) -> dict:
    """The `tlx` variant of pass `pass_` ("fwd" or "bwd"): kernels_triton/triple/fwd.py's or
    bwd.py's `prepare` with this module as its `impl`."""
    import importlib
    import sys
    passes = importlib.import_module(f"kernels_triton.triple.{pass_}")
    impl = sys.modules[__name__]

    def prepare(spec, profile: bool | str = False):
        return passes.prepare(spec, profile, impl=impl)

    def launch(spec, *kernel_args, profile: bool | str = False) -> None:
        prepare(spec, profile)(*kernel_args)

    def profiled_kernels(spec) -> dict[str, int]:
        return host.profiled_kernels(spec, pass_, impl)

    return dict(supports=host.supports, prepare=prepare, launch=launch,
                compile_configs=compile_configs, profiled_kernels=profiled_kernels)

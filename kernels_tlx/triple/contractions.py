"""The two contractions (kernels_triton/triple/core.py) as the TLX variants run them: the TLX
kernel where it takes the shape, the plain-Triton one elsewhere. The Triton passes
(kernels_triton/triple/fwd.py, bwd.py, causal.py) take this module as their `impl`.

    partials   partials.py (Y 64 or 128 wide), partials_pairs.py (32); Triton otherwise
    apply      apply.py at Dx = Dy = Do = 32, non-causal; Triton otherwise
"""
from __future__ import annotations

from kernels_triton.triple import host
from kernels_tlx.triple import apply as resident
from kernels_tlx.triple.partials import n_splits, partials  # noqa: F401


def apply(x, y, w, out, c: float, chunk: int = 0, profile: bool = False) -> None:
    """kernels_triton.triple.host.apply's contract (`profile`: the Triton kernel's only)."""
    if resident.takes(x.shape[-1], y.shape[-1], out.shape[-1], chunk, out.dtype):
        resident.apply(x, y, w, out, c)
    else:
        host.apply(x, y, w, out, c, chunk=chunk, profile=profile)


def compile_configs():
    from kernels_tlx.triple import partials as ws
    return ws.compile_configs() + resident.compile_configs()


def profiled_kernels(spec) -> dict[bool, int]:
    """Proton scopes live in the Triton kernels a `tlx` pass runs (its TLX kernels have none): the
    `triton` variant's width, not the pass's widest kernel (`Variant.warps`, the Dv = 32
    partials' 16 warps)."""
    return {True: 8}

"""`tlx`: the triple-attention backward in kernels_triton/triple/bwd.py's order (causal: its
chunked form) with the TLX contractions (kernels_tlx/triple/contractions.py): dS (and the causal
chunk states) from the warp-specialized `partials`, the five input gradients from the
resident-state `apply` at Dq = Dv = 32 and from the Triton `apply` elsewhere."""
from __future__ import annotations

from kernels_triton.triple import bwd as triton_bwd
from kernels_triton.triple.host import supports  # noqa: F401  (this variant's `supports`)
from kernels_tlx.triple import contractions
from kernels_tlx.triple.contractions import profiled_kernels  # noqa: F401


def prepare(spec, profile: bool = False):
    """kernels_triton.triple.bwd.prepare with the TLX contractions: run(q1, q2, k1, k2, v, state,
    dout, dstate, dq1, dq2, dk1, dk2, dv)."""
    return triton_bwd.prepare(spec, profile, impl=contractions)


def launch(spec, q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv,
           profile: bool = False) -> None:
    prepare(spec, profile)(q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv)


def compile_configs():
    return contractions.compile_configs()

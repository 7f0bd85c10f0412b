"""`tlx`: the triple-attention forward in kernels_triton/triple/fwd.py's order (causal: its chunked
form) with the TLX contractions (kernels_tlx/triple/contractions.py): the state (and causal chunk
states) from the warp-specialized `partials`, the output from the resident-state `apply` at
Dq = Dv = 32 and from the Triton `apply` elsewhere."""
from __future__ import annotations

from kernels_triton.triple import fwd as triton_fwd
from kernels_triton.triple.host import supports  # noqa: F401  (this variant's `supports`)
from kernels_tlx.triple import contractions
from kernels_tlx.triple.contractions import profiled_kernels  # noqa: F401


def prepare(spec, profile: bool = False):
    """kernels_triton.triple.fwd.prepare with the TLX contractions: run(q1, q2, k1, k2, v, out,
    out_state)."""
    return triton_fwd.prepare(spec, profile, impl=contractions)


def launch(spec, q1, q2, k1, k2, v, out, out_state, profile: bool = False) -> None:
    prepare(spec, profile)(q1, q2, k1, k2, v, out, out_state)


def compile_configs():
    return contractions.compile_configs()

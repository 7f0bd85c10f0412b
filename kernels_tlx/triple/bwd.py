"""`tlx`: the triple-attention backward with dS (and, causal, the chunk states) from the
warp-specialized TLX `partials` (kernels_tlx/triple/partials.py) and the five input gradients
from the Triton `apply`, in kernels_triton/triple/bwd.py's order. Where Dv is 32 the TLX kernel
does not apply and dS is the Triton kernel's (partials.takes)."""
from __future__ import annotations

from kernels_triton.triple import bwd as triton_bwd
from kernels_triton.triple.host import supports  # noqa: F401  (this variant's `supports`)
from kernels_tlx.triple import partials


def launch(spec, q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv,
           profile: bool = False) -> None:
    triton_bwd.launch(spec, q1, q2, k1, k2, v, state, dout, dstate, dq1, dq2, dk1, dk2, dv,
                      profile, impl=partials)


def compile_configs():
    return partials.compile_configs()

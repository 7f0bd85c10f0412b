"""`tlx`: the triple-attention forward with the state from the warp-specialized TLX `partials`
(kernels_tlx/triple/partials.py) and the output from the Triton `apply` (kernels_triton/triple/
core.py), in kernels_triton/triple/fwd.py's order (causal: its chunked form, the chunk states
from the TLX kernel). Where Dv is 32 the TLX kernel does not apply and the state is the Triton
kernel's (partials.takes)."""
from __future__ import annotations

from kernels_triton.triple import fwd as triton_fwd
from kernels_triton.triple.host import supports  # noqa: F401  (this variant's `supports`)
from kernels_tlx.triple import partials


def launch(spec, q1, q2, k1, k2, v, out, out_state, profile: bool = False) -> None:
    triton_fwd.launch(spec, q1, q2, k1, k2, v, out, out_state, profile, impl=partials)


def compile_configs():
    return partials.compile_configs()

"""`tlx_pairs_ordered`: the `tlx_pairs` backward (kernels_tlx/simplicial/bwd_pairs.py) with
bitwise-repeatable sums. Its kernel with ORDERED: each tile's dQ share is reduce-added in fp32 in
a fixed order, the launch order (kernels_tlx/simplicial/pairs_order.py: per-box counters, the
programs visiting their tokens from the last down), and the end's dK1/dK2/dV1/dV2 sums are int64
atomics of llrint(s * value) (`end_scale`: s a power of two per call from bounds on the inputs;
integer adds commute). Same GEMMs, same bytes of dQ reduce-adds as `tlx_pairs`.
Supports `tlx_pairs`' shapes with G = Hq/Hk >= 64 (one 64-row dQ box a tile), Hk = 1 (at Hk > 1
the kernel spills 16 bytes: sm_90a, fbtriton 3.7.4), the trilinear form, one sequence a batch
row. Speed against `tlx_pairs`: docs/perf-bwd-ordered.md."""
from __future__ import annotations

from kernels_tlx.simplicial import bwd_pairs
from kernels_tlx.simplicial.bwd_pairs import profiled_kernels  # noqa: F401 - the variant's
from kernels_triton.simplicial.bwd_common import build_compile_configs, compile_specs
from kernels_triton.simplicial.det import det_of


def supports(spec) -> str | None:
    why = bwd_pairs.supports(spec)
    if why is None and spec.G < 64:
        why = f"G = Hq/Hk = {spec.G}: G >= 64 only (one 64-row dQ box a tile, its counter)"
    if why is None and spec.Hk != 1:
        why = (f"Hk = {spec.Hk}: Hk = 1 only (at Hk > 1 its kernel spills 16 bytes of registers; "
               "deterministic=True takes `tlx_ws` there)")
    if why is None and det_of(spec):
        why = "form 'trilinear' only"
    return why


def prepare(spec, profile: bool | str = False):
    """`bwd_pairs.prepare` with ordered sums: run(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1,
    dk2, dv1, dv2)."""
    return bwd_pairs.prepare(spec, profile, ordered=True)


def launch(spec, q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2,
           profile: bool | str = False) -> None:
    """One backward."""
    prepare(spec, profile)(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2)


def compile_configs():
    """The kernel (and its remainder programs) at every compile shape it supports."""
    kernels = {bwd_pairs._pairs_kernel: lambda launch: (
        "pairs_ordered_remainder" if launch.constexprs.get("PACK") else "pairs_ordered")}
    return build_compile_configs(prepare, kernels,
                                 [s for s in compile_specs() if supports(s) is None])

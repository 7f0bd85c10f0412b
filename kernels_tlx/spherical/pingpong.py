"""`tlx_pingpong`: `tlx_pipelined` with the two consumer warp groups taking turns on the tensor
cores (FlashAttention-3's inter-warp-group pingpong).

Consumer c waits on named barrier 11 + c before issuing its step's wgmma pair (QK(j) and PV(j-1);
the prologue's QK(0) and the last PV alone) and arrives on the other's barrier once they are
issued, so the pairs strictly alternate: c0, c1, c0, ... Consumer 1 arrives once at the start so
consumer 0 goes first. Both consumers of a tile issue the same number of pairs (they share its key
blocks), across persistent tiles too. With no exp the consumers' CUDA-core work per step is short
(one FMA and a convert per score), so the turns mainly order the GEMMs; measure against
`tlx_pipelined`.
Roles, shapes, persistent grid, producer, epilogue: as `tlx_ws` (kernels_tlx/spherical/fwd_common.py,
PIPELINE=True, PINGPONG=True).
"""
from __future__ import annotations

from kernels_tlx.spherical.fwd_common import entry_points, supports  # noqa: F401

config, prepare, launch, compile_configs = entry_points(pipeline=True, pingpong=True)

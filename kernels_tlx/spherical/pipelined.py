"""`tlx_pipelined`: `tlx_ws` with each consumer's two GEMMs pipelined (FlashAttention-3's
intra-warp-group overlap).

Step j of a consumer issues QK(j), then PV(j-1) (with P(j-1) held in registers), waits for QK(j)
only (`async_dot_wait(1)`), frees the K slot, squares and sums S(j) while PV(j-1) still runs, then
waits for PV(j-1), frees its V slot and only then converts P(j) = bf16(S(j)) (so ptxas cannot
write P(j) into the registers PV(j-1) is reading). Prologue: QK(0); epilogue: PV(last).
Each consumer keeps two wgmma in flight, so the tensor cores have work queued even while both
consumers are between steps. Registers: acc (64) + S (64) + P (32) per thread at D 128.
Roles, shapes, persistent grid, producer, epilogue: as `tlx_ws` (kernels_tlx/spherical/fwd_common.py,
PIPELINE=True, PINGPONG=False).
"""
from __future__ import annotations

from kernels_tlx.spherical.fwd_common import entry_points, supports  # noqa: F401

config, prepare, launch, compile_configs = entry_points(pipeline=True, pingpong=False)

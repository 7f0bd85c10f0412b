"""`tlx_ws`: warp-specialized TLX spherical-attention forward, plain.

Technique: FlashAttention-3's forward shape with softmax replaced by the square-accumulate. A
producer warp group TMA-loads the tile's Q once and K, V into rings of shared-memory slots
(mbarriers full / empty); two consumer warp groups of 64 rows each run, per key block,
    S = Q K^T (SS-wgmma, waited), z += rowsum(S*S), P = bf16(S), acc += P V (RS-wgmma, waited)
and at the end r = c sqrt(z), out = acc c / (r + eps) through a TMA store. Each consumer waits for
each of its GEMMs; the two consumers overlap each other on the tensor cores on their own.
Persistent grid (min(#SMs, tiles) programs); `config(spec, persistent=False)` gives one program
per tile, for comparison.
Roles: producer ("default", 4 warps, 32 registers), consumers 2 x 4 warps at 240 registers.
Supports any B, N, Nk, Hq, Hk (Hq a multiple of Hk), D 64 and 128, causal, seqlens.
The kernel body and host side are kernels_tlx/spherical/fwd_common.py; this file sets
PIPELINE=False, PINGPONG=False. Siblings: pipelined.py (QK(j) under PV(j-1)), pingpong.py (turns).
"""
from __future__ import annotations

from kernels_tlx.spherical.fwd_common import entry_points, supports  # noqa: F401

config, prepare, launch, compile_configs = entry_points(pipeline=False, pingpong=False)

"""`tlx_pipelined_kv`: `tlx_ws_kv` with the softmax overlapping the tensor cores inside each
consumer warp group (FlashAttention-3 style).

Step c issues the QK wgmma of step c and the PV wgmma of step c - 1 back to back, waits for QK(c)
only, and runs the softmax of step c while PV(c - 1) is still on the tensor cores; P of the
previous step is carried in registers (kernels_tlx/ws_kv.py: consume_pipelined). This fits where
`tlx_pipelined` (on `tlx_ws`) could not: with the V1 multiply moved to the producers, a consumer
holds only acc, S, P and its Q rows (zero spills at 224 registers).

Everything else (the two producers of B_j = K1[j] * K2 and C_j = V1[j] * V2, tile, rings) is
`tlx_ws_kv`'s kernel, run with PIPELINE=True. Supports the same shapes: G = Hq/Hk = 128.
"""
from __future__ import annotations

from kernels_tlx import ws_kv
from kernels_tlx.common import tlx_entry_points
from kernels_tlx.ws_kv import (ABSENT_SCOPES, EXTRA_SCOPES,  # noqa: F401  (read by tests, trace)
                               ROUNDS_KEYS_SIDE, ROUNDS_VALUES_SIDE, supports)
from simplicial_attn.spec import ProblemSpec


def config(spec: ProblemSpec) -> dict:
    return ws_kv.config(spec, pipelined=True)


launch, compile_configs = tlx_entry_points(ws_kv.simplicial_fwd_ws_kv_kernel, config, supports)

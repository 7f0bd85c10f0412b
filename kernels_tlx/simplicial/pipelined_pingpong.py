"""`tlx_pipelined_pingpong`: `tlx_pipelined_kv` with the two consumer warp groups taking turns.

Each consumer step issues QK(c) and PV(c - 1) as one pair (as `tlx_pipelined_kv` does; in the
compiled code each consumer still waits for its PV before its softmax, see pipelined_kv.py).
Here consumer c waits on named barrier TURN_BARRIER + c before issuing its pair and arrives on the
other consumer's barrier after (kernels_tlx/simplicial/common.py: take_turn / pass_turn). So the pairs
alternate between the consumers: one consumer's softmax runs while the other's pair owns the
tensor cores. Consumer 1 arrives once at the start so consumer 0 goes first. Both consumers run
the same steps (same j, two 64-row halves of the tile), so the turns always match.

Everything else (the two producers of B_j = K1[j] * K2 and C_j = V1[j] * V2, tile, rings) is
`tlx_ws_kv`'s kernel, run with PIPELINE=True and PINGPONG=True. Supports the same shapes:
G = Hq/Hk = 128. Also computes form "det" (the keys-side det build, kernels_tlx/simplicial/ws_kv.py), where
it is the fastest forward at D = 128 (docs/perf.md).
"""
from __future__ import annotations

from kernels_tlx.simplicial import ws_kv
from kernels_tlx.simplicial.ws_kv import supports
from altattn.simplicial.spec import ProblemSpec


def config(spec: ProblemSpec) -> dict:
    return ws_kv.config(spec, pipelined=True, pingpong=True)


prepare, launch, compile_configs = ws_kv.pipelined_entry_points(config)

"""`tlx_pingpong`: `tlx_ws` with the two consumer warp groups taking turns on the tensor cores.

The seeds' Kernel-3. Every wgmma issue (QK and PV) of consumer c waits on named barrier
TURN_BARRIER + c and, once issued, arrives on the other consumer's barrier (kernels_tlx/simplicial/common.py:
take_turn / pass_turn). So the issues strictly alternate — c0 QK, c1 QK, c0 PV, c1 PV, ... — and
one consumer's softmax runs while the other's GEMM owns the tensor cores, instead of both
consumers' GEMMs queueing at once. Consumer 1 arrives once at the start so consumer 0 goes first.
Strict alternation needs both consumers to issue the same number of wgmma: with an odd w1 window,
consumer 1 runs one extra, fully masked step per block.

Everything else (producer, tile geometry, split-j window, Q and A in registers, merge) is
`tlx_ws`'s kernel, run with PINGPONG=True. Supports the same shapes as `tlx_ws`.
"""
from __future__ import annotations

from kernels_tlx.simplicial import ws
from kernels_tlx.simplicial.ws import supports
from kernels_triton.simplicial.host import entry_points
from altattn.simplicial.spec import ProblemSpec


def config(spec: ProblemSpec) -> dict:
    return ws.config(spec, pingpong=True)


prepare, launch, compile_configs = entry_points(ws.simplicial_fwd_ws_kernel, config, supports,
                                               q_tma=True)

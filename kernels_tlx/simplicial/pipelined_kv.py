"""`tlx_pipelined_kv`: `tlx_ws_kv` with each consumer's two GEMMs issued as one pair
(FlashAttention-3's intra-warp-group pipelining, as written).

Step c issues the QK wgmma of step c and the PV wgmma of step c - 1 back to back and waits for
QK(c) first, so that the softmax of step c could run while PV(c - 1) is still on the tensor cores;
P of the previous step is carried in registers (kernels_tlx/simplicial/ws_kv.py: consume_pipelined). A
consumer holds only acc, S, P and its Q rows (zero spills at 224 registers).

What the compiled code does: ptxas writes the new P into the registers that PV(c - 1) is still
reading (the loop-carried P), so it waits for PV(c - 1) before the softmax begins ("ex2 under
wgmma" = 0 in `python -m profiling.resources`). The step is then QK(c) + PV(c - 1) back to back,
one wait, softmax: the gain over `tlx_ws_kv` (+4-5% at S*) is the pair issue, not a softmax under
PV. A version whose softmax does run under PV was slower (docs/history/perf-notes.md, session 12).

Everything else (the two producers of B_j = K1[j] * K2 and C_j = V1[j] * V2, tile, rings) is
`tlx_ws_kv`'s kernel, run with PIPELINE=True. Supports the same shapes: G = Hq/Hk = 128.
Also computes form "det" (the keys-side det build, kernels_tlx/simplicial/ws_kv.py).
"""
from __future__ import annotations

from kernels_tlx.simplicial import ws_kv
from kernels_tlx.simplicial.ws_kv import supports
from altattn.simplicial.spec import ProblemSpec


def config(spec: ProblemSpec) -> dict:
    return ws_kv.config(spec, pipelined=True)


prepare, launch, compile_configs = ws_kv.pipelined_entry_points(config)

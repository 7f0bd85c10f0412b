"""`tlx_pairs_pp` backward (UNMEASURED prototype, issue 51): `tlx_pairs` (bwd_pairs.py, whose
docstring states the algorithm) with its two consumers taking turns on the tensor cores.

docs/perf-bwd.md, "Where the tensor cores idle": `tlx_pairs`' consumers wait for every wgmma
group in turn ({S^T, dP^T} -> softmax -> {dC, dB} -> dQ of the tile before -> staging), and
the two drift into the same phases, so the tensor cores are busy ~51% of a step. Here each step
holds two turns per consumer (`take_turn` / `pass_turn`, named barriers 11 and 12):
    turn A: issue S^T and dP^T
    turn B: issue dC and dB, store dS^T, wait for them, then (tile u - 1) issue dQ
so the issues alternate c0 A, c1 A, c0 B, c1 B, ... and each consumer's softmax runs under the
other's turn A, its staging and TMA issue under the other's turn B. The dQ of u - 1 needs both
consumers' dS^T of u - 1, which both stored before the other's turn A of u: no new wait.
Every consumer takes and passes both turns on every tile (the skipped branch too), and
consumer 1 passes once before its loop (consumer 0 issues first). Everything else (producer,
rings, the end's sums, the host side) is `tlx_pairs`'. Not bitwise repeatable, as `tlx_pairs`.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
import triton.language.extra.tlx as tlx

from altattn.registry import CompileConfig
from altattn.simplicial.spec import ProblemSpec
from kernels_tlx.consumers import pass_turn, take_turn
from kernels_tlx.ring import empty_phase, full_phase
from kernels_tlx.simplicial.bwd_pairs import (
    FINISH_BLOCK,
    _finish_kernel,
    config,
    key_blocks,
    supports,
)
from kernels_tlx.simplicial.common import NUM_CONSUMERS, opaque
from kernels_tlx.simplicial.hadamard import build, row_tile
from kernels_tlx.simplicial.pairs_parts import (
    KEYS,
    ROWS,
    active_tiles,
    add_dq,
    box_rows,
    epilogue_rows,
    first_token,
    load_rows,
    pair_program,
    probabilities,
    row_values,
    row_width,
    scale_add_rows,
    tile_tokens,
)
from kernels_triton.launch import Desc, Kernel, meta
from kernels_triton.proton import profiled
from kernels_triton.simplicial.bwd_common import (
    build_compile_configs,
    compile_specs,
    prepare_delta,
    prepare_sum_parts,
)
from kernels_triton.simplicial.host import kv_layout, q_layout
from kernels_triton.simplicial.tiling import BF16_BYTES, LOG2E, enter, leave

__all__ = ["supports", "prepare", "launch", "compile_configs", "profiled_kernels"]


@triton.jit
def _dq_columns_pass(ds_tiles, b_tiles, d, cid, COL: tl.constexpr, DH: tl.constexpr,
                     PASS: tl.constexpr):
    """pairs_parts.dq_columns with the turn passed (PASS) between the issue and the wait."""
    dq = tl.zeros([ROWS, DH], tl.float32)
    for c in tl.static_range(NUM_CONSUMERS):
        dq = tlx.async_dot(tlx.local_trans(tlx.local_view(ds_tiles, d * NUM_CONSUMERS + c)),
                           tlx.local_slice(tlx.local_view(b_tiles, c), [0, COL], [64, DH]), dq)
    if PASS:
        pass_turn(cid, True)
    return tlx.async_dot_wait(0, dq)


@triton.jit
def _dq_share_pass(ds_tiles, b_tiles, ds_fulls, u, cid, DH: tl.constexpr, PASS: tl.constexpr):
    """pairs_parts.dq_share, passing the turn (PASS) once its wgmma are issued; each branch
    waits for its own (an accumulator in flight across the merge serialises every wgmma)."""
    d = u % 2
    tlx.barrier_wait(tlx.local_view(ds_fulls, d), full_phase(u, 2))
    if cid == 0:
        dq = _dq_columns_pass(ds_tiles, b_tiles, d, cid, 0, DH, PASS)
    else:
        dq = _dq_columns_pass(ds_tiles, b_tiles, d, cid, DH, DH, PASS)
    return dq


@triton.jit
def _pairs_pp_kernel(Q, K1, K2, V1, V2, DO, Lse2, Delta, K2rows, V2rows, DQacc, DK1acc, DK2acc,
                     DV1acc, DV2acc, N, w1, w2, n_kb, qk_scale, HQ: tl.constexpr,
                     HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NUM_Q: tl.constexpr,
                     CH: tl.constexpr, CONSUMER_REGS: tl.constexpr, PROFILE: tl.constexpr = False,
                     Seq=None, VARLEN: tl.constexpr = False):
    R: tl.constexpr = box_rows(G)
    tl.static_assert(NUM_Q == NUM_CONSUMERS, "the row ring holds the raw K2/V2 halves first")
    DH: tl.constexpr = D // NUM_CONSUMERS
    b_tiles = tlx.local_alloc((64, D), tl.bfloat16, NUM_CONSUMERS)
    c_tiles = tlx.local_alloc((64, D), tl.bfloat16, NUM_CONSUMERS)
    rows_q = tlx.storage_alias_spec()
    rows_do = tlx.storage_alias_spec()
    q_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, NUM_Q, reuse=rows_q)
    do_tiles = tlx.local_alloc((ROWS, D), tl.bfloat16, NUM_Q, reuse=rows_do)
    stage_q = tlx.local_alloc((64, D), tl.float32, 1, reuse=rows_q)
    stage_do = tlx.local_alloc((64, D), tl.float32, 1, reuse=rows_do)
    ds_tiles = tlx.local_alloc((64, ROWS), tl.bfloat16, 2 * NUM_CONSUMERS)
    dq_stage = tlx.local_alloc((ROWS, DH), tl.float32, NUM_CONSUMERS)
    lse_tiles = tlx.local_alloc((tile_tokens(G), row_width(G)), tl.float32, NUM_Q)
    delta_tiles = tlx.local_alloc((tile_tokens(G), row_width(G)), tl.float32, NUM_Q)
    kv_full = tlx.local_view(tlx.alloc_barriers(num_barriers=1, arrive_count=1), 0)
    bc_full = tlx.local_view(tlx.alloc_warp_barrier(num_barriers=1, num_warps=4), 0)
    q_fulls = tlx.alloc_barriers(num_barriers=NUM_Q, arrive_count=1)
    q_empties = tlx.alloc_warp_barrier(num_barriers=NUM_Q, num_warps=4 * NUM_CONSUMERS)
    ds_fulls = tlx.alloc_warp_barrier(num_barriers=2, num_warps=4 * NUM_CONSUMERS)
    ds_empties = tlx.alloc_warp_barrier(num_barriers=2, num_warps=4 * NUM_CONSUMERS)

    with tlx.async_tasks():
        with tlx.async_task("default"):  # producer: bwd_pairs.py's, unchanged
            b, g, j, kb, kv_base, n_tiles, live, t_end = pair_program(
                tl.program_id(0), N, w1, w2, n_kb, HK, D, G, Seq, VARLEN)
            if live:
                enter("load_kv", PROFILE)
                tlx.barrier_expect_bytes(kv_full, 2 * NUM_CONSUMERS * 64 * D * BF16_BYTES)
                for c in tl.static_range(NUM_CONSUMERS):
                    tlx.async_descriptor_load(K2, tlx.local_view(q_tiles, c),
                                              [b, kb + c * 64, g * D], kv_full)
                    tlx.async_descriptor_load(V2, tlx.local_view(do_tiles, c),
                                              [b, kb + c * 64, g * D], kv_full)
                tlx.barrier_wait(kv_full, 0)
                leave("load_kv", PROFILE)
                enter("build_a", PROFILE)
                kv_row = kv_base + j.to(tl.int64) * (HK * D)
                k1 = row_tile(K1, kv_row, D, CH)
                v1 = row_tile(V1, kv_row, D, CH)
                for c in tl.static_range(NUM_CONSUMERS):
                    n_rows = tl.minimum(j + w1, t_end) - (kb + c * 64)
                    build(k1, tlx.local_view(q_tiles, c), tlx.local_view(b_tiles, c), D, 64, CH,
                          MASK_ROWS=VARLEN, n_rows=n_rows)
                    build(v1, tlx.local_view(do_tiles, c), tlx.local_view(c_tiles, c), D, 64, CH,
                          MASK_ROWS=VARLEN, n_rows=n_rows)
                tlx.barrier_arrive(bc_full, 1)
                tlx.barrier_wait(bc_full, 0)
                leave("build_a", PROFILE)
                for u in range(0, n_tiles):
                    s = u % NUM_Q
                    enter("load_kv", PROFILE)
                    tlx.barrier_wait(tlx.local_view(q_empties, s), empty_phase(u, NUM_Q))
                    i0, h0 = first_token(j, u, G)
                    qf = tlx.local_view(q_fulls, s)
                    tlx.barrier_expect_bytes(qf, 2 * ROWS * D * BF16_BYTES + 2 * ROWS * 4)
                    for t in tl.static_range(tile_tokens(G)):
                        row0 = (b * N + tl.minimum(i0 + t, t_end - 1)) * HQ + g * G + h0
                        load_rows(Q, DO, Lse2, Delta, q_tiles, do_tiles, lse_tiles, delta_tiles, s,
                                  qf, row0, t, R, D)
                    leave("load_kv", PROFILE)

        with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
            cid = tlx.async_task_replica_id()
            b, g, j, kb, kv_base, n_tiles, live, t_end = pair_program(
                tl.program_id(0), N, w1, w2, n_kb, HK, D, G, Seq, VARLEN)
            if live:  # (the same for both consumers: both take every turn or neither)
                k0 = kb + cid * 64
                u_lo, u_hi = active_tiles(j, k0, n_tiles, w2, G)
                i_end = tl.minimum(j + w1, t_end)
                b_tile = tlx.local_view(b_tiles, cid)
                c_tile = tlx.local_view(c_tiles, cid)
                kpos = k0 + tl.arange(0, 64)
                dk = tl.zeros([64, D], tl.float32)
                dv = tl.zeros([64, D], tl.float32)
                tlx.barrier_wait(bc_full, 0)
                if cid == 1:
                    pass_turn(cid, True)  # consumer 0 issues first
                for u in range(0, n_tiles):
                    s = u % NUM_Q
                    d = u % 2
                    i0, _ = first_token(j, u, G)
                    tlx.barrier_wait(tlx.local_view(q_fulls, s), full_phase(u, NUM_Q))
                    q_tile = tlx.local_view(q_tiles, s)
                    do_tile = tlx.local_view(do_tiles, s)
                    ds_tile = tlx.local_view(ds_tiles, d * NUM_CONSUMERS + cid)
                    tlx.barrier_wait(tlx.local_view(ds_empties, d), empty_phase(u, 2))
                    take_turn(cid, True)  # turn A
                    if (u >= u_lo) & (u < u_hi):
                        enter("qk_gemm", PROFILE)
                        st = tlx.async_dot(b_tile, tlx.local_trans(q_tile))
                        dpt = tlx.async_dot(c_tile, tlx.local_trans(do_tile))
                        pass_turn(cid, True)
                        lse2 = row_values(lse_tiles, s, G)
                        st = tlx.async_dot_wait(1, st)
                        leave("qk_gemm", PROFILE)
                        enter("softmax", PROFILE)
                        pt = probabilities(st, lse2, qk_scale, kpos, i0, i_end, w2, G)
                        delta = row_values(delta_tiles, s, G)
                        dpt = tlx.async_dot_wait(0, dpt)
                        dst = (pt * (dpt - delta)).to(tl.bfloat16)
                        leave("softmax", PROFILE)
                        take_turn(cid, True)  # turn B
                        enter("pv_gemm", PROFILE)
                        dv = tlx.async_dot(pt.to(tl.bfloat16), do_tile, dv)
                        dk = tlx.async_dot(dst, q_tile, dk)
                        tlx.local_store(ds_tile, dst)
                        dv = tlx.async_dot_wait(0, dv)
                        dk = tlx.async_dot_wait(0, dk)
                        leave("pv_gemm", PROFILE)
                    else:
                        pass_turn(cid, True)
                        tlx.local_store(ds_tile, tl.zeros([64, ROWS], tl.bfloat16))
                        take_turn(cid, True)  # turn B
                    tlx.fence_async_shared()
                    tlx.barrier_arrive(tlx.local_view(ds_fulls, d), 1)
                    tlx.barrier_arrive(tlx.local_view(q_empties, s), 1)
                    if u > 0:
                        enter("epilogue", PROFILE)
                        dq = _dq_share_pass(ds_tiles, b_tiles, ds_fulls, u - 1, cid, DH, True)
                        tlx.barrier_arrive(tlx.local_view(ds_empties, 1 - d), 1)
                        add_dq(dq, dq_stage, DQacc, b, g, j, u - 1, N, i_end, cid, HQ, G, DH)
                        leave("epilogue", PROFILE)
                    else:
                        pass_turn(cid, True)
                # the coordinates again, from an opaque program id (held over the loop they spill)
                b, g, j, kb, kv_base, n_tiles, _, t_end = pair_program(
                    opaque(tl.program_id(0)), N, w1, w2, n_kb, HK, D, G, Seq, VARLEN)
                k0 = kb + cid * 64
                u_lo, u_hi = active_tiles(j, k0, n_tiles, w2, G)
                enter("epilogue", PROFILE)
                dq = _dq_share_pass(ds_tiles, b_tiles, ds_fulls, n_tiles - 1, cid, DH, False)
                add_dq(dq, dq_stage, DQacc, b, g, j, n_tiles - 1, N, tl.minimum(j + w1, t_end),
                       cid, HQ, G, DH)
                tlx.async_descriptor_store_wait(0)
                if u_lo < u_hi:
                    if cid == 0:
                        stage = tlx.local_view(stage_q, 0)
                    else:
                        stage = tlx.local_view(stage_do, 0)
                    kv_row = kv_base + j.to(tl.int64) * (HK * D)
                    offs_d = tl.arange(0, D)
                    k1 = tl.load(K1 + kv_row + offs_d).to(tl.float32)
                    scale_add_rows(dk, stage, k1, K2rows, kv_base, k0, t_end, DK2acc, DK1acc,
                                   kv_row, cid, HK, D, epilogue_rows(G))
                    v1 = tl.load(V1 + kv_row + offs_d).to(tl.float32)
                    scale_add_rows(dv, stage, v1, V2rows, kv_base, k0, t_end, DV2acc, DV1acc,
                                   kv_row, cid, HK, D, epilogue_rows(G))
                leave("epilogue", PROFILE)


def prepare(spec: ProblemSpec, profile: bool | str = False, packed: bool = False):
    """bwd_pairs.prepare with `_pairs_pp_kernel`: Delta, the kernel into zeroed fp32
    accumulators, then the bf16 gradients (its docstring has the scratch and `packed`)."""
    profile = profiled(profile, "pairs", ("pairs",))
    delta_of = prepare_delta(spec)
    r = min(spec.G, ROWS.value)
    rows = spec.B * spec.N * spec.Hq
    row_values = Desc([rows // r, r], [r, 1], [1, r])
    heads = q_layout(spec, ROWS.value)
    keys = kv_layout(spec, KEYS)
    dq_halves = Desc([rows, spec.D], [spec.D, 1], [r, spec.D // 2])
    grid = (spec.B * spec.Hk * spec.N * key_blocks(spec),)
    options = dict(HQ=spec.Hq, HK=spec.Hk, G=spec.G, D=spec.D, PROFILE=bool(profile),
                   **config(spec))
    pairs = Kernel(_pairs_pp_kernel, grid, **options, **({"VARLEN": True} if packed else {}))
    n_dq = rows * spec.D
    finish = Kernel(_finish_kernel, (triton.cdiv(n_dq, FINISH_BLOCK),), BLOCK=FINISH_BLOCK,
                    num_warps=4)
    sum_parts = prepare_sum_parts(spec.B * spec.N * spec.Hk * spec.D, spec.sm_scale, 1)
    args = (spec.N, spec.w1, spec.w2, key_blocks(spec), spec.sm_scale * LOG2E)
    sm_scale = spec.sm_scale

    def run(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2, bounds=None
            ) -> None:
        delta = delta_of(out, dout, dlse)
        lse2, delta = (t.transpose(1, 2).contiguous() for t in (lse * LOG2E, delta))
        dq_acc = torch.zeros(dq.shape, dtype=torch.float32, device=q.device)
        dk1_acc, dk2_acc, dv1_acc, dv2_acc = torch.zeros((4, *dk1.shape), dtype=torch.float32,
                                                         device=q.device)
        pairs(heads(q), k1, keys(k2), v1, keys(v2), heads(dout), row_values(lse2),
              row_values(delta), k2, v2, dq_halves(dq_acc), dk1_acc, dk2_acc, dv1_acc, dv2_acc,
              *args, **({"Seq": bounds} if packed else {}))
        finish(dq_acc, dq, n_dq, sm_scale)
        sum_parts(dk1_acc, dv1_acc, dk1, dv1)
        sum_parts(dk2_acc, dv2_acc, dk2, dv2)

    return run


@functools.lru_cache(maxsize=64)
def _prepared_packed(spec: ProblemSpec, profile: bool | str):
    return prepare(spec, profile, packed=True)


def launch(spec: ProblemSpec, q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2,
           profile: bool | str = False, packed=None) -> None:
    """One backward (bwd_pairs.launch's arguments)."""
    run = prepare(spec, profile) if packed is None else _prepared_packed(spec, profile)
    run(q, k1, k2, v1, v2, out, lse, dout, dlse, dq, dk1, dk2, dv1, dv2,
        bounds=None if packed is None else packed.bounds)


def profiled_kernels(spec: ProblemSpec) -> dict[str, int]:
    """The one Proton-scoped kernel, "pairs": a producer and NUM_CONSUMERS consumer warp groups."""
    return {"pairs": config(spec)["num_warps"] * (1 + NUM_CONSUMERS.value)}


def compile_configs() -> list[CompileConfig]:
    """The kernel at every compile shape it supports, and packed (VARLEN) at the first."""
    kernels = {_pairs_pp_kernel: lambda launch: "pairs_packed" if launch.constexprs.get("VARLEN")
               else "pairs"}
    out = build_compile_configs(prepare, kernels, [s for s in compile_specs()
                                                   if supports(s) is None])
    spec = compile_specs()[0]
    if supports(spec) is None:
        bounds = meta(spec.B * spec.N, 2, dtype=torch.int32)
        out += build_compile_configs(
            lambda s: functools.partial(prepare(s, packed=True), bounds=bounds), kernels, [spec])
    return out

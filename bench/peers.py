"""The kernels bench times beside a family's variants: each peer of the family record
(registry.Peer): cuDNN SDPA on the softmax attention its rule gives (`peer.dense(shape)`), or a
peer that runs its own kernel (`peer.runs`, "module:function"), forward, backward or forward +
backward; the bf16 matmul (the measured tensor-core ceiling); and bench/fwd.py --frontier's dense
FlashAttention tutorials that ship inside fbtriton.

The rule that gives the dense shape (2-simplicial attention: Lkv = w1*w2 keys per query;
spherical attention: the same B, H, N, D, causal when the shape is) is the family record's alone;
here a dense shape is {"B", "H", "Nq", "Nk", "D"} and optionally "causal" (default False), q
[B, H, Nq, D] and k/v [B, H, Nk, D], bf16.
"""
from __future__ import annotations

import argparse
import importlib
import warnings
from collections.abc import Callable

import torch

from altattn import registry
from bench.common import MATMUL_SIZE, timed_row
from profiling.timing import median_ms, tflops

# useful FLOPs of a pass over the dense forward's 4*B*H*Nq*Nk*D (FlashAttention's convention)
DENSE_FLOPS_PER_F = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}

# --frontier: TLX's dense FlashAttention tutorials (fbtriton), technique added at each step
FRONTIER_TUTORIALS = ("hopper_fa_ws", "hopper_fa_ws_pipelined", "hopper_fa_ws_pipelined_pingpong",
                      "hopper_fa_ws_pipelined_pingpong_persistent")
FRONTIER_PACKAGE = "triton.language.extra.tlx.tutorials"
FRONTIER_BLOCK = 128                 # their tiles: L must be a multiple of it (no masking)


def peer(fam: registry.Family, name: str | None = None) -> registry.Peer:
    """The family's peer `name` (None: its first dense one, cuDNN SDPA's); ValueError naming
    its peers."""
    for p in fam.peers:
        if p.name == name or (name is None and p.dense is not None):
            return p
    raise ValueError(f"family {fam.name} has no peer {name or 'with a dense shape'!r}; peers: "
                     f"{', '.join(p.name for p in fam.peers) or 'none'}")


def dense_peer(fam: registry.Family) -> registry.Peer | None:
    """The family's first peer with a dense shape (cuDNN SDPA's, --frontier's length), or None
    (a family whose peers all run their own kernels)."""
    return next((p for p in fam.peers if p.dense is not None), None)


def visible_pairs(nq: int, nk: int, causal: bool = False) -> int:
    """(query, key) pairs of dense attention: query i sees keys j <= i when causal (top-left
    aligned, as SDPA's is_causal)."""
    if not causal:
        return nq * nk
    m = min(nq, nk)
    return m * (m + 1) // 2 + (nq - m) * nk


def dense_flops(d: dict) -> float:
    """The dense forward's FLOPs: QK^T and PV, 2 each per visible (query, key, dim)."""
    return 4 * d["B"] * d["H"] * d["D"] * visible_pairs(d["Nq"], d["Nk"], d.get("causal", False))


def _oom(e: BaseException) -> str:
    return f"out of memory: {str(e).splitlines()[0]}"


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)


def peer_rows(base: dict, passes: tuple[str, ...], flops: dict[str, float]) -> list[dict]:
    """A peer's rows before timing, one per pass: a forward row carries nothing more, a backward
    one its pass (as each benchmark writes them); `flops`: pass -> useful FLOPs."""
    return [{**base, **({} if p == "fwd" else {"pass": p}), "flops": flops[p]} for p in passes]


def time_rows(rows: list[dict], passes: tuple[str, ...], calls: dict[str, Callable],
              args: argparse.Namespace) -> list[dict]:
    """Each row timed with its pass's call (an out-of-memory error becomes its note); a forward
    row with % of peak (timed_row), the others ms and TFLOPS."""
    out = []
    for p, r in zip(passes, rows):
        try:
            ms = median_ms(calls[p], args.warmup_ms, args.rep_ms)
        except torch.cuda.OutOfMemoryError as e:
            out.append({**r, "note": _oom(e)})
            continue
        out.append(timed_row(r, ms) if p == "fwd"
                   else {**r, "ms": ms, "tflops": tflops(r["flops"], ms)})
    return out


def bench_peers(fam: registry.Family, s, args: argparse.Namespace,
                passes: tuple[str, ...] = ("fwd",)) -> list[dict]:
    """Every peer of the family record on `s`, one row per pass of `passes` each (or rows with a
    note saying why it did not run)."""
    rows = []
    for p in fam.peers:
        rows += bench_sdpa(fam, s, args, passes, p) if p.runs is None else \
            bench_own(fam, p, s, args, passes)
        torch.cuda.empty_cache()
    return rows


def bench_own(fam: registry.Family, p: registry.Peer, s, args: argparse.Namespace,
              passes: tuple[str, ...]) -> list[dict]:
    """A peer that runs its own kernel on the family's shape: `p.runs` ("module:function", in
    the family's package) is function(shape, passes, seed) -> {pass: setup() -> the timed call,
    or a note saying why the pass is not timed; "note": a remark for the timed rows}. Rows carry
    the family's useful FLOPs; an out-of-memory error is its rows' note."""
    flops = {"fwd": fam.flops(s, "fwd"), "bwd": fam.flops(s, "bwd")}
    flops["fwd+bwd"] = flops["fwd"] + flops["bwd"]
    rows = peer_rows({"kind": "peer", "variant": p.name, "shape": s.short(), **s.fields()},
                     passes, flops)
    module, _, function = p.runs.partition(":")
    try:
        plan = getattr(importlib.import_module(module), function)(s, passes, args.seed)
    except (ImportError, AttributeError) as e:
        return [{**r, "note": f"not run: {p.runs}: {e}"} for r in rows]
    except torch.cuda.OutOfMemoryError as e:
        return [{**r, "note": _oom(e)} for r in rows]
    out = []
    for q, r in zip(passes, rows):
        setup = plan.get(q, "not run")
        if isinstance(setup, str):
            out.append({**r, "note": setup})
            continue
        r = {**r, "note": plan["note"]} if plan.get("note") else r
        try:
            out += time_rows([r], (q,), {q: setup()}, args)
        except torch.cuda.OutOfMemoryError as e:
            out.append({**r, "note": _oom(e)})
        torch.cuda.empty_cache()  # a backward's graph goes with its call
    return out


def bench_sdpa(fam: registry.Family, s, args: argparse.Namespace,
               passes: tuple[str, ...] = ("fwd",), dense_peer: registry.Peer | None = None
               ) -> list[dict]:
    """cuDNN SDPA on the dense shape of the peer's rule for `s` (default: the family's first
    dense peer), causal when the rule says so, one row per pass of `passes` ("fwd", "bwd",
    "fwd+bwd"), or rows with a note saying why it did not run. A forward row carries Lkv and %
    of peak, a backward one its pass (as each benchmark wrote them)."""
    p = dense_peer or peer(fam)
    d = p.dense(s)
    causal = bool(d.get("causal", False))
    f = dense_flops(d)
    base = {"kind": "peer", "variant": p.name,
            "shape": f"B{d['B']} H{d['H']} N{d['Nq']} Lkv{d['Nk']} D{d['D']}"
                     + (" causal" if causal else ""), **s.fields()}
    rows = [{**r, **({"Lkv": d["Nk"]} if q == "fwd" else {})} for q, r in
            zip(passes, peer_rows(base, passes, {q: DENSE_FLOPS_PER_F[q] * f for q in passes}))]
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        return [{**r, "note": f"cuDNN SDPA unavailable: {e}"} for r in rows]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    grad = passes != ("fwd",)
    try:
        q = _randn(gen, d["B"], d["H"], d["Nq"], d["D"]).requires_grad_(grad)
        k, v = (_randn(gen, d["B"], d["H"], d["Nk"], d["D"]).requires_grad_(grad)
                for _ in range(2))
    except torch.cuda.OutOfMemoryError as e:
        return [{**r, "note": f"cuDNN SDPA inputs: {_oom(e)}"} for r in rows]

    def fwd() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                o = fwd()
                torch.cuda.synchronize()
            except RuntimeError as e:
                why = "; ".join([str(e).splitlines()[0]] + [str(w.message).splitlines()[0]
                                                           for w in caught])
                return [{**r, "note": f"cuDNN SDPA unavailable: {why}"} for r in rows]
        do = torch.randn_like(o) if grad else None
        calls = {"fwd": fwd,
                 "bwd": lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                 "fwd+bwd": lambda: torch.autograd.grad(fwd(), (q, k, v), do)}
        return time_rows(rows, passes, calls, args)


def bench_matmul(args: argparse.Namespace, pass_: str = "fwd") -> dict:
    """bf16 MATMUL_SIZE^3 matmul (torch / cuBLAS): the measured tensor-core ceiling. Its row as
    each benchmark wrote it: bench/fwd.py's kind "matmul" (the % of matmul column divides by
    it), bench/bwd.py's a peer of pass "-"."""
    n = MATMUL_SIZE
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    a, b = (_randn(gen, n, n) for _ in range(2))
    ms = median_ms(lambda: a @ b, args.warmup_ms, args.rep_ms)
    if pass_ == "fwd":
        return timed_row({"kind": "matmul", "variant": "matmul_bf16", "shape": f"{n}x{n}x{n}",
                          "flops": 2 * n ** 3}, ms)
    return {"kind": "peer", "variant": "matmul", "pass": "-", "shape": f"{n}^3", "ms": ms,
            "tflops": tflops(2 * n ** 3, ms)}


def frontier_key(fam: registry.Family, s) -> tuple[int, ...]:
    """What --frontier's rows of `s` depend on: its dense (B, H, Nk, D); a sweep repeats them."""
    d = peer(fam).dense(s)
    return d["B"], d["H"], d["Nk"], d["D"]


def bench_frontier(s, args: argparse.Namespace, log: Callable[[str], None]) -> list[dict]:
    """One row per FRONTIER_TUTORIALS kernel: dense non-causal self-attention of length L = the
    keys per query of the family's dense peer (2-simplicial attention: w1*w2; spherical
    attention: N), q/k/v [B, H, L, D], timed as the tutorial ships it (its own autotuning; the
    tutorials have no causal mask, so a causal shape's row says so and is timed non-causal). Its
    output is first compared with torch SDPA's on the same inputs; above the family's "out_rel"
    tolerance it is not timed."""
    fam = registry.get_family(args.family)
    tol = fam.tolerances["out_rel"]
    dense = peer(fam).dense(s)
    L = dense["Nk"]
    d = {"B": dense["B"], "H": dense["H"], "D": dense["D"], "Nq": L, "Nk": L}
    base = {"kind": "frontier", "shape": f"B{d['B']} H{d['H']} L{L} D{d['D']} dense",
            "B": d["B"], "Hq": d["H"], "D": d["D"], "Lkv": L, "flops": dense_flops(d)}
    if dense.get("causal"):
        base["note"] = "non-causal (the tutorials have no causal mask)"
    rows = [{**base, "variant": f"tutorial:{name.removeprefix('hopper_')}"}
            for name in FRONTIER_TUTORIALS]
    if L % FRONTIER_BLOCK:
        return [{**r, "note": f"not run: L = {L} (keys per query of the dense peer's rule) is not "
                              f"a multiple of {FRONTIER_BLOCK}"} for r in rows]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    try:
        q, k, v = (_randn(gen, d["B"], d["H"], L, d["D"]) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).float()
    except torch.cuda.OutOfMemoryError as e:
        return [{**r, "note": f"inputs: {_oom(e)}"} for r in rows]
    scale = d["D"] ** -0.5
    out_rows = []
    for name, row in zip(FRONTIER_TUTORIALS, rows):
        try:
            attention = importlib.import_module(f"{FRONTIER_PACKAGE}.{name}").attention
        except Exception as e:  # noqa: BLE001  (upstream Triton has no tutorials; any import error)
            out_rows.append({**row, "note": f"not run: cannot import {name}: {e}"})
            continue

        def fn(attention: Callable = attention) -> torch.Tensor:
            return attention(q, k, v, scale)

        try:
            err = float(torch.linalg.norm(fn().float() - ref) / torch.linalg.norm(ref))
            if not err <= tol:
                out_rows.append({**row, "note": f"not timed: out rel err {err:.3g} vs SDPA "
                                                f"(out_rel tolerance {tol})"})
                continue
            log(f"check {row['variant']} {row['shape']}: out rel err vs SDPA {err:.2e} (ok)")
            ms = median_ms(fn, args.warmup_ms, args.rep_ms)
        except torch.cuda.OutOfMemoryError as e:
            out_rows.append({**row, "note": _oom(e)})
            continue
        out_rows.append({**timed_row(row, ms), "check_out_rel": err})
    return out_rows

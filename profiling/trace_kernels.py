"""The kernel-level (CUPTI) table of profiling/trace.py --kernels, on the CPU: time per call and
TFLOPS per variant, and time per kernel of a call, from the .hatchet JSON that trace_capture's
kernel_level writes (one proton scope per call, its useful FLOPs as the scope's metric)."""
from __future__ import annotations

import statistics
from collections.abc import Iterable

from profiling.timing import pct_of_peak

def _frames(node: dict) -> Iterable[dict]:
    yield node
    for c in node.get("children", []) or []:
        yield from _frames(c)


def _kernel_times(node: dict) -> dict[str, tuple[float, int]]:
    """{kernel name: (sum of "time (ns)", sum of "count")} of the kernel frames under node."""
    out: dict[str, tuple[float, int]] = {}
    for f in _frames(node):
        m = f.get("metrics", {}) or {}
        if "time (ns)" in m:
            t, n = out.get(f["frame"]["name"], (0.0, 0))
            out[f["frame"]["name"]] = (t + float(m["time (ns)"]), n + int(m.get("count", 1)))
    return out


def measured_scopes(hatchet: list | dict) -> list[dict]:
    """The measured scopes of a proton CUPTI .hatchet JSON (a list: the tree root, then device
    info), in order: every frame whose metrics hold "flops", with the kernel frames below it.
    {"variant": the scope name up to "#", "flops", "calls", "kernels": {name: (ns, count)}}. A
    scope "<variant>#<i>" is one call (profiling/trace_capture.kernel_level enters each once; a
    backward call runs several kernels); a scope "<variant>" counts one call per launch of its
    most launched kernel."""
    roots = hatchet if isinstance(hatchet, list) else [hatchet]
    out: list[dict] = []

    def visit(node: dict) -> None:
        metrics = node.get("metrics", {}) or {}
        name = str(node.get("frame", {}).get("name", ""))
        if "flops" in metrics and name != "ROOT":
            kernels = _kernel_times(node)
            if kernels and sum(t for t, _ in kernels.values()) > 0:
                calls = 1 if "#" in name else max(n for _, n in kernels.values())
                out.append({"variant": name.split("#")[0], "flops": float(metrics["flops"]),
                            "calls": calls, "kernels": kernels})
            return
        for child in node.get("children", []) or []:
            visit(child)

    for r in roots:
        if isinstance(r, dict) and "frame" in r:
            visit(r)
    return out


def _by_variant(scopes: list[dict]) -> dict[str, list[dict]]:
    per: dict[str, list[dict]] = {}
    for sc in scopes:
        per.setdefault(sc["variant"], []).append(sc)
    return per


def kernel_table(hatchet: list | dict) -> list[dict]:
    """One row per variant of a .hatchet (measured_scopes): variant, reps (scopes), launches
    (kernel launches), kernels (distinct kernels per call: 1 forward, 4 and more backward), flops
    (per call), ms (median time per call: a scope's kernel time / its calls), tflops (median over
    scopes of flops / time), pct_peak (of the GPU's peak, timing.peak_tflops)."""
    rows = []
    for variant, scopes in _by_variant(measured_scopes(hatchet)).items():
        times = [sum(t for t, _ in sc["kernels"].values()) for sc in scopes]
        tf = statistics.median(sc["flops"] / t / 1e3 for sc, t in zip(scopes, times))  # TFLOP/s
        ns = statistics.median(t / sc["calls"] for sc, t in zip(scopes, times))
        rows.append({"variant": variant, "reps": len(scopes),
                     "launches": sum(n for sc in scopes for _, n in sc["kernels"].values()),
                     "kernels": max(len(sc["kernels"]) for sc in scopes),
                     "flops": sum(sc["flops"] for sc in scopes) / sum(sc["calls"] for sc in scopes),
                     "ms": ns * 1e-6, "tflops": tf, "pct_peak": pct_of_peak(tf)})
    return rows


def kernel_breakdown(hatchet: list | dict) -> list[dict]:
    """One row per (variant, kernel) of a .hatchet: ms (median over the variant's scopes of the
    kernel's time per call) and pct (of the sum of these medians over the variant's kernels), in
    launch order. Where a backward call spends its time."""
    rows = []
    for variant, scopes in _by_variant(measured_scopes(hatchet)).items():
        names = list(dict.fromkeys(k for sc in scopes for k in sc["kernels"]))
        ms = {k: statistics.median(sc["kernels"].get(k, (0.0, 0))[0] / sc["calls"]
                                   for sc in scopes) * 1e-6 for k in names}
        total = sum(ms.values())
        rows.extend({"variant": variant, "kernel": k, "ms": ms[k],
                     "pct": 100.0 * ms[k] / total if total > 0 else None} for k in names)
    return rows


KERNEL_COLUMNS = [("variant", "variant"), ("pass", "pass"), ("shape", "shape"),
                  ("launches", "launches"), ("kernels", "kernels/call"),
                  ("ms", "ms per call (median)"), ("tflops", "TFLOPS"),
                  ("pct_peak", "% of peak")]
BREAKDOWN_COLUMNS = [("variant", "variant"), ("kernel", "kernel"), ("ms", "ms per call (median)"),
                     ("pct", "% of the call")]

"""Proton traces on the CPU: read, normalize, trim, summarize (cycles per scope, tensor-core busy,
bubble), compare, and the kernel-level (CUPTI) table. The capture (GPU) is in trace_capture.py,
the timeline picture in trace_plot.py, the command line in trace.py (its docstring says what the
numbers mean).

Trace format (what proton writes): {"displayTimeUnit": "ns", "traceEvents": [{"name": scope,
"ph": "X", "cat": "<kernel>", "pid": "<kernel> Core<sm> CTA<id>", "tid": "warp <w> (line 0)",
"ts": .., "dur": .., "args": {"Frequency (MHz)": f, ...}}]}; ts and dur are microseconds of an
f MHz clock, so cycles = value * f. A backward trace holds several kernels (one capture session
each, trace_capture.py): trimming keeps CTAs of each, and a summary is per kernel.
"""
from __future__ import annotations

import itertools
import json
import re
import statistics
from collections.abc import Iterable, Sequence

from profiling.common import format_table
from profiling.timing import H100_SXM_BF16_DENSE_TFLOPS, pct_of_peak
from altattn.simplicial.family import SCOPES

# GEMM_SCOPES are the scopes that hold a wgmma (issue + wait); every scope name, in kernel order,
# is registry.SCOPES.
GEMM_SCOPES = ("qk_gemm", "pv_gemm")
STEP_SCOPES = ("qk_gemm", "softmax", "pv_gemm", "v1_mul")  # the work of one (K2/V2 block, j)
# One of each per step in every kernel design: unequal counts in a warp mean dropped events.
PAIRED_SCOPES = ("qk_gemm", "softmax", "pv_gemm")
PRODUCER_SCOPES = ("load_kv",)
OUTSIDE = "(outside scopes)"
WARPS_PER_GROUP = 4

MAX_TRACE_BYTES = 20_000_000
DEFAULT_FREQUENCY_MHZ = 1000.0

CAVEATS = (
    ("gemm scopes (qk_gemm, pv_gemm) include the wait for the wgmma result: they measure issue to "
     "completion as seen by the warp, an upper bound of tensor-core busy time (qk_gemm also holds "
     "the K1/V1 row loads and Q*K1[j], or in tlx_ws_keys the wait for the producer's B_j)"),
    "instrumentation (a clock read + store per scope boundary) perturbs timing and scheduling",
    ("cycles are the SM clock of the sampled warps; spans run from a group's first scope entry to "
     "its last scope exit in each CTA"),
)


# ---------------------------------------------------------------------------------------------
# Reading, normalizing and trimming traces

_WARP = re.compile(r"warp\s+(\d+)")
_CTA = re.compile(r"CTA\s*(\d+)")


def read_trace_file(path: str) -> dict:
    """The trace file as written (a dict with "traceEvents"; a bare list is wrapped)."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return data


def kernel_of(raw_event: dict) -> str:
    """The kernel of a raw event: its "cat" (proton writes the kernel name there), else the start
    of its pid ("<kernel> Core<sm> CTA<id>")."""
    return str(raw_event.get("cat") or str(raw_event.get("pid", "")).split(" Core")[0])


def events_from_trace(trace: dict | list) -> list[dict]:
    """Proton's complete ("ph": "X") events -> normalized events, sorted by (cta, warp, start):
    {"kernel", "cta" (the pid string), "warp" (int), "name", "start", "end", "dur"} with times in
    cycles (ts/dur in us of the trace's clock x its "Frequency (MHz)"). Other events are ignored."""
    raw = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = []
    for e in raw:
        if e.get("ph") != "X" or "ts" not in e or "dur" not in e:
            continue
        m = _WARP.search(str(e.get("tid", "")))
        if m is None:
            continue
        freq = float((e.get("args") or {}).get("Frequency (MHz)", DEFAULT_FREQUENCY_MHZ))
        start = float(e["ts"]) * freq
        dur = float(e["dur"]) * freq
        out.append({"kernel": kernel_of(e), "cta": str(e.get("pid", "")),
                    "warp": int(m.group(1)), "name": str(e["name"]),
                    "start": start, "end": start + dur, "dur": dur, "freq": freq})
    out.sort(key=lambda e: (e["cta"], e["warp"], e["start"]))
    return out


def load_trace(path: str) -> list[dict]:
    """Normalized events (see events_from_trace) of a .chrome_trace file."""
    return events_from_trace(read_trace_file(path))


def cta_order(raw_events: Iterable[dict]) -> list[str]:
    """CTA ids (pids) ordered by their first event's start, then by CTA number."""
    first: dict[str, float] = {}
    for e in raw_events:
        if "pid" not in e or "ts" not in e:
            continue
        pid = str(e["pid"])
        first[pid] = min(first.get(pid, float("inf")), float(e["ts"]))

    def key(pid: str) -> tuple:
        m = _CTA.search(pid)
        return first[pid], int(m.group(1)) if m else -1, pid

    return sorted(first, key=key)


def middle(items: Sequence, k: int) -> list:
    """k consecutive items from the middle of `items` (all of them when k >= len)."""
    if k >= len(items):
        return list(items)
    lo = (len(items) - k) // 2
    return list(items[lo:lo + k])


def ctas_per_kernel(raw_events: Iterable[dict]) -> dict[str, list[str]]:
    """CTA ids (pids) of each kernel (kernel_of), each list in cta_order."""
    raw_events = list(raw_events)
    kernel = {str(e["pid"]): kernel_of(e) for e in raw_events if "pid" in e}
    out: dict[str, list[str]] = {}
    for pid in cta_order(raw_events):
        out.setdefault(kernel[pid], []).append(pid)
    return out


def trim(trace: dict, ctas: int) -> dict:
    """A copy of `trace` that keeps the events of `ctas` CTAs from the middle of each kernel's
    launch (CTAs ordered by start time: the steady state, away from the first and last waves).
    Events without a pid (metadata) are kept; other top-level keys are kept as they are."""
    if ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")
    raw = trace["traceEvents"]
    keep = {pid for pids in ctas_per_kernel(raw).values() for pid in middle(pids, ctas)}
    out = {k: v for k, v in trace.items() if k != "traceEvents"}
    out["traceEvents"] = [e for e in raw if "pid" not in e or str(e["pid"]) in keep]
    return out


def dumps_trace(trace: dict) -> str:
    return json.dumps(trace, separators=(",", ":"))


def write_trimmed(trace: dict, ctas: int, path: str, max_bytes: int = MAX_TRACE_BYTES) -> int:
    """Trim to `ctas` CTAs per kernel and write `path`; when the text exceeds max_bytes, keep fewer
    CTAs (proportionally, at least 1). Returns the number of CTAs written per kernel (at most)."""
    n = max(1, min(ctas, max(map(len, ctas_per_kernel(trace["traceEvents"]).values()),
                             default=0)))
    while True:
        text = dumps_trace(trim(trace, n))
        if len(text) <= max_bytes or n == 1:
            break
        n = max(1, min(n - 1, int(n * max_bytes / len(text) * 0.95)))
    with open(path, "w") as f:
        f.write(text)
    return n


# ---------------------------------------------------------------------------------------------
# Summary

def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, cur_lo, cur_hi = 0.0, None, None
    for lo, hi in sorted(intervals):
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_hi is not None:
        total += cur_hi - cur_lo
    return total


def group_role(scope_names: Iterable[str]) -> str:
    """'consumer' for a warp group that runs a gemm scope, 'producer' for one that only loads,
    'other' otherwise."""
    names = set(scope_names)
    if names & set(GEMM_SCOPES):
        return "consumer"
    if names & set(PRODUCER_SCOPES):
        return "producer"
    return "other"


def group_labels(events: Iterable[dict]) -> tuple[dict[int, str], dict[int, str]]:
    """(role, label) per warp group of the events: 'wg1 consumer 0', 'wg0 producer', ...
    Consumers are numbered only when there are several."""
    names: dict[int, set[str]] = {}
    for e in events:
        names.setdefault(e["warp"] // WARPS_PER_GROUP, set()).add(e["name"])
    roles = {g: group_role(names[g]) for g in sorted(names)}
    consumers = [g for g in roles if roles[g] == "consumer"]
    labels = {}
    for g, role in roles.items():
        labels[g] = f"wg{g} {role}" + (f" {consumers.index(g)}" if role == "consumer"
                                         and len(consumers) > 1 else "")
    return roles, labels


def split_kernels(events: list[dict], name: str) -> list[tuple[str, list[dict]]]:
    """(label, events) per kernel of a trace's events, in kernel-name order; the label is `name`
    for a one-kernel trace, else "<name> <kernel>". Summaries and pictures are per kernel: the
    kernels of a backward differ in warps, roles and scopes."""
    by_kernel: dict[str, list[dict]] = {}
    for e in events:
        by_kernel.setdefault(e["kernel"], []).append(e)
    if len(by_kernel) <= 1:
        return [(name, events)]
    return [(f"{name} {k}", by_kernel[k]) for k in sorted(by_kernel)]


def ordered_scopes(names: Iterable[str]) -> list[str]:
    names = set(names)
    return [s for s in SCOPES if s in names] + sorted(names - set(SCOPES))


def summarize(events: list[dict]) -> dict:
    """Per warp group and scope: count, mean and total cycles, share of the group's span;
    tensor-core busy per consumer group; bubble fraction per CTA and overall. `events` as from
    load_trace.

    Returns {"kernel", "frequency_mhz", "ctas", "cta_ids", "warps", "cta_span_cycles" (mean
    first-to-last event of a CTA), "groups": [{"group", "role", "label", "warps", "scopes":
    {name: {"count", "mean_cycles", "total_cycles", "share"}}, "outside_share", "span_cycles"
    (mean per CTA), "gemm_share" (qk_gemm + pv_gemm shares), "tc_busy" (consumers, else None),
    "steps" and "step_cycles" (consumers: qk_gemm count, and the cycles of all
    qk_gemm/softmax/pv_gemm/v1_mul scopes per qk_gemm)}], "bubble", "per_cta": [{"cta",
    "span_cycles", "bubble", "tc_busy": {label: fraction}}], "per_warp": {warp: {"group",
    "counts"}}, "warnings": [...], "caveats": [...]}. Fractions are in [0, 1].
    """
    if not events:
        raise ValueError("no scope events in the trace")
    by_cta_warp: dict[tuple[str, int], list[dict]] = {}
    for e in events:
        by_cta_warp.setdefault((e["cta"], e["warp"]), []).append(e)
    first: dict[str, float] = {}
    for e in events:
        first[e["cta"]] = min(first.get(e["cta"], e["start"]), e["start"])
    ctas = sorted(first, key=lambda c: (first[c], c))
    warps = sorted({e["warp"] for e in events})
    group_ids = sorted({w // WARPS_PER_GROUP for w in warps})
    roles, labels = group_labels(events)
    warnings: list[str] = []

    # per-warp counts and sanity checks
    per_warp: dict[int, dict] = {}
    for w in warps:
        counts: dict[str, int] = {}
        for e in events:
            if e["warp"] == w:
                counts[e["name"]] = counts.get(e["name"], 0) + 1
        per_warp[w] = {"group": w // WARPS_PER_GROUP, "counts": counts}
    for (cta, w), evs in sorted(by_cta_warp.items()):
        if roles[w // WARPS_PER_GROUP] == "consumer":
            c = {s: sum(1 for e in evs if e["name"] == s) for s in PAIRED_SCOPES}
            if len(set(c.values())) > 1:
                warnings.append(f"{cta} warp {w}: qk_gemm/softmax/pv_gemm counts differ {c} "
                                f"(events dropped? proton's buffer is circular)")
        ordered = sorted(evs, key=lambda e: e["start"])
        if any(b["start"] < a["end"] - 1e-6 for a, b in itertools.pairwise(ordered)):
            warnings.append(f"{cta} warp {w}: scopes overlap (nested scopes): shares can add up "
                            f"to more than 1")

    groups = []
    per_cta = [{"cta": c, "tc_busy": {}} for c in ctas]
    for g in group_ids:
        scope_tot: dict[str, float] = {}
        scope_cnt: dict[str, int] = {}
        denom = span_sum = busy_sum = 0.0
        n_spans = 0
        for i, cta in enumerate(ctas):
            evs = [e for w in warps if w // WARPS_PER_GROUP == g
                   for e in by_cta_warp.get((cta, w), [])]
            if not evs:
                continue
            nw = len({e["warp"] for e in evs})
            span = max(e["end"] for e in evs) - min(e["start"] for e in evs)
            denom += nw * span
            span_sum += span
            n_spans += 1
            for e in evs:
                scope_tot[e["name"]] = scope_tot.get(e["name"], 0.0) + e["dur"]
                scope_cnt[e["name"]] = scope_cnt.get(e["name"], 0) + 1
            if roles[g] == "consumer":
                covered = _union_length((e["start"], e["end"]) for e in evs
                                        if e["name"] in GEMM_SCOPES)
                busy_sum += covered
                per_cta[i]["tc_busy"][labels[g]] = covered / span if span > 0 else 0.0
        scopes = {}
        for s in ordered_scopes(scope_tot):
            scopes[s] = {"count": scope_cnt[s], "mean_cycles": scope_tot[s] / scope_cnt[s],
                         "total_cycles": scope_tot[s],
                         "share": scope_tot[s] / denom if denom > 0 else 0.0}
        in_scopes = sum(v["share"] for v in scopes.values())
        entry = {"group": g, "role": roles[g], "label": labels[g],
                 "warps": [w for w in warps if w // WARPS_PER_GROUP == g],
                 "scopes": scopes, "outside_share": 1.0 - in_scopes,
                 "span_cycles": span_sum / n_spans if n_spans else 0.0,
                 "gemm_share": sum(scopes[s]["share"] for s in GEMM_SCOPES if s in scopes),
                 "tc_busy": None, "steps": None, "step_cycles": None}
        if roles[g] == "consumer":
            entry["tc_busy"] = busy_sum / span_sum if span_sum > 0 else 0.0
            if "qk_gemm" in scopes:
                entry["steps"] = scopes["qk_gemm"]["count"]
                entry["step_cycles"] = sum(scopes[s]["total_cycles"] for s in STEP_SCOPES
                                           if s in scopes) / scopes["qk_gemm"]["count"]
        groups.append(entry)

    # bubble: per CTA, consumer span not covered by any consumer group's gemm scope
    cons_warps = [w for w in warps if roles[w // WARPS_PER_GROUP] == "consumer"]
    bubble_cycles = cons_span_total = 0.0
    for i, cta in enumerate(ctas):
        all_evs = [e for w in warps for e in by_cta_warp.get((cta, w), [])]
        per_cta[i]["span_cycles"] = (max(e["end"] for e in all_evs)
                                     - min(e["start"] for e in all_evs))
        evs = [e for w in cons_warps for e in by_cta_warp.get((cta, w), [])]
        if not evs:
            per_cta[i]["bubble"] = None
            continue
        span = max(e["end"] for e in evs) - min(e["start"] for e in evs)
        covered = _union_length((e["start"], e["end"]) for e in evs if e["name"] in GEMM_SCOPES)
        per_cta[i]["bubble"] = 1.0 - covered / span if span > 0 else 0.0
        bubble_cycles += span - covered
        cons_span_total += span
    freqs = sorted({e["freq"] for e in events})
    if len(freqs) > 1:
        warnings.append(f"several clock frequencies in one trace: {freqs}")
    return {
        "kernel": ", ".join(sorted({e["kernel"] for e in events})),
        "frequency_mhz": freqs[0],
        "ctas": len(ctas),
        "cta_ids": ctas,
        "warps": warps,
        "cta_span_cycles": statistics.fmean(c["span_cycles"] for c in per_cta),
        "groups": groups,
        "bubble": bubble_cycles / cons_span_total if cons_span_total > 0 else None,
        "per_cta": per_cta,
        "per_warp": per_warp,
        "warnings": warnings,
        "caveats": list(CAVEATS),
    }


def _pct(x: float | None) -> float | None:
    return None if x is None else 100.0 * x


def format_summary(s: dict, title: str = "") -> str:
    """The summary as text: a header, one row per (group, scope), busy/bubble lines, caveats."""
    lines = []
    if title:
        lines.append(title)
    lines.append(f"kernel {s['kernel']} | {s['ctas']} CTAs | sampled warps "
                 f"{', '.join(map(str, s['warps']))} | clock {s['frequency_mhz']:g} MHz | "
                 f"CTA span {s['cta_span_cycles']:,.0f} cycles (mean)")
    rows = []
    for g in s["groups"]:
        first = True
        for name, v in g["scopes"].items():
            rows.append({"group": g["label"] if first else "", "scope": name,
                         "count": v["count"], "mean": round(v["mean_cycles"]),
                         "total": round(v["total_cycles"]), "share": _pct(v["share"])})
            first = False
        rows.append({"group": "", "scope": OUTSIDE, "count": None, "mean": None, "total": None,
                     "share": _pct(g["outside_share"])})
    lines.append(format_table(rows, [("group", "warp group"), ("scope", "scope"),
                                     ("count", "count"), ("mean", "mean cycles"),
                                     ("total", "total cycles"), ("share", "% of span")]))
    for g in s["groups"]:
        if g["role"] == "consumer":
            step = (f"; {g['steps']} steps of {g['step_cycles']:,.0f} cycles (qk+softmax+pv+v1)"
                    if g["steps"] else "")
            lines.append(f"tensor-core busy {g['label']}: {100 * g['tc_busy']:.1f}% of its span "
                         f"(qk_gemm U pv_gemm; scope shares {100 * g['gemm_share']:.1f}%){step}")
    if s["bubble"] is not None:
        per_cta = [100 * c["bubble"] for c in s["per_cta"] if c["bubble"] is not None]
        per = (", ".join(f"{b:.1f}" for b in per_cta) if len(per_cta) <= 8 else
               f"min {min(per_cta):.1f}, median {statistics.median(per_cta):.1f}, "
               f"max {max(per_cta):.1f}")
        lines.append(f"bubble (no consumer group in a gemm scope): {100 * s['bubble']:.1f}% of the "
                     f"consumers' span (per CTA: {per})")
    for w in s["warnings"]:
        lines.append(f"warning: {w}")
    lines.extend(f"note: {c}" for c in s["caveats"])
    return "\n".join(lines)


def format_comparison(named: Sequence[tuple[str, dict]]) -> str:
    """Key numbers of several summaries side by side: one column per trace."""
    keys: list[tuple[str, object]] = [("CTAs", lambda s: s["ctas"]),
                                      ("CTA span (cycles)", lambda s: round(s["cta_span_cycles"])),
                                      ("bubble %", lambda s: _pct(s["bubble"]))]
    scope_names = ordered_scopes({n for _, s in named for g in s["groups"]
                                   if g["role"] == "consumer" for n in g["scopes"]})

    def consumers(s: dict) -> list[dict]:
        return [g for g in s["groups"] if g["role"] == "consumer"]

    def mean_over(s: dict, f) -> float | None:
        vals = [f(g) for g in consumers(s)]
        vals = [v for v in vals if v is not None]
        return statistics.fmean(vals) if vals else None

    keys.append(("consumer groups", lambda s: len(consumers(s))))
    keys.append(("tc busy % (mean of groups)",
                 lambda s: _pct(mean_over(s, lambda g: g["tc_busy"]))))
    keys.append(("step cycles (consumer)", lambda s: mean_over(s, lambda g: g["step_cycles"])))
    for n in scope_names:
        keys.append((f"{n} mean cycles", lambda s, n=n: mean_over(
            s, lambda g: g["scopes"][n]["mean_cycles"] if n in g["scopes"] else None)))
        keys.append((f"{n} % of span", lambda s, n=n: _pct(mean_over(
            s, lambda g: g["scopes"][n]["share"] if n in g["scopes"] else None))))
    rows = []
    for label, f in keys:
        row = {"metric": label}
        for name, s in named:
            v = f(s)
            row[name] = round(v) if isinstance(v, float) and "cycles" in label else v
        rows.append(row)
    return format_table(rows, [("metric", "metric (scope rows: mean over consumer groups)")]
                        + [(name, name) for name, _ in named])


# ---------------------------------------------------------------------------------------------
# Kernel-level (CUPTI) table

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
    scopes of flops / time), pct_peak (of H100_SXM_BF16_DENSE_TFLOPS)."""
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
                  ("pct_peak", f"% of {H100_SXM_BF16_DENSE_TFLOPS:.0f}")]
BREAKDOWN_COLUMNS = [("variant", "variant"), ("kernel", "kernel"), ("ms", "ms per call (median)"),
                     ("pct", "% of the call")]

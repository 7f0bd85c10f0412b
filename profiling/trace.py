"""Proton traces of the forward kernels: capture (GPU), trim, summarize, plot, compare (CPU).

    python profiling/trace.py --variant tlx_ws --out out/trace         # capture + summary + png
    python profiling/trace.py --compare triton tlx_ws --out out/trace  # both, side by side
    python profiling/trace.py --kernels                                # kernel-level TFLOPS
    python profiling/trace.py --summarize out/trace/tlx_ws.chrome_trace [--json]    # CPU only
    python profiling/trace.py --plot out/trace/tlx_ws.chrome_trace --png t.png      # CPU only

Capture: every variant's `launch(..., profile=True)` compiles a copy of the same kernel with Proton
scopes (load_kv, wait_kv, qk_gemm, softmax, pv_gemm, v1_mul, epilogue). Proton's instrumentation
backend records the cycle counter at every scope entry and exit for the sampled warps (default:
the first warp of every warp group) of every CTA. A whole grid is hundreds of MB, so the trace is
trimmed to --ctas CTAs from the middle of the launch (steady state, ordered by start time) and
written as OUT/<variant>.chrome_trace (Chrome trace JSON: open it in ui.perfetto.dev or
chrome://tracing).

Trace format (what proton writes): {"displayTimeUnit": "ns", "traceEvents": [{"name": scope,
"ph": "X", "pid": "<kernel> Core<sm> CTA<id>", "tid": "warp <w> (line 0)", "ts": .., "dur": ..,
"args": {"Frequency (MHz)": f, ...}}]}; ts and dur are microseconds of an f MHz clock, so
cycles = value * f.

Summary (`summarize`): warps are grouped into warp groups of 4 (warp w -> group w // 4). A group
that runs a gemm scope is a consumer; one that only loads is the producer (TLX). In each CTA a
group's span runs from its sampled warps' first scope entry to their last scope exit.
  share      scope cycles / (sampled warps x span), summed over CTAs; "(outside scopes)" is the rest
  tc busy    |union of qk_gemm and pv_gemm intervals of the group's warps| / span, summed over CTAs
  bubble     share of the consumers' span (first to last consumer event of the CTA) in which no
             consumer group is in a gemm scope; cycle-weighted average over CTAs
Caveats: a gemm scope ends after the warp has waited for the wgmma result, so it measures issue to
completion as seen by the warp (an upper bound of tensor-core busy time: a wgmma in flight while
another group's softmax runs is counted, and the wait is counted too); and the instrumentation
itself (a clock read and a store per scope boundary) perturbs the timing and the schedule.

Exit status: 0 done; 1 a capture produced an unusable trace; 2 bad arguments or no CUDA GPU.
"""
from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterable, Sequence  # noqa: E402

from bench.common import (H100_SXM_BF16_DENSE_TFLOPS, PRESETS, Shape,  # noqa: E402
                          add_shape_args, format_table, metadata_line, positive_int,
                          run_metadata, shape_from_args)

PROG = "profiling/trace.py"

# Scope names, in kernel order. GEMM_SCOPES are the ones that hold a wgmma (issue + wait).
SCOPES = ("load_kv", "wait_kv", "qk_gemm", "softmax", "pv_gemm", "v1_mul", "epilogue")
GEMM_SCOPES = ("qk_gemm", "pv_gemm")
STEP_SCOPES = ("qk_gemm", "softmax", "pv_gemm", "v1_mul")  # the work of one (K2/V2 block, j)
# One of each per step in every kernel design: unequal counts in a warp mean dropped events.
PAIRED_SCOPES = ("qk_gemm", "softmax", "pv_gemm")
PRODUCER_SCOPES = ("load_kv",)
OUTSIDE = "(outside scopes)"

WARPS_PER_GROUP = 4
DEFAULT_PRESET = "small"   # B=1 N=2048 Hq=64 Hk=1 D=128 w1=32 w2=256
DEFAULT_CTAS = 8
MAX_TRACE_BYTES = 20_000_000
DEFAULT_FREQUENCY_MHZ = 1000.0

# Total warps of a variant's kernel when it cannot be read from the compiled kernel
# (warp-specialized kernels launch more warps than their num_warps: tlx_ws = 4 producer + 2 x 4
# consumer warps).
# Variants not listed use their compile config's num_warps. The one place that names these numbers.
TOTAL_WARPS_FALLBACK = {"tlx_ws": 12, "tlx_pingpong": 12, "tlx_ws_keys": 12,
                        "tlx_ws_kv": 16, "tlx_pipelined_kv": 16, "tlx_pipelined_pingpong": 16}

# Fixed colours per scope (tab10), so every picture reads the same.
SCOPE_COLORS = {
    "load_kv": "#1f77b4", "wait_kv": "#7f7f7f", "qk_gemm": "#d62728", "softmax": "#2ca02c",
    "pv_gemm": "#ff7f0e", "v1_mul": "#9467bd", "epilogue": "#8c564b",
}
_EXTRA_COLORS = ("#e377c2", "#bcbd22", "#17becf", "#aec7e8", "#98df8a", "#ffbb78")

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
        out.append({"kernel": e.get("cat", ""), "cta": str(e.get("pid", "")),
                    "warp": int(m.group(1)), "name": str(e["name"]),
                    "start": start, "end": start + dur, "dur": dur, "freq": freq})
    out.sort(key=lambda e: (e["cta"], e["warp"], e["start"]))
    return out


def load_trace(path: str) -> list[dict]:
    """Normalized events (see events_from_trace) of a .chrome_trace file."""
    return events_from_trace(read_trace_file(path))


def _cta_order(raw_events: Iterable[dict]) -> list[str]:
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


def trim(trace: dict, ctas: int) -> dict:
    """A copy of `trace` that keeps the events of `ctas` CTAs from the middle of the launch (CTAs
    ordered by start time: the steady state, away from the first and last waves). Events without a
    pid (metadata) are kept; other top-level keys are kept as they are."""
    if ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")
    raw = trace["traceEvents"]
    keep = set(middle(_cta_order(raw), ctas))
    out = {k: v for k, v in trace.items() if k != "traceEvents"}
    out["traceEvents"] = [e for e in raw if "pid" not in e or str(e["pid"]) in keep]
    return out


def dumps_trace(trace: dict) -> str:
    return json.dumps(trace, separators=(",", ":"))


def write_trimmed(trace: dict, ctas: int, path: str, max_bytes: int = MAX_TRACE_BYTES) -> int:
    """Trim to `ctas` CTAs and write `path`; when the text exceeds max_bytes, keep fewer CTAs
    (proportionally, at least 1). Returns the number of CTAs written."""
    n = max(1, min(ctas, len(_cta_order(trace["traceEvents"]))))
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


def _ordered_scopes(names: Iterable[str]) -> list[str]:
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
        for s in _ordered_scopes(scope_tot):
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
    scope_names = _ordered_scopes({n for _, s in named for g in s["groups"]
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
# Timeline plot

def scope_color(name: str) -> str:
    if name in SCOPE_COLORS:
        return SCOPE_COLORS[name]
    return _EXTRA_COLORS[sum(map(ord, name)) % len(_EXTRA_COLORS)]


def _zoom_window(evs: list[dict], t0: float, t1: float) -> tuple[float, float]:
    """A window of about 4 steps (qk_gemm starts) around the middle of the CTA, else 1/16 of it."""
    starts = sorted(e["start"] for e in evs if e["name"] == "qk_gemm")
    if len(starts) > 8:
        ws = sorted({e["warp"] for e in evs if e["name"] == "qk_gemm"})
        starts = sorted(e["start"] for e in evs if e["name"] == "qk_gemm" and e["warp"] == ws[0])
    if len(starts) > 8:
        i = len(starts) // 2
        return starts[i] - 0.02 * (starts[i + 4] - starts[i]), starts[i + 4]
    mid, half = (t0 + t1) / 2, (t1 - t0) / 32
    return mid - half, mid + half


def _draw_cta(ax, evs: list[dict], t0: float, lanes: list[int], labels: dict[int, str],
              window: tuple[float, float] | None = None) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator
    for lane, w in enumerate(lanes):
        by_name: dict[str, list[tuple[float, float]]] = {}
        for e in evs:
            if e["warp"] != w:
                continue
            if window and (e["end"] < window[0] or e["start"] > window[1]):
                continue
            by_name.setdefault(e["name"], []).append((e["start"] - t0, e["dur"]))
        for name, bars in by_name.items():
            ax.broken_barh(bars, (lane - 0.4, 0.8), facecolors=scope_color(name),
                           edgecolor="none")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([labels[w] for w in lanes], fontsize=7)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    if window:
        ax.set_xlim(window[0] - t0, window[1] - t0)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12 if window is None else 4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if x else "0"))
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(True, axis="x", alpha=0.3)


def plot_timelines(traces: Sequence[tuple[str, list[dict]]], png: str, max_ctas: int = 4) -> str:
    """One PNG: for each (title, events) up to max_ctas CTAs from the middle of the trace, stacked;
    each CTA gets its whole span (left; one common x scale when there are several traces) and a
    zoom on ~4 steps in its middle (right). One lane per sampled warp, labelled with its warp
    group; x in cycles from the CTA's first event."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = []  # (title, cta, events of the cta, lanes, labels)
    names: set[str] = set()
    for title, events in traces:
        if not events:
            raise ValueError(f"{title}: no scope events to plot")
        names.update(e["name"] for e in events)
        _, group_label = group_labels(events)
        starts: dict[str, float] = {}
        for e in events:
            starts[e["cta"]] = min(starts.get(e["cta"], float("inf")), e["start"])
        ctas = middle(sorted(starts, key=lambda c: starts[c]), max_ctas)
        for cta in ctas:
            evs = [e for e in events if e["cta"] == cta]
            lanes = sorted({e["warp"] for e in evs})
            labels = {w: f"warp {w}  {group_label[w // WARPS_PER_GROUP]}" for w in lanes}
            panels.append((title, cta, evs, lanes, labels))
    heights = [0.6 + 0.28 * len(p[3]) for p in panels]
    fig, axes = plt.subplots(len(panels), 2, figsize=(15, sum(heights) + 1.2), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1], "height_ratios": heights})
    # several traces: one x scale for every whole-CTA panel, so lengths compare at a glance
    longest = max(max(e["end"] for e in p[2]) - min(e["start"] for e in p[2]) for p in panels)
    for (title, cta, evs, lanes, labels), (ax_full, ax_zoom) in zip(panels, axes):
        t0 = min(e["start"] for e in evs)
        t1 = max(e["end"] for e in evs)
        _draw_cta(ax_full, evs, t0, lanes, labels)
        ax_full.set_xlim(0, longest if len(traces) > 1 else t1 - t0)
        ax_full.set_title(f"{title}: {cta} ({t1 - t0:,.0f} cycles)", fontsize=8, loc="left")
        win = _zoom_window(evs, t0, t1)
        _draw_cta(ax_zoom, evs, t0, lanes, labels, window=win)
        ax_zoom.set_yticklabels([])
        ax_zoom.set_title("zoom: ~4 steps mid-CTA", fontsize=8, loc="left")
    for ax in axes[-1]:
        ax.set_xlabel("cycles since the CTA's first event (k = 1000)", fontsize=8)
    handles = [Patch(color=scope_color(n), label=n) for n in _ordered_scopes(names)]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / (sum(heights) + 1.2)))
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def plot_timeline(events: list[dict], png: str, max_ctas: int = 4, title: str = "") -> str:
    """Timeline of up to max_ctas CTAs of one trace (see plot_timelines)."""
    kernel = title or ", ".join(sorted({e["kernel"] for e in events})) or "trace"
    return plot_timelines([(kernel, events)], png, max_ctas)


# ---------------------------------------------------------------------------------------------
# Kernel-level (CUPTI) table

def _frames(node: dict) -> Iterable[dict]:
    yield node
    for c in node.get("children", []) or []:
        yield from _frames(c)


def _kernel_time_count(node: dict) -> tuple[float, int]:
    """Sum of "time (ns)" and "count" of the kernel frames under (and at) node."""
    t, n = 0.0, 0
    for f in _frames(node):
        m = f.get("metrics", {}) or {}
        if "time (ns)" in m:
            t += float(m["time (ns)"])
            n += int(m.get("count", 1))
    return t, n


def kernel_table(hatchet: list | dict) -> list[dict]:
    """Rows from a proton CUPTI .hatchet JSON (a list: the tree root, then device info).

    Every frame whose metrics hold "flops" is a measured scope; its kernels are the frames below it
    with "time (ns)" (and "count"). Scopes named "<variant>" or "<variant>#<rep>" are grouped by
    variant. Per scope: TFLOPS = flops / time. Row: variant, reps (scopes), launches (kernel count),
    flops (per launch), ms (median per-launch time: scope time / its kernel count), tflops (median
    over scopes), pct_peak (of H100_SXM_BF16_DENSE_TFLOPS)."""
    roots = hatchet if isinstance(hatchet, list) else [hatchet]
    per: dict[str, list[tuple[float, float, int]]] = {}  # variant -> (flops, ns, kernels), in order

    def visit(node: dict) -> None:
        metrics = node.get("metrics", {}) or {}
        name = str(node.get("frame", {}).get("name", ""))
        if "flops" in metrics and name != "ROOT":
            t, n = _kernel_time_count(node)
            if n and t > 0:
                per.setdefault(name.split("#")[0], []).append((float(metrics["flops"]), t, n))
            return
        for child in node.get("children", []) or []:
            visit(child)

    for r in roots:
        if isinstance(r, dict) and "frame" in r:
            visit(r)
    rows = []
    for variant, scopes in per.items():
        tf = statistics.median(f / t / 1e3 for f, t, _ in scopes)  # flops/ns / 1e3 = TFLOP/s
        launches = sum(n for _, _, n in scopes)
        rows.append({"variant": variant, "reps": len(scopes), "launches": launches,
                     "flops": sum(f for f, _, _ in scopes) / launches,
                     "ms": statistics.median(t / n for _, t, n in scopes) * 1e-6,
                     "tflops": tf, "pct_peak": 100.0 * tf / H100_SXM_BF16_DENSE_TFLOPS})
    return rows


KERNEL_COLUMNS = [("variant", "variant"), ("shape", "shape"), ("launches", "launches"),
                  ("ms", "ms (median)"), ("tflops", "TFLOPS"),
                  ("pct_peak", f"% of {H100_SXM_BF16_DENSE_TFLOPS:.0f}")]


# ---------------------------------------------------------------------------------------------
# Capture (GPU)

def is_tlx(variant: str) -> bool:
    from simplicial_attn import registry
    return registry.get(variant).module.startswith("kernels_tlx")


def expected_scopes(variant: str) -> set[str]:
    """Scopes a full trace of `variant` holds (with one warp of every warp group sampled): the
    common ones plus the variant module's EXTRA_SCOPES, less its ABSENT_SCOPES (common scopes
    whose work the kernel does not have, e.g. no v1_mul where a producer builds V1[j] * V2)."""
    from simplicial_attn import registry
    mod = registry.get(variant).load()
    base = {"load_kv", "qk_gemm", "softmax", "pv_gemm", "v1_mul", "epilogue"}
    base |= {"wait_kv"} if is_tlx(variant) else set()
    return (base | set(getattr(mod, "EXTRA_SCOPES", ()))) - set(getattr(mod, "ABSENT_SCOPES", ()))


def _compiled_warps(mod) -> int | None:
    """num_warps of the kernels compiled so far from `mod`'s launch functions (the config's `fn`);
    for warp-specialized kernels Triton stores the total (ttg.total-num-warps) there."""
    found = set()
    try:
        fns = {id(c.fn): c.fn for c in mod.compile_configs()}.values()
        for fn in fns:
            for cache in getattr(fn, "device_caches", {}).values():
                for k in cache[0].values():
                    k = k.result() if hasattr(k, "result") else k
                    found.add(int(k.metadata.num_warps))
    except Exception:  # noqa: BLE001 - internals of this Triton version; fall back to the table
        return None
    return max(found) if found else None


def total_warps(variant: str, mod=None) -> int:
    """Warps per CTA of `variant`'s kernel: read from the compiled kernel when one was compiled in
    this process, else TOTAL_WARPS_FALLBACK, else 12 for TLX variants (producer + two consumer
    warp groups), else the first compile config's num_warps."""
    from simplicial_attn import registry
    mod = mod or registry.get(variant).load()
    got = _compiled_warps(mod)
    if got is not None:
        return got
    if variant in TOTAL_WARPS_FALLBACK:
        return TOTAL_WARPS_FALLBACK[variant]
    if is_tlx(variant):  # producer + two consumer warp groups, the layout every TLX variant uses
        return 12
    return int(mod.compile_configs()[0].num_warps)


def default_sampled_warps(total: int) -> list[int]:
    """The first warp of every warp group: 0, 4, 8, ... below `total`."""
    return list(range(0, total, WARPS_PER_GROUP))


def parse_warps(text: str, total: int) -> list[int]:
    """'all', or a comma-separated list of warp ids below `total` -> sorted ids."""
    if text.strip() == "all":
        return list(range(total))
    try:
        ws = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        raise ValueError(f"--warps {text!r}: give 'all' or a list like 0,4,8") from None
    bad = [w for w in ws if not 0 <= w < total]
    if not ws or bad:
        raise ValueError(f"--warps {text!r}: the kernel has warps 0-{total - 1}")
    return ws


def _gpu_inputs(s: Shape, seed: int):
    import torch

    from bench.common import make_inputs
    from simplicial_attn.spec import validate
    inputs = make_inputs(s.B, s.N, s.Hq, s.Hk, s.D, device="cuda", seed=seed)
    spec = validate(*inputs, s.w1, s.w2)
    q, k1, k2, v1, v2 = inputs
    if spec.swapped:  # as simplicial_attn.launcher does
        k1, v1, k2, v2 = k2, v2, k1, v1
    out = torch.empty(s.B, s.N, s.Hq, s.D, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(s.B, s.Hq, s.N, dtype=torch.float32, device="cuda")
    return spec, (q, k1, k2, v1, v2, out, lse)


def _load_variant(variant: str, spec):
    import torch

    from simplicial_attn import launcher, registry
    from simplicial_attn.spec import check_device
    hopper = torch.cuda.get_device_capability()[0] == 9
    v = launcher.pick(spec, variant, hopper)
    check_device(torch.empty(0, device="cuda"), needs_hopper=v.needs_hopper, variant=variant)
    return registry.get(variant).load()


def _written_file(folder: str, ext: str) -> str:
    """The file proton wrote into `folder` (a fresh directory): the one ending in `ext`, else the
    only file there."""
    files = sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f)))
    named = [f for f in files if f.endswith(ext)]
    if named or len(files) == 1:
        return os.path.join(folder, (named or files)[0])
    raise RuntimeError(f"proton wrote no {ext} file in {folder} (found: {files})")


def capture(variant: str, s: Shape, out_dir: str, ctas: int = DEFAULT_CTAS,
            warps: str | None = None, seed: int = 0, keep_full: bool = False,
            log=print) -> str:
    """Capture one trace of `variant` on shape `s` and write OUT/<variant>.chrome_trace, trimmed to
    `ctas` CTAs (fewer if it would pass MAX_TRACE_BYTES). Returns the path."""
    import torch
    import triton.profiler as proton
    from triton.profiler import mode

    spec, args = _gpu_inputs(s, seed)
    mod = _load_variant(variant, spec)
    mod.launch(spec, *args)  # compile and warm the plain kernel first
    torch.cuda.synchronize()
    total = total_warps(variant, mod)
    sampled = parse_warps(warps, total) if warps else default_sampled_warps(total)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    raw_dir = tempfile.mkdtemp(prefix=f"raw-{variant}-", dir=out_dir)
    try:
        proton.start(os.path.join(raw_dir, variant), data="trace", backend="instrumentation",
                     mode=mode.Default(metric_type="cycle", optimizations="clock32,time_shift",
                                       sampling_strategy="selective",
                                       sampling_options=", ".join(map(str, sampled)),
                                       buffer_type="global"))
        try:
            mod.launch(spec, *args, profile=True)
            torch.cuda.synchronize()
        finally:
            proton.finalize()
        raw_path = _written_file(raw_dir, ".chrome_trace")
        size = os.path.getsize(raw_path)
        trace = read_trace_file(raw_path)
        n_all = len(_cta_order(trace["traceEvents"]))
        path = os.path.join(out_dir, f"{variant}.chrome_trace")
        n = write_trimmed(trace, ctas, path)
        log(f"{variant}: {s.short()}, {total} warps/CTA, sampled {', '.join(map(str, sampled))}; "
            f"full trace {n_all} CTAs {size / 1e6:.1f} MB -> kept {n} CTAs "
            f"({os.path.getsize(path) / 1e6:.2f} MB): {path}")
        if n < ctas and n < n_all:
            log(f"{variant}: kept {n} of the {ctas} CTAs asked for, to stay under "
                f"{MAX_TRACE_BYTES / 1e6:.0f} MB")
        if keep_full:
            kept = os.path.join(out_dir, f"{variant}.full.chrome_trace")
            shutil.move(raw_path, kept)
            log(f"{variant}: full trace kept as {kept}")
    finally:
        shutil.rmtree(raw_dir, ignore_errors=True)
    return path


def kernel_level(names: Sequence[str], s: Shape, out_dir: str, reps: int = 5,
                 seed: int = 0) -> list[dict]:
    """CUPTI kernel times of each variant on `s`: `reps` launches per variant, each in its own
    proton scope "<variant>#<i>" with the FLOP count, L2 flushed before each launch (as
    bench.common.median_ms does); rows from kernel_table of OUT/kernels.hatchet."""
    import torch
    import triton.profiler as proton

    import simplicial_attn
    spec, args = _gpu_inputs(s, seed)
    mods = {n: _load_variant(n, spec) for n in names}
    for m in mods.values():  # compile outside the session
        m.launch(spec, *args)
    torch.cuda.synchronize()
    flops = float(simplicial_attn.flops(s.B, s.N, s.Hq, s.D, s.w1, s.w2))
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    raw_dir = tempfile.mkdtemp(prefix="raw-kernels-", dir=out_dir)
    try:
        proton.start(os.path.join(raw_dir, "kernels"), backend="cupti")
        try:
            for name, m in mods.items():
                for i in range(reps):
                    flush.zero_()
                    with proton.scope(f"{name}#{i}", metrics={"flops": flops}):
                        m.launch(spec, *args)
            torch.cuda.synchronize()
        finally:
            proton.finalize()
        path = os.path.join(out_dir, "kernels.hatchet")
        shutil.move(_written_file(raw_dir, ".hatchet"), path)
    finally:
        shutil.rmtree(raw_dir, ignore_errors=True)
    with open(path) as f:
        rows = kernel_table(json.load(f))
    for r in rows:
        r["shape"] = s.short()
    return rows


# ---------------------------------------------------------------------------------------------
# Command line

def build_parser() -> argparse.ArgumentParser:
    from simplicial_attn import registry
    names = [v.name for v in registry.all_variants()]
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Proton traces of the forward kernels. Capture modes (--variant, --compare, "
                    "--kernels) need a CUDA GPU; --summarize and --plot run anywhere.",
        epilog=f"Default shape: preset {DEFAULT_PRESET} ({PRESETS[DEFAULT_PRESET].short()}). "
               "Numbers: cycles of the SM clock; gemm scopes include the wait for the wgmma "
               "result (an upper bound of tensor-core busy time); instrumentation perturbs "
               "timing. Open a .chrome_trace in ui.perfetto.dev. Exit status: 0 ok, 1 unusable "
               "capture, 2 bad arguments or no GPU.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--compare", nargs=2, metavar=("A", "B"), choices=names,
                      help="capture two variants; summaries side by side, OUT/compare_A_B.png")
    mode.add_argument("--kernels", action="store_true",
                      help="kernel-level CUPTI table (median of --reps launches, TFLOPS, %% of "
                           f"{H100_SXM_BF16_DENSE_TFLOPS:.0f}) for the --variant(s), default every "
                           "variant that takes the shape")
    mode.add_argument("--summarize", nargs="+", metavar="TRACE",
                      help="summarize .chrome_trace file(s) (no GPU); two or more: side by side")
    mode.add_argument("--plot", nargs="+", metavar="TRACE",
                      help="timeline PNG of .chrome_trace file(s), stacked (no GPU); needs --png")
    p.add_argument("--variant", action="append", choices=names, metavar="NAME",
                   help=f"variant to capture (repeatable): {', '.join(names)}")
    add_shape_args(p, default_preset=DEFAULT_PRESET)
    p.add_argument("--out", metavar="DIR", default="out/trace",
                   help="output directory of captures (default: out/trace; created)")
    p.add_argument("--ctas", type=positive_int, default=DEFAULT_CTAS, metavar="K",
                   help=f"CTAs kept in a captured trace, from the middle of the launch "
                        f"(default: {DEFAULT_CTAS}; fewer if the file would pass "
                        f"{MAX_TRACE_BYTES // 1_000_000} MB)")
    p.add_argument("--warps", metavar="LIST",
                   help="warps to sample, e.g. 0,4,8 or 'all' (default: the first warp of every "
                        "warp group)")
    p.add_argument("--max-ctas", type=positive_int, default=None, metavar="K",
                   help="CTAs per trace in a timeline picture (default: 4, 2 per trace when "
                        "comparing)")
    p.add_argument("--png", metavar="OUT.png", help="output picture of --plot")
    p.add_argument("--json", action="store_true",
                   help="print the summary (or the --kernels rows) as JSON instead of text")
    p.add_argument("--reps", type=positive_int, default=5, metavar="R",
                   help="launches per variant for --kernels (default: 5)")
    p.add_argument("--keep-full", action="store_true",
                   help="also keep the untrimmed trace as OUT/<variant>.full.chrome_trace")
    p.add_argument("--seed", type=int, default=0, metavar="INT", help="input seed (default: 0)")
    return p


def _spec_of(parser: argparse.ArgumentParser, s: Shape):
    """The library's own shape checks on meta tensors (no memory, no device)."""
    from simplicial_attn.spec import validate_shape
    try:
        return validate_shape(s.B, s.N, s.Hq, s.Hk, s.D, s.w1, s.w2)
    except (ValueError, TypeError) as e:
        parser.error(f"shape {s.short()}: {e}")


def _check_shape(parser: argparse.ArgumentParser, s: Shape, names: Sequence[str]) -> None:
    """The shape checks of `_spec_of`, then each variant's `supports`."""
    from simplicial_attn import registry
    spec = _spec_of(parser, s)
    for n in names:
        why = registry.get(n).load().supports(spec)
        if why is not None:
            parser.error(f"variant {n!r} cannot take {s.short()}: {why}")


def _summary_text(paths: Sequence[str], as_json: bool) -> str:
    named = []
    for p in paths:
        named.append((os.path.basename(p).replace(".chrome_trace", ""), summarize(load_trace(p))))
    if as_json:
        out = [dict(s, path=p) for p, (_, s) in zip(paths, named)]
        return json.dumps(out[0] if len(out) == 1 else out, indent=1)
    parts = [format_summary(s, title=f"trace: {p}") for p, (_, s) in zip(paths, named)]
    if len(named) > 1:
        parts.append("side by side:\n" + format_comparison(named))
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.summarize or args.plot:
        paths = args.summarize or args.plot
        for path in paths:
            if not os.path.isfile(path):
                parser.error(f"{path}: no such file")
        if args.plot:
            if not args.png or not args.png.lower().endswith(".png"):
                parser.error("--plot needs --png OUT.png")
            try:
                traces = [(os.path.basename(p).replace(".chrome_trace", ""), load_trace(p))
                          for p in paths]
                plot_timelines(traces, args.png,
                               args.max_ctas or (4 if len(paths) == 1 else 2))
            except (ValueError, OSError) as e:
                print(f"{PROG}: {e}", file=sys.stderr)
                return 1
            print(f"wrote {args.png}")
            return 0
        try:
            print(_summary_text(paths, args.json))
        except (ValueError, OSError, json.JSONDecodeError) as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 1
        return 0

    from simplicial_attn import registry
    if args.kernels:
        names = args.variant or []
    elif args.compare:
        if args.compare[0] == args.compare[1]:
            parser.error("--compare needs two different variants")
        names = list(args.compare)
    else:
        if not args.variant:
            parser.error("say what to do: --variant NAME (capture), --compare A B, --kernels, "
                         "--summarize PATH or --plot PATH --png OUT.png")
        names = list(dict.fromkeys(args.variant))
    shape = shape_from_args(args)
    if args.kernels and not names:  # every variant that takes the shape
        spec = _spec_of(parser, shape)
        names = [v.name for v in registry.all_variants() if v.load().supports(spec) is None]
    _check_shape(parser, shape, names)

    import torch
    if not torch.cuda.is_available():
        print(f"{PROG}: no CUDA GPU found; capturing a trace needs one (H100/H200)",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    print(metadata_line(run_metadata()), flush=True)

    if args.kernels:
        rows = kernel_level(names, shape, args.out, reps=args.reps, seed=args.seed)
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print(format_table(rows, KERNEL_COLUMNS))
            print(f"CUPTI kernel time per launch (median of {args.reps}, L2 flushed before each); "
                  f"raw tree: {os.path.join(args.out, 'kernels.hatchet')}")
        return 0

    captured = []
    for n in names:
        try:
            path = capture(n, shape, args.out, ctas=args.ctas, warps=args.warps, seed=args.seed,
                           keep_full=args.keep_full)
        except (RuntimeError, ValueError, OSError, json.JSONDecodeError) as e:
            print(f"{PROG}: capture of {n} failed: {e}", file=sys.stderr)
            return 1
        events = load_trace(path)
        if not events:
            print(f"{PROG}: {path} holds no scope events", file=sys.stderr)
            return 1
        missing = expected_scopes(n) - {e["name"] for e in events}
        if missing and not args.warps:
            print(f"warning: {n}: scopes missing from the trace: {', '.join(sorted(missing))}",
                  file=sys.stderr)
        captured.append((n, path, events))
    summaries = [(n, summarize(ev)) for n, _, ev in captured]
    if args.json:
        print(json.dumps([dict(s, variant=n, path=p) for (n, s), (_, p, _) in
                          zip(summaries, captured)], indent=1))
    else:
        for (n, s), (_, p, _) in zip(summaries, captured):
            print()
            print(format_summary(s, title=f"{n}: {p}"))
        if args.compare:
            print("\nside by side:\n" + format_comparison(summaries))
    if args.compare:
        png = os.path.join(args.out, f"compare_{names[0]}_{names[1]}.png")
        plot_timelines([(n, ev) for n, _, ev in captured], png, args.max_ctas or 2)
        print(f"wrote {png}")
    else:
        for n, _, ev in captured:
            png = os.path.join(args.out, f"{n}.png")
            plot_timeline(ev, png, args.max_ctas or 4, title=n)
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

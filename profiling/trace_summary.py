"""Proton traces on the CPU: read, normalize, trim, summarize (cycles per scope, tensor-core busy,
bubble) and compare. What a scope is for (its role: load, gemm, softmax, ...) comes from the
family's record (registry.Family.scopes, ScopeRoles below). The capture (GPU) is in
trace_capture.py, the kernel-level (CUPTI) table in trace_kernels.py, the timeline picture in
trace_plot.py, the command line in trace.py (its docstring says what the numbers mean).

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from altattn import registry
from profiling.common import format_table

OUTSIDE = "(outside scopes)"
WARPS_PER_GROUP = 4

MAX_TRACE_BYTES = 20_000_000
DEFAULT_FREQUENCY_MHZ = 1000.0


@dataclass(frozen=True)
class ScopeRoles:
    """A family's Proton scopes (registry.Family.scopes): their kernel order and the role of each
    (registry.SCOPE_ROLES). All the summary knows about scope names comes from here: a warp group
    that runs a "gemm" scope is a consumer, one that runs "load" or "build" scopes and no gemm is a
    producer; a consumer's step is its gemm, softmax and scale scopes, counted by its first gemm
    scope in kernel order."""

    order: tuple[str, ...]
    role: Mapping[str, str]

    @classmethod
    def of(cls, family: str) -> ScopeRoles:
        scopes = registry.get_family(family).scopes
        return cls(tuple(scopes), dict(scopes))

    def named(self, *roles: str) -> tuple[str, ...]:
        """The scopes of these roles, in kernel order."""
        return tuple(s for s in self.order if self.role[s] in roles)

    @property
    def gemm(self) -> tuple[str, ...]:    # hold a wgmma (issue + wait): tensor-core busy
        return self.named("gemm")

    @property
    def step(self) -> tuple[str, ...]:    # the work of one step of a consumer
        return self.named("gemm", "softmax", "scale")

    def group_role(self, scope_names: Iterable[str]) -> str:
        """'consumer' for a warp group that runs a gemm scope, 'producer' for one that only loads
        or builds, 'other' otherwise."""
        roles = {self.role.get(n) for n in scope_names}
        if "gemm" in roles:
            return "consumer"
        if roles & {"load", "build"}:
            return "producer"
        return "other"

    def ordered(self, names: Iterable[str]) -> list[str]:
        """`names` in kernel order, names the family lacks after them (sorted)."""
        names = set(names)
        return [s for s in self.order if s in names] + sorted(names - set(self.order))

    def caveats(self) -> tuple[str, ...]:
        """The notes printed with every summary."""
        return (
            (f"gemm scopes ({', '.join(self.gemm)}) include the wait for the wgmma result: they "
             "measure issue to completion as seen by the warp, an upper bound of tensor-core busy "
             "time (a gemm scope also holds what its warps do between issue and wait, e.g. the "
             "loads and products of its operands or the wait for a producer's)"),
            "instrumentation (a clock read + store per scope boundary) perturbs timing and scheduling",
            ("cycles are the SM clock of the sampled warps; spans run from a group's first scope "
             "entry to its last scope exit in each CTA"),
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


def group_labels(events: Iterable[dict], roles: ScopeRoles) -> tuple[dict[int, str], dict[int, str]]:
    """(role, label) per warp group of the events: 'wg1 consumer 0', 'wg0 producer', ...
    Consumers are numbered only when there are several. `roles`: the family's."""
    names: dict[int, set[str]] = {}
    for e in events:
        names.setdefault(e["warp"] // WARPS_PER_GROUP, set()).add(e["name"])
    role = {g: roles.group_role(names[g]) for g in sorted(names)}
    consumers = [g for g in role if role[g] == "consumer"]
    labels = {}
    for g, r in role.items():
        labels[g] = f"wg{g} {r}" + (f" {consumers.index(g)}" if r == "consumer"
                                      and len(consumers) > 1 else "")
    return role, labels


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


def summarize(events: list[dict], family: str) -> dict:
    """Per warp group and scope: count, mean and total cycles, share of the group's span;
    tensor-core busy per consumer group; bubble fraction per CTA and overall. `events` as from
    load_trace; the roles of their scopes are `family`'s (ScopeRoles: gemm and step scopes
    below are the family's scopes of those roles).

    Returns {"kernel", "frequency_mhz", "ctas", "cta_ids", "warps", "cta_span_cycles" (mean
    first-to-last event of a CTA), "groups": [{"group", "role", "label", "warps", "scopes":
    {name: {"count", "mean_cycles", "total_cycles", "share"}}, "outside_share", "span_cycles"
    (mean per CTA), "gemm_share" (gemm scopes' shares), "tc_busy" (consumers, else None),
    "steps" and "step_cycles" (consumers: the count of its first gemm scope, and the cycles of all
    its step scopes per step)}], "bubble", "per_cta": [{"cta",
    "span_cycles", "bubble", "tc_busy": {label: fraction}}], "per_warp": {warp: {"group",
    "counts"}}, "family", "gemm_scopes", "step_scopes", "warnings": [...], "caveats": [...]}.
    Fractions are in [0, 1].
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
    sr = ScopeRoles.of(family)
    roles, labels = group_labels(events, sr)
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
                                        if e["name"] in sr.gemm)
                busy_sum += covered
                per_cta[i]["tc_busy"][labels[g]] = covered / span if span > 0 else 0.0
        scopes = {}
        for s in sr.ordered(scope_tot):
            scopes[s] = {"count": scope_cnt[s], "mean_cycles": scope_tot[s] / scope_cnt[s],
                         "total_cycles": scope_tot[s],
                         "share": scope_tot[s] / denom if denom > 0 else 0.0}
        in_scopes = sum(v["share"] for v in scopes.values())
        entry = {"group": g, "role": roles[g], "label": labels[g],
                 "warps": [w for w in warps if w // WARPS_PER_GROUP == g],
                 "scopes": scopes, "outside_share": 1.0 - in_scopes,
                 "span_cycles": span_sum / n_spans if n_spans else 0.0,
                 "gemm_share": sum(scopes[s]["share"] for s in sr.gemm if s in scopes),
                 "tc_busy": None, "steps": None, "step_cycles": None}
        if roles[g] == "consumer":
            entry["tc_busy"] = busy_sum / span_sum if span_sum > 0 else 0.0
            first = next((s for s in sr.gemm if s in scopes), None)  # one per step
            if first is not None:
                entry["steps"] = scopes[first]["count"]
                entry["step_cycles"] = sum(scopes[s]["total_cycles"] for s in sr.step
                                           if s in scopes) / scopes[first]["count"]
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
        covered = _union_length((e["start"], e["end"]) for e in evs if e["name"] in sr.gemm)
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
        "family": family,
        "gemm_scopes": list(sr.gemm),
        "step_scopes": list(sr.step),
        "caveats": list(sr.caveats()),
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
            step = (f"; {g['steps']} steps of {g['step_cycles']:,.0f} cycles "
                    f"({'+'.join(s['step_scopes'])})" if g["steps"] else "")
            lines.append(f"tensor-core busy {g['label']}: {100 * g['tc_busy']:.1f}% of its span "
                         f"({' U '.join(s['gemm_scopes'])}; scope shares "
                         f"{100 * g['gemm_share']:.1f}%){step}")
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
    """Key numbers of several summaries side by side: one column per trace (scope rows in the
    kernel order of the first summary's family)."""
    keys: list[tuple[str, object]] = [("CTAs", lambda s: s["ctas"]),
                                      ("CTA span (cycles)", lambda s: round(s["cta_span_cycles"])),
                                      ("bubble %", lambda s: _pct(s["bubble"]))]
    scope_names = ScopeRoles.of(named[0][1]["family"]).ordered(
        {n for _, s in named for g in s["groups"] if g["role"] == "consumer"
         for n in g["scopes"]}) if named else []

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

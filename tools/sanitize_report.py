"""Reading a compute-sanitizer log and judging it against the allow-list (tools/sanitize.py's
runs; no GPU). docs/sanitizers.md says what is allowed and why.

An allowance names a finding by what the report itself says, never by the kernel's source text:
the kernel's name, the severity of the race, and a `kind` (RACE_KINDS) that is a fact of the two
accesses racecheck reports (their source line as racecheck gives it, their SASS offsets). A source
edit that moves a line changes nothing here; a renamed kernel fails tests/tools/test_sanitize.py (each
allowance's kernel must be one of its variant's compiled kernels).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

WORKER_DONE = "sanitize worker: done"
DOC = "docs/sanitizers.md"
DISPATCH_DOC = f"{DOC}#the-warp-specialization-dispatch"
TMA_INIT_DOC = f"{DOC}#plain-triton-tma-loads-mbarrier-init-then-arrive-in-one-warp"
TRIPLE_TLX_DOC = f"{DOC}#triple-attention"
RELEASE_DOC = f"{DOC}#a-warp-groups-reads-released-by-one-threads-mbarrier-arrive"
# mbarrier init, then arrive, in one warp's straight-line code: the arrive this many SASS bytes
# after the init at most (0x30-0xb0 in the 2-simplicial builds of docs/sanitizers.md; up to 0x300
# in the spherical kernels, whose loads of Q, K and V sit among more address arithmetic)
INIT_ARRIVE_WINDOW = 0x400


@dataclass(frozen=True)
class Access:
    """One side of a race as racecheck's analysis report names it: "Write access at
    KERNEL+0xOFF in FILE:LINE"."""

    kind: str      # "Write" or "Read"
    kernel: str
    offset: int    # SASS offset in the kernel
    where: str     # "FILE:LINE" as racecheck prints it (the file's path or its name)


@dataclass(frozen=True)
class Race:
    """One finding of racecheck's analysis report: its severity and its two accesses."""

    severity: str  # "Error" or "Warning"
    first: Access
    second: Access
    hazards: int | None = None

    def access(self, kind: str) -> Access | None:
        return next((a for a in (self.first, self.second) if a.kind == kind), None)


def _dispatch(r: Race) -> bool:
    """The warp-specialization dispatch: the exit-code store against a worker's load of its byte,
    both on the source line racecheck gives the kernel's entry (one line, one kernel)."""
    w, rd = r.access("Write"), r.access("Read")
    return (r.severity == "Error" and w is not None and rd is not None
            and w.kernel == rd.kernel and w.where == rd.where)


def _mbarrier_init(r: Race) -> bool:
    """Triton's TMA load: one warp inits an mbarrier (the write), then one thread of it arrives
    (the read) a few instructions later in the same straight-line code."""
    w, rd = r.access("Write"), r.access("Read")
    return (r.severity == "Warning" and w is not None and rd is not None
            and w.kernel == rd.kernel and 0 < rd.offset - w.offset <= INIT_ARRIVE_WINDOW)


def _released_read(r: Race) -> bool:
    """A producer's store into a ring slot against a consumer's plain load of it: the write in the
    default (producer) task's code, which comes first in the SASS, the read in a consumer's,
    after it; on different lines (the dispatch's pair shares one)."""
    w, rd = r.access("Write"), r.access("Read")
    return (r.severity == "Error" and w is not None and rd is not None
            and w.kernel == rd.kernel and w.offset < rd.offset and w.where != rd.where)


# What a race must look like to be allowed (Allowance.kind): a fact of its two accesses
RACE_KINDS: dict[str, Callable[[Race], bool]] = {
    "dispatch": _dispatch, "mbarrier_init": _mbarrier_init, "released_read": _released_read}


@dataclass(frozen=True)
class Allowance:
    """Findings of one (tool, pass, variant) explained in the docs: at most `count` per run (None:
    any number); with `kernel` and `kind`, only racecheck findings whose two accesses are in that
    kernel (its name in the report) and are a race of that kind (RACE_KINDS; a tuple of kinds:
    any of them); with `pattern`,
    only findings whose report line matches it (re.search)."""

    doc: str                    # where the explanation is, e.g. "docs/sanitizers.md#a-section"
    count: int | None = None
    kernel: str | None = None
    kind: str | tuple[str, ...] | None = None
    pattern: str | None = None

    def admits(self, line: str, race: Race | None) -> bool:
        if self.pattern is not None and not re.search(self.pattern, line):
            return False
        if self.kernel is None and self.kind is None:
            return True
        if race is None:
            return False
        if self.kernel is not None and self.kernel not in (race.first.kernel, race.second.kernel):
            return False
        if self.kernel is not None and race.first.kernel != race.second.kernel:
            return False
        kinds = (self.kind,) if isinstance(self.kind, str) else self.kind
        return kinds is None or any(RACE_KINDS[k](race) for k in kinds)


# The allow-list of each family, keyed by (tool, pass, variant): the one place that excuses a
# finding, each entry pointing at the docs section that explains it.
ALLOWED_BY_FAMILY: dict[str, dict[tuple[str, str, str], Allowance]] = {
    "simplicial": {
        # the compiler's warp-specialization dispatch: the exit-code store against a worker's load
        ("racecheck", "fwd", "tlx_ws"): Allowance(DISPATCH_DOC, 1, "simplicial_fwd_ws_kernel",
                                                  "dispatch"),
        ("racecheck", "fwd", "tlx_pingpong"): Allowance(DISPATCH_DOC, 1,
                                                        "simplicial_fwd_ws_kernel", "dispatch"),
        # the same in the pipelined tlx_ws_kv kernels, reported in their form "det" runs only
        ("racecheck", "fwd", "tlx_pipelined_kv"): Allowance(
            DISPATCH_DOC, 1, "simplicial_fwd_ws_kv_kernel", "dispatch"),
        ("racecheck", "fwd", "tlx_pipelined_pingpong"): Allowance(
            DISPATCH_DOC, 1, "simplicial_fwd_ws_kv_kernel", "dispatch"),
        # tlx_ws's backward: its k-owner's dispatch (its row-owner is clean); tlx_pairs's
        ("racecheck", "bwd", "tlx_ws"): Allowance(DISPATCH_DOC, 1, "_dkv2_ws_kernel", "dispatch"),
        ("racecheck", "bwd", "tlx_pairs"): Allowance(DISPATCH_DOC, 1, "_pairs_kernel",
                                                     "dispatch"),
        # Triton's TMA load: warp 0 inits an mbarrier, then thread 0 arrives on it (in SASS order)
        ("racecheck", "fwd", "triton"): Allowance(TMA_INIT_DOC, 2, "simplicial_fwd_kernel",
                                                  "mbarrier_init"),
        ("racecheck", "bwd", "triton"): Allowance(TMA_INIT_DOC, 1, "_dq_kernel",
                                                  "mbarrier_init"),
        # a producer's store into a slot whose last reads (plain loads of a consumer warp group)
        # are released by one thread's mbarrier arrive (seen once in three runs)
        ("racecheck", "fwd", "tlx_ws_keys"): Allowance(RELEASE_DOC, 1,
                                                       "simplicial_fwd_ws_keys_kernel",
                                                       "released_read"),
    },
    "spherical": {
        # Triton's TMA loads of Q, K, V (forward) and of Q, dO, K, V (backward's two kernels)
        ("racecheck", "fwd", "triton"): Allowance(TMA_INIT_DOC, 3, "spherical_fwd_kernel",
                                                  "mbarrier_init"),
        ("racecheck", "bwd", "triton"): Allowance(TMA_INIT_DOC, 8, None, "mbarrier_init"),
        # the warp-specialization dispatch of the key-block kernel (and tlx_ws_det's dQ kernel)
        ("racecheck", "bwd", "tlx_ws"): Allowance(DISPATCH_DOC, 1, "_dkv_kernel", "dispatch"),
        ("racecheck", "bwd", "tlx_ws_det"): Allowance(DISPATCH_DOC, 2, None, "dispatch"),
    },
    "triple": {
        # Triton's TMA loads: `apply`'s slabs of W, and (causal) intra.py's tiles in its three
        # kernels; one finding per load site a run reaches (1 non-causal forward, 6 causal; 6
        # and 26 backward)
        ("racecheck", "fwd", "triton"): Allowance(TMA_INIT_DOC, 6, None, "mbarrier_init"),
        # (+1: the forward run before the backward is `auto`'s, the `tlx` forward, whose
        # partials kernel may add its dispatch finding)
        ("racecheck", "bwd", "triton"): Allowance(TRIPLE_TLX_DOC, 27, None,
                                                  ("mbarrier_init", "dispatch")),
        # `tlx` runs the same Triton kernels, and its TLX partials kernel adds at most one
        # warp-specialization dispatch finding per launch (1 forward; 3 in a causal backward run,
        # the forward's launch included)
        ("racecheck", "fwd", "tlx"): Allowance(TRIPLE_TLX_DOC, 7, None,
                                               ("mbarrier_init", "dispatch")),
        ("racecheck", "bwd", "tlx"): Allowance(TRIPLE_TLX_DOC, 29, None,
                                               ("mbarrier_init", "dispatch")),
    },
}


def allowed_for(family: str) -> Mapping[tuple[str, str, str], Allowance]:
    """The allow-list of `family` (empty: every finding fails)."""
    return ALLOWED_BY_FAMILY.get(family, {})


@dataclass
class Report:
    """What a run's log says: `findings` (None: no summary line, the sanitizer did not finish),
    the report line of each finding, racecheck's races (analysis report) by line, and whether the
    worker got to its last line."""

    findings: int | None
    lines: list[str] = field(default_factory=list)
    done: bool = False
    races: dict[str, Race] = field(default_factory=dict, compare=False)


_ERRORS = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACES = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, "
                    r"(\d+) warnings?\)")
# The sanitizer's own lines ("========= " then text; detail lines are indented further) that are
# not findings.
_NOT_FINDINGS = re.compile(r"COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|"
                           r"Target application returned an error|"
                           r"process didn't terminate successfully")
_ACCESS = r"(Write|Read) access at (\S+?)\+0x([0-9a-f]+) in (\S+:\d+)"
_RACE = re.compile(rf"^========= (Error|Warning): Race reported between {_ACCESS}\s*\n"
                   rf"=========\s+and {_ACCESS}(?: \[(\d+) hazards?\])?", re.M)


def parse_races(text: str) -> dict[str, Race]:
    """racecheck's analysis-report findings: {report line (as Report.lines holds it): Race}."""
    out = {}
    for m in _RACE.finditer(text):
        sev, k1, n1, o1, w1, k2, n2, o2, w2, hz = m.groups()
        line = m.group(0).split("\n")[0][len("========= "):].rstrip()
        out[line] = Race(sev, Access(k1, n1, int(o1, 16), w1), Access(k2, n2, int(o2, 16), w2),
                         int(hz) if hz else None)
    return out


def parse_report(text: str, tool: str) -> Report:
    """The findings of a sanitizer log: racecheck's errors + warnings from its summary, the other
    tools' error count; the report line of each finding (the sanitizer's unindented lines), each
    race's accesses (racecheck); and whether the worker printed WORKER_DONE."""
    if tool == "racecheck":
        counts = [int(e) + int(w) for _, e, w in _RACES.findall(text)]
    else:
        counts = [int(n) for n in _ERRORS.findall(text)]
    lines = [m.group(1).rstrip() for m in re.finditer(r"^========= (\S.*)$", text, re.M)
             if not _NOT_FINDINGS.search(m.group(1))]
    done = any(line.startswith(WORKER_DONE) for line in text.splitlines())
    races = parse_races(text) if tool == "racecheck" else {}
    return Report(sum(counts) if counts else None, lines, done, races)


def judge(run, report: Report, returncode: int | None,
          allowed: Mapping[tuple[str, str, str], Allowance] | None = None) -> tuple[bool, str]:
    """(passed, verdict) of a run (tool, pass_, variant, family): its report, the sanitizer's exit
    status (None: timed out) and the allow-list (default: the run's family's)."""
    if allowed is None:
        allowed = allowed_for(run.family)
    if returncode is None:
        return False, "timed out"
    n = report.findings
    if n is None:
        return False, f"no sanitizer summary (exit {returncode}): read the log"
    if not report.done:
        return False, f"{n} findings, the worker did not finish (exit {returncode}): read the log"
    if n == 0:
        if returncode != 0:
            return False, f"exit {returncode} without a counted finding: read the log"
        return True, "clean"
    entry = allowed.get((run.tool, run.pass_, run.variant))
    if entry is None:
        return False, f"{n} findings, not allowed"
    if entry.count is not None and n > entry.count:
        return False, f"{n} findings, {entry.count} allowed ({entry.doc})"
    stray = [line for line in report.lines if not entry.admits(line, report.races.get(line))]
    if stray:
        what = (f"kind ({entry.kind} in {entry.kernel})" if entry.kind or entry.kernel
                else "pattern")
        return False, f"{n} findings, {len(stray)} outside the allowed {what}: {stray[0]}"
    return True, f"{n} findings, allowed ({entry.doc})"

"""Reading a compute-sanitizer log and judging it against the allow-list (tools/sanitize.py's
runs; no GPU): each family's is its record's `sanitizer_allowed` (altattn/<family>/family.py,
registry.SanitizerAllowance). docs/sanitizers.md says what is allowed and why.

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

from altattn import registry

WORKER_DONE = "sanitize worker: done"
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


# An allowance of a family's record (Family.sanitizer_allowed)
Allowance = registry.SanitizerAllowance


def admits(entry: Allowance, line: str, race: Race | None) -> bool:
    """Whether the finding on report line `line` (racecheck's `race`, None for other tools) is
    one that `entry` explains: its `pattern`, `kernel` and `kind`."""
    if entry.pattern is not None and not re.search(entry.pattern, line):
        return False
    if entry.kernel is None and entry.kind is None:
        return True
    if race is None:
        return False
    if entry.kernel is not None and entry.kernel not in (race.first.kernel, race.second.kernel):
        return False
    if entry.kernel is not None and race.first.kernel != race.second.kernel:
        return False
    kinds = (entry.kind,) if isinstance(entry.kind, str) else entry.kind
    return kinds is None or any(RACE_KINDS[k](race) for k in kinds)


def allowed_for(family: str) -> Mapping[tuple[str, str, str], Allowance]:
    """The allow-list of `family`, keyed by (tool, pass, variant): its record's
    `sanitizer_allowed`, the one place that excuses a finding, each entry pointing at the docs
    section that explains it (a family without one: every finding fails)."""
    return registry.get_family(family).sanitizer_allowed


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
    stray = [line for line in report.lines if not admits(entry, line, report.races.get(line))]
    if stray:
        what = (f"kind ({entry.kind} in {entry.kernel})" if entry.kind or entry.kernel
                else "pattern")
        return False, f"{n} findings, {len(stray)} outside the allowed {what}: {stray[0]}"
    return True, f"{n} findings, allowed ({entry.doc})"

"""Compute-sanitizer runs anyone can repeat: memcheck, racecheck and synccheck on every registered
variant, forward and backward, in each logits' form it computes (form "det": `triton`, and the
forward's `tlx_pipelined_kv` and `tlx_pipelined_pingpong`), at two small shapes each, failing on
any finding that the allow-list (ALLOWED, one entry per explained finding, for every form of the
variant) does not name. docs/sanitizers.md says what is allowed
and why.

    python3 profiling/sanitize.py                                   # everything (GPU)
    python3 profiling/sanitize.py --tool racecheck --pass fwd --variant tlx_ws
    python3 profiling/sanitize.py --jobs 4                          # 4 children at once
    python3 profiling/sanitize.py --tool racecheck --pass probe     # the warp-specialization probe
    python3 profiling/sanitize.py --dry-run                         # the runs, no GPU needed
    python3 profiling/sanitize.py --form det                        # form "det" only

Each run is one child process, `compute-sanitizer --tool T --error-exitcode 1 ... python3
profiling/sanitize.py --worker ...`, that calls one variant of one pass once on one shape
(profiling.common.run_pass; the backward after a plain forward, whose kernels are excluded from
the check). Its whole output is OUT/<tool>-<pass>-<variant>-<shape>.log. A finding is what the
sanitizer's summary counts: memcheck and synccheck "ERROR SUMMARY: N errors", racecheck
"RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)" (E + W; racecheck looks at shared
memory only). A run passes when it finished (the worker printed its last line) with no finding,
or with findings that its ALLOWED entry covers. `--jobs N` runs up to N children at once on the
one GPU; the lines and the table stay in the order of the runs.

The probe (`--pass probe`, not a variant, not in the default passes): profiling/ws_probe.py's
kernel, which has our TLX kernels' warp-specialized task layout and no shared memory of its own,
so a finding in it is the compiler's dispatch code's (issue 23), one run per tool.

Shapes: for each variant, the first of SMALL_G_OR_HK that it takes (G < 16, else Hk > 1) and the
first of RAGGED_N (N = 333, not a multiple of any block), chosen with Variant.cannot_take, so
without a GPU. PyTorch's caching allocator is off in the child (PYTORCH_NO_CUDA_MEMORY_CACHING):
each tensor is its own allocation, so memcheck sees an access past its end.

Exit status: 0 every run passed; 1 a finding not allowed, or a run that did not finish; 2 bad
arguments, no compute-sanitizer, no GPU, or a GPU that is not a Hopper.
"""
from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # `python3 profiling/sanitize.py` from a checkout
    sys.path.insert(0, REPO_ROOT)

import argparse  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from profiling.common import (Shape, format_table, gpu_problem, positive_int,  # noqa: E402
                              variant_names)
from altattn import registry  # noqa: E402
from altattn.simplicial.spec import FORMS  # noqa: E402

PROG = "profiling/sanitize.py"
SCRIPT = os.path.abspath(__file__)
TOOLS = ("memcheck", "racecheck", "synccheck")
# Options of every run, then each tool's. --print-limit: every finding printed, so the summary
# counts what the log shows. racecheck's "analysis" report (its default) gives one finding per
# pair of racing accesses, with the count of hazards behind it; "hazard" or "all" print each.
COMMON_ARGS = ("--error-exitcode", "1", "--print-limit", "10000")
TOOL_ARGS = {"memcheck": (), "racecheck": ("--racecheck-report", "analysis"), "synccheck": ()}
RACECHECK_REPORTS = ("analysis", "hazard", "all")  # --racecheck-report: its first is the default
# The probe: a run kind beside the passes, not a registered variant (profiling/ws_probe.py).
PROBE = "probe"
PROBE_NAME = "ws_probe"
PROBE_KERNEL = "ws_probe_kernel"   # its one kernel; the probe's runs check only it
PASSES = (*registry.PASSES, PROBE)
SHAPE_SETS = ("small", "ragged")
# Every forward kernel's name starts with this (tests/test_sanitize.py checks it); a backward run
# excludes them: its plain forward (out and LSE) is not what it checks.
FWD_KERNEL_PREFIX = "simplicial_fwd"
WORKER_DONE = "sanitize worker: done"

# Candidate shapes (B, N, Hq, Hk, D, w1, w2): the first one a variant takes, of each list.
SMALL_G_OR_HK = (Shape(1, 256, 8, 1, 64, 32, 64),     # G = 8: triton
                 Shape(1, 256, 64, 2, 128, 32, 64),   # G = 32: tlx_ws, tlx_pingpong
                 Shape(1, 256, 128, 2, 128, 32, 64),  # G = 64: the tlx_ws backward
                 Shape(1, 256, 256, 2, 128, 32, 64))  # G = 128 only
RAGGED_N = (Shape(2, 333, 128, 1, 128, 32, 96),)      # G = 128: every variant today


@dataclass(frozen=True)
class Allowance:
    """Findings of one (tool, pass, variant) explained in the docs: at most `count` per run (None:
    any number) and, with `pattern`, only findings whose report line matches it (re.search)."""

    doc: str                    # where the explanation is, e.g. "docs/sanitizers.md#a-section"
    count: int | None = None
    pattern: str | None = None


# The allow-list, keyed by (tool, pass, variant): the one place that excuses a finding, each
# entry pointing at the docs section that explains it (the first of them, where it covers more).
DISPATCH_DOC = "docs/sanitizers.md#the-warp-specialization-dispatch-issue-23"
TMA_INIT_DOC = "docs/sanitizers.md#plain-triton-tma-loads-mbarrier-init-then-arrive-in-one-warp"
RELEASE_DOC = "docs/sanitizers.md#a-warp-groups-reads-released-by-one-threads-mbarrier-arrive"


def _lines(path: str, needle: str) -> list[int]:
    """The 1-based numbers of the lines of REPO_ROOT/path that contain `needle`."""
    with open(os.path.join(REPO_ROOT, path)) as f:
        return [i for i, line in enumerate(f, 1) if needle in line]


def _at(kernel: str, path: str, needle: str) -> str:
    """A regex for "KERNEL+0x... in FILE:LINE" at the lines of `path` holding `needle`, as
    racecheck names a kernel's instruction (the file as its path or its name)."""
    lines = "|".join(map(str, _lines(path, needle)))
    return rf"{kernel}\+0x[0-9a-f]+ in (\S*/)?{re.escape(os.path.basename(path))}:({lines})"


def _race(severity: str, *write_at: str) -> str:
    """The analysis report line of a race ("Error" or "Warning") whose write is at one of
    `write_at` (regexes; racecheck's analysis report names the write first)."""
    return rf"^{severity}: Race reported between Write access at ({'|'.join(write_at)})$"


# Where the write of each explained race is: the kernel's entry line (the dispatch: the line info
# places no other shared-memory instruction there), Triton's descriptor loads, a producer's store
# into a ring slot that consumers read with plain loads.
WS_FWD_ENTRY = _at("simplicial_fwd_ws_kernel", "kernels_tlx/simplicial/ws.py", "def simplicial_fwd_ws_kernel(")
WS_KV_ENTRY = _at("simplicial_fwd_ws_kv_kernel", "kernels_tlx/simplicial/ws_kv.py",
                  "def simplicial_fwd_ws_kv_kernel(")
WS_BWD_ENTRY = _at("_dkv2_ws_kernel", "kernels_tlx/simplicial/bwd_ws.py", "def _dkv2_ws_kernel(")
PAIRS_ENTRY = _at("_pairs_kernel", "kernels_tlx/simplicial/bwd_pairs.py", "def _pairs_kernel(")
FWD_TMA_INIT = _at("simplicial_fwd_kernel", "kernels_triton/simplicial/fwd.py", "2.load([b, kb, g * D])")
DQ_TMA_INIT = "|".join((_at("_dq_kernel", "kernels_triton/simplicial/bwd.py", "for kb in range(k_lo, i_hi"),
                        _at("_dq_kernel", "kernels_triton/simplicial/bwd.py", "x, z = _dq_step(")))
WS_KEYS_V1 = _at("simplicial_fwd_ws_keys_kernel", "kernels_tlx/simplicial/ws_keys.py",
                 "tlx.local_store(tlx.local_view(v1_slots, bs), v1)")

ALLOWED: dict[tuple[str, str, str], Allowance] = {
    # The compiler's warp-specialization dispatch: racecheck's one report of the exit-code store
    # against the workers' dispatch load.
    ("racecheck", "fwd", "tlx_ws"): Allowance(DISPATCH_DOC, 1, _race("Error", WS_FWD_ENTRY)),
    ("racecheck", "fwd", "tlx_pingpong"): Allowance(DISPATCH_DOC, 1, _race("Error", WS_FWD_ENTRY)),
    # the same in the pipelined tlx_ws_kv kernels, reported in their form "det" runs only
    ("racecheck", "fwd", "tlx_pipelined_kv"): Allowance(DISPATCH_DOC, 1,
                                                        _race("Error", WS_KV_ENTRY)),
    ("racecheck", "fwd", "tlx_pipelined_pingpong"): Allowance(DISPATCH_DOC, 1,
                                                              _race("Error", WS_KV_ENTRY)),
    # Triton's TMA load: warp 0 inits an mbarrier, then thread 0 arrives on it (ordered in SASS).
    ("racecheck", "fwd", "triton"): Allowance(TMA_INIT_DOC, 2, _race("Warning", FWD_TMA_INIT)),
    ("racecheck", "bwd", "triton"): Allowance(TMA_INIT_DOC, 1, _race("Warning", DQ_TMA_INIT)),
    # A producer's store into a slot whose last reads (plain loads of a consumer warp group) are
    # released by one thread's mbarrier arrive after the group's barrier (seen once in three runs).
    ("racecheck", "fwd", "tlx_ws_keys"): Allowance(RELEASE_DOC, 1, _race("Error", WS_KEYS_V1)),
    # tlx_ws's backward: its k-owner's dispatch (its row-owner, TLX at every G it takes, is clean)
    ("racecheck", "bwd", "tlx_ws"): Allowance(DISPATCH_DOC, 1, _race("Error", WS_BWD_ENTRY)),
    # tlx_pairs's: the same report at its entry, at one of the two shapes (session 21)
    ("racecheck", "bwd", "tlx_pairs"): Allowance(DISPATCH_DOC, 1, _race("Error", PAIRS_ENTRY)),
}


@dataclass(frozen=True)
class Run:
    tool: str
    pass_: str           # "fwd", "bwd" or PROBE
    variant: str         # a registered variant, or PROBE_NAME
    shape: Shape | None  # None for the probe (its launch is its own)
    form: str = "trilinear"  # the logits' form (one of the variant's `forms`)

    def tag(self) -> str:
        s = self.shape
        if s is None:
            return f"{self.tool}-{self.pass_}-{self.variant}"
        form = "" if self.form == "trilinear" else f"-{self.form}"
        return (f"{self.tool}-{self.pass_}-{self.variant}-B{s.B}-N{s.N}-H{s.Hq}x{s.Hk}-D{s.D}"
                f"-w{s.w1}x{s.w2}{form}")

    def shape_text(self) -> str:
        if self.shape is None:
            return "probe launch"
        return self.shape.short() + ("" if self.form == "trilinear" else f" form={self.form}")


@dataclass
class Report:
    """What a run's log says: `findings` (None: no summary line, the sanitizer did not finish),
    the report line of each finding, and whether the worker got to its last line."""

    findings: int | None
    lines: list[str] = field(default_factory=list)
    done: bool = False


# ---------------------------------------------------------------------------------------------
# Shapes and runs (no GPU)


def shapes_for(v: registry.Variant, form: str = "trilinear") -> list[Shape]:
    """The variant's two shapes in the logits' `form`: the first it takes of SMALL_G_OR_HK and of
    RAGGED_N (fewer when it takes none of a list: plan() refuses that)."""
    return [s for s in (next((c for c in cands if v.cannot_take(c.spec(form)) is None), None)
                        for cands in (SMALL_G_OR_HK, RAGGED_N)) if s is not None]


def plan(tools: Sequence[str], passes: Sequence[str], names: Sequence[str] | None,
         shape_sets: Sequence[str] = SHAPE_SETS,
         forms: Sequence[str] | None = None) -> list[Run]:
    """Every (tool, pass, variant, shape, form) to run: the probe's first (one per tool, when
    PROBE is among `passes`), then grouped by variant and form; `names` None: every registered
    variant of the passes; `shape_sets`: which of each variant's two shapes ("small": of
    SMALL_G_OR_HK, "ragged": of RAGGED_N); `forms` None: every form each variant computes (its
    `forms`), else those of them in `forms`. ValueError for a name no chosen pass has, or a
    variant that takes no candidate shape of a list."""
    runs = [Run(t, PROBE, PROBE_NAME, None) for t in tools] if PROBE in passes else []
    variants = [v for p in passes if p != PROBE for v in registry.all_variants(p)
                if names is None or v.name in names]
    for n in names or ():
        if not any(v.name == n for v in variants):
            real = [p for p in passes if p != PROBE] or [PROBE]
            raise ValueError(f"--variant {n}: not a variant of pass {' or '.join(real)}")
    for v in variants:
        for form in (f for f in v.accepted("form") if forms is None or f in forms):
            shapes = shapes_for(v, form)
            if len(shapes) < 2:
                raise ValueError(f"{v.name} ({v.pass_}, form {form}) takes no shape of "
                                 f"SMALL_G_OR_HK or of RAGGED_N in {PROG}: add one it takes")
            shapes = [s for s, name in zip(shapes, SHAPE_SETS) if name in shape_sets]
            runs += [Run(t, v.pass_, v.name, s, form) for s in shapes for t in tools]
    return runs


def find_sanitizer() -> str | None:
    """compute-sanitizer: $COMPUTE_SANITIZER when set, else on PATH, else in $CUDA_HOME/bin or
    /usr/local/cuda/bin (the toolkit's place, often not on PATH); None when absent."""
    if os.environ.get("COMPUTE_SANITIZER"):
        path = os.environ["COMPUTE_SANITIZER"]
        return path if os.access(path, os.X_OK) else None
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        path = os.path.join(home, "bin", "compute-sanitizer") if home else ""
        if path and os.access(path, os.X_OK):
            return path
    return None


def command(sanitizer: str, run: Run, racecheck_report: str = "analysis") -> list[str]:
    """The child process of one run: the sanitizer around this script's --worker; racecheck
    with `racecheck_report` (RACECHECK_REPORTS)."""
    s = run.shape
    tool_args = (("--racecheck-report", racecheck_report) if run.tool == "racecheck"
                 else TOOL_ARGS[run.tool])
    cmd = [sanitizer, "--tool", run.tool, *COMMON_ARGS, *tool_args]
    if run.pass_ == PROBE:
        return cmd + ["--kernel-name", f"kns={PROBE_KERNEL}", sys.executable, SCRIPT,
                      "--worker", "--pass", PROBE]
    if run.pass_ == "bwd":
        cmd += ["--kernel-name-exclude", f"kns={FWD_KERNEL_PREFIX}"]
    form = [] if run.form == "trilinear" else ["--form", run.form]
    return cmd + [sys.executable, SCRIPT, "--worker", "--pass", run.pass_, "--variant",
                  run.variant, "--shape", *map(str, (s.B, s.N, s.Hq, s.Hk, s.D, s.w1, s.w2)),
                  *form]


# ---------------------------------------------------------------------------------------------
# Reading a report, judging it (no GPU)

_ERRORS = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACES = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, "
                    r"(\d+) warnings?\)")
# The sanitizer's own lines ("========= " then text; detail lines are indented further) that are
# not findings.
_NOT_FINDINGS = re.compile(r"COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|"
                           r"Target application returned an error|"
                           r"process didn't terminate successfully")


def parse_report(text: str, tool: str) -> Report:
    """The findings of a sanitizer log: racecheck's errors + warnings from its summary, the other
    tools' error count; the report line of each finding (the sanitizer's unindented lines); and
    whether the worker printed WORKER_DONE."""
    if tool == "racecheck":
        counts = [int(e) + int(w) for _, e, w in _RACES.findall(text)]
    else:
        counts = [int(n) for n in _ERRORS.findall(text)]
    lines = [m.group(1).rstrip() for m in re.finditer(r"^========= (\S.*)$", text, re.M)
             if not _NOT_FINDINGS.search(m.group(1))]
    done = any(line.startswith(WORKER_DONE) for line in text.splitlines())
    return Report(sum(counts) if counts else None, lines, done)


def judge(run: Run, report: Report, returncode: int | None,
          allowed: dict[tuple[str, str, str], Allowance] | None = None) -> tuple[bool, str]:
    """(passed, verdict) of a run: its report, the sanitizer's exit status (None: timed out) and
    the allow-list (default ALLOWED)."""
    allowed = ALLOWED if allowed is None else allowed
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
    if entry.pattern is not None:
        stray = [line for line in report.lines if not re.search(entry.pattern, line)]
        if stray:
            return False, f"{n} findings, {len(stray)} outside the allowed pattern: {stray[0]}"
    return True, f"{n} findings, allowed ({entry.doc})"


# ---------------------------------------------------------------------------------------------
# Running (GPU)


# The children running now, so that an interrupted run (Ctrl-C) can end them: each runs in its
# own session (start_new_session), where the terminal's SIGINT does not reach it.
_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()
_STOP = threading.Event()


def execute(run: Run, sanitizer: str, out_dir: str, timeout: int,
            racecheck_report: str = "analysis") -> tuple[str, int | None]:
    """Run one child under the sanitizer, its output (after the command line) into its log.
    Returns (log path, exit status or None when it ran past `timeout` seconds and was killed, or
    was not started because the whole run is being stopped)."""
    log = os.path.join(out_dir, f"{run.tag()}.log")
    cmd = command(sanitizer, run, racecheck_report)
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        with _LIVE_LOCK:
            if _STOP.is_set():
                return log, None
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                    env=env, start_new_session=True)
            _LIVE.add(proc)
        try:
            return log, proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)  # the sanitizer and its python child
            proc.wait()
            return log, None
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def stop_all() -> None:
    """Start no more children and kill the running ones (their process groups)."""
    with _LIVE_LOCK:
        _STOP.set()
        live = list(_LIVE)
    for proc in live:
        _kill(proc)


def run_all(runs: Sequence[Run], sanitizer: str, out_dir: str, timeout: int, jobs: int = 1,
            racecheck_report: str = "analysis", report=None) -> list[dict]:
    """Every run, up to `jobs` children at once, each judged when its child ends; `report(i, row)`
    is called in the order of `runs` (run i's line waits for runs 1 .. i - 1). Returns the rows
    of the table, in that order. Ctrl-C kills the running children and re-raises."""
    def one(r: Run) -> tuple[str, int | None, float]:
        t0 = time.monotonic()
        log, rc = execute(r, sanitizer, out_dir, timeout, racecheck_report)
        return log, rc, time.monotonic() - t0

    rows = []
    _STOP.clear()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, r) for r in runs]
        try:
            for i, (r, fut) in enumerate(zip(runs, futures), 1):
                log, rc, secs = fut.result()
                with open(log, errors="replace") as f:
                    rep = parse_report(f.read(), r.tool)
                ok, verdict = judge(r, rep, rc)
                row = {"tool": r.tool, "pass": r.pass_, "variant": r.variant,
                       "shape": r.shape_text(), "findings": rep.findings,
                       "verdict": ("ok: " if ok else "FAIL: ") + verdict,
                       "seconds": round(secs), "log": os.path.relpath(log, out_dir), "ok": ok}
                rows.append(row)
                if report is not None:
                    report(i, row)
        except BaseException:
            for fut in futures:
                fut.cancel()
            stop_all()
            raise
    return rows


def worker(pass_: str, variant: str | None, s: Shape | None, form: str = "trilinear") -> int:
    """One call of `variant` of `pass_` on `s` in the logits' `form` (what a run checks), or the
    probe's one launch (pass_ PROBE), then WORKER_DONE."""
    import torch

    from profiling.common import pass_inputs, run_pass
    problem = gpu_problem(PROG)
    if problem is not None:
        return problem
    if pass_ == PROBE:
        from profiling import ws_probe
        ws_probe.run()
        print(f"{WORKER_DONE}: {PROBE} {PROBE_NAME} {ws_probe.GRID} CTAs", flush=True)
        return 0
    inputs = pass_inputs(pass_, s, form=form)
    run_pass(pass_, variant, inputs, s, form=form)
    torch.cuda.synchronize()
    print(f"{WORKER_DONE}: {pass_} {variant} {s.short()} form={form}", flush=True)
    return 0


COLUMNS = [("tool", "tool"), ("pass", "pass"), ("variant", "variant"), ("shape", "shape"),
           ("findings", "findings"), ("verdict", "verdict"), ("seconds", "s"), ("log", "log")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 every run passed, 1 a finding not allowed or a run that did not "
               "finish, 2 bad arguments, no compute-sanitizer ($COMPUTE_SANITIZER, PATH, "
               "$CUDA_HOME/bin, /usr/local/cuda/bin) or no Hopper GPU.")
    p.add_argument("--tool", nargs="+", choices=TOOLS, default=list(TOOLS), metavar="TOOL",
                   help=f"sanitizer tools (default: all of {', '.join(TOOLS)})")
    p.add_argument("--pass", dest="passes", nargs="+", choices=PASSES,
                   default=list(registry.PASSES), metavar="PASS",
                   help=f"passes (default: {' '.join(registry.PASSES)}); '{PROBE}' adds the "
                        "warp-specialization probe (profiling/ws_probe.py, not a variant: one "
                        "run per tool)")
    p.add_argument("--variant", nargs="+", choices=variant_names(), metavar="NAME",
                   help="variants (default: every registered variant of the passes): "
                        f"{', '.join(variant_names())}")
    p.add_argument("--out", metavar="DIR", default="out/sanitize",
                   help="directory of the logs and summary.txt (default: out/sanitize; created)")
    p.add_argument("--shapes", nargs="+", choices=SHAPE_SETS, default=list(SHAPE_SETS),
                   metavar="SET", help="which of each variant's shapes: small (of SMALL_G_OR_HK), "
                                       "ragged (of RAGGED_N) (default: both)")
    p.add_argument("--racecheck-report", choices=RACECHECK_REPORTS, default="analysis",
                   help="racecheck's report: analysis (one finding per pair of racing accesses, "
                        "the default), hazard (each hazard, with the threads and the address) or "
                        "all")
    p.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                   help="children run at once on the one GPU (default: 1); lines and table keep "
                        "the order of the runs")
    p.add_argument("--timeout", type=positive_int, default=1800, metavar="S",
                   help="seconds one run may take before it is killed (default: 1800)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the runs and their commands, run nothing (no GPU needed)")
    p.add_argument("--form", nargs="+", choices=FORMS, metavar="FORM",
                   help=f"the logits' forms to check: {', '.join(FORMS)} (default: every form "
                        f"each variant computes, its registry `forms`)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", nargs=7, type=positive_int, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        if args.passes == [PROBE]:
            return worker(PROBE, None, None)
        if not args.shape or not args.variant or len(args.variant) != 1 or len(args.passes) != 1:
            parser.error("--worker needs --shape B N Hq Hk D w1 w2, one --variant and one --pass")
        if args.form is not None and len(args.form) != 1:
            parser.error("--worker takes one --form")
        return worker(args.passes[0], args.variant[0], Shape(*args.shape),
                      (args.form or ["trilinear"])[0])
    try:
        runs = plan(args.tool, args.passes, args.variant, args.shapes, args.form)
    except ValueError as e:
        parser.error(str(e))
    sanitizer = find_sanitizer()
    if args.dry_run:
        for i, r in enumerate(runs, 1):
            cmd = command(sanitizer or "compute-sanitizer", r, args.racecheck_report)
            print(f"[{i}/{len(runs)}] {r.tool} {r.pass_} {r.variant} {r.shape_text()}: "
                  f"{shlex.join(cmd)}")
        return 0
    if sanitizer is None:
        print(f"{PROG}: compute-sanitizer not found ($COMPUTE_SANITIZER, PATH, $CUDA_HOME/bin, "
              f"/usr/local/cuda/bin); it comes with the CUDA toolkit", file=sys.stderr)
        return 2
    problem = gpu_problem(PROG)
    if problem is not None:
        return problem
    import torch
    if any(r.pass_ == PROBE or registry.get(r.variant, r.pass_).needs_hopper for r in runs):
        major, minor = torch.cuda.get_device_capability()
        if major != 9:
            print(f"{PROG}: the variants need a Hopper GPU (sm_90); this one is sm_{major}{minor}",
                  file=sys.stderr)
            return 2
    os.makedirs(args.out, exist_ok=True)
    print(f"{len(runs)} runs, {args.jobs} at a time, logs in {args.out}; {sanitizer}", flush=True)

    def line(i: int, row: dict) -> None:
        print(f"[{i}/{len(runs)}] {row['tool']} {row['pass']} {row['variant']} {row['shape']}: "
              f"{'ok' if row['ok'] else 'FAIL'}, {row['verdict'].split(': ', 1)[1]} "
              f"({row['seconds']} s)", flush=True)

    t0 = time.monotonic()
    try:
        rows = run_all(runs, sanitizer, args.out, args.timeout, args.jobs,
                       args.racecheck_report, line)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; the running children were killed", file=sys.stderr)
        return 130
    failed = sum(not r["ok"] for r in rows)
    table = format_table(rows, COLUMNS)
    summary = (f"{table}\n{len(runs) - failed} of {len(runs)} runs passed "
               f"({time.monotonic() - t0:.0f} s, --jobs {args.jobs})")
    print(f"\n{summary}")
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

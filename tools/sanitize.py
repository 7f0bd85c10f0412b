"""Compute-sanitizer runs anyone can repeat: memcheck, racecheck and synccheck on every registered
variant of a family (--family, default simplicial), forward and backward, in each logits' form it
computes, at the family's small shapes (Family.sanitizer_shapes), failing on any finding that the
family's allow-list (its record's `sanitizer_allowed`, altattn/<family>/family.py: one entry per
explained finding, for every form of the variant) does not name. docs/sanitizers.md says what is
allowed and why.

    python3 tools/sanitize.py                                   # everything (GPU)
    python3 tools/sanitize.py --tool racecheck --pass fwd --variant tlx_ws
    python3 tools/sanitize.py --jobs 4                          # 4 children at once
    python3 tools/sanitize.py --tool racecheck --pass probe     # the warp-specialization probe
    python3 tools/sanitize.py --dry-run                         # the runs, no GPU needed
    python3 tools/sanitize.py --form det                        # form "det" only

Each run is one child process, `compute-sanitizer --tool T --error-exitcode 1 ... python3
tools/sanitize.py --worker ...`, that calls one variant of one pass once on one shape
(launcher.run on the family's make_inputs; the backward after a plain forward, whose kernels are
excluded from the check: forward_kernel_prefix; where the passes share kernels, as triple
attention's, nothing is excluded and the backward run checks the forward's kernels too).
Its whole output is OUT/<tool>-<pass>-<variant>-<shape>.log. A finding is what the
sanitizer's summary counts: memcheck and synccheck "ERROR SUMMARY: N errors", racecheck
"RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)" (E + W; racecheck looks at shared
memory only). A run passes when it finished (the worker printed its last line) with no finding,
or with findings that its allow-list entry covers. `--jobs N` runs up to N children at once on the
one GPU; the lines and the table stay in the order of the runs.

The probe (`--pass probe`, not a variant, not in the default passes): tools/ws_probe.py's
kernel, which has our TLX kernels' warp-specialized task layout and no shared memory of its own,
so a finding in it is the compiler's dispatch code's, one run per tool.

Shapes: for each variant, the first shape it takes of each group of its family's
`sanitizer_shapes` (chosen with Variant.cannot_take, so without a GPU); `--shapes 1 2` picks
groups by number. PyTorch's caching allocator is off in the child (PYTORCH_NO_CUDA_MEMORY_CACHING):
each tensor is its own allocation, so memcheck sees an access past its end.

Exit status: 0 every run passed; 1 a finding not allowed, or a run that did not finish; 2 bad
arguments, no compute-sanitizer, no GPU, or a GPU that is not a Hopper.
"""
from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # `python3 tools/sanitize.py` from a checkout
    sys.path.insert(0, REPO_ROOT)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
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

from altattn import registry  # noqa: E402
from profiling.common import (DEFAULT_FAMILY, add_family_arg, form_options,  # noqa: E402
                              format_table, forms_of, gpu_problem, parse_shape, positive_int,
                              shape_spec)
from tools.sanitize_report import (WORKER_DONE, Allowance, Report,  # noqa: E402,F401
                                       allowed_for, judge, parse_report)

PROG = "tools/sanitize.py"
SCRIPT = os.path.abspath(__file__)
TOOLS = ("memcheck", "racecheck", "synccheck")
# Options of every run, then each tool's. --print-limit: every finding printed, so the summary
# counts what the log shows. racecheck's "analysis" report (its default) gives one finding per
# pair of racing accesses, with the count of hazards behind it; "hazard" or "all" print each.
COMMON_ARGS = ("--error-exitcode", "1", "--print-limit", "10000")
TOOL_ARGS = {"memcheck": (), "racecheck": ("--racecheck-report", "analysis"), "synccheck": ()}
RACECHECK_REPORTS = ("analysis", "hazard", "all")  # --racecheck-report: its first is the default
# The probe: a run kind beside the passes, not a registered variant (tools/ws_probe.py).
PROBE = "probe"
PROBE_NAME = "ws_probe"
PROBE_KERNEL = "ws_probe_kernel"   # its one kernel; the probe's runs check only it
PASSES = (*registry.PASSES, PROBE)


def _kernel_name(fn) -> str:
    return getattr(fn, "__name__", None) or fn.fn.__name__


@functools.lru_cache(maxsize=None)
def forward_kernel_prefix(family: str) -> str | None:
    """The longest common start of the names of `family`'s forward kernels (its forward variants'
    compile configs), which no backward kernel's name has: a backward run excludes the kernels
    whose names start with it (its plain forward, for out and LSE, is not what it checks).
    None when there is none (the passes share kernels: a backward run then checks them all)."""
    fwd = {_kernel_name(c.fn) for _, c in registry.compile_configs("fwd", family)}
    bwd = {_kernel_name(c.fn) for _, c in registry.compile_configs("bwd", family)}
    prefix = os.path.commonprefix(sorted(fwd))
    if not prefix or any(n.startswith(prefix) for n in bwd):
        return None
    return prefix


@dataclass(frozen=True)
class Run:
    tool: str
    pass_: str           # "fwd", "bwd" or PROBE
    variant: str         # a registered variant, or PROBE_NAME
    shape: object | None  # the family's shape type; None for the probe (its launch is its own)
    # the logits' form (one of the variant's accepted("form")); None: the family's plain one
    form: str | None = None
    family: str = field(kw_only=True)  # whose variant (the probe: the family whose plan has it)

    def other_form(self) -> str | None:
        """The form, when it is not the family's plain one (what tags and commands name)."""
        plain = (forms_of(registry.get_family(self.family)) or [None])[0]
        return None if self.form in (None, plain) else self.form

    def tag(self) -> str:
        s = self.shape
        if s is None:
            return f"{self.tool}-{self.pass_}-{self.variant}"
        form = "" if self.other_form() is None else f"-{self.form}"
        shape = re.sub(r"[^\w.=-]+", "-", s.short().replace("/", "x"))  # a file name
        return f"{self.tool}-{self.pass_}-{self.variant}-{shape}{form}"

    def shape_text(self) -> str:
        if self.shape is None:
            return "probe launch"
        return self.shape.short() + ("" if self.other_form() is None else f" form={self.form}")


# ---------------------------------------------------------------------------------------------
# Shapes and runs (no GPU)


def shapes_for(v: registry.Variant, form: str | None = None) -> list:
    """The variant's shapes in the logits' `form` (None: the family's plain one): the first it
    takes of each group of its family's sanitizer_shapes (fewer when it takes none of a group:
    plan() refuses that)."""
    groups = registry.get_family(v.family).sanitizer_shapes
    return [s for s in (next((c for c in cands if v.cannot_take(shape_spec(c, form)) is None),
                             None)
                        for cands in groups) if s is not None]


def plan(tools: Sequence[str], passes: Sequence[str], names: Sequence[str] | None,
         groups: Sequence[int] | None = None, forms: Sequence[str] | None = None, *,
         family: str) -> list[Run]:
    """Every (tool, pass, variant, shape, form) of `family` to run: the probe's first (one per
    tool, when PROBE is among `passes`), then grouped by variant and form; `names` None: every
    registered variant of the passes; `groups`: which of each variant's shapes, by the 1-based
    number of their group in Family.sanitizer_shapes (None: all); `forms` None: every form each
    variant computes, else those of them in `forms`. ValueError for a name no chosen pass has, a
    group number the family lacks, or a variant that takes no shape of a group."""
    n_groups = len(registry.get_family(family).sanitizer_shapes)
    for g in groups or ():
        if not 1 <= g <= n_groups:
            raise ValueError(f"--shapes {g}: family {family} has {n_groups} shape groups")
    runs = ([Run(t, PROBE, PROBE_NAME, None, family=family) for t in tools] if PROBE in passes
            else [])
    variants = [v for p in passes if p != PROBE for v in registry.all_variants(p, family)
                if names is None or v.name in names]
    for n in names or ():
        if not any(v.name == n for v in variants):
            real = [p for p in passes if p != PROBE] or [PROBE]
            raise ValueError(f"--variant {n}: not a variant of pass {' or '.join(real)}")
    has_forms = "form" in registry.get_family(family).accepts
    for v in variants:
        for form in (f for f in (v.accepted("form") if has_forms else (None,))
                     if forms is None or f is None or f in forms):
            shapes = shapes_for(v, form)
            if len(shapes) < n_groups:
                raise ValueError(f"{v.name} ({v.pass_}{'' if form is None else ', form ' + form}"
                                 f") takes no shape of some "
                                 f"group of {family}'s sanitizer_shapes: add one it takes")
            shapes = [s for g, s in enumerate(shapes, 1) if groups is None or g in groups]
            runs += [Run(t, v.pass_, v.name, s, form, family=family) for s in shapes for t in tools]
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
    if run.pass_ == "bwd" and (prefix := forward_kernel_prefix(run.family)) is not None:
        cmd += ["--kernel-name-exclude", f"kns={prefix}"]
    form = [] if run.other_form() is None else ["--form", run.form]
    family = [] if run.family == DEFAULT_FAMILY else ["--family", run.family]
    return cmd + [sys.executable, SCRIPT, "--worker", "--pass", run.pass_, "--variant",
                  run.variant, "--shape", *map(str, dataclasses.astuple(s)), *form, *family]


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


def worker(pass_: str, variant: str | None, s, form: str | None, family: str) -> int:
    """One call of `variant` of (family, pass_) on `s` in the logits' `form` (what a run checks),
    or the probe's one launch (pass_ PROBE), then WORKER_DONE."""
    import torch

    from altattn import launcher
    problem = gpu_problem(PROG)
    if problem is not None:
        return problem
    if pass_ == PROBE:
        from tools import ws_probe
        ws_probe.run()
        print(f"{WORKER_DONE}: {PROBE} {PROBE_NAME} {ws_probe.GRID} CTAs", flush=True)
        return 0
    inputs = registry.get_family(family).make_inputs(s, pass_, seed=0, device="cuda",
                                                     **form_options(form))
    launcher.run(family, pass_, *inputs, variant=variant)
    torch.cuda.synchronize()
    print(f"{WORKER_DONE}: {pass_} {variant} {s.short()}"
          + ("" if form is None else f" form={form}"), flush=True)
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
                        "warp-specialization probe (tools/ws_probe.py, not a variant: one "
                        "run per tool)")
    names = list(dict.fromkeys(v.name for v in registry.all_variants(None, None)))
    forms = sorted({f for v in registry.all_variants(None, None)
                    for f in (v.accepted("form") if "form" in registry.get_family(
                        v.family).accepts else ())})
    add_family_arg(p)
    p.add_argument("--variant", nargs="+", choices=names, metavar="NAME",
                   help="variants (default: every registered variant of the family's passes): "
                        f"{', '.join(names)}")
    p.add_argument("--out", metavar="DIR", default="out/sanitize",
                   help="directory of the logs and summary.txt (default: out/sanitize; created)")
    p.add_argument("--shapes", nargs="+", type=positive_int, metavar="GROUP",
                   help="which of each variant's shapes, by the number (from 1) of their group "
                        "in the family's sanitizer_shapes (default: every group)")
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
    p.add_argument("--form", nargs="+", choices=forms, metavar="FORM",
                   help=f"the logits' forms to check: {', '.join(forms)} (default: every form "
                        f"each variant computes, its record's accepted('form'))")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", nargs="+", help=argparse.SUPPRESS)  # the shape's fields, as text
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        if args.passes == [PROBE]:
            return worker(PROBE, None, None, None, args.family)
        if not args.shape or not args.variant or len(args.variant) != 1 or len(args.passes) != 1:
            parser.error("--worker needs --shape (the shape's fields), one --variant and one "
                         "--pass")
        if args.form is not None and len(args.form) != 1:
            parser.error("--worker takes one --form")
        try:
            shape = parse_shape(registry.get_family(args.family), args.shape)
        except ValueError as e:
            parser.error(f"--shape: {e}")
        return worker(args.passes[0], args.variant[0], shape, (args.form or [None])[0],
                      args.family)
    try:
        runs = plan(args.tool, args.passes, args.variant, args.shapes, args.form,
                    family=args.family)
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
    if any(r.pass_ == PROBE or registry.get(r.variant, r.pass_, r.family).needs_hopper
           for r in runs):
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

"""Tests of tools/sanitize.py on the CPU: reading sanitizer reports (realistic sample text of
memcheck, racecheck and synccheck), the allow-list's verdicts, the shapes and runs chosen per
variant (registry only), the probe's runs, the child's command; (gpu marker) the worker of every
planned run, the probe's included, without the sanitizer. The command line and its children
(--jobs, with a stand-in sanitizer script): test_sanitize_cli.py."""
from __future__ import annotations

import os
import re
import sys

import pytest

from tools import sanitize, sanitize_report
from tools.sanitize import Allowance, Report, Run, judge, parse_report
from altattn import registry
from conftest import ROOT

REPO_ROOT = str(ROOT)  # the checkout (conftest puts it on sys.path)

FAM = "simplicial"  # the family whose runs these are
FAMILY = registry.get_family(FAM)
SMALL = FAMILY.sanitizer_shapes[0][0]
RAGGED = FAMILY.sanitizer_shapes[1][0]
DONE = f"{sanitize.WORKER_DONE}: fwd tlx_ws B2 N333 H128/1 D128 w32x96"

MEMCHECK_CLEAN = f"""$ compute-sanitizer --tool memcheck --error-exitcode 1 ...
========= COMPUTE-SANITIZER
{DONE}
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK_OOB = """$ compute-sanitizer --tool memcheck --error-exitcode 1 ...
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at simplicial_fwd_kernel+0x1a40 in /repo/kernels_triton/simplicial/tiling.py:171
=========     by thread (32,0,0) in block (5,0,0)
=========     Address 0x7f3a2c000400 is out of bounds
=========     and is 1,024 bytes after the nearest allocation at 0x7f3a2bf00000 of size \
1,048,576 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2f0e2f] in libcuda.so.1
=========
========= Invalid __global__ read of size 16 bytes
=========     at simplicial_fwd_kernel+0x1a40 in /repo/kernels_triton/simplicial/tiling.py:171
=========     by thread (33,0,0) in block (5,0,0)
=========
Traceback (most recent call last):
RuntimeError: CUDA error: unspecified launch failure
========= Program hit CUDA_ERROR_LAUNCH_FAILED (error 719) due to "unspecified launch failure" on \
CUDA API call to cuStreamSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========
========= Target application returned an error
========= ERROR SUMMARY: 3 errors
"""

RACECHECK = f"""$ compute-sanitizer --tool racecheck --error-exitcode 1 ...
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at simplicial_fwd_ws_kernel+0x3b70 in \
/repo/kernels_tlx/simplicial/ws.py:131
=========     and Read access at simplicial_fwd_ws_kernel+0x4c20 in /repo/kernels_tlx/simplicial/ws.py:140 \
[512 hazards]
=========
========= Warning: Race reported between Read access at simplicial_fwd_ws_kernel+0x51a0 in \
/repo/kernels_tlx/simplicial/common.py:50
=========     and Write access at simplicial_fwd_ws_kernel+0x2210 in /repo/kernels_tlx/simplicial/ws.py:88 \
[64 hazards]
=========
{DONE}
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""

RACECHECK_CLEAN = f"""========= COMPUTE-SANITIZER
{DONE}
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""

SYNCCHECK = f"""========= COMPUTE-SANITIZER
========= Barrier error detected. Divergent thread(s) in warp
=========     at _dq_kernel+0x9c0 in /repo/kernels_triton/simplicial/bwd.py:359
=========     by thread (0,0,0) in block (3,0,0)
=========
{DONE}
========= ERROR SUMMARY: 1 error
"""


# ---------------------------------------------------------------------------------------------
# Reports


def test_parse_clean_reports():
    for text, tool in ((MEMCHECK_CLEAN, "memcheck"), (RACECHECK_CLEAN, "racecheck")):
        r = parse_report(text, tool)
        assert r == Report(0, [], True), tool


def test_parse_memcheck_findings_and_a_worker_that_died():
    r = parse_report(MEMCHECK_OOB, "memcheck")
    assert r.findings == 3 and not r.done
    hit = ('Program hit CUDA_ERROR_LAUNCH_FAILED (error 719) due to "unspecified launch failure" '
           "on CUDA API call to cuStreamSynchronize.")
    assert r.lines == ["Invalid __global__ read of size 16 bytes"] * 2 + [hit]


def test_parse_racecheck_counts_errors_and_warnings():
    r = parse_report(RACECHECK, "racecheck")
    assert r.findings == 2 and r.done
    assert [line.split(" at ")[0] for line in r.lines] == [
        "Error: Race reported between Write access", "Warning: Race reported between Read access"]
    assert parse_report(RACECHECK.replace("(1 error, 1 warning)", "(228 errors, 0 warnings)")
                        .replace("2 hazards", "228 hazards"), "racecheck").findings == 228


def test_parse_synccheck_and_a_report_without_summary():
    r = parse_report(SYNCCHECK, "synccheck")
    assert r.findings == 1 and r.done and r.lines == [
        "Barrier error detected. Divergent thread(s) in warp"]
    r = parse_report("========= COMPUTE-SANITIZER\nSegmentation fault\n", "memcheck")
    assert r.findings is None and not r.done
    # racecheck's count is its own summary's, not an ERROR SUMMARY
    assert parse_report("========= ERROR SUMMARY: 0 errors\n", "racecheck").findings is None


# ---------------------------------------------------------------------------------------------
# The allow-list


RUN = Run("racecheck", "fwd", "tlx_ws", RAGGED, family=FAM)


def test_every_allow_list_entry_points_at_the_docs():
    assert sanitize_report.allowed_for(FAM)  # the dispatch and the TMA-init findings
    for (tool, pass_, name), entry in sanitize_report.allowed_for(FAM).items():
        assert tool in sanitize.TOOLS and registry.get(name, pass_, FAM)
        path, _, anchor = entry.doc.partition("#")
        with open(os.path.join(REPO_ROOT, path)) as f:
            assert anchor and anchor in _anchors(f.read()), entry.doc


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings of a markdown text."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", markdown, re.M)}


def test_judge_clean_and_unexplained():
    assert judge(RUN, parse_report(RACECHECK_CLEAN, "racecheck"), 0) == (True, "clean")
    ok, why = judge(RUN, parse_report(RACECHECK, "racecheck"), 1, allowed={})
    assert not ok and why == "2 findings, not allowed"
    ok, why = judge(RUN, parse_report(RACECHECK, "racecheck"), 1)  # the allow-list: not these lines
    assert not ok


def _race(severity: str, kernel: str, first: tuple[str, int, str], second: tuple[str, int, str],
          read_kernel: str | None = None) -> str:
    """A racecheck analysis report of one race: (access, SASS offset, FILE:LINE) of each side."""
    (a1, o1, w1), (a2, o2, w2) = first, second
    return (f"========= COMPUTE-SANITIZER\n"
            f"========= {severity}: Race reported between {a1} access at {kernel}+0x{o1:x} in "
            f"{w1}\n=========     and {a2} access at {read_kernel or kernel}+0x{o2:x} in {w2} "
            f"[228 hazards]\n=========\n{DONE}\n"
            f"========= RACECHECK SUMMARY: 1 hazard displayed "
            f"({int(severity == 'Error')} errors, {int(severity == 'Warning')} warnings)\n")


WS, ENTRY = "simplicial_fwd_ws_kernel", "/r/kernels_tlx/simplicial/ws.py:148"


@pytest.mark.parametrize("key,text,allowed", [
    # the dispatch: the exit-code store and a worker's load, both on the kernel's entry line
    (("fwd", "tlx_ws"), _race("Error", WS, ("Write", 0x9600, ENTRY), ("Read", 0x96c0, ENTRY)),
     True),
    (("fwd", "tlx_ws"), _race("Error", WS, ("Write", 0x9640, "ws.py:150"),
                              ("Read", 0x9700, "ws.py:150")), True),  # as the H100 prints it
    (("fwd", "tlx_pingpong"), _race("Error", WS, ("Write", 0x9d70, ENTRY),
                                    ("Read", 0x9e30, ENTRY)), True),
    (("fwd", "tlx_ws"), _race("Error", WS, ("Write", 0x3b70, "ws.py:131"),
                              ("Read", 0x4c20, "ws.py:140")), False),  # two lines: our buffers
    (("fwd", "tlx_ws"), _race("Warning", WS, ("Write", 0x9600, ENTRY), ("Read", 0x96c0, ENTRY)),
     False),  # a warning
    (("fwd", "tlx_ws"), _race("Error", "simplicial_fwd_ws_kv_kernel", ("Write", 0x9600, ENTRY),
                              ("Read", 0x96c0, ENTRY)), False),  # another kernel
    (("bwd", "tlx_ws"), _race("Error", "_dkv2_ws_kernel", ("Write", 0x1a00, "bwd_ws.py:60"),
                              ("Read", 0x1a70, "bwd_ws.py:60")), True),
    (("bwd", "tlx_ws"), _race("Error", "_dq_ws_kernel", ("Write", 0xc50, "bwd_dq_ws.py:90"),
                              ("Read", 0xd00, "bwd_dq_ws.py:90")), False),  # not its kernel
    (("bwd", "tlx_ws"), _race("Error", "_dkv2_ws_kernel", ("Write", 0x1a00, "bwd_ws.py:60"),
                              ("Read", 0x1a70, "bwd_ws.py:60"), "_dq_ws_kernel"), False),
    # Triton's TMA load: the init (write), then the arrive (read) a few instructions later
    (("fwd", "triton"), _race("Warning", "simplicial_fwd_kernel", ("Write", 0x42b0, "fwd.py:88"),
                              ("Read", 0x4360, "fwd.py:88")), True),
    (("fwd", "triton"), _race("Warning", "simplicial_fwd_kernel", ("Read", 0x4360, "fwd.py:88"),
                              ("Write", 0x42b0, "fwd.py:88")), True),  # either order
    (("fwd", "triton"), _race("Warning", "simplicial_fwd_kernel", ("Write", 0x42b0, "fwd.py:88"),
                              ("Read", 0x6000, "fwd.py:120")), False),  # far apart
    (("fwd", "triton"), _race("Warning", "simplicial_fwd_kernel", ("Write", 0x4360, "fwd.py:88"),
                              ("Read", 0x42b0, "fwd.py:88")), False),  # the read first
    (("bwd", "triton"), _race("Warning", "_dq_kernel", ("Write", 0x1ea0, "bwd.py:343"),
                              ("Read", 0x1ed0, "bwd.py:344")), True),
    (("bwd", "triton"), _race("Warning", "_dkv2_kernel", ("Write", 0x1ea0, "bwd.py:343"),
                              ("Read", 0x1ed0, "bwd.py:344")), False),  # not the row-owner
    (("bwd", "triton"), _race("Error", "_dq_kernel", ("Write", 0x1ea0, "bwd.py:343"),
                              ("Read", 0x1ed0, "bwd.py:344")), False),  # an error
    # a producer's store (its code first in the SASS) against a consumer's load of the slot
    (("fwd", "tlx_ws_keys"), _race("Error", "simplicial_fwd_ws_keys_kernel",
                                   ("Write", 0xf80, "ws_keys.py:120"),
                                   ("Read", 0x3dd0, "ws_keys.py:200")), True),
    (("fwd", "tlx_ws_keys"), _race("Error", "simplicial_fwd_ws_keys_kernel",
                                   ("Write", 0x3dd0, "ws_keys.py:200"),
                                   ("Read", 0xf80, "ws_keys.py:120")), False),  # consumer writes
])
def test_the_allowed_kinds(key, text, allowed):
    """Each entry admits its explained race, named by kernel and by facts of its two accesses
    (racecheck's line of each, their SASS offsets), and not a neighbour's."""
    run = Run("racecheck", *key, RAGGED, family=FAM)
    report = parse_report(text, "racecheck")
    assert report.findings == 1 and len(report.races) == 1
    assert judge(run, report, 1)[0] == allowed


def test_races_are_parsed_from_the_analysis_report():
    r = parse_report(RACECHECK, "racecheck")
    first, second = (r.races[line] for line in r.lines)
    assert first.severity == "Error" and first.hazards == 512
    assert first.first == sanitize_report.Access(
        "Write", "simplicial_fwd_ws_kernel", 0x3b70, "/repo/kernels_tlx/simplicial/ws.py:131")
    assert second.access("Write").offset == 0x2210 and second.access("Read").offset == 0x51a0


def test_every_allowance_names_a_kernel_of_its_variant():
    """An allowance names its kernel as the report does: one its variant compiles (a renamed
    kernel fails here, not silently on the GPU), with a known kind and a docs section."""
    for (tool, pass_, name), entry in sanitize_report.allowed_for(FAM).items():
        v = registry.get(name, pass_, FAM)
        kernels = {sanitize._kernel_name(c.fn) for c in v.compile_configs()}
        assert entry.kernel in kernels, (pass_, name, entry.kernel, kernels)
        assert entry.kind in sanitize_report.RACE_KINDS and entry.pattern is None


def test_judge_by_count_and_pattern():
    report = parse_report(RACECHECK, "racecheck")
    key = ("racecheck", "fwd", "tlx_ws")
    doc = "docs/sanitizers.md#x"
    assert judge(RUN, report, 1, {key: Allowance(doc, count=2)}) == (
        True, f"2 findings, allowed ({doc})")
    assert judge(RUN, report, 1, {key: Allowance(doc)})[0]  # any number
    ok, why = judge(RUN, report, 1, {key: Allowance(doc, count=1)})
    assert not ok and "1 allowed" in why
    assert judge(RUN, report, 1, {key: Allowance(doc, pattern=r"kernels_tlx/simplicial/(ws|common)\.py")})[0]
    ok, why = judge(RUN, report, 1, {key: Allowance(doc, pattern=r"ws\.py:131")})
    assert not ok and "1 outside the allowed pattern: Warning: Race" in why
    # the entry is per (tool, pass, variant): another tool or pass is not covered
    for tool, pass_ in (("memcheck", "fwd"), ("racecheck", "bwd")):
        other = Run(tool, pass_, "tlx_ws", SMALL, family=FAM)
        assert not judge(other, Report(2, [], True), 1, {key: Allowance(doc)})[0]


def test_judge_runs_that_did_not_finish():
    assert judge(RUN, Report(0, [], True), None) == (False, "timed out")
    ok, why = judge(RUN, parse_report(MEMCHECK_OOB, "memcheck"), 1)
    assert not ok and why.startswith("3 findings, the worker did not finish (exit 1)")
    ok, why = judge(RUN, Report(None, [], False), -11)
    assert not ok and why.startswith("no sanitizer summary (exit -11)")
    ok, why = judge(RUN, Report(0, [], True), 1)  # an exit 1 that no summary counted
    assert not ok and "without a counted finding" in why
    # even an allowance does not cover a run that did not finish
    allow = {("memcheck", "fwd", "tlx_ws"): Allowance("d#x")}
    run = Run("memcheck", "fwd", "tlx_ws", SMALL, family=FAM)
    assert not judge(run, Report(3, [], False), 1, allow)[0]


# ---------------------------------------------------------------------------------------------
# Shapes and runs


def test_two_shapes_per_variant():
    """Every registered variant takes its two shapes: one with G < 16 or Hk > 1 where it takes
    one (`tlx_pairs_ordered` takes Hk = 1 and G >= 64 only), one ragged N."""
    odd = [s for s in FAMILY.sanitizer_shapes[0] if s.Hq // s.Hk < 16 or s.Hk > 1]
    for v in registry.all_variants(None, FAM):
        small, ragged = sanitize.shapes_for(v)
        assert v.cannot_take(small.spec()) is None and v.cannot_take(ragged.spec()) is None
        if any(v.cannot_take(s.spec()) is None for s in odd):
            assert small in odd, (v.name, small)
        assert ragged.N % 16 != 0, (v.name, ragged)
        assert small.B * small.N <= 1024 and ragged.B * ragged.N <= 1024  # small runs
    expected = {("fwd", "triton"): (8, 1), ("bwd", "triton"): (8, 1), ("fwd", "tlx_ws"): (64, 2),
                ("fwd", "tlx_pingpong"): (64, 2), ("bwd", "tlx_ws"): (128, 2),
                ("fwd", "tlx_ws_kv"): (256, 2)}
    for (pass_, name), (hq, hk) in expected.items():
        small, ragged = sanitize.shapes_for(registry.get(name, pass_, FAM))
        assert (small.Hq, small.Hk) == (hq, hk), name
        assert ragged == FAMILY.shape_type(B=2, N=333, Hq=128, Hk=1, D=128, w1=32, w2=96)


def test_plan_of_the_runs():
    runs = sanitize.plan(sanitize.TOOLS, registry.PASSES, None, family=FAM)
    variants = registry.all_variants(None, FAM)
    n = sum(len(v.accepted("form")) for v in variants)  # each form a variant computes
    assert len(runs) == 3 * 2 * n and len(set(runs)) == len(runs)
    assert {(r.pass_, r.variant, r.form) for r in runs} == {
        (v.pass_, v.name, f) for v in variants for f in v.accepted("form")}
    assert {(r.pass_, r.variant) for r in runs if r.form == "det"} == {
        ("fwd", "triton"), ("bwd", "triton"), ("fwd", "tlx_pipelined_kv"),
        ("fwd", "tlx_pipelined_pingpong"), ("bwd", "tlx_pairs")}
    trilinear = sanitize.plan(sanitize.TOOLS, registry.PASSES, None, forms=["trilinear"],
                              family=FAM)
    assert len(trilinear) == 3 * 2 * len(variants)
    runs = sanitize.plan(["racecheck"], ["fwd", "bwd"], ["tlx_ws"], family=FAM)
    assert [(r.pass_, r.shape.Hq, r.shape.Hk) for r in runs] == [
        ("fwd", 64, 2), ("fwd", 128, 1), ("bwd", 128, 2), ("bwd", 128, 1)]
    with pytest.raises(ValueError, match="tlx_ws_kv: not a variant of pass bwd"):
        sanitize.plan(["memcheck"], ["bwd"], ["tlx_ws_kv"], family=FAM)
    runs = sanitize.plan(["memcheck"], ["fwd", "bwd"], ["tlx_ws_kv"], family=FAM)
    assert {r.pass_ for r in runs} == {"fwd"}


def test_plan_with_the_probe_and_one_shape_set():
    runs = sanitize.plan(["racecheck", "synccheck"], ["probe", "bwd"], ["tlx_ws"], [1], family=FAM)
    assert [(r.tool, r.pass_, r.variant, r.shape) for r in runs[:2]] == [
        ("racecheck", "probe", "ws_probe", None), ("synccheck", "probe", "ws_probe", None)]
    assert [(r.pass_, r.shape.N) for r in runs[2:]] == [("bwd", 256), ("bwd", 256)]
    assert sanitize.plan(["memcheck"], ["probe"], None, family=FAM) == [
        Run("memcheck", "probe", "ws_probe", None, family=FAM)]
    ragged = sanitize.plan(["memcheck"], ["fwd"], ["triton"], [2], family=FAM)
    assert [(r.shape, r.form) for r in ragged] == [(s, f) for f in ("trilinear", "det")
                                                   for s in FAMILY.sanitizer_shapes[1]]
    with pytest.raises(ValueError, match="tlx_ws: not a variant of pass probe"):
        sanitize.plan(["memcheck"], ["probe"], ["tlx_ws"], family=FAM)
    # the default passes are the registered ones: no probe
    runs = sanitize.plan(sanitize.TOOLS, registry.PASSES, None, family=FAM)
    assert all(r.pass_ != "probe" for r in runs)


def test_the_probes_command_and_tag():
    run = Run("racecheck", "probe", "ws_probe", None, family=FAM)
    cmd = sanitize.command("cs", run, racecheck_report="hazard")
    text = " ".join(cmd)
    assert "--racecheck-report hazard" in text
    assert f"--kernel-name kns={sanitize.PROBE_KERNEL}" in text
    assert cmd[cmd.index(sys.executable) + 1:] == [sanitize.SCRIPT, "--worker", "--pass", "probe"]
    assert run.tag() == "racecheck-probe-ws_probe" and run.shape_text() == "probe launch"
    from tools import ws_probe
    assert ws_probe.KERNEL_NAME == sanitize.PROBE_KERNEL == ws_probe.ws_probe_kernel.__name__


def test_the_childs_command():
    run = Run("racecheck", "bwd", "tlx_ws", SMALL, family=FAM)
    cmd = sanitize.command("/cuda/bin/compute-sanitizer", run)
    assert cmd[:3] == ["/cuda/bin/compute-sanitizer", "--tool", "racecheck"]
    text = " ".join(cmd)
    assert "--error-exitcode 1" in text and "--racecheck-report analysis" in text
    assert f"--kernel-name-exclude kns={sanitize.forward_kernel_prefix(FAM)}" in text
    i = cmd.index(sys.executable)
    assert cmd[i + 1:] == [sanitize.SCRIPT, "--worker", "--pass", "bwd", "--variant", "tlx_ws",
                           "--shape", "1", "256", "8", "1", "64", "32", "64"]
    fwd = sanitize.command("cs", Run("memcheck", "fwd", "triton", SMALL, family=FAM))
    assert "--kernel-name-exclude" not in fwd and "--racecheck-report" not in fwd
    assert run.tag() == "racecheck-bwd-tlx_ws-B1-N256-H8x1-D64-w32x64"
    det = Run("memcheck", "bwd", "triton", SMALL, "det", family=FAM)
    assert sanitize.command("cs", det)[-2:] == ["--form", "det"]
    assert det.tag() == "memcheck-bwd-triton-B1-N256-H8x1-D64-w32x64-det"
    assert det.shape_text().endswith(" form=det")


def test_the_backward_runs_exclude_every_forward_kernel_and_no_backward_one():
    """A backward run checks its own kernels, not the plain forward before it: every forward
    kernel's name has the excluded prefix (derived from the registry), no backward kernel's has."""
    prefix = sanitize.forward_kernel_prefix(FAM)
    assert prefix
    for v, config in registry.compile_configs(None, FAM):
        has = sanitize._kernel_name(config.fn).startswith(prefix)
        assert has == (v.pass_ == "fwd"), (v.pass_, v.name, config.fn.__name__)
    import kernels_triton.simplicial.bwd as bwd  # the two kernels without a compile config
    assert not any(k.__name__.startswith(prefix) for k in (bwd._delta_kernel, bwd._dkv1_kernel))


# ---------------------------------------------------------------------------------------------
# GPU: what every run launches, without the sanitizer


@pytest.mark.gpu
def test_the_worker_of_every_run(capsys):
    for r in sanitize.plan(["memcheck"], sanitize.PASSES, None, family=FAM):
        assert sanitize.worker(r.pass_, r.variant, r.shape, r.form, r.family) == 0, r
        assert sanitize.WORKER_DONE in capsys.readouterr().out

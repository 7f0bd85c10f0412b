"""The trace tool's command line (profiling/trace.py) on the CPU, its capture plumbing with Proton
and the GPU replaced by stand-ins (file names, sampling, trimming), and (gpu marker) a capture of
every registered variant of every family and pass. The summaries, trims and plots: test_trace.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import no_gpu_env

from profiling import trace_capture, trace_summary
from altattn.simplicial.shapes import Shape
from altattn import registry
from test_trace import REPO_ROOT, TLX_WS, TRITON, run_cli


# ---------------------------------------------------------------------------------------------
# Command line


def test_cli_summarize_prints_and_exits_0():
    r = run_cli("--summarize", TLX_WS)
    assert r.returncode == 0, r.stderr
    for text in ("wg0 producer", "wg1 consumer 0", "qk_gemm", "tensor-core busy", "bubble"):
        assert text in r.stdout
    for caveat in trace_summary.ScopeRoles.of("simplicial").caveats():  # printed with the numbers, whatever their wording
        assert f"note: {caveat}" in r.stdout


def test_cli_summarize_json_and_side_by_side():
    r = run_cli("--summarize", TRITON, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["ctas"] == 3 and 0 <= s["bubble"] < 1
    r = run_cli("--summarize", TRITON, TLX_WS)
    assert r.returncode == 0, r.stderr
    assert "side by side" in r.stdout and "triton_small" in r.stdout
    assert "tlx_ws_small" in r.stdout


def test_cli_plot_as_module(tmp_path):
    png = str(tmp_path / "t.png")
    r = run_cli("--plot", TRITON, "--png", png, module=True)
    assert r.returncode == 0, r.stderr
    assert os.path.getsize(png) > 10_000


def test_cli_bad_arguments_exit_2(tmp_path):
    assert run_cli().returncode == 2  # nothing to do
    assert run_cli("--plot", TRITON).returncode == 2  # no --png
    assert run_cli("--summarize", str(tmp_path / "missing.chrome_trace")).returncode == 2
    assert run_cli("--variant", "nope").returncode == 2
    assert run_cli("--variant", "triton", "--d", "96").returncode == 2
    assert run_cli("--variant", "triton", "--pass", "sideways").returncode == 2
    r = run_cli("--variant", "tlx_ws", "--hq", "8")  # the launcher's message, before the GPU check
    assert r.returncode == 2 and "variant 'tlx_ws' cannot take" in r.stderr, r.stderr
    assert "GPU" not in r.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (["--variant", "tlx_ws_kv", "--pass", "bwd"], "unknown variant 'tlx_ws_kv' of pass 'bwd'"),
    (["--variant", "tlx_ws", "--pass", "bwd", "--hq", "32"], "variant 'tlx_ws' cannot take"),
    (["--variant", "triton", "--pass", "bwd", "--warps", "0,4,8"], "kernel 'dkv2'"),
    (["--variant", "triton", "--warps", "4"], "the kernel has warps 0-3"),
    (["--compare", "triton", "tlx_ws", "--pass", "bwd", "--warps", "9"], "warps 0-7"),
])
def test_cli_pass_and_warps_checked_before_the_gpu(args, needle):
    r = run_cli(*args, env=no_gpu_env())
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert "GPU" not in r.stderr


@pytest.mark.parametrize("args", [["--variant", "triton"], ["--compare", "triton", "tlx_ws"],
                                  ["--kernels"], ["--variant", "tlx_ws", "--pass", "bwd"],
                                  ["--kernels", "--pass", "bwd"]])
def test_cli_capture_without_gpu_exits_2(tmp_path, args):
    r = run_cli(*args, "--out", str(tmp_path), env=no_gpu_env())  # also on a GPU machine
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "GPU" in r.stderr
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# GPU: capture every registered variant


def _trace_shape(fam: registry.Family, v: registry.Variant):
    """A small shape of `fam` the variant takes: 2-simplicial N 256 (Hq 64 or 128, as the variant
    needs), the others their `small` preset."""
    if fam.name != "simplicial":
        return fam.presets["small"]
    return next(s for h in (64, 128) for s in [Shape(B=1, N=256, Hq=h, Hk=1, D=128, w1=32, w2=256)]
                if v.cannot_take(s.spec()) is None)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(registry.FAMILIES))
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_capture_every_variant(tmp_path, family, pass_):
    fam = registry.get_family(family)
    for v in registry.all_variants(pass_, family):
        s = _trace_shape(fam, v)
        path = trace_capture.capture(v.name, s, str(tmp_path), ctas=2, log=lambda msg: None,
                                     pass_=pass_, family=family)
        assert os.path.getsize(path) < trace_summary.MAX_TRACE_BYTES
        events = trace_summary.load_trace(path)
        names = {e["name"] for e in events}
        # the GEMM scopes, and no name outside the record; not every scope of the record: at a
        # small size the trace of tlx_pipelined_kv held no softmax event (H100, 2026-11-24)
        gemms = {n for n in v.scopes if fam.scopes[n] == "gemm"}
        assert gemms and gemms <= names, (v.name, names)
        assert names <= set(v.scopes), (v.name, names - set(v.scopes))
        parts = trace_summary.split_kernels(events, v.name)
        assert len(parts) == len(v.profiled_kernels(s.spec())), [k for k, _ in parts]
        for _, ev in parts:
            assert len({e["cta"] for e in ev}) == 2
            summary = trace_summary.summarize(ev, family)
            assert any(g["role"] == "consumer" for g in summary["groups"])


# ---------------------------------------------------------------------------------------------
# Capture with proton and the GPU replaced by stand-ins (CPU): file names, sampling, trimming


def _stand_ins(monkeypatch, traces: list[str]) -> dict:
    """proton and the GPU replaced: every call is recorded; the n-th session's finalize writes
    what proton would, here a copy of traces[n]."""
    import triton.profiler as proton

    from altattn import launcher
    from altattn.simplicial import passes as backward

    calls = {"launch": [], "start": []}

    def run(*args, variant, out=None, lse=None, profile=False, form="trilinear"):
        calls["launch"].append((variant, profile))
        return "out", "lse"

    monkeypatch.setattr(trace_capture, "pass_inputs", lambda pass_, s, seed, family: ())
    monkeypatch.setattr(launcher, "run", run)
    monkeypatch.setattr(backward, "backward", run)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def start(name, **kw):
        calls["start"].append((name, kw))

    def finalize():
        src = traces[len(calls["start"]) - 1]
        with open(src) as f, open(calls["start"][-1][0] + ".chrome_trace", "w") as dst:
            dst.write(f.read())

    monkeypatch.setattr(proton, "start", start)
    monkeypatch.setattr(proton, "finalize", finalize)
    return calls


def test_capture_plumbing_with_stand_ins(tmp_path, monkeypatch):
    calls = _stand_ins(monkeypatch, [TRITON])
    out = tmp_path / "out"
    path = trace_capture.capture("triton", Shape(1, 256, 64, 1, 128, 32, 256), str(out), ctas=2,
                                 log=lambda msg: None, family="simplicial")
    assert path == str(out / "triton.chrome_trace")
    # warm the plain kernel, then the profiled one
    assert calls["launch"] == [("triton", False), ("triton", True)]
    ((_, kw),) = calls["start"]
    assert kw["data"] == "trace" and kw["backend"] == "instrumentation"
    assert "sampling_options=0:" in str(kw["mode"]) and "GLOBAL" in str(kw["mode"])
    assert len({e["cta"] for e in trace_summary.load_trace(path)}) == 2
    assert os.listdir(out) == ["triton.chrome_trace"]  # the raw capture is removed


def test_backward_capture_plumbing_with_stand_ins(tmp_path, monkeypatch):
    """A backward capture: one session per scoped kernel, each sampling its own warps, merged into
    OUT/<variant>_bwd.chrome_trace with --ctas CTAs of each kernel."""
    calls = _stand_ins(monkeypatch, [TLX_WS, TRITON])  # stand-ins for the k-owner and row-owner
    out = tmp_path / "out"
    path = trace_capture.capture("tlx_ws", Shape(1, 2048, 64, 1, 128, 32, 256), str(out),
                                 ctas=2, log=lambda msg: None, pass_="bwd", keep_full=True,
                                 family="simplicial")
    assert path == str(out / "tlx_ws_bwd.chrome_trace")
    assert calls["launch"] == [("tlx_ws", False), ("tlx_ws", "dkv2"), ("tlx_ws", "dq")]
    modes = [str(kw["mode"]) for _, kw in calls["start"]]
    assert all("sampling_options=0, 4, 8:" in m for m in modes)  # both TLX, 12 warps
    per = trace_summary.ctas_per_kernel(trace_summary.read_trace_file(path)["traceEvents"])
    assert {k: len(v) for k, v in per.items()} == {"simplicial_fwd_ws_kernel": 2,
                                                   "simplicial_fwd_kernel": 2}
    assert sorted(os.listdir(out)) == ["tlx_ws_bwd.chrome_trace",
                                       "tlx_ws_bwd.dkv2.full.chrome_trace",
                                       "tlx_ws_bwd.dq.full.chrome_trace"]


def test_one_buffer_per_kernel_runs_after_protons_exit_hook():
    """The hook that forgets a kernel's profile buffer must run after Proton's own exit hook (which
    reads the buffer): exit hooks run last-added first, so it goes first in the chain."""
    from triton import knobs
    from triton.profiler.hooks.hook import HookManager
    from triton.profiler.hooks.instrumentation import InstrumentationHook

    order = []

    def protons_exit(metadata):
        order.append(("proton", [h.buffer for h in HookManager.active_hooks]))

    hook = InstrumentationHook.__new__(InstrumentationHook)
    hook.buffer = "buffer of the traced kernel"
    saved = list(HookManager.active_hooks)
    HookManager.active_hooks[:] = [hook]
    knobs.runtime.launch_exit_hook.add(protons_exit)
    try:
        with trace_capture.one_buffer_per_kernel():
            knobs.runtime.launch_exit_hook(None)
        assert order == [("proton", ["buffer of the traced kernel"])] and hook.buffer is None
    finally:
        knobs.runtime.launch_exit_hook.remove(protons_exit)
        HookManager.active_hooks[:] = saved
    assert knobs.runtime.launch_exit_hook.calls == []


def test_profiling_needs_no_bench():
    """profiling/ is installed without bench/ (not a package): none of its modules imports it."""
    code = ("import sys, profiling.trace, tools.resources; "
            "print(sorted(m for m in sys.modules if m == 'bench' or m.startswith('bench.')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"

"""Tests of the trace tool (profiling/trace.py, its CLI, and trace_summary.py, trace_plot.py,
trace_capture.py): summary, trim, plot and kernel table on CPU (real traces in tests/tools/data and
hand-built ones, one- and multi-kernel), warps and scopes per variant. The command line, the
capture with stand-ins and (gpu marker) of every registered variant: test_trace_cli.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from profiling import timing, trace_capture, trace_kernels, trace_plot, trace_summary
from altattn.simplicial.shapes import Shape
from altattn import registry
from conftest import ROOT

REPO_ROOT = str(ROOT)  # the checkout (conftest puts it on sys.path)

DATA = os.path.join(REPO_ROOT, "tests", "tools", "data")
TRITON = os.path.join(DATA, "triton_small.chrome_trace")
TLX_WS = os.path.join(DATA, "tlx_ws_small.chrome_trace")
REAL = {"triton": TRITON, "tlx_ws": TLX_WS}
STEP = ("qk_gemm", "softmax", "pv_gemm", "v1_mul")


def run_cli(*args: str, module: bool = False, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    cmd = ([sys.executable, "-m", "profiling.trace"] if module
           else [sys.executable, os.path.join("profiling", "trace.py")])
    return subprocess.run([*cmd, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture(scope="module")
def summaries() -> dict:
    return {name: trace_summary.summarize(trace_summary.load_trace(path), "simplicial")
            for name, path in REAL.items()}


# ---------------------------------------------------------------------------------------------
# The two real traces


@pytest.mark.parametrize("name", sorted(REAL))
def test_consumer_warps_have_every_step_scope_equally_often(summaries, name):
    s = summaries[name]
    consumers = [g for g in s["groups"] if g["role"] == "consumer"]
    assert consumers
    for g in consumers:
        for w in g["warps"]:
            counts = s["per_warp"][w]["counts"]
            assert all(counts.get(k, 0) > 0 for k in STEP), (w, counts)
            assert len({counts[k] for k in STEP}) == 1, (w, counts)
    assert s["warnings"] == []


@pytest.mark.parametrize("name", sorted(REAL))
def test_busy_bubble_and_shares_are_consistent(summaries, name):
    s = summaries[name]
    for g in s["groups"]:
        shares = [v["share"] for v in g["scopes"].values()]
        assert all(0 <= x <= 1 for x in shares)
        assert sum(shares) + g["outside_share"] == pytest.approx(1.0)
        assert g["outside_share"] >= 0
        if g["role"] != "consumer":
            assert g["tc_busy"] is None
            continue
        assert 0 < g["tc_busy"] < 1
        non_gemm = g["outside_share"] + sum(v["share"] for k, v in g["scopes"].items()
                                            if k not in trace_summary.ScopeRoles.of("simplicial").gemm)
        # the union over a group's warps is close to one warp's own gemm share: the warps of a
        # warp group issue the wgmma together
        assert g["tc_busy"] + non_gemm == pytest.approx(1.0, abs=0.02)
        assert g["tc_busy"] >= g["gemm_share"] - 1e-9  # union over warps >= the mean of them
    assert 0 <= s["bubble"] < 1
    for c in s["per_cta"]:
        assert 0 <= c["bubble"] < 1
    assert s["ctas"] == 3


def test_triton_single_group_bubble_is_one_minus_busy(summaries):
    s = summaries["triton"]
    (g,) = s["groups"]
    assert g["role"] == "consumer" and g["warps"] == [0, 1, 2, 3]
    assert s["bubble"] == pytest.approx(1.0 - g["tc_busy"])
    assert set(g["scopes"]) == {"load_kv", "qk_gemm", "softmax", "pv_gemm", "v1_mul", "epilogue"}


def test_tlx_ws_load_kv_only_on_the_producer_group(summaries):
    s = summaries["tlx_ws"]
    by_group = {g["group"]: g for g in s["groups"]}
    assert sorted(by_group) == [0, 1, 2]
    assert by_group[0]["role"] == "producer" and by_group[0]["label"] == "wg0 producer"
    assert set(by_group[0]["scopes"]) == {"load_kv"}
    for gid in (1, 2):
        g = by_group[gid]
        assert g["role"] == "consumer"
        assert "load_kv" not in g["scopes"]
        assert {"wait_kv", *STEP, "epilogue"} <= set(g["scopes"])
    assert [by_group[1]["label"], by_group[2]["label"]] == ["wg1 consumer 0", "wg2 consumer 1"]
    assert [w for w, v in s["per_warp"].items() if "load_kv" in v["counts"]] == [0]


def test_roles_come_from_the_family_record():
    """The summary names no scope itself: gemm and step scopes are the family record's
    scopes of those roles, and a group's role follows them."""
    fam = registry.get_family("simplicial")
    roles = trace_summary.ScopeRoles.of(fam.name)
    assert roles.order == tuple(fam.scopes)
    assert set(roles.gemm) == {n for n, r in fam.scopes.items() if r == "gemm"}
    assert roles.group_role([n for n, r in fam.scopes.items() if r == "load"]) == "producer"
    assert roles.group_role([n for n, r in fam.scopes.items() if r == "build"]) == "producer"
    assert roles.group_role([*roles.gemm[:1], "anything"]) == "consumer"
    assert roles.group_role(["epilogue", "not_a_scope"]) == "other"
    # a made-up family: other names, the same roles, the same summary
    renamed = {n: f"x_{n}" for n in fam.scopes}
    other = trace_summary.ScopeRoles(tuple(renamed.values()),
                                     {renamed[n]: r for n, r in fam.scopes.items()})
    assert other.gemm == tuple(renamed[n] for n in roles.gemm)
    assert other.step == tuple(renamed[n] for n in roles.step)


def test_cycles_use_the_trace_frequency():
    raw = trace_summary.read_trace_file(TLX_WS)
    e = raw["traceEvents"][0]
    ev = trace_summary.events_from_trace({"traceEvents": [e]})[0]
    f = e["args"]["Frequency (MHz)"]
    assert ev["dur"] == pytest.approx(e["dur"] * f)
    assert ev["start"] == pytest.approx(e["ts"] * f)


# ---------------------------------------------------------------------------------------------
# A hand-built trace: every number computed by hand


def _chrome(pid: str, warp: int, name: str, c0: float, c1: float, freq: float = 1000.0) -> dict:
    """One proton-style event from cycles c0..c1 at `freq` MHz (ts/dur in us)."""
    return {"args": {"Frequency (MHz)": freq, "call_stack": ["ROOT", "k"]}, "cat": "k",
            "name": name, "ph": "X", "pid": pid, "tid": f"warp {warp} (line 0)",
            "ts": c0 / freq, "dur": (c1 - c0) / freq}


A, B = "k Core0 CTA1", "k Core1 CTA2"
SYNTH = [
    # CTA A: producer warp 0, consumer 0 (warp 4), consumer 1 (warp 8)
    (A, 0, "load_kv", 0, 100), (A, 0, "load_kv", 100, 400),
    (A, 4, "wait_kv", 10, 20), (A, 4, "qk_gemm", 20, 60), (A, 4, "softmax", 60, 80),
    (A, 4, "pv_gemm", 80, 100), (A, 4, "v1_mul", 100, 110), (A, 4, "epilogue", 130, 140),
    (A, 8, "wait_kv", 10, 30), (A, 8, "qk_gemm", 60, 100), (A, 8, "softmax", 100, 120),
    (A, 8, "pv_gemm", 120, 130), (A, 8, "v1_mul", 130, 140), (A, 8, "epilogue", 140, 150),
    # CTA B, later
    (B, 0, "load_kv", 1000, 1050),
    (B, 4, "qk_gemm", 1000, 1100), (B, 4, "softmax", 1100, 1150), (B, 4, "pv_gemm", 1150, 1200),
    (B, 4, "v1_mul", 1200, 1210),
    (B, 8, "qk_gemm", 1100, 1200), (B, 8, "softmax", 1200, 1250), (B, 8, "pv_gemm", 1250, 1300),
    (B, 8, "v1_mul", 1300, 1310),
]


def _synthetic(freq: float = 1000.0) -> dict:
    return {"displayTimeUnit": "ns",
            "traceEvents": [_chrome(p, w, n, c0, c1, freq) for p, w, n, c0, c1 in SYNTH]}


@pytest.mark.parametrize("freq", [1000.0, 1500.0])
def test_summary_matches_hand_computation(freq):
    s = trace_summary.summarize(trace_summary.events_from_trace(_synthetic(freq)), "simplicial")

    def ap(x):
        return pytest.approx(x, rel=1e-12, abs=1e-9)

    assert s["ctas"] == 2 and s["cta_ids"] == [A, B] and s["warps"] == [0, 4, 8]
    assert s["frequency_mhz"] == freq
    g0, g1, g2 = s["groups"]
    assert [g["label"] for g in s["groups"]] == ["wg0 producer", "wg1 consumer 0",
                                                 "wg2 consumer 1"]
    # producer: spans 400 (A) + 50 (B), all of it in load_kv
    assert g0["scopes"]["load_kv"] == {"count": 3, "mean_cycles": ap(150), "total_cycles": ap(450),
                                       "share": ap(1.0)}
    assert g0["tc_busy"] is None and g0["span_cycles"] == ap(225)
    # consumer 0: spans 130 (10..140) + 210 (1000..1210) = 340
    sc = g1["scopes"]
    assert list(sc) == ["wait_kv", "qk_gemm", "softmax", "pv_gemm", "v1_mul", "epilogue"]
    assert sc["qk_gemm"] == {"count": 2, "mean_cycles": ap(70), "total_cycles": ap(140),
                             "share": ap(140 / 340)}
    assert sc["softmax"]["total_cycles"] == ap(70) and sc["pv_gemm"]["total_cycles"] == ap(70)
    assert sc["v1_mul"]["total_cycles"] == ap(20) and sc["wait_kv"]["count"] == 1
    assert g1["outside_share"] == ap(20 / 340)
    assert g1["tc_busy"] == ap((60 + 150) / 340) and g1["gemm_share"] == ap(210 / 340)
    assert g1["steps"] == 2 and g1["step_cycles"] == ap(70 + 35 + 35 + 10)
    # consumer 1: spans 140 (10..150) + 210 (1100..1310) = 350; gemm 40+10 and 100+50
    assert g2["tc_busy"] == ap((50 + 150) / 350)
    assert g2["scopes"]["pv_gemm"]["share"] == ap(60 / 350)
    assert g2["outside_share"] == ap(30 / 350)
    # bubble: A: consumer span 10..150 = 140, gemm union [20,100) + [120,130) = 90 -> 50 idle;
    #         B: 1000..1310 = 310, union [1000,1200) + [1250,1300) = 250 -> 60 idle
    assert [c["bubble"] for c in s["per_cta"]] == [ap(50 / 140), ap(60 / 310)]
    assert s["bubble"] == ap((50 + 60) / (140 + 310))
    assert s["per_cta"][0]["tc_busy"] == {"wg1 consumer 0": ap(60 / 130),
                                          "wg2 consumer 1": ap(50 / 140)}
    assert [c["span_cycles"] for c in s["per_cta"]] == [ap(400), ap(310)]
    assert s["cta_span_cycles"] == ap(355)
    assert s["warnings"] == []


def test_unequal_step_counts_are_no_warning():
    """A step may hold two scopes of one name (spherical's tlx forward waits for its QK^T in a
    second qk_gemm scope): counts are no evidence of lost events (Proton's own message is, at
    capture: trace_capture.dropped_events)."""
    events = trace_summary.events_from_trace(_synthetic())
    events = [e for e in events
              if not (e["cta"] == B and e["warp"] == 8 and e["name"] == "softmax")]
    assert trace_summary.summarize(events, "simplicial")["warnings"] == []


def test_union_length():
    assert trace_summary._union_length([]) == 0
    assert trace_summary._union_length([(0, 10), (5, 15), (20, 25), (25, 30), (1, 2)]) == 25


# ---------------------------------------------------------------------------------------------
# Trim


def test_trim_keeps_exactly_k_ctas_from_the_middle():
    raw = {"displayTimeUnit": "ns", "traceEvents": [
        _chrome(f"k Core0 CTA{i}", 0, "qk_gemm", start, start + 10)
        for i, start in ((5, 400), (1, 0), (4, 300), (2, 100), (3, 200))]
        + [{"name": "process_name", "ph": "M", "args": {}}]}
    out = trace_summary.trim(raw, 3)
    assert out["displayTimeUnit"] == "ns"
    kept = [e["pid"] for e in out["traceEvents"] if "pid" in e]
    assert sorted(kept) == ["k Core0 CTA2", "k Core0 CTA3", "k Core0 CTA4"]  # by start time
    assert any(e.get("ph") == "M" for e in out["traceEvents"])  # metadata kept
    assert len(raw["traceEvents"]) == 6  # input untouched
    with pytest.raises(ValueError):
        trace_summary.trim(raw, 0)


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_trim_real_trace(k):
    raw = trace_summary.read_trace_file(TRITON)
    out = trace_summary.trim(raw, k)
    assert len({e["pid"] for e in out["traceEvents"]}) == min(k, 3)
    s = trace_summary.summarize(trace_summary.events_from_trace(out), "simplicial")
    assert s["ctas"] == min(k, 3)


def _two_kernels() -> dict:
    """A backward-like trace: the real triton and tlx_ws traces (3 CTAs each) as two kernels of
    one file, as trace_capture merges its sessions."""
    return {"displayTimeUnit": "ns", "traceEvents": [
        *trace_summary.read_trace_file(TRITON)["traceEvents"],
        *trace_summary.read_trace_file(TLX_WS)["traceEvents"]]}


def test_trim_keeps_ctas_of_every_kernel():
    raw = _two_kernels()
    per = trace_summary.ctas_per_kernel(raw["traceEvents"])
    assert sorted(per) == ["simplicial_fwd_kernel", "simplicial_fwd_ws_kernel"]
    assert [len(v) for v in per.values()] == [3, 3]
    out = trace_summary.trim(raw, 2)
    kept = trace_summary.ctas_per_kernel(out["traceEvents"])
    assert {k: len(v) for k, v in kept.items()} == {"simplicial_fwd_kernel": 2,
                                                    "simplicial_fwd_ws_kernel": 2}
    for k, pids in kept.items():  # the middle of each kernel's own launch order
        assert pids == trace_summary.middle(per[k], 2)


def test_summary_per_kernel_of_a_multi_kernel_trace(tmp_path):
    events = trace_summary.events_from_trace(_two_kernels())
    parts = trace_summary.split_kernels(events, "x_bwd")
    assert [label for label, _ in parts] == ["x_bwd simplicial_fwd_kernel",
                                            "x_bwd simplicial_fwd_ws_kernel"]
    for (_, ev), path in zip(parts, (TRITON, TLX_WS)):  # each as summarized on its own
        alone = trace_summary.summarize(trace_summary.load_trace(path), "simplicial")
        assert trace_summary.summarize(ev, "simplicial") == alone
    assert trace_summary.split_kernels(trace_summary.load_trace(TRITON), "t")[0][0] == "t"
    path = str(tmp_path / "x_bwd.chrome_trace")
    trace_summary.write_trimmed(_two_kernels(), 8, path)
    r = run_cli("--summarize", path)
    assert r.returncode == 0, r.stderr
    assert "(x_bwd simplicial_fwd_kernel)" in r.stdout
    assert "(x_bwd simplicial_fwd_ws_kernel)" in r.stdout and "side by side" in r.stdout
    r = run_cli("--summarize", path, "--json")
    assert [s["kernel"] for s in json.loads(r.stdout)] == ["simplicial_fwd_kernel",
                                                           "simplicial_fwd_ws_kernel"]
    png = str(tmp_path / "x.png")
    assert run_cli("--plot", path, "--png", png).returncode == 0 and os.path.getsize(png) > 10_000


def test_write_trimmed_respects_the_size_limit(tmp_path):
    raw = trace_summary.read_trace_file(TRITON)
    one_cta = len(trace_summary.dumps_trace(trace_summary.trim(raw, 1)))
    path = str(tmp_path / "t.chrome_trace")
    n = trace_summary.write_trimmed(raw, 3, path, max_bytes=int(2.5 * one_cta))
    assert n == 2 and os.path.getsize(path) <= 2.5 * one_cta
    assert len({e["cta"] for e in trace_summary.load_trace(path)}) == 2
    assert trace_summary.write_trimmed(raw, 8, path) == 3


# ---------------------------------------------------------------------------------------------
# Plot


@pytest.mark.parametrize("name", sorted(REAL))
def test_plot_writes_a_png(tmp_path, name):
    png = str(tmp_path / f"{name}.png")
    trace_plot.plot_timeline(trace_summary.load_trace(REAL[name]), png, "simplicial", max_ctas=2)
    with open(png, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 10_000


def test_plot_compare_two_traces(tmp_path):
    png = str(tmp_path / "cmp.png")
    trace_plot.plot_timelines([(n, trace_summary.load_trace(p)) for n, p in REAL.items()], png,
                              max_ctas=1, family="simplicial")
    assert os.path.getsize(png) > 10_000


# ---------------------------------------------------------------------------------------------
# Kernel table (CUPTI .hatchet)


def _kernel(name: str, count: int, ns: float) -> dict:
    return {"frame": {"name": name, "type": "function"},
            "metrics": {"count": count, "device_id": "0", "device_type": "CUDA", "time (ns)": ns},
            "children": []}


def _scope(name: str, flops: float, *kernels: dict) -> dict:
    return {"frame": {"name": name, "type": "function"}, "metrics": {"flops": flops},
            "children": list(kernels)}


CANNED_HATCHET = [
    {"frame": {"name": "ROOT", "type": "function"}, "metrics": {}, "children": [
        _kernel("flush_l2", 9, 5e5),  # outside any scope: ignored
        _scope("triton", 3e12, _kernel("simplicial_fwd_kernel", 3, 6e6)),
        _scope("tlx_ws#0", 1e12, _kernel("simplicial_fwd_ws_kernel", 1, 1.25e6)),
        _scope("tlx_ws#1", 1e12, _kernel("simplicial_fwd_ws_kernel", 1, 1.0e6)),
        _scope("tlx_ws#2", 1e12, _kernel("simplicial_fwd_ws_kernel", 1, 2.0e6)),
        {"frame": {"name": "__proton_launch_metadata", "type": "function"}, "metrics": {},
         "children": []},
    ]},
    {"CUDA": {"0": {"arch": "90", "num_sms": 132, "clock_rate": 1980000}}},
]


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0),
                                            ("NVIDIA H100 PCIe", 756.0), ("NVIDIA A100-SXM4-80GB", None)])
def test_percent_of_the_gpus_own_peak(monkeypatch, name, peak):
    assert timing.peak_for(name) == peak
    monkeypatch.setattr(timing, "peak_tflops", lambda: timing.peak_for(name))
    assert timing.pct_of_peak(100.0) == (pytest.approx(100 * 100.0 / peak) if peak else None)
    assert ("not in" in timing.peak_words()) == (peak is None)


def test_kernel_table_on_canned_hatchet(monkeypatch):
    monkeypatch.setattr(timing, "peak_tflops", lambda: 1000.0)  # the GPU's own peak
    rows = trace_kernels.kernel_table(json.loads(json.dumps(CANNED_HATCHET)))
    assert [r["variant"] for r in rows] == ["triton", "tlx_ws"]
    tri, tlx = rows
    # triton: 3e12 FLOP in 6e6 ns = 500 TFLOP/s; 3 launches of 2 ms
    assert tri["tflops"] == pytest.approx(500.0)
    assert tri["ms"] == pytest.approx(2.0) and tri["launches"] == 3 and tri["reps"] == 1
    assert tri["flops"] == pytest.approx(1e12)
    assert tri["pct_peak"] == pytest.approx(50.0)
    # tlx_ws: 1e12 FLOP each in 1.25, 1.0, 2.0 ms -> 800, 1000, 500 TFLOP/s; median 800
    assert tlx["tflops"] == pytest.approx(800.0)
    assert tlx["ms"] == pytest.approx(1.25) and tlx["reps"] == 3 and tlx["launches"] == 3


# A backward: each call (scope "<variant>#<i>") runs 4 Triton kernels and 2 fills (pk1, pv1)
CANNED_BWD = [
    {"frame": {"name": "ROOT", "type": "function"}, "metrics": {}, "children": [
        _scope(f"triton#{i}", 2.5e12, _kernel("_delta_kernel", 1, 0.1e6),
               _kernel("_dkv2_kernel", 1, 2.0e6 + i * 0.2e6),
               _kernel("vectorized_elementwise_kernel", 2, 0.1e6), _kernel("_dq_kernel", 1, 2.5e6),
               _kernel("_dkv1_kernel", 1, 0.3e6))
        for i in range(3)]},
    {"CUDA": {"0": {"arch": "90", "num_sms": 132}}},
]


def test_kernel_table_of_multi_kernel_calls():
    (row,) = trace_kernels.kernel_table(CANNED_BWD)
    # a call: 0.1 + 2.0/2.2/2.4 + 0.1 + 2.5 + 0.3 ms = 5.0/5.2/5.4 ms; median 5.2
    assert row["variant"] == "triton" and row["reps"] == 3 and row["kernels"] == 5
    assert row["launches"] == 3 * 6 and row["flops"] == pytest.approx(2.5e12)
    assert row["ms"] == pytest.approx(5.2)
    assert row["tflops"] == pytest.approx(2.5e12 / 5.2e6 / 1e3)
    rows = trace_kernels.kernel_breakdown(CANNED_BWD)
    assert [r["kernel"] for r in rows] == ["_delta_kernel", "_dkv2_kernel",
                                           "vectorized_elementwise_kernel", "_dq_kernel",
                                           "_dkv1_kernel"]
    ms = {r["kernel"]: r["ms"] for r in rows}
    assert ms["_dkv2_kernel"] == pytest.approx(2.2) and ms["_dq_kernel"] == pytest.approx(2.5)
    assert sum(r["pct"] for r in rows) == pytest.approx(100.0)
    assert rows[3]["pct"] == pytest.approx(100 * 2.5 / 5.2)


# ---------------------------------------------------------------------------------------------
# Warps and scopes per variant


def test_sampled_warps():
    assert trace_capture.default_sampled_warps(4) == [0]
    assert trace_capture.default_sampled_warps(12) == [0, 4, 8]
    assert trace_capture.parse_warps("all", 4) == [0, 1, 2, 3]
    assert trace_capture.parse_warps("8, 0,4", 12) == [0, 4, 8]
    with pytest.raises(ValueError):
        trace_capture.parse_warps("0,12", 12)


def test_sessions_sample_the_warps_of_each_kernel():
    """One capture session per scoped kernel, each sampling the first warp of its own warp groups:
    Proton refuses a sampled warp that a kernel lacks."""
    small = Shape(B=1, N=2048, Hq=64, Hk=1, D=128, w1=32, w2=256)
    assert trace_capture.sampled_warps("tlx_ws", small, family="simplicial") == [(True, 12, [0, 4, 8])]
    assert trace_capture.sampled_warps("triton", small, "bwd", family="simplicial") == [("dkv2", 8, [0, 4]),
                                                                  ("dq", 4, [0])]
    assert trace_capture.sampled_warps("tlx_ws", small, "bwd", family="simplicial") == [("dkv2", 12, [0, 4, 8]),
                                                                  ("dq", 12, [0, 4, 8])]
    assert trace_capture.sampled_warps("tlx_ws", small, "bwd", warps="0", family="simplicial") == [
        ("dkv2", 12, [0]), ("dq", 12, [0])]
    with pytest.raises(ValueError, match="'dkv2'.*warps 0-7"):
        trace_capture.sampled_warps("triton", small, "bwd", warps="0,4,8", family="simplicial")
    assert trace_capture.trace_name("tlx_ws", "bwd") == "tlx_ws_bwd"
    assert trace_capture.trace_name("tlx_ws", "fwd") == "tlx_ws"


def test_profiled_kernels_fit_the_records():
    """Each scoped kernel's warps are whole warp groups, at most the record's `warps` (its widest
    kernel's), which one of them reaches."""
    from altattn.simplicial.spec import validate_shape
    shapes = [validate_shape(1, 512, hq, hk, d, 32, 256) for hq, hk in ((8, 1), (64, 1), (64, 2),
                                                                       (128, 1), (256, 2))
              for d in (64, 128)]
    for v in registry.all_variants(None, "simplicial"):
        widths = []
        for spec in shapes:
            if v.cannot_take(spec) is None:
                kernels = v.profiled_kernels(spec)
                assert all(w % 4 == 0 and 4 <= w <= v.warps for w in kernels.values()), v.name
                # a forward is one kernel; a backward its GEMM kernels (the 8-GEMM split's two,
                # tlx_pairs's one)
                assert len(kernels) in ((1,) if v.pass_ == "fwd" else (1, 2)), v.name
                widths += kernels.values()
        assert max(widths) == v.warps, (v.pass_, v.name)


def test_scopes_of_the_real_traces_match_the_records():
    """The scopes of the two captured traces in tests/tools/data are their variants' record's."""
    for name, path in REAL.items():
        assert {e["name"] for e in trace_summary.load_trace(path)} == set(
            registry.get(name, "fwd", "simplicial").scopes), name


def test_lost_events_are_found_and_a_buffer_sized_for_them():
    lines = ["tlx_ws_bwd: something else",
             "Warning (cta0, warp4): first 4 events are dropped due to insufficient buffer size "
             "(2048/2052)",
             "Warning (cta3, warp8): first 59202 events are dropped due to insufficient buffer "
             "size (2048/61250)"]
    assert trace_capture.dropped_events(lines) == (2048, 61250)
    assert trace_capture.dropped_events(lines[:1]) is None
    # a warp's segment: a power of two of 8-byte events; all of them where one CTA's events fit
    # a trace file (2052 -> 4096), else the most that fit (61250 -> 8192 at 3 warps)
    assert trace_capture.buffer_for((2048, 2052), warps=3, ctas=16) == 3 * 4096 * 8
    cap = trace_summary.MAX_TRACE_BYTES // (trace_capture.JSON_EVENT_BYTES * 3)
    size = trace_capture.buffer_for((2048, 61250), warps=3, ctas=16)
    assert size == 3 * 8192 * 8 and 8192 <= cap < 2 * 8192
    # the grid's buffers stay under MAX_PROFILE_BYTES; none when that holds no more than before
    ctas = trace_capture.MAX_PROFILE_BYTES // size
    assert trace_capture.buffer_for((2048, 61250), warps=3, ctas=ctas) == size
    assert trace_capture.buffer_for((2048, 61250), warps=3, ctas=2 * ctas) == size // 2
    assert trace_capture.buffer_for((2048, 61250), warps=3, ctas=4 * ctas) is None


def test_stderr_lines_keeps_what_fd_2_wrote(capfd):
    lines: list[str] = []
    with trace_capture.stderr_lines(lines):
        os.write(2, b"from C: first 1 events are dropped\nand a second line\n")
    assert lines == ["from C: first 1 events are dropped", "and a second line"]
    assert "from C" in capfd.readouterr().err  # and passed on

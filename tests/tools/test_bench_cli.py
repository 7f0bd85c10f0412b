"""CPU tests of the benchmark CLIs (bench/fwd.py, bench/bwd.py, bench/overhead.py's profile,
tools/l2_bandwidth.py) and their helpers (bench/common.py, profiling/common.py)."""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from altattn import registry
from altattn.simplicial import flops as simplicial_flops
from altattn.simplicial.shapes import PRESETS, Shape, make_inputs  # the family these runs are of
from bench import common, peers
from conftest import ROOT, bench_script, no_gpu_env
from profiling.common import format_table, run_metadata

REPO_ROOT = str(ROOT)  # the checkout (conftest puts it on sys.path)

META_KEYS = ("gpu", "torch", "triton", "commit", "time_utc")


def run_cli(*args: str, script: str = "fwd.py", env: dict | None = None,
            folder: str = "bench") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(folder, script), *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("args, needle", [
    (["--variant", "no_such_kernel"], "--variant"),
    (["--N", "0"], "--N"),
    (["--B", "-3"], "--B"),
    (["--w1", "0"], "--w1"),
    (["--w2", "abc"], "--w2"),
    (["--hq", "12", "--hk", "5"], "--hq 12 must be a multiple of --hk 5"),
    (["--d", "96"], "--d 96"),
    (["--plot", "tflops.svg"], "--plot"),
    (["--preset", "huge"], "--preset"),
    (["--sweep", "--N", "4096"], "--sweep"),
    (["--csv", os.path.join("no", "such", "dir", "rows.csv")], "--csv"),
    (["--rep-ms", "0"], "--rep-ms"),
    (["--pass", "fwd"], "unrecognized arguments: --pass fwd"),  # bench/fwd.py times the forward
    (["--family", "nope"], "argument --family: invalid choice: 'nope'"),
    (["--variant", "nope"], "argument --variant: invalid choice: 'nope'; fwd variants of "
                            "simplicial: tlx_pipelined_kv"),
    # a variant of the other pass: named as such, with the benchmark that times it
    (["--variant", "tlx_pairs"], "invalid choice: 'tlx_pairs' ('tlx_pairs' is a bwd variant: "
                                 "use bench/bwd.py); fwd variants of simplicial"),
    (["--variant", "auto", "--hq", "3"], "no variant can take"),
    # a shape the named variant cannot take: the launcher's message, before the GPU check
    (["--variant", "tlx_ws", "--hq", "8"], "variant 'tlx_ws' cannot take B=4 N=16384 Hq=8 Hk=1"),
    (["--variant", "tlx_ws_kv", "--sweep", "--preset", "star64"], "G = Hq/Hk = 64, not 128"),
    # --form: a named variant that does not compute an asked form, whatever the shape
    (["--form", "det", "--variant", "tlx_ws"],
     ("--form det: variant 'tlx_ws' computes form trilinear only; variants that compute det: "
      "tlx_pipelined_kv, triton, tlx_pipelined_pingpong")),
    (["--form", "trilinear", "det", "--variant", "triton", "--variant", "tlx_ws_keys"],
     "--form det: variant 'tlx_ws_keys' computes form trilinear only"),
    (["--form", "cubic"], "argument --form: invalid choice: 'cubic'"),
    (["--form"], "argument --form: expected at least one argument"),
    (["--form", "det", "--hq", "12", "--hk", "5"], "--hq 12 must be a multiple of --hk 5"),
])
def test_bad_arguments_exit_2(args: list[str], needle: str) -> None:
    res = run_cli(*args)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr
    assert "error:" in res.stderr
    assert "no CUDA GPU" not in res.stderr  # argument errors come before the GPU check


# bench/bwd.py: every refusal names the flag (or, for a shape the variant cannot take, the shape
# and the rule), exits 2 and comes before the GPU check
BWD_BAD = {
    "variant_unknown": (["--variant", "nope"], "argument --variant: invalid choice: 'nope'"),
    "variant_of_fwd": (["--variant", "tlx_pipelined_kv"],
                       "argument --variant: invalid choice: 'tlx_pipelined_kv' ('tlx_pipelined_kv' "
                       "is a fwd variant: use bench/fwd.py); bwd variants of simplicial: triton, "
                       "tlx_ws, tlx_pairs, tlx_pairs_ordered, or 'auto' or 'all'"),
    "family_unknown": (["--family", "nope"], "argument --family: invalid choice: 'nope'"),
    "all_refused_shape": (["--variant", "all", "--hq", "3"], "G = Hq/Hk = 3"),
    "shape_variant_refuses": (["--variant", "tlx_ws", "--hq", "16"], "G = Hq/Hk = 16 < 64"),
    "layer_zero": (["--layer", "0"], "argument --layer: must be a positive integer, got 0"),
    "hk_not_divisor": (["--hk", "3", "--hq", "128"], "--hq 128 must be a multiple of --hk 3"),
    "g_not_power_of_2": (["--hq", "3"], "G = Hq/Hk = 3"),
    "d96": (["--d", "96"], "--d 96: head dim not supported"),
    "w1_zero": (["--w1", "0"], "argument --w1: must be a positive integer, got 0"),
    "w2_negative": (["--w2", "-5"], "argument --w2: must be a positive integer, got -5"),
    "N_float": (["--N", "1.5"], "argument --N: must be a positive integer, got '1.5'"),
    "hk_zero": (["--hk", "0"], "argument --hk: must be a positive integer, got 0"),
    "rep_ms_zero": (["--rep-ms", "0"], "argument --rep-ms: must be a positive number"),
    "warmup_negative": (["--warmup-ms", "-1"], "argument --warmup-ms: must be a positive number"),
    "csv_no_dir": (["--csv", os.path.join("no", "such", "dir", "rows.csv")], "does not exist"),
    "json_no_dir": (["--json", os.path.join("no", "such", "dir", "rows.json")], "does not exist"),
    "preset_unknown": (["--preset", "huge"], "argument --preset: invalid choice"),
    "form_unknown": (["--form", "nope"], "argument --form: invalid choice: 'nope'"),
    "form_det_tlx": (["--variant", "tlx_ws", "--form", "det"],
                     "--form det: variant 'tlx_ws' computes form trilinear only; variants that "
                     "compute det: triton"),
}


@pytest.mark.parametrize("args, needle", BWD_BAD.values(), ids=BWD_BAD.keys())
def test_bwd_bad_arguments_exit_2(args: list[str], needle: str) -> None:
    res = run_cli(*args, script="bwd.py", env=no_gpu_env())
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and "error:" in res.stderr, res.stderr
    assert "no CUDA GPU" not in res.stderr  # argument errors come before the GPU check


@pytest.mark.parametrize("args", [[], ["--variant", "auto"], ["--variant", "all"],
                                  ["--variant", "auto", "--variant", "all",
                                   "--family", "simplicial"],
                                  ["--variant", "triton", "--d", "64"],
                                  ["--variant", "tlx_ws", "--layer", "4096"],
                                  ["--preset", "small", "--hk", "2", "--w1", "100000"],
                                  ["--form", "trilinear", "det"],
                                  ["--variant", "triton", "--form", "det", "--layer", "1024"]])
def test_bwd_good_arguments_reach_the_gpu_check(args: list[str]) -> None:
    res = run_cli(*args, script="bwd.py", env=no_gpu_env())
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "bench/bwd.py: no CUDA GPU found; this benchmark needs one (H100/H200)"], res.stderr


def _variant_help(stdout: str) -> str:
    """--variant's help text, unwrapped."""
    text = " ".join(stdout.split())
    start = text.index("--variant NAME ")
    return text[start:text.index("--form FORM", start)]


@pytest.mark.parametrize("script, pass_", [("fwd.py", "fwd"), ("bwd.py", "bwd")])
def test_help_lists_only_the_pass_variants(script: str, pass_: str) -> None:
    """Both benchmarks: one vocabulary (the pass's variants, 'auto', 'all'), --family, no --pass;
    --peers states the family record's equal-work rule."""
    res = run_cli("--help", script=script)
    assert res.returncode == 0, res.stderr
    help_ = _variant_help(res.stdout)
    assert "'auto'" in help_ and "'all'" in help_
    names = {v.name for v in registry.all_variants(None, "simplicial")}
    own = {v.name for v in registry.all_variants(pass_, "simplicial")}
    listed = {n for n in names if f" {n}," in help_ or f" {n};" in help_}
    assert listed == own, help_
    assert "--family" in res.stdout and "--pass" not in res.stdout
    rule = registry.get_family("simplicial").peers[0].rule
    assert rule in " ".join(res.stdout.split())


def test_auto_and_all_runs() -> None:
    """fwd: 'auto' is one run per form (resolved on the GPU, its row names the variant), 'all'
    every forward variant; both together: auto first, then the rest, no duplicates."""
    fwd = bench_script("fwd")
    names = [v.name for v in registry.all_variants("fwd", "simplicial")]
    assert fwd.parse_args(["--variant", "auto"])[2] == [("auto", "trilinear")]
    assert fwd.parse_args(["--variant", "all"])[2] == [(n, "trilinear") for n in names]
    runs = fwd.parse_args(["--variant", "auto", "--variant", "all", "--variant", "triton"])[2]
    assert runs == [("auto", "trilinear")] + [(n, "trilinear") for n in names]


def test_bwd_help_exits_0() -> None:
    res = run_cli("--help", script="bwd.py")
    assert res.returncode == 0, res.stderr
    for flag in ("--variant", "--preset", "--peers", "--layer", "--csv", "--json", "--rep-ms"):
        assert flag in res.stdout


def test_help_exits_0() -> None:
    res = run_cli("--help")
    assert res.returncode == 0
    for flag in ("--variant", "--form", "--family", "--preset", "--sweep", "--no-check",
                 "--peers", "--frontier", "--csv", "--json", "--plot"):
        assert flag in res.stdout
    text = " ".join(res.stdout.split())  # argparse wraps the help
    assert "the useful FLOPs of det equal the plain form's" in text
    assert "'--form trilinear det' times each variant that computes both in both" in text


def test_l2_bandwidth_help_exits_0() -> None:
    res = run_cli("--help", script="l2_bandwidth.py", folder="tools")
    assert res.returncode == 0, res.stderr
    assert "L2" in res.stdout and res.stderr == ""
    assert run_cli("--no-such-flag", script="l2_bandwidth.py", folder="tools").returncode == 2


def test_refused_variant_names_the_takers() -> None:
    """The message is the launcher's own: the reason, then the variants that can take the shape."""
    res = run_cli("--variant", "tlx_ws", "--hq", "8")
    assert res.returncode == 2
    assert "G = Hq/Hk = 8 < 16" in res.stderr and "variants that can: triton" in res.stderr


@pytest.mark.parametrize("args", [[], ["--variant", "all", "--preset", "small", "--peers"],
                                  ["--variant", "auto", "--preset", "small"],
                                  ["--variant", "auto", "--variant", "triton",
                                   "--form", "trilinear", "det", "--family", "simplicial"],
                                  ["--frontier"],
                                  ["--sweep", "--preset", "star64", "--hq", "16", "--hk", "2"],
                                  ["--variant", "triton", "--form", "trilinear", "det", "--peers"],
                                  ["--form", "det", "--sweep", "--preset", "small"]])
def test_no_gpu_exits_2_with_one_line(args: list[str]) -> None:
    res = run_cli(*args, env=no_gpu_env())  # no GPU visible, also on a GPU machine
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "no CUDA GPU" in lines[0]
    assert res.stdout == ""


def test_frontier_tutorials_ship_with_fbtriton() -> None:
    """--frontier imports these by name: an fbtriton that renames them must fail here, not on
    the GPU. (find_spec reads the files; importing them would need a GPU driver.)"""
    if importlib.util.find_spec("triton.language.extra.tlx") is None:
        pytest.skip("upstream Triton: no TLX tutorials")
    for name in peers.FRONTIER_TUTORIALS:
        assert importlib.util.find_spec(f"{peers.FRONTIER_PACKAGE}.{name}") is not None, name


def test_frontier_rows_without_gpu_when_l_is_not_a_tile_multiple() -> None:
    fwd = bench_script("fwd")
    s = Shape(B=2, N=100, Hq=64, Hk=1, D=128, w1=3, w2=50)  # L = 150
    rows = peers.bench_frontier(s, fwd.parse_args([])[0], print)
    assert [r["variant"] for r in rows] == [
        "tutorial:" + n.removeprefix("hopper_") for n in peers.FRONTIER_TUTORIALS]
    for r in rows:
        assert r["kind"] == "frontier" and "tflops" not in r
        assert "not a multiple of 128" in r["note"]
        assert r["flops"] == 4 * 2 * 64 * 150 * 150 * 128


def test_form_selects_the_variants_that_compute_it() -> None:
    """runs: (variant, form) pairs, a variant's forms adjacent in --form order; 'all' (the default)
    means the variants that compute the form; duplicates dropped."""
    from altattn import registry
    fwd = bench_script("fwd")
    variants = registry.all_variants("fwd", "simplicial")
    det = [v.name for v in variants if "det" in v.accepted("form")]
    assert det, "no forward variant computes form 'det'"
    assert fwd.parse_args([])[2] == [(v.name, "trilinear") for v in variants]
    args, _, runs = fwd.parse_args(["--form", "det"])
    assert args.form == ["det"] and runs == [(n, "det") for n in det]
    assert fwd.parse_args(["--form", "trilinear", "det"])[2] == [
        (v.name, f) for v in variants for f in ("trilinear", "det") if f in v.accepted("form")]
    args, _, runs = fwd.parse_args(["--form", "det", "trilinear", "det", "--variant", det[0]])
    assert args.form == ["det", "trilinear"]
    assert runs == [(det[0], "det"), (det[0], "trilinear")]


@pytest.mark.parametrize("form", ["trilinear", "det"])
def test_variant_rows_carry_the_form(form, tmp_path) -> None:
    """bench_variant on CPU tensors: a 'not run' row (the launcher's device check), with its form
    and the form-independent useful FLOPs, through to the CSV and JSON rows."""
    fwd = bench_script("fwd")
    s = Shape(B=1, N=64, Hq=16, Hk=1, D=64, w1=4, w2=8)
    inputs = make_inputs(s.B, s.N, s.Hq, s.Hk, s.D, device="cpu")
    args = fwd.parse_args(["--form", form, "--variant", "triton", "--preset", "small"])[0]
    row = fwd.bench_variant("triton", form, s, inputs, args, {}, print)
    assert row["form"] == form and row["variant"] == "triton" and row["kind"] == "variant"
    assert row["note"].startswith("not run:") and "CUDA GPU" in row["note"], row["note"]
    assert row["flops"] == simplicial_flops(1, 64, 16, 64, 4, 8)
    csv_path, json_path = tmp_path / "rows.csv", tmp_path / "rows.json"
    common.write_rows([row], csv_path=str(csv_path), json_path=str(json_path))
    with open(csv_path, newline="") as f:
        assert next(csv.DictReader(f))["form"] == form
    assert json.loads(json_path.read_text())[0]["form"] == form


def test_det_rows_get_their_ratio_to_trilinear() -> None:
    """vs_trilinear: a det row's TFLOPS over its variant's trilinear TFLOPS on the same shape;
    None without a timed twin; no key on other rows. The table gains 'x trilinear' only then."""
    fwd = bench_script("fwd")

    def row(variant, form, shape, tflops, kind="variant"):
        return {"kind": kind, "pass": "fwd", "variant": variant, "form": form, "shape": shape,
                "tflops": tflops}

    rows = [row("triton", "trilinear", "a", 500.0), row("triton", "det", "a", 460.0),
            row("triton", "det", "b", 450.0), row("triton", "trilinear", "c", None),
            row("triton", "det", "c", 440.0), row("tlx_ws", "trilinear", "a", 600.0),
            {"kind": "peer", "variant": "cudnn_sdpa", "shape": "a", "tflops": 630.0}]
    plain = [dict(r) for r in rows if r.get("form") != "det"]
    assert common.table_columns(plain, fwd.TABLE_COLUMNS, "trilinear") == fwd.TABLE_COLUMNS
    common.add_form_ratios(plain, "trilinear")
    assert all("vs_trilinear" not in r for r in plain)

    common.add_form_ratios(rows, "trilinear")
    assert rows[1]["vs_trilinear"] == pytest.approx(0.92)
    assert rows[2]["vs_trilinear"] is None and rows[4]["vs_trilinear"] is None
    assert all("vs_trilinear" not in r for r in rows if r.get("form") != "det")
    cols = common.table_columns(rows, fwd.TABLE_COLUMNS, "trilinear")
    keys = [k for k, _ in cols]
    assert keys[keys.index("tflops") + 1] == "vs_trilinear"
    header = format_table(rows, cols).splitlines()[0]
    assert "form" in header and "x trilinear" in header


def test_plot_series_name_keeps_the_forms_apart() -> None:
    assert common.series_name({"variant": "triton"}) == "triton"
    assert common.series_name({"variant": "triton", "form": "trilinear"}) == "triton"
    assert common.series_name({"variant": "triton", "form": "det"}) == "triton det"
    assert common.series_name({"variant": "cudnn_sdpa", "form": ""}) == "cudnn_sdpa"


def test_sweep_shapes() -> None:
    """The family record's sweep axes: w2 outer, N inner."""
    base = PRESETS["small"]
    sweep = registry.get_family("simplicial").sweep
    shapes = common.sweep_shapes(base, sweep)
    assert len(shapes) == len(sweep["N"]) * len(sweep["w2"]) == 15
    assert {(s.N, s.w2) for s in shapes} == {(n, w) for n in (1024, 2048, 4096, 8192, 16384)
                                             for w in (256, 512, 1024)}
    for s in shapes:  # everything else comes from the base shape
        assert (s.B, s.Hq, s.Hk, s.D, s.w1) == (base.B, base.Hq, base.Hk, base.D, base.w1)
    assert [s.N for s in shapes[:5]] == sorted(sweep["N"])
    assert common.sweep_shapes(base, {"N": (64,), "w2": (8, 16)}) == [
        Shape(1, 64, 64, 1, 128, 32, 8), Shape(1, 64, 64, 1, 128, 32, 16)]


def _fake_rows() -> list[dict]:
    meta = run_metadata()
    rows = []
    for w2 in (256, 512):
        for n in (1024, 2048, 4096):
            s = Shape(B=1, N=n, Hq=64, Hk=1, D=128, w1=32, w2=w2)
            rows.append({"kind": "variant", "variant": "triton", "shape": s.short(), **s.fields(),
                         "ms": 1.0, "tflops": 100.0 + n / 100 + w2 / 10, "note": "", **meta})
            rows.append({"kind": "peer", "variant": "cudnn_sdpa", "shape": "x", **s.fields(),
                         "ms": 1.0, "tflops": 300.0, "note": "", **meta})
    rows.append({"kind": "variant", "variant": "tlx", "shape": "y", "B": 1, "N": 1024,
                 "w2": 256, "ms": None, "tflops": None, "note": "not run: G", **meta})
    rows.append({"kind": "matmul", "variant": "matmul_bf16", "shape": "8192x8192x8192",
                 "ms": 1.4, "tflops": 780.0, "note": "", **meta})
    return rows


def test_plot_tflops_vs_n_writes_png(tmp_path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed")
    det = [{**r, "form": "det", "tflops": 0.9 * r["tflops"]} for r in _fake_rows()
           if r["variant"] == "triton"]
    for rows in (_fake_rows(), _fake_rows()[:1], _fake_rows() + det):
        path = tmp_path / f"plot{len(rows)}.png"
        common.plot_tflops_vs_n(rows, str(path), "2-simplicial attention forward", "simplicial")
        data = path.read_bytes()
        assert len(data) > 1000
        assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_rows_round_trip(tmp_path) -> None:
    rows = _fake_rows()
    csv_path, json_path = tmp_path / "rows.csv", tmp_path / "rows.json"
    common.write_rows(rows, csv_path=str(csv_path), json_path=str(json_path))

    with open(csv_path, newline="") as f:
        back = list(csv.DictReader(f))
    assert len(back) == len(rows)
    for key in META_KEYS + ("variant", "B", "N", "Hq", "Hk", "D", "w1", "w2", "ms", "tflops"):
        assert key in back[0]
    assert back[0]["N"] == "1024" and back[0]["variant"] == "triton"
    assert back[-1]["B"] == ""  # the matmul row has no shape fields: empty, not 'None'

    loaded = json.loads(json_path.read_text())
    assert loaded == rows
    assert all(k in loaded[0] for k in META_KEYS)


@pytest.mark.parametrize("gpu", [None, "NVIDIA H100 80GB HBM3"], ids=["no_gpu", "gpu"])
def test_run_metadata_and_table(gpu, monkeypatch) -> None:
    """Both branches on any machine: the GPU (or its absence) is simulated."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    meta = run_metadata()
    assert set(META_KEYS) <= set(meta)
    assert meta["gpu"] == (gpu or "none")
    assert meta["commit"]  # a hash, or 'unknown' outside a checkout
    text = format_table([{"a": "x", "b": 1.5}, {"a": "longer", "b": None}],
                        [("a", "name"), ("b", "ms")])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "ms"]
    assert len(lines) == 4 and "1.500" in lines[2]


def test_make_inputs_cpu() -> None:
    q, k1, k2, v1, v2 = make_inputs(2, 16, 4, 2, 64, device="cpu", seed=3)
    assert q.shape == (2, 16, 4, 64) and q.dtype == torch.bfloat16
    assert all(t.shape == (2, 16, 2, 64) for t in (k1, k2, v1, v2))
    again = make_inputs(2, 16, 4, 2, 64, device="cpu", seed=3)
    assert all(torch.equal(a, b) for a, b in zip((q, k1, k2, v1, v2), again))
    assert not torch.equal(k1, k2)


def test_report_prints_the_header_and_table_and_writes_meta_and_rows(tmp_path, capsys):
    """profiling.common.report, every benchmark's ending: header (a line or a function of the
    run's metadata), the table, and the JSON {"meta", "rows"}."""
    import json

    from profiling.common import report
    rows = [{"call": "op fwd", "us": 40.9}, {"call": "forward", "us": 38.2}]
    path = tmp_path / "rows.json"
    meta = report(rows, [("call", "call"), ("us", "us")], str(path),
                  lambda m: f"on {m['gpu']}: 128 tokens")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"on {meta['gpu']}: 128 tokens"
    assert out[1].split() == ["call", "us"] and out[3].split() == ["op", "fwd", "40.9"]
    assert json.loads(path.read_text()) == {"meta": meta, "rows": rows}
    report(rows, [("call", "call")], None, "a plain line")
    assert capsys.readouterr().out.startswith("a plain line\n")


def test_overhead_profile_prints_the_calls_own_time(capsys):
    """bench.overhead --profile's printer: a heading naming the call, then cProfile's rows with
    the profiled function among them."""
    from bench.overhead import print_profile

    def spin():
        return sum(range(50))
    print_profile("toy spin", spin, 30, 5)
    out = capsys.readouterr().out
    assert "## toy spin: 30 calls" in out and "spin" in out.split("## toy spin")[1]

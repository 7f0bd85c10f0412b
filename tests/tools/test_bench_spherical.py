"""CPU tests of the tools on a second family (spherical attention): shape flags and presets from its
shape record, refusals before any GPU work, the generic pre-timing check (bench/check.py) with the
launcher stubbed by the reference, the peers (plain PyTorch against the reference; the optional
triton-sigmoid; cuDNN's causal FLOPs), the N x causal plot, and trace/sanitize arguments."""
from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import pytest
import torch

from altattn import launcher, registry
from altattn.spherical import peers as spherical_peers
from bench import check, common, peers
from conftest import ROOT, bench_script, no_gpu_env
from profiling import common as pcommon

REPO_ROOT = str(ROOT)  # the checkout (conftest puts it on sys.path)

FAM = registry.get_family("spherical")
SHAPE = FAM.shape_type
SPH = ["--family", "spherical"]


def _kernels_load() -> bool:
    try:
        for v in FAM.variants:
            v.load()
    except Exception:  # noqa: BLE001  (kernel modules still being written)
        return False
    return True


def run_cli(path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, path, *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env=no_gpu_env(), check=False)


# ---------------------------------------------------------------------------------------------
# Arguments


def test_shape_flags_come_from_the_shape_record() -> None:
    simplicial = pcommon.shape_flags(registry.get_family("simplicial"))
    assert simplicial == {"B": "--B", "N": "--N", "Hq": "--hq", "Hk": "--hk", "D": "--d",
                          "w1": "--w1", "w2": "--w2"}
    assert pcommon.shape_flags(FAM) == {"B": "--B", "N": "--N", "Hq": "--hq", "Hk": "--hk",
                                        "D": "--d", "causal": "--causal", "pad": "--pad"}


def test_fwd_parses_presets_and_overrides() -> None:
    fwd = bench_script("fwd")
    args, shapes, runs = fwd.parse_args(SPH)
    assert shapes == [FAM.presets[FAM.default_preset]] and args.form == [None]
    assert runs == [(v.name, None) for v in FAM.variants if v.pass_ == "fwd"]
    _, shapes, _ = fwd.parse_args([*SPH, "--preset", "p2", "--causal", "--pad", "0.25",
                                   "--N", "2048", "--variant", "auto"])
    assert shapes == [dataclasses.replace(FAM.presets["p2"], causal=True, pad=0.25, N=2048)]
    _, shapes, _ = fwd.parse_args([*SPH, "--preset", "p1_causal", "--no-causal"])
    assert shapes[0].causal is False
    _, shapes, _ = fwd.parse_args([*SPH, "--sweep", "--preset", "small"])
    assert len(shapes) == len(FAM.sweep["N"]) * len(FAM.sweep["causal"])
    assert {(s.N, s.causal) for s in shapes} == {(n, c) for n in FAM.sweep["N"]
                                                 for c in FAM.sweep["causal"]}
    assert [s.N for s in shapes[:len(FAM.sweep["N"])]] == list(FAM.sweep["N"])


@pytest.mark.parametrize("script, args, needle", [
    ("fwd", ["--preset", "p9"], "argument --preset: invalid choice: 'p9'"),
    ("fwd", ["--preset", "star"], "argument --preset: invalid choice: 'star'"),
    ("fwd", ["--w1", "32"], "unrecognized arguments: --w1 32"),
    ("fwd", ["--form", "det"], "unrecognized arguments: --form det"),
    ("fwd", ["--hq", "12", "--hk", "5"], "--hq 12 must be a multiple of --hk 5"),
    ("fwd", ["--d", "96"], "--d 96: head dim not supported; supported: 64, 128"),
    ("fwd", ["--pad", "-1"], "argument --pad: must be a number >= 0, got -1"),
    ("fwd", ["--pad", "x"], "argument --pad: must be a number >= 0, got 'x'"),
    ("fwd", ["--N", "0"], "argument --N: must be a positive integer, got 0"),
    ("fwd", ["--sweep", "--causal"], "--sweep sets N and causal itself; drop --causal"),
    ("fwd", ["--variant", "tlx_ws_det"],
     ("invalid choice: 'tlx_ws_det' ('tlx_ws_det' is a bwd variant: use bench/bwd.py); "
      "fwd variants of spherical")),
    ("fwd", ["--variant", "tlx_pipelined_kv"], "invalid choice: 'tlx_pipelined_kv'"),
    ("bwd", ["--variant", "tlx_pipelined"], "'tlx_pipelined' is a fwd variant: use bench/fwd.py"),
    ("bwd", ["--hq", "6", "--hk", "4"], "--hq 6 must be a multiple of --hk 4"),
])
def test_refusals_exit_2_before_the_gpu(script, args, needle, capsys) -> None:
    mod = bench_script(script)
    with pytest.raises(SystemExit) as e:
        mod.main([*SPH, *args]) if script == "bwd" else mod.parse_args([*SPH, *args])
    assert e.value.code == 2
    assert needle in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("script, args", [
    ("bench/fwd.py", ["--peers", "--frontier"]),
    ("bench/fwd.py", ["--preset", "p2", "--causal", "--pad", "0.25", "--N", "2048", "--peers"]),
    ("bench/fwd.py", ["--sweep", "--variant", "auto", "--plot", "out.png"]),
    ("bench/bwd.py", ["--peers"]),
    ("bench/bwd.py", ["--preset", "p1_causal", "--variant", "auto"]),
])
def test_good_arguments_reach_the_gpu_check(script, args) -> None:
    if not _kernels_load():
        pytest.skip("spherical kernel modules do not import yet")
    res = run_cli(script, *SPH, *args)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.strip().splitlines() == [
        f"{script}: no CUDA GPU found; this benchmark needs one (H100/H200)"], res.stderr


def test_help_names_the_family_peers_and_checks() -> None:
    fwd = bench_script("fwd")
    text = " ".join(fwd.build_fwd_parser(FAM).format_help().split())
    for p in FAM.peers:
        assert p.rule in text
    assert "--form" not in text and "--causal, --no-causal" in text
    assert "out rel. Frobenius error <= 0.01, r rel. Frobenius error <= 0.001" in text


def test_variant_row_without_a_gpu() -> None:
    """A 'not run' row (the launcher's device check) with the family's useful FLOPs, no form."""
    fwd = bench_script("fwd")
    s = SHAPE(B=2, N=64, Hq=4, Hk=2, D=64, causal=True, pad=0.25)
    args = fwd.parse_args([*SPH, "--variant", "triton", "--preset", "small"])[0]
    inputs = FAM.make_inputs(s, "fwd", seed=0, device="cpu")
    row = fwd.bench_variant("triton", None, s, inputs, args, {}, print)
    assert row["kind"] == "variant" and row["form"] is None and row["causal"] is True
    assert row["note"].startswith("not run:") and "CUDA GPU" in row["note"], row["note"]
    assert row["flops"] == FAM.flops(s, "fwd")
    cols = common.table_columns([row], fwd.TABLE_COLUMNS, None)
    assert "form" not in [k for k, _ in cols]


# ---------------------------------------------------------------------------------------------
# The check, on the CPU: launcher.run stubbed by the reference in bf16


@pytest.fixture
def cpu_launcher(monkeypatch):
    """launcher.run -> the family's reference, outputs rounded as the kernels' (bf16 out and
    gradients, fp32 statistics); a backward's forward ("auto") the same."""
    def run(family, pass_, *args, variant="auto", **_):
        fam = registry.get_family(family)
        outs = check.reference_outputs(fam, pass_, args, torch.float64)
        names = fam.passes[pass_].outputs
        return tuple(o.float() if n in ("lse", "r") else o.to(torch.bfloat16)
                     for n, o in zip(names, outs))
    monkeypatch.setattr(launcher, "run", run)
    monkeypatch.setattr(check.launcher, "run", run)
    monkeypatch.setattr(check, "DEVICE", "cpu")
    import altattn.simplicial.passes as sp
    import altattn.spherical.passes as pp
    monkeypatch.setattr(pp, "forward", lambda *a, **k: run("spherical", "fwd", *a, k["causal"],
                                                            None, 1e-6, k["seqlens"]))
    monkeypatch.setattr(sp, "forward", lambda *a, form="trilinear", **_: run(
        "simplicial", "fwd", *a, None, form))
    return run


@pytest.mark.parametrize("family, pass_, keys", [
    ("spherical", "fwd", ["out_rel", "r_rel"]), ("spherical", "bwd", ["grad_rel"] * 3),
    ("simplicial", "fwd", ["out_rel", "lse_abs"]), ("simplicial", "bwd", ["grad_rel"] * 5)])
def test_check_compares_every_output(cpu_launcher, family, pass_, keys) -> None:
    fam = registry.get_family(family)
    s = (SHAPE(2, 40, 4, 2, 64, causal=True, pad=0.2) if family == "spherical"
         else fam.shape_type(1, 24, 4, 1, 64, 4, 8))
    errors = check.check_pass(family, pass_, "triton", s)
    assert [e.output for e in errors] == list(fam.passes[pass_].outputs)
    assert [e.key for e in errors] == keys
    assert all(e.ok for e in errors), check.summary(errors, short=False)


def test_check_failure_names_the_output_and_its_tolerance(cpu_launcher, monkeypatch) -> None:
    fwd = bench_script("fwd")

    def wrong(family, pass_, *args, **kw):
        out, r = cpu_launcher(family, pass_, *args, **kw)
        return out, r * 1.01
    monkeypatch.setattr(check.launcher, "run", wrong)
    with pytest.raises(fwd.CheckFailed, match=r"r relative error 0\.01 \(r_rel tolerance 0\.001\)"):
        fwd.check_variant("triton", SHAPE(1, 32, 2, 2, 64), 0, None, "spherical")
    bwd = bench_script("bwd")
    monkeypatch.setattr(check.launcher, "run", lambda f, p, *a, **k: tuple(
        g * 1.1 for g in cpu_launcher(f, p, *a, **k)))
    assert bwd.check("triton", SHAPE(1, 32, 2, 2, 64), None, "spherical") == (
        f"dq: relative error 1.00e-01 > {FAM.tolerances['grad_rel']}")


def test_tolerance_keys_and_forward_backward_calls(cpu_launcher) -> None:
    with pytest.raises(ValueError, match="no tolerance for output 'z'"):
        check.tolerance_key(FAM, "fwd", "z")
    bwd = bench_script("bwd")
    s = SHAPE(1, 16, 2, 1, 64, causal=True)
    args = FAM.make_inputs(s, "bwd", seed=0, device="cpu")
    fwd_args, bwd_args = bwd.fwd_bwd_calls(FAM, args)
    assert len(fwd_args) == 7 and fwd_args[0] is args[2] and fwd_args[3] is True
    new = bwd_args(("OUT", "R"))
    assert new[5:7] == ("OUT", "R") and new[:5] == args[:5] and new[7:] == args[7:]


# ---------------------------------------------------------------------------------------------
# Peers


def test_plain_pytorch_peer_matches_the_reference(monkeypatch) -> None:
    from altattn.spherical.reference import reference, reference_backward
    monkeypatch.setattr(spherical_peers, "S_BYTES", 2 * 2 * 48 * 48 * 3)  # several chunks
    for s in (SHAPE(2, 48, 8, 2, 64), SHAPE(3, 48, 4, 1, 64, causal=True, pad=0.3)):
        q, k, v, lengths = spherical_peers.inputs(s, 0, "cpu")
        seqlens = None if lengths is None else torch.tensor(lengths)
        out, r = spherical_peers.torch_forward(q, k, v, s.causal, lengths)
        dout = torch.randn_like(out)
        got = (out, r, *spherical_peers.torch_backward(dout, q, k, v, out, r, s.causal, lengths))
        want = (*reference(q, k, v, s.causal, seqlens=seqlens),
                *reference_backward(q, k, v, dout, None, s.causal, seqlens=seqlens))
        for g, w in zip(got, want):
            assert float((g.double() - w).norm() / w.norm()) < 1.5e-2, s.short()


def test_peer_rows_without_a_gpu(monkeypatch) -> None:
    """A peer whose module is missing, and triton-sigmoid when not installed: rows with notes,
    the family's useful FLOPs, nothing launched."""
    monkeypatch.setitem(sys.modules, "triton_sigmoid", None)  # import fails: "not installed"
    fam = dataclasses.replace(FAM, peers=(
        registry.Peer(name="triton_sigmoid", rule="r", runs="altattn.spherical.peers:triton_sigmoid"),
        registry.Peer(name="ghost", rule="r", runs="bench.no_such_module:bench")))
    s = SHAPE(2, 256, 4, 4, 64, causal=True)
    args = bench_script("fwd").parse_args(SPH)[0]
    rows = peers.bench_peers(fam, s, args, ("bwd", "fwd+bwd"))
    assert [(r["variant"], r["pass"]) for r in rows] == [
        ("triton_sigmoid", "bwd"), ("triton_sigmoid", "fwd+bwd"), ("ghost", "bwd"),
        ("ghost", "fwd+bwd")]
    assert rows[0]["note"].startswith("not installed") and rows[0]["flops"] == FAM.flops(s, "bwd")
    assert rows[1]["flops"] == FAM.flops(s, "fwd") + FAM.flops(s, "bwd")
    assert rows[2]["note"].startswith("not run: bench.no_such_module:bench")


def test_dense_peer_is_causal_when_the_shape_is() -> None:
    d = peers.peer(FAM).dense(SHAPE(2, 1024, 8, 8, 128, causal=True))
    assert d["causal"] is True and d["Nq"] == d["Nk"] == 1024
    assert peers.dense_flops(d) == 4 * 2 * 8 * 128 * 1024 * 1025 // 2
    assert peers.dense_flops(d) == FAM.flops(SHAPE(2, 1024, 8, 8, 128, causal=True), "fwd")
    assert peers.visible_pairs(5, 3, True) == 1 + 2 + 3 + 3 + 3
    assert peers.frontier_key(FAM, SHAPE(2, 1024, 8, 8, 128)) == (2, 8, 1024, 128)


def test_frontier_of_a_causal_shape_says_it_is_timed_non_causal() -> None:
    args = bench_script("fwd").parse_args(SPH)[0]
    rows = peers.bench_frontier(SHAPE(1, 100, 2, 2, 64, causal=True), args, print)
    assert all(r["flops"] == 4 * 2 * 64 * 100 * 100 for r in rows)
    assert all("not a multiple of 128" in r["note"] for r in rows)  # L = 100: not run


# ---------------------------------------------------------------------------------------------
# Plot, trace, sanitize


def test_plot_has_one_panel_per_causal_value(tmp_path, monkeypatch) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed")
    assert common.panel_field("spherical") == "causal" and common.panel_field("simplicial") == "w2"
    rows = []
    for causal in (False, True):
        for n in (1024, 2048, 4096):
            s = SHAPE(4, n, 128, 128, 128, causal=causal)
            for kind, name, tf in (("variant", "tlx_pipelined", 500.0), ("peer", "cudnn_sdpa",
                                                                           600.0)):
                rows.append({"kind": kind, "variant": name, "form": None, "shape": s.short(),
                             **s.fields(), "tflops": tf + n / 100})
    rows.append({"kind": "matmul", "variant": "matmul_bf16", "tflops": 780.0})
    import matplotlib.pyplot as plt
    made = []
    real = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: made.append(a) or real(*a, **k))
    path = tmp_path / "sweep.png"
    common.plot_tflops_vs_n(rows, str(path), "spherical attention forward", "spherical")
    assert made == [(1, 2)] and path.read_bytes()[:4] == b"\x89PNG"


def test_trace_takes_the_family_shapes(capsys) -> None:
    from profiling import trace
    p = trace.build_parser("spherical")
    args = p.parse_args([*SPH, "--variant", "triton", "--causal", "--N", "512"])
    s = pcommon.shape_from_args(args)
    assert args.preset == "small" and s == dataclasses.replace(FAM.presets["small"], causal=True,
                                                               N=512)
    with pytest.raises(SystemExit):
        trace.main([*SPH, "--variant", "triton", "--hq", "6", "--hk", "4"])
    assert "--hq 6 must be a multiple of --hk 4" in capsys.readouterr().err


def test_sanitize_runs_and_worker_shapes() -> None:
    from tools import sanitize
    s = SHAPE(1, 256, 8, 2, 64, causal=True, pad=0.25)
    run = sanitize.Run("memcheck", "fwd", "triton", s, None, family="spherical")
    cmd = sanitize.command("cs", run)
    i = cmd.index("--shape")
    assert cmd[i + 1:] == ["1", "256", "8", "2", "64", "True", "0.25", "--family", "spherical"]
    assert pcommon.parse_shape(FAM, cmd[i + 1:i + 8]) == s
    assert run.tag() == "memcheck-fwd-triton-B1-N256-H8x2-D64-causal-pad0.25"
    with pytest.raises(ValueError, match="shape field causal: must be True or False"):
        pcommon.parse_shape(FAM, ["1", "256", "8", "2", "64", "maybe", "0"])
    with pytest.raises(ValueError, match="has 7 fields"):
        pcommon.parse_shape(FAM, ["1", "256"])
    if not _kernels_load():
        pytest.skip("spherical kernel modules do not import yet")
    runs = sanitize.plan(["memcheck"], registry.PASSES, None, family="spherical")
    assert runs and all(r.form is None and r.family == "spherical" for r in runs)
    assert {(r.pass_, r.variant) for r in runs} == {(v.pass_, v.name) for v in FAM.variants}


def test_spherical_decode_bench_counts_the_cache_read_and_needs_a_gpu():
    """bench.spherical_decode's bytes are the K and V cache rows read (2 B L Hk D 2: 1.07 GB at
    B 64, 4,097 rows, Hk 8, D 128); without a GPU it stops with a message, not a traceback."""
    from bench.spherical_decode import cache_bytes
    assert cache_bytes(64, 4097, 8, 128) == 2 * 64 * 4097 * 8 * 128 * 2 == 1_074_003_968
    p = subprocess.run([sys.executable, "-m", "bench.spherical_decode"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120, env=no_gpu_env())
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr

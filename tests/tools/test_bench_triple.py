"""CPU tests of the tools on the third family (triple attention): shape flags and presets from its
shape record (--h --dq --dv), refusals before any GPU work, the generic pre-timing check
(bench/check.py) with the launcher stubbed by the reference, the forward/backward calls of
bench/bwd.py (the backward takes the state, not out), and the peers (altattn/triple/peers.py)
against the reference."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest
import torch

from altattn import launcher, registry
from altattn.triple.reference import reference, reference_backward
from altattn.triple import peers as triple_peers
from bench import check, common, peers
from profiling import common as pcommon
from conftest import ROOT, bench_script, no_gpu_env

REPO_ROOT = str(ROOT)  # the checkout (conftest puts it on sys.path)

FAM = registry.get_family("triple")
SHAPE = FAM.shape_type
TRI = ["--family", "triple"]
BF16 = torch.bfloat16


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------------------------
# Arguments


def test_shape_flags_come_from_the_shape_record() -> None:
    assert pcommon.shape_flags(FAM) == {"B": "--B", "N": "--N", "H": "--h", "Dq": "--dq",
                                        "Dv": "--dv", "causal": "--causal"}
    assert common.panel_field("triple") == "causal"


def test_fwd_parses_presets_overrides_and_the_sweep() -> None:
    fwd = bench_script("fwd")
    args, shapes, runs = fwd.parse_args(TRI)
    assert shapes == [FAM.presets[FAM.default_preset]] and args.form == [None]
    assert runs == [("tlx", None), ("triton", None)]  # every registered variant, by rank
    _, shapes, _ = fwd.parse_args([*TRI, "--preset", "t1", "--causal", "--N", "65536",
                                   "--dv", "64", "--h", "2"])
    assert shapes == [dataclasses.replace(FAM.presets["t1"], causal=True, N=65536, Dv=64, H=2)]
    _, shapes, _ = fwd.parse_args([*TRI, "--sweep", "--preset", "small"])
    assert {(s.N, s.causal) for s in shapes} == {(n, c) for n in FAM.sweep["N"]
                                                 for c in FAM.sweep["causal"]}


@pytest.mark.parametrize("script, args, needle", [
    ("fwd", ["--dq", "48"], "shape B1 N524288 H8 Dq48 Dv64: head dim Dq=48 is not supported"),
    ("fwd", ["--frontier"], "--frontier: triple attention has no dense softmax peer"),
    ("fwd", ["--hq", "4"], "unrecognized arguments: --hq 4"),
    ("fwd", ["--preset", "p1"], "argument --preset: invalid choice: 'p1'"),
    ("fwd", ["--sweep", "--N", "1024"], "--sweep sets N and causal itself; drop --N"),
    ("bwd", ["--dv", "16"], "head dim Dv=16 is not supported"),
])
def test_refusals_exit_2_before_the_gpu(script, args, needle, capsys) -> None:
    mod = bench_script(script)
    with pytest.raises(SystemExit) as e:
        mod.main([*TRI, *args]) if script == "bwd" else mod.parse_args([*TRI, *args])
    assert e.value.code == 2
    assert needle in " ".join(capsys.readouterr().err.split())


def test_help_names_the_peers_and_checks() -> None:
    fwd = bench_script("fwd")
    text = " ".join(fwd.build_fwd_parser(FAM).format_help().split())
    for p in FAM.peers:
        assert " ".join(p.rule.split()) in text
    assert "out rel. Frobenius error <= 0.01, state rel. Frobenius error <= 0.01" in text
    assert "--h INT" in text and "--dq INT" in text and "no dense softmax peer" in text


# ---------------------------------------------------------------------------------------------
# The check, on the CPU: launcher.run stubbed by the reference, rounded as the kernels' outputs


@pytest.fixture
def cpu_launcher(monkeypatch):
    def run(family, pass_, *args, variant="auto", **_):
        fam = registry.get_family(family)
        outs = check.reference_outputs(fam, pass_, args, torch.float64)
        names = fam.passes[pass_].outputs
        return tuple(o.float() if n == "state" else o.to(BF16) for n, o in zip(names, outs))
    monkeypatch.setattr(launcher, "run", run)
    monkeypatch.setattr(check.launcher, "run", run)
    monkeypatch.setattr(check, "DEVICE", "cpu")
    import altattn.triple.passes as tp
    monkeypatch.setattr(tp, "forward", lambda *a, **k: run("triple", "fwd", *a, k.get("scale"),
                                                            k["causal"]))
    return run


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pass_, keys", [("fwd", ["out_rel", "state_rel"]),
                                         ("bwd", ["grad_rel"] * 5)])
def test_check_compares_every_output(cpu_launcher, pass_, keys, causal) -> None:
    s = SHAPE(2, 40, 3, 32, 64, causal=causal)
    errors = check.check_pass("triple", pass_, "triton", s)
    assert [e.output for e in errors] == list(FAM.passes[pass_].outputs)
    assert [e.key for e in errors] == keys
    assert all(e.ok for e in errors), check.summary(errors, short=False)


def test_forward_backward_calls_take_the_state(cpu_launcher) -> None:
    bwd = bench_script("bwd")
    args = FAM.make_inputs(SHAPE(1, 16, 2, 32, 32, causal=True), "bwd", seed=0, device="cpu")
    fwd_args, bwd_args = bwd.fwd_bwd_calls(FAM, args)
    # (q1, ..., v, scale, causal, initial_state): the defaults of what make_inputs leaves out
    assert len(fwd_args) == 8 and fwd_args[0] is args[2] and fwd_args[5:] == (None, True, None)
    new = bwd_args(("OUT", "STATE"))  # out is no argument of the backward: dropped
    assert len(new) == len(args) + 1 and new[7] == "STATE" and new[:7] == args[:7]
    assert new[-1] is None  # no initial_state


def test_the_layer_of_the_record() -> None:
    layer = FAM.layer(SHAPE(1, 16, 2, 32, 64, causal=True), 48, "auto")
    assert (layer.n_heads, layer.head_dim, layer.v_head_dim, layer.causal) == (2, 32, 64, True)
    x = torch.randn(1, 16, 48, dtype=torch.float64)
    assert layer.double()(x).shape == x.shape


# ---------------------------------------------------------------------------------------------
# Peers


def _inputs(s: SHAPE, seed: int = 0):
    return FAM.make_inputs(s, "fwd", seed=seed, device="cpu")[:5]


@pytest.mark.parametrize("causal", [False, True])
def test_einsum_peer_matches_the_reference(causal, monkeypatch) -> None:
    monkeypatch.setattr(triple_peers, "CAUSAL_CHUNK", 8)  # several chunks
    x = [t.requires_grad_() for t in _inputs(SHAPE(2, 30, 2, 32, 64))]
    out, state = triple_peers.einsum_forward(*x, causal=causal, chunk=None if causal else 7)
    want_out, want_state = reference(*x, causal=causal)
    assert rel(out, want_out) < 1.5e-2 and rel(state, want_state) < 1e-2
    assert out.dtype == BF16 and state.dtype == torch.float32
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, x, dout)
    want = reference_backward(*(t.detach() for t in x), dout, causal=causal)
    for name, g, w in zip(("dq1", "dq2", "dk1", "dk2", "dv"), got, want):
        assert rel(g, w) < 2e-2, name


def test_materialised_peer_matches_the_reference() -> None:
    x = _inputs(SHAPE(2, 30, 3, 32, 64))
    want, _ = reference(*x)
    assert rel(triple_peers.materialised_forward(*x), want) < 1.5e-2
    A, K2, Phi = triple_peers.build_operands(*x, 1 / 30, 2)  # the first two (b, h) pairs
    assert A.shape == (2, 30, 32 * 64) and K2.shape == (2, 30, 32) and Phi.shape == (2, 30, 1024)
    out = triple_peers.materialised_phases(A, K2, Phi, 64)
    assert rel(out[1], want[0, :, 1]) < 1.5e-2


def test_materialised_peer_is_forward_only() -> None:
    args = argparse.Namespace(seed=0, warmup_ms=1.0, rep_ms=1.0)
    peer = next(p for p in FAM.peers if p.name == "materialised")
    s = SHAPE(1, 64, 2, 32, 32)
    rows = peers.bench_own(FAM, peer, s, args, ("bwd", "fwd+bwd"))
    assert [r["note"] for r in rows] == ["forward only"] * 2
    assert rows[0]["flops"] == FAM.flops(s, "bwd") and rows[0]["pass"] == "bwd"


def test_triple_decode_bench_counts_the_state_read_and_written_and_needs_a_gpu():
    """bench.triple_decode's bytes are the fp32 state read and written once a launch (2 B H Dq^2
    Dv 4: a 537 MB state at B 64, H 8, D 64; a launch per 8 tokens); without a GPU it stops
    with a message, not a traceback."""
    from bench.triple_decode import state_bytes
    assert state_bytes(64, 8, 64, 64) == 2 * 64 * 8 * 64 ** 3 * 4 == 1_073_741_824
    assert state_bytes(64, 8, 64, 64, 9) == 2 * state_bytes(64, 8, 64, 64, 8)  # two launches
    p = subprocess.run([sys.executable, "-m", "bench.triple_decode"], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=120, env=no_gpu_env())
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr

"""Resource gate for every registered config of every pass, compiled for sm_90a on CPU
(tools.resources).

2-simplicial: no spills, shared memory within the Hopper limit, wgmma in the Hopper-only variants,
the warp count of the variant's record (its widest kernel's), and an exp2 count under an
in-flight wgmma only where the record says the variant pairs its GEMMs. Spherical
(`GATED`): the CLI's own gate (`tools.resources.problems`: compiles, no spill, shared memory
within the limit, wgmma operands kept), what `python -m tools.resources --family spherical`
exits 0 on; its records' warps and pairing flags do not follow the simplicial rules (decoding
helpers without wgmma, a backward that leaves dV in flight). The kernels are the ones
test_compile.py compiled (tools.resources compiles and measures each config once per process);
the CLI tests run the tool in this process, plus one cheap run as `python -m tools.resources`.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from tools import resources
from tools.resources import (HOPPER_SMEM_LIMIT, parse_cuobjdump, parse_ptx, parse_ptxas,
                                 parse_sass_clobbered_operands, parse_sass_overlap)
from altattn import registry

REQUIRED_KEYS = {"pass", "variant", "config", "registers", "spill_bytes", "smem_bytes", "wgmma",
                 "setmaxnreg", "named_barriers", "ex2_overlap", "total_warps"}
CONFIGS = registry.compile_configs(None, "simplicial")
CASES = [pytest.param(v, c.name, id=f"{v.pass_}-{v.name}-{c.name}") for v, c in CONFIGS]


def _key(r: dict) -> tuple:
    return r["pass"], r["variant"], r["config"]


@pytest.fixture(scope="module")
def rows() -> dict:
    return {_key(r): r for r in resources.report(family="simplicial")}


@pytest.mark.parametrize("variant,config", CASES)
def test_config_resources(rows, variant, config):
    r = rows[(variant.pass_, variant.name, config)]
    where = resources.where(r)
    assert r["error"] is None, f"{where}: {r['error']}"
    assert r["spill_bytes"] == 0, (f"{where} spills {r['spill_bytes']} bytes "
                                   f"({r['spill_stores']} stores + {r['spill_loads']} loads), "
                                   f"{r['registers']} registers")
    assert r["smem_bytes"] <= HOPPER_SMEM_LIMIT, (f"{where} needs {r['smem_bytes']} bytes of "
                                                  f"shared memory > {HOPPER_SMEM_LIMIT}")
    assert not r["operand_clobbers"], (f"{where}: its loop overwrites the registers its QK "
                                       f"wgmma reads: {r['operand_clobbers'][:4]}")
    if variant.needs_hopper:
        assert r["wgmma"] >= 1, f"{where} is Hopper-only but its PTX has no wgmma.mma_async"
    assert r["total_warps"] <= variant.warps, (f"{where}: the kernel runs {r['total_warps']} "
                                               f"warps, its registry record says {variant.warps}")
    if variant.pipelined:
        # QK(c) issued with PV(c - 1), QK(c) waited for alone (wgmma.wait_group 1): the SASS waits
        # for a wgmma while another is in flight, so ex2_overlap is a count (how many exp2 run
        # under it is a performance figure, reported by tools.resources, not pinned here)
        assert r["ex2_overlap"] is not None, f"{where} never waits with a wgmma left in flight"
    else:
        assert r["ex2_overlap"] is None, f"{where} leaves a wgmma in flight: {r['ex2_overlap']}"


GATED = ("spherical",)  # families gated on tools.resources.problems alone (module docstring)
GATED_CASES = [pytest.param(f, v.pass_, v.name, c.name, id=f"{f}-{v.pass_}-{v.name}-{c.name}")
               for f in GATED for v, c in registry.compile_configs(None, f)]


@pytest.fixture(scope="module")
def gated_rows() -> dict:
    return {(f, *_key(r)): r for f in GATED for r in resources.report(family=f)}


@pytest.mark.parametrize("family,pass_,variant,config", GATED_CASES)
def test_family_config_gate(gated_rows, family, pass_, variant, config):
    r = gated_rows[(family, pass_, variant, config)]
    assert not resources.problems(r), f"{family} {resources.where(r)}: {resources.problems(r)}"


@pytest.mark.parametrize("variant", sorted({v for v, _ in CONFIGS},
                                            key=lambda v: (v.pass_, v.name)),
                         ids=lambda v: f"{v.pass_}-{v.name}")
def test_record_warps(rows, variant):
    """The record's `warps` is its widest kernel's: every config runs at most that many (above),
    and one runs exactly that many."""
    mine = [r["total_warps"] for (p, n, _), r in rows.items()
            if (p, n) == (variant.pass_, variant.name)]
    assert max(mine) == variant.warps, f"{variant.name}: widest kernel {max(mine)} warps"


def test_cli_json(rows, capsys):
    """The CLI's JSON rows are the report's (measured once in this process: no recompile)."""
    assert resources.main(["--json"]) in (0, 1)  # 1 = some config fails the gate (tested above)
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, list) and out
    for r in out:
        assert REQUIRED_KEYS <= r.keys(), REQUIRED_KEYS - r.keys()
    assert {_key(r) for r in out} == set(rows)
    assert resources.main(["--pass", "fwd", "--variant", "triton"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["pass", "variant", "config"]
    assert all(line.split()[:2] == ["fwd", "triton"] for line in table.splitlines()[2:-1])
    assert resources.main(["--variant", "no_such_variant"]) == 2


def test_cli_as_a_module():
    """`python -m tools.resources` runs as a module (its help; the compiles are above)."""
    p = subprocess.run([sys.executable, "-m", "tools.resources", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    assert "--pass" in p.stdout


PTX = """
.version 8.8
.target sm_90a
.visible .entry attn_fwd()
.reqntid 384
    // wgmma.mma_async in a comment does not count; neither does bar.sync 7, 64;
    setmaxnreg.dec.sync.aligned.u32 24;
    setmaxnreg.inc.sync.aligned.u32 \t240;
    bar.sync 0;
    bar.sync 0, 128;
    bar.sync 9, 256;
    @%p1 bar.arrive 10, 256;
    barrier.sync.aligned 3, 128;
    bar.red.popc.u32 %r1, 5, %p2;
    bar.warp.sync -1;
    mbarrier.arrive.shared::cta.b64 _, [%r2];
    mbarrier.try_wait.parity.shared::cta.b64 complete, [%r3], %r4;
    barrier.cluster.arrive;
    wgmma.fence.sync.aligned;
    wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r5}, %rd1, %rd2, 0, 1, 1, 0, 0;
    wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r5}, %rd1, %rd2, %p5, 1, 1, 0, 0;
    wgmma.commit_group.sync.aligned;
"""

PTXAS_LOG = """\
ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'attn_fwd' for 'sm_90a'
ptxas info    : Function properties for attn_fwd
    8 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 11 barriers, 4096 bytes smem, 8 bytes cumulative stack size
ptxas warning : Too many maxnreg specified for entry attn_fwd, will be ignored
ptxas info    : Compile time = 476.855 ms
"""

CUOBJDUMP = """
Resource usage:
 Common:
  GLOBAL:11 CONSTANT[4]:8
 Function attn_fwd:
  REG:168 STACK:8 SHARED:5120 LOCAL:0 CONSTANT[0]:1328 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_parse_ptx():
    p = parse_ptx(PTX)
    assert p["wgmma"] == 2
    assert p["threads"] == 384
    assert p["setmaxnreg_values"] == [24, 240]
    assert p["setmaxnreg_dec"] == [24] and p["setmaxnreg_inc"] == [240]
    assert p["named_barrier_ids"] == [3, 5, 9, 10]
    assert parse_ptx("bar.sync 0;\nbarrier.sync 0, 128;") == {
        "threads": None, "wgmma": 0, "setmaxnreg_inc": [], "setmaxnreg_dec": [],
        "setmaxnreg_values": [], "named_barrier_ids": []}
    assert parse_ptx("bar.sync %r7, 128;")["named_barrier_ids"] == ["%r7"]


def test_parse_ptxas():
    p = parse_ptxas(PTXAS_LOG)
    assert p["entries"] == ["attn_fwd"]
    assert p["functions"]["attn_fwd"] == {"stack": 8, "spill_stores": 8, "spill_loads": 12,
                                          "registers": 168, "barriers": 11, "smem": 4096,
                                          "cumulative_stack": 8}
    assert p["notes"] == [("ptxas warning : Too many maxnreg specified for entry attn_fwd, "
                           "will be ignored")]


def test_parse_cuobjdump():
    assert parse_cuobjdump(CUOBJDUMP)["attn_fwd"]["REG"] == 168
    assert parse_cuobjdump(CUOBJDUMP)["attn_fwd"]["SHARED"] == 5120
    assert "Common" not in parse_cuobjdump(CUOBJDUMP)


SASS = """
        /*5ca0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;        /* 0x00008000000079c5 */
        /*5cb0*/                   MUFU.EX2 R1, R1 ;                      /* 0x0000000100017308 */
        /*5cc0*/                   MUFU.EX2 R2, R2 ;                      /* 0x0000000200027308 */
        /*5cd0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;        /* 0x00008000000079c5 */
        /*5ce0*/                   MUFU.EX2 R3, R3 ;                      /* 0x0000000300037308 */
        /*5cf0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;        /* 0x00008000000079c5 */
        /*5d00*/                   MUFU.EX2 R4, R4 ;                      /* 0x0000000400047308 */
        /*5d10*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;        /* 0x00008000000079c5 */
"""


def test_parse_sass_overlap():
    # the larger window counts; the exp2 after a full wait is in none
    assert parse_sass_overlap(SASS) == 2
    assert parse_sass_overlap(SASS.replace("0x1 ;", "0x0 ;")) is None  # only full waits
    no_ex2 = "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\nWARPGROUP.DEPBAR.LE gsb0, 0x0 ;"
    assert parse_sass_overlap(no_ex2) == 0
    unclosed = "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\nMUFU.EX2 R1, R1 ;"
    assert parse_sass_overlap(unclosed) is None  # a window never closed by a full wait


# A consumer loop as ptxas compiled `tlx_ws_kv` with the det build (docs/perf-det.md): the QK chain
# reads Q from R180-R183, and the softmax then writes P into R180 before the back edge.
CLOBBER_SASS = """
        /*3ae0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x382f0], R3 ;
        /*3c40*/                   HGMMA.64x128x16.F32.BF16 R24, R180, gdesc[UR4], RZ, !UPT ;
        /*3c80*/                   HGMMA.64x128x16.F32.BF16 R24, R184, gdesc[UR4], R24, gsb0 ;
        /*4c90*/                   FFMA R180, R24, UR20, -R4 ;
        /*6270*/                   HGMMA.64x128x16.F32.BF16 R88, R180, gdesc[UR4].tnspB, R88 ;
        /*64d0*/               @P0 BRA 0x3ae0 ;
"""


def test_parse_sass_clobbered_operands():
    assert parse_sass_clobbered_operands(CLOBBER_SASS) == [
        "R180 (HGMMA at 0x3c40, written at 0x4c90)"]
    # Q re-loaded at the top of each iteration (the trilinear tlx_ws_kv): fine
    reload = CLOBBER_SASS.replace(
        "        /*3c40*/",
        "        /*3b00*/                   LDSM.16.M88.4 R180, [R6+0x34000] ;\n        /*3c40*/")
    assert parse_sass_clobbered_operands(reload) == []
    # the write after the loop's back edge (an epilogue) is no clobber
    assert parse_sass_clobbered_operands(CLOBBER_SASS.replace("/*4c90*/", "/*6500*/")) == []
    # Q's registers written by a vector load in the loop: LDS.128 R176 covers R176-R179 only
    assert parse_sass_clobbered_operands(CLOBBER_SASS.replace(
        "FFMA R180, R24, UR20, -R4", "LDS.128 R176, [R2]")) == []
    # a barrier wait's retry past the last EXIT jumps back before the HGMMA: no loop
    retry = CLOBBER_SASS.replace("        /*64d0*/               @P0 BRA 0x3ae0 ;", (
        "        /*64d0*/                   EXIT ;\n"
        "        /*6500*/                   BRA 0x3ae0 ;"))
    assert parse_sass_clobbered_operands(retry) == []
    assert parse_sass_clobbered_operands(CLOBBER_SASS.replace(
        "FFMA R180, R24, UR20, -R4", "LDS.128 R178, [R2]")) == [
        "R180 (HGMMA at 0x3c40, written at 0x4c90)", "R181 (HGMMA at 0x3c40, written at 0x4c90)"]

"""Tests of tools/ws_dispatch.py (the compiler's warp-specialization dispatch in SASS, and
whether barrier 1 orders it) and of the probe of tools/ws_probe.py, on the CPU: the check on
small hand-written listings, one correct and several broken; then on the compiled sm_90a SASS of
the probe and of the `tlx_ws` kernels (forward and backward) at the sanitizer's ragged shape, which
must show the same protocol; the probe's host-side expected values. (gpu marker) one launch of
the probe, checked."""
from __future__ import annotations

import re

import pytest

from tools import ws_dispatch, ws_probe
from altattn import registry

# A dispatch as Triton lowers it, in cuobjdump's format: warps 0-3 fall through the role split;
# the workers loop at 0x100 (barrier, their byte at 0x104 + warp, the exit code 2 or a partition
# between two barriers; a state of no partition takes the @P2 pair of barriers and loops).
GOOD = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   ISETP.GE.U32.AND P0, PT, R0, 0x80, PT ;
        /*0020*/               @P0 BRA 0x100 ;
        /*0030*/                   STS.64 [UR4+0x108], R2 ;
        /*0040*/                   STS [UR4], R5 ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0, 0x80 ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;
        /*0090*/                   STS.64 [UR4+0x108], R6 ;
        /*00a0*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;
        /*00b0*/                   EXIT ;
        /*0100*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;
        /*0110*/                   LDS.U8 R1, [R0+UR7+0x104] ;
        /*0120*/                   ISETP.GT.U32.AND P2, PT, R1, 0x2, PT ;
        /*0130*/               @P2 BAR.SYNC.DEFER_BLOCKING 0x1 ;
        /*0140*/               @P2 BAR.SYNC.DEFER_BLOCKING 0x1 ;
        /*0150*/               @P2 BRA 0x100 ;
        /*0160*/                   ISETP.NE.U32.AND P1, PT, R1, 0x2, PT ;
        /*0170*/              @!P1 EXIT ;
        /*0180*/                   LDS R9, [UR4] ;
        /*0190*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;
        /*01a0*/                   BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;
        /*01b0*/               @P1 BRA 0x1a0 ;
        /*01c0*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;
        /*01d0*/                   BRA 0x100 ;
"""


def test_a_correct_dispatch_is_ordered():
    d = ws_dispatch.check(GOOD)
    assert d.problems == []
    assert (d.state, sorted(d.state_bytes), sorted(d.captures), d.split) == (
        0x104, list(range(0x108, 0x110)), [0, 1, 2, 3], 0x20)
    assert d.summary() == {"default STS captures": [0], "default STS state": [0, 3],
                           "worker LDS captures": [1, 4], "worker LDS state": [1, 4]}
    assert d.exits == {"default": {4}, "worker": {1, 4}}
    lines = ws_dispatch.listing(GOOD)
    assert "/*0090*/ STS.64 [UR4+0x108], R6   <- default state, interval 3" in lines
    assert not any("0x2, 0x80" in line or "0x0, 0x80" in line for line in lines)


def _edit(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new)


@pytest.mark.parametrize(("old", "new", "needle"), [
    # the exit code stored after the default group's last barrier: nothing orders it
    ("/*0090*/                   STS.64 [UR4+0x108], R6 ;\n"
     "        /*00a0*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;",
     "/*0090*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;\n"
     "        /*00a0*/                   STS.64 [UR4+0x108], R6 ;",
     "state: a write (at 0x00a0) and a read (at 0x0110) both after barrier-1 generation 4"),
    # no barrier between the exit code and the workers' next read
    ("/*00a0*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;",
     "/*00a0*/                   BAR.SYNC.DEFER_BLOCKING 0x3, 0x80 ;",
     "state: a write (at 0x0090) and a read (at 0x0110) both after barrier-1 generation 3"),
    # barrier 1 with a thread count: not every thread takes part
    ("/*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;",
     "/*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;",
     "/*0050*/ BAR.SYNC.DEFER_BLOCKING 0x1, 0x100: barrier 1 not as a full-CTA BAR.SYNC"),
    ("/*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x1 ;",
     "/*0060*/                   BAR.ARV 0x1, 0x180 ;",
     "/*0060*/ BAR.ARV 0x1, 0x180: barrier 1 not as a full-CTA BAR.SYNC"),
    # a pair of barriers under different predicates: a worker may pass one of them
    ("/*0140*/               @P2 BAR.SYNC.DEFER_BLOCKING 0x1 ;",
     "/*0140*/               @P3 BAR.SYNC.DEFER_BLOCKING 0x1 ;",
     "state: a write (at 0x0090) and a read (at 0x0110) both after barrier-1 generation 3"),
    # the default group reading a dispatch byte
    ("/*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0, 0x80 ;",
     "/*0070*/                   LDS.U8 R3, [UR4+0x109] ;",
     "default warps read the state (at 0x0070): not the protocol"),
    # a worker writing a dispatch byte
    ("/*01a0*/                   BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;",
     "/*01a0*/                   STS.U8 [UR4+0x10a], R3 ;",
     "worker warps write the state (at 0x01a0): not the protocol"),
    # a barrier 1 inside a loop of the default group
    ("/*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0, 0x80 ;",
     "/*0070*/               @P4 BRA 0x50 ;",
     "default warps pass more than"),
])
def test_a_broken_dispatch_is_not_proven(old, new, needle):
    d = ws_dispatch.check(_edit(GOOD, old, new))
    assert any(needle in p for p in d.problems), d.problems


def test_indirect_branches():
    elf = """
\tAttribute:\tEIATTR_INDIRECT_BRANCH_TARGETS
\tFormat:\tEIFMT_SVAL
\tValue:\t
\t\tOffset of Indirect Branch: 0x1650\t Number of targets: 4
\t\tTargets: 0x1660 0x8180 0x25b0 0xdd00 
"""
    assert ws_dispatch.indirect_targets(elf) == {0x1650: [0x1660, 0x8180, 0x25b0, 0xdd00]}
    jump = _edit(GOOD, "/*0150*/               @P2 BRA 0x100 ;",
                 "/*0150*/               @P2 BRA 0x100 ;\n        /*0155*/  BRX R4 -0x160 ;")
    assert any("BRX R4 -0x160: control flow not walked" in p
               for p in ws_dispatch.check(jump).problems)
    assert ws_dispatch.check(jump, {0x155: [0x160]}).problems == []


def test_not_a_warp_specialized_kernel():
    with pytest.raises(ValueError, match="not a warp-specialized kernel"):
        ws_dispatch.check("        /*0000*/                   EXIT ;\n")


# ---------------------------------------------------------------------------------------------
# Compiled (sm_90a, no GPU)


def _config(pass_: str, name: str, config: str):
    return next(c for v, c in registry.compile_configs(pass_, "simplicial")
                if v.name == name and c.name == config)


@pytest.fixture(scope="module")
def compiled():
    """The probe, and tlx_ws's forward and backward configs of B2 N333 Hq128 Hk1 D128 w32x96 (the
    sanitizer's ragged shape)."""
    return {label: ws_dispatch.compiled_sass(c) for label, c in (
        ("probe", ws_probe.compile_config()),
        ("fwd", _config("fwd", "tlx_ws", "G128_Hk1_D128_M64_N128")),
        ("bwd", _config("bwd", "tlx_ws", "dkv2_G128_Hk1_D128_N128")),
        ("bwd_dq", _config("bwd", "tlx_ws", "dq_G128_Hk1_D128_N64")))}


def test_the_probe_has_the_kernels_dispatch(compiled):
    found = {label: ws_dispatch.check(*c) for label, c in compiled.items()}
    for label, d in found.items():
        assert d.problems == [], (label, d.problems)
        assert d.exits["default"] == {4}, label
    state = {"default STS state": [0, 3], "worker LDS state": [1, 4]}
    captures = {"default STS captures": [0], "worker LDS captures": [1, 4]}
    assert found["bwd"].summary() == state          # the backward passes nothing
    assert found["bwd_dq"].summary() == state
    assert found["fwd"].summary() == found["probe"].summary() == {**state, **captures}
    for d in found.values():  # a byte per worker warp: 8 workers (two 4-warp replicas)
        assert len(d.state_bytes) == 8 and min(d.state_bytes) == d.state + 4


def test_the_probe_has_no_shared_memory_of_its_own(compiled):
    """Every shared access of the probe is the compiler's (dispatch bytes or captures)."""
    sass, _ = compiled["probe"]
    d = ws_dispatch.check(sass)
    owned = d.state_bytes | d.captures | set(range(d.state, d.state + 4))
    for x in ws_dispatch.instructions(sass):
        a = ws_dispatch.shared_access(x.op)
        if a is not None:
            assert set(range(a[1], a[1] + a[2])) <= owned, x
        assert not x.op.startswith(("LDSM", "STSM", "SYNCS", "UTMA", "HGMMA")), x


def test_the_backward_listing_quotes_the_issues_instructions(compiled):
    """The listing docs/sanitizers.md quotes, up to offsets and register numbers (they move with
    any change of the kernel): the default group's state stores at intervals 0 and 3, each
    followed by barrier 1, and the workers' load of their byte in intervals 1 and 4."""
    lines = [re.sub(r"/\*[0-9a-f]+\*/ ", "", x).strip()
             for x in ws_dispatch.listing(*compiled["bwd"])]
    for interval in (0, 3):
        at = [i for i, x in enumerate(lines) if re.fullmatch(
            rf"STS\.64 \[UR\d+\+0x340e8\], R\d+ +<- default state, interval {interval}", x)]
        assert len(at) == 1, (interval, lines)
        assert lines[at[0] + 1] == "BAR.SYNC.DEFER_BLOCKING 0x1", lines[at[0] + 1]
    assert any(re.fullmatch(r"LDS\.U8 R\d+, \[R\d+\+UR\d+\+0x340e4\] +<- worker state, "
                            r"interval 1; worker state, interval 4", x) for x in lines), lines


def test_expected_values():
    got = ws_probe.expected([5, -7], 3)
    assert got.shape == (2, ws_probe.TASKS, ws_probe.LANES)

    def lcg(x, n):
        for _ in range(n):
            x = (x * ws_probe.LCG_A + ws_probe.LCG_C) % 2**32
        return x - 2**32 if x >= 2**31 else x

    assert int(got[0, 0, 7]) == lcg(5 + 7, 3)            # the default task: iters steps
    assert int(got[0, 2, 0]) == lcg(5 + 2000, 3 * 3)      # replica 1: 3 * iters steps
    assert int(got[1, 1, 127]) == lcg(-7 + 127 + 1000, 3 * 2)


@pytest.mark.gpu
def test_the_probe_runs():
    ws_probe.run(grid=8, iters=64)

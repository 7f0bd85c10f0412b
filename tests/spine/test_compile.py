"""Every registered config, of every pass, compiles for sm_90a on a machine with no GPU, down to
PTX that uses the Hopper tensor-core instruction (wgmma). Resource limits (spills, shared memory)
are gated in test_resources.py, on the same compiled kernels: tools.resources.compile_config
compiles each config once per process."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from tools.resources import compile_config  # noqa: E402
from altattn import registry  # noqa: E402

CASES = [pytest.param(v, c, id=f"{v.pass_}-{v.name}-{c.name}")
         for v, c in registry.compile_configs(None, "simplicial")]


def test_every_variant_has_configs():
    for v in registry.all_variants(None, "simplicial"):
        assert v.compile_configs(), f"{v.pass_}/{v.name} lists no compile configs"


@pytest.mark.parametrize("variant,c", CASES)
def test_compiles_for_hopper_with_wgmma(variant, c):
    where = f"{variant.pass_}/{variant.name}/{c.name}"
    try:
        k = compile_config(c)
    except Exception as e:  # the compiler's own message is long: keep its head and name the config
        pytest.fail(f"{where} failed to compile for sm_90a: {type(e).__name__}: {str(e)[:2000]}")
    ptx = k.asm["ptx"]
    assert re.search(r"^\s*\.target\s+sm_90a\b", ptx, re.M), f"{where}: PTX not for sm_90a"
    code = "\n".join(line.split("//")[0] for line in ptx.splitlines())  # drop comments
    assert "wgmma.mma_async" in code, (f"{where}: no wgmma.mma_async in its PTX (not the Hopper "
                                       "path)")
    assert k.asm.get("cubin"), f"{where}: no cubin (ptxas did not run)"


def test_every_config_within_the_dispatchers_descriptors():
    """fbtriton's C dispatcher takes at most MAX_TMA_DESCS TMA descriptors and MAX_PARAMS
    parameters a kernel; a kernel with more gets none and runs through the JIT's launcher at
    every call (~40 us of host more, docs/perf-call.md): every config of every family stays
    within both (no compiling needed)."""
    from kernels_triton.launch import MAX_PARAMS, MAX_TMA_DESCS, flat_params
    for fam in registry.families():
        for v, c in registry.compile_configs(None, fam.name):
            descs = sum(str(t).startswith("tensordesc") for t in c.signature.values())
            assert descs <= MAX_TMA_DESCS, (fam.name, v.pass_, v.name, c.name, descs)
            params = flat_params(c.signature.values())
            assert params <= MAX_PARAMS, (fam.name, v.pass_, v.name, c.name, params)


def test_every_form_of_a_variant_has_configs():
    """A variant that computes form "det" compiles it too (config names end in _det, and
    _det_swapped for the kernel of the exchanged pairs where the sign is a constexpr, DET = -1;
    `tlx_pairs` takes it in det_keys_side's packing, one kernel for both), so the resource gate
    covers it."""
    for v in registry.all_variants(None, "simplicial"):
        configs = v.compile_configs()
        names = [c.name for c in configs]
        if "det" in v.accepted("form"):
            assert any(n.endswith("_det") for n in names), (v.pass_, v.name, names)
            signed = any(type(c.constexprs.get("DET")) is int and c.constexprs["DET"] == 1
                         for c in configs)  # DET = +1 (not True): the sign is a constexpr
            assert signed == any(n.endswith("_det_swapped") for n in names), (v.pass_, v.name,
                                                                              names)
        else:
            assert not any("_det" in n for n in names), (v.pass_, v.name, names)

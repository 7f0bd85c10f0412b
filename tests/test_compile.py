"""Every registered config compiles for sm_90a on a machine with no GPU, down to PTX that uses the
Hopper tensor-core instruction (wgmma). Resource limits (spills, shared memory) are gated
separately by profiling.resources / test_resources.py."""
from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402

from simplicial_attn import registry  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def _cases():
    return [pytest.param(v, c, id=f"{v.name}-{c.name}")
            for v in registry.all_variants() for c in v.load().compile_configs()]


CASES = _cases()


def compile_config(c):
    src = c.source()
    return triton.compile(src, target=HOPPER,
                          options={"num_warps": c.num_warps, "num_stages": c.num_stages})


def test_every_variant_has_configs():
    for v in registry.all_variants():
        assert v.load().compile_configs(), f"{v.name} lists no compile configs"


@pytest.mark.parametrize("variant,c", CASES)
def test_compiles_for_hopper_with_wgmma(variant, c):
    where = f"{variant.name}/{c.name}"
    try:
        k = compile_config(c)
    except Exception as e:  # the compiler's own message is long: keep its head and name the config
        pytest.fail(f"{where} failed to compile for sm_90a: {type(e).__name__}: {str(e)[:2000]}")
    ptx = k.asm["ptx"]
    assert re.search(r"^\s*\.target\s+sm_90a\b", ptx, re.M), f"{where}: PTX not for sm_90a"
    code = "\n".join(line.split("//")[0] for line in ptx.splitlines())  # drop comments
    assert "wgmma.mma_async" in code, f"{where}: no wgmma.mma_async in its PTX (not the Hopper path)"
    assert k.asm.get("cubin"), f"{where}: no cubin (ptxas did not run)"

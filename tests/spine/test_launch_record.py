"""kernels_triton/launch.py's recorded launches: a prepared launch run on meta tensors yields the
compile configs (each argument's Triton type from its value, the constexprs, warps and stages),
launches nothing, and leaves Kernel's call as it was."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from kernels_triton import launch  # noqa: E402
from kernels_triton.launch import Kernel, meta, recorded  # noqa: E402
from altattn import registry  # noqa: E402


@triton.jit
def _toy(X, Y, Desc, N, scale, Maybe, BLOCK: tl.constexpr, FLAG: tl.constexpr = False,
         LAST: tl.constexpr = 3):
    pass


def _prepare(block: int):
    kernel = Kernel(_toy, (launch.sm_count(),), BLOCK=block, FLAG=True, num_warps=8)

    def run(x, y, n):
        desc = TensorDescriptor(y, list(y.shape), [y.shape[1], 1], [block, y.shape[1]])
        kernel(x, y, desc, n, 0.5, None)

    return run


def test_a_recorded_launch_types_every_argument_from_its_value():
    x = meta(64, dtype=torch.float32)
    y = meta(128, 64)
    (found,) = recorded(lambda: _prepare(32)(x, y, 4096))
    assert found.fn is _toy
    assert found.signature == {
        "X": "*fp32", "Y": "*bf16", "Desc": "tensordesc<bf16[32,64]>", "N": "i32",
        "scale": "fp32", "Maybe": "constexpr", "BLOCK": "constexpr", "FLAG": "constexpr",
        "LAST": "constexpr"}
    # LAST, not passed, at the default the JIT binds (ASTSource applies none: a config without
    # it would compile another kernel than the launch runs)
    assert found.constexprs == {"Maybe": None, "BLOCK": 32, "FLAG": True, "LAST": 3}
    assert (found.num_warps, found.num_stages) == (8, 3)  # Triton's default stages
    cfg = found.config("toy")
    assert (cfg.name, cfg.fn, cfg.signature, cfg.num_warps) == ("toy", _toy, found.signature, 8)


def test_recording_sees_record_sms_and_restores_the_call_even_on_error():
    call = Kernel.__call__
    grids = []

    def run():
        grids.append(launch.sm_count())
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        recorded(run)
    assert grids == [launch.RECORD_SMS]
    assert Kernel.__call__ is call and not launch._recording


def test_compile_configs_names_and_leaves_out():
    x, y = meta(64, dtype=torch.float32), meta(128, 64)
    both = launch.compile_configs(lambda: _prepare(64), (x, y, 7), lambda found: "a")
    assert [c.name for c in both] == ["a"] and both[0].constexprs["BLOCK"] == 64
    assert launch.compile_configs(lambda: _prepare(64), (x, y, 7), lambda found: None) == []


@pytest.mark.parametrize("family", [f.name for f in registry.families()])
def test_every_variants_configs_are_recorded_launches(family):
    """Each variant's compile configs come from its launches: every runtime argument typed (a
    pointer, descriptor or scalar), none also a constexpr."""
    for v, c in registry.compile_configs(None, family):
        runtime = {n: t for n, t in c.signature.items() if t != "constexpr"}
        assert runtime, (v.name, c.name)
        for name, t in runtime.items():
            assert t.startswith(("*", "tensordesc<", "i", "fp", "u")), (v.name, c.name, name, t)
        assert not set(runtime) & set(c.constexprs), (v.name, c.name)


class _Compiled:
    def __init__(self, n_descs: int):
        args = [{"index": i, "type": "tensordesc<bf16[64, 64]>"} for i in range(n_descs)]
        self.asm = {"launch_metadata": '{"args": %s}' % str(args).replace("'", '"')}


class _Fn:
    """A JIT function stand-in: fn[grid](*args) returns its compiled kernel."""
    __name__ = "toy_kernel"
    arg_names = ["a", "b"]

    def __init__(self, compiled):
        self.compiled = compiled

    def __getitem__(self, grid):
        return lambda *args, **kw: self.compiled


@pytest.mark.parametrize("found, says", [(None, "9 TMA descriptors and 45 parameters (at most 8 and 62"),
                                         ((object(), (0, 5)), "neither a positional")])
def test_check_launch_names_a_kernel_without_its_dispatcher(monkeypatch, found, says):
    """ALTATTN_CHECK_LAUNCH: a first call that leaves a kernel without the C dispatcher (every
    later call through the JIT's launcher) fails, naming the kernel and why."""
    monkeypatch.setattr(launch, "CHECK", True)
    monkeypatch.setattr(launch, "_dispatcher", lambda compiled: found)
    kernel = Kernel(_Fn(_Compiled(9)), (1,))
    with pytest.raises(AssertionError, match="toy_kernel: .*" + re.escape(says)):
        kernel._jit((1, 2), {})
    monkeypatch.setattr(launch, "CHECK", False)  # unchecked: the JIT's launch, no complaint
    Kernel(_Fn(_Compiled(9)), (1,))._jit((1, 2), {})

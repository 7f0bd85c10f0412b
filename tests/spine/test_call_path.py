"""The call path's host-side pieces on the CPU: the remembered validation (checks.cached_validate)
and the generated op declarations (altattn/ops.py). The GPU side (plans, the thin launch, CUDA
graphs) is tests/spine/test_gpu_call.py."""
from __future__ import annotations

import pytest
import torch

from altattn import checks, ops
from altattn.spherical import ops as spherical_ops
from altattn.simplicial import ops as simplicial_ops
from altattn.triple import ops as triple_ops


def _counted_validate():
    calls = []

    def validate(x, flag=False, scale=None):
        calls.append(1)
        checks.check_floating("x", x)
        checks.check_bool("flag", flag)
        return (tuple(x.shape), flag, scale)
    return calls, checks.cached_validate(validate, remember=lambda x: True)


def test_a_remembered_call_skips_the_checks_and_gives_the_spec(gen):
    calls, validate = _counted_validate()
    x = torch.randn(2, 3, generator=gen)
    assert validate(x, True, 0.5) == ((2, 3), True, 0.5)
    assert validate(torch.randn(2, 3, generator=gen), True, 0.5) == ((2, 3), True, 0.5)
    assert len(calls) == 1
    assert validate(torch.randn(2, 4, generator=gen), True, 0.5) == ((2, 4), True, 0.5)
    assert len(calls) == 2


def test_a_remembered_call_still_refuses_what_differs_only_in_type(gen):
    """True == 1 and hash alike: the key holds each argument's type, so flag=1 is checked."""
    _, validate = _counted_validate()
    x = torch.randn(2, 3, generator=gen)
    validate(x, True)
    with pytest.raises(TypeError, match="flag must be a bool"):
        validate(x, 1)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        validate(x.to(torch.int32), True)
    with pytest.raises(TypeError, match="flag must be a bool"):  # unhashable: checked
        validate(x, [True])


def test_cpu_tensors_are_never_remembered(gen):
    calls = []

    def validate(x):
        calls.append(1)
        return x.shape
    cached = checks.cached_validate(validate)
    x = torch.randn(3, generator=gen)
    cached(x)
    cached(x)
    assert len(calls) == 2


@pytest.mark.parametrize("op", [spherical_ops.OP, simplicial_ops.OP, triple_ops.OP],
                         ids=["spherical", "simplicial", "triple"])
def test_each_op_matches_its_passes(op):
    """The declaration's order is the passes': the forward's validate takes (inputs, params,
    optional), the backward's (one gradient per output, inputs, saved outputs, params,
    optional); the optional tensors are the forward pass's `optional`, and may be None in both
    schemas and as gradients."""
    import inspect
    d = op.decl
    fwd = list(inspect.signature(op.fwd_io.validate).parameters)
    bwd = list(inspect.signature(op.bwd_io.validate).parameters)
    params = [n for n, _ in d.params]
    assert fwd == [*d.inputs, *params, *d.optional]
    assert len(bwd) == len(d.outputs) + len(d.inputs) + len(d.saved) + len(params) + len(
        d.optional)
    assert bwd[len(d.outputs):] == [*d.inputs, *d.saved, *params, *d.optional]
    assert set(d.saved) <= set(d.outputs)
    assert tuple(getattr(op.fwd_io, "optional", ())) == d.optional
    assert set(d.optional) <= set(getattr(op.bwd_io, "optional", ()))
    fwd_schema, bwd_schema = ops._schema(d)
    assert str(op.fwd_op._opoverload._schema).count("Tensor") >= len(d.inputs)
    assert all(f"Tensor? {n}" in fwd_schema and f"Tensor? {n}" in bwd_schema
               for n in d.optional)
    assert fwd_schema.endswith(f"-> ({', '.join('Tensor' for _ in d.outputs)})")
    grads = ["Tensor" for _ in d.inputs] + ["Tensor?" for _ in d.optional]
    assert bwd_schema.endswith(f"-> ({', '.join(grads)})")


class _Fn:
    """A stand-in for a JITFunction: its parameters' names, a launch that returns `compiled`."""

    arg_names = ["Q", "K", "N", "HQ", "Seq", "n_split", "R1"]

    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append(("jit", grid, args, kw))
            return object()
        return launch


def test_a_kernel_hands_positional_and_keyword_runtime_arguments_to_its_dispatcher(monkeypatch):
    """Kernel: the first call goes through the JIT; later calls hand the dispatcher the runtime
    parameters it takes (schema indices: Q, N, Seq, R1; HQ a constexpr, n_split specialized), in
    parameter order, keyword ones included; a schema the arguments cannot fill keeps the JIT."""
    from kernels_triton import launch as L
    calls = []
    monkeypatch.setattr(L, "_dispatcher", lambda compiled: (
        lambda *a: calls.append(("disp", a)), (0, 2, 4, 6)))
    monkeypatch.setattr(L, "_get_device", lambda: 0)
    monkeypatch.setattr(L, "_get_stream", lambda dev: 77)
    monkeypatch.setattr(L._THREAD, "ready", True, raising=False)
    fn = _Fn(calls)
    k = L.Kernel(fn, (3, 2), HQ=8, num_warps=4)
    k("q", "k", 5, Seq="s", n_split=1, R1=9)
    assert calls[0] == ("jit", (3, 2), ("q", "k", 5),
                        {"Seq": "s", "n_split": 1, "R1": 9, "HQ": 8, "num_warps": 4})
    k("q2", "k2", 5, R1=9, n_split=1, Seq="s2")
    assert calls[1] == ("disp", (3, 2, 1, 77, "q2", 5, "s2", 9))
    short = L.Kernel(fn, (1,), HQ=8)  # Seq not given: the dispatcher cannot be fed
    short("q", "k", 5)
    short("q", "k", 5)
    assert [c[0] for c in calls[2:]] == ["jit", "jit"]

"""The launcher's argument contract for every registered (family, pass, variant), on CPU tensors.

Generated from the registry (registry.all_variants(None, None)): a variant or a family is tested
the day it is registered, with no edit here. Family-agnostic: only the Family record and the
launcher are used. The arguments of a pass are its `validate`'s parameters (inspect.signature),
their values `Family.make_inputs` (a backward's inputs come from a forward whose device check and
launch are stubbed out: on CPU tensors nothing runs); a tensor argument is one that make_inputs
gives as a torch.Tensor.

Contract, each checked with the variant's `launch` replaced by one that raises
AssertionError("launched ...") and the device check passed (so a bad argument the validation
missed would reach the launch and fail loudly):
  * every tensor argument replaced by None, and every argument by a list or a numpy array:
    TypeError naming it;
  * a tensor argument of a rank too high or too low, of dtype int32, or on another device (meta):
    TypeError or ValueError naming it;
  * the error is the pass's own `validate`'s (the same type and message), raised before any launch;
  * `outputs=` of the wrong shape, dtype, layout or device: ValueError naming the output;
  * an unknown variant name: ValueError listing the pass's variants; a variant of another pass:
    ValueError saying which pass it belongs to; deterministic=True with a variant that is not
    deterministic: ValueError naming it;
  * every tensor handed to `launch` is contiguous and 16-byte aligned, whatever the inputs'
    layout; a misaligned `outputs=` entry is refused naming it;
  * clean CPU inputs reach the device check (which refuses CPU tensors before any launch), and
    past it, the launch of the variant named.
"""
from __future__ import annotations

import contextlib
import inspect
import re

import numpy as np
import pytest
import torch

from altattn import checks, launcher, registry

from conftest import contract_inputs, contract_params, contract_shape

VARIANTS = contract_params()
PASS_PARAMS = [pytest.param(f.name, p, id=f"{f.name}-{p}")
               for f in registry.families() for p in f.passes]

_INPUTS: dict = {}


class Launched(AssertionError):
    pass


def _no_op(*args, **kwargs) -> None:
    return None


def _no_cuda_device(device):
    """torch.cuda.device(d) for a CPU d: the launcher enters it around the launch."""
    return contextlib.nullcontext()


def _launched(*args, **kwargs):
    raise Launched("launched")


def _launch_of(module, spec, profile):
    """The launcher's prepared launch, made of the module's `launch` (which these tests replace)
    rather than its `prepare`: on the CPU plans are not cached, so each call sees the stub."""
    return lambda *args: module.launch(spec, *args, profile=profile)


def cpu_inputs(fam, pass_: str, shape, form) -> tuple:
    """One call's arguments on the CPU (cached per family, pass, shape and form; never mutated).
    The forward a backward's inputs need runs through the launcher with the device check passed
    and every variant's launch a no-op: its outputs are uninitialized, which validation ignores."""
    key = (fam.name, pass_, repr(shape), form)
    if key not in _INPUTS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(launcher, "check_device", _no_op)
            mp.setattr(launcher, "_prepared", _launch_of)
            mp.setattr(torch.cuda, "device", _no_cuda_device)
            for v in fam.variants:
                mp.setattr(v.load(), "launch", _no_op)
            _INPUTS[key] = contract_inputs(fam, pass_, shape, form, seed=0, device="cpu")
    return _INPUTS[key]


def arg_names(fam, pass_: str) -> list[str]:
    """The pass's positional arguments, by name (its validate's parameters)."""
    sig = inspect.signature(fam.passes[pass_].validate)
    return [n for n, p in sig.parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def names_word(name: str, message: str) -> bool:
    """`name` appears in `message` as a word of its own ("q" in "q must ..." but not in "requires")."""
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message) is not None


class Case:
    """One (family, pass, variant) on the CPU: its arguments and a call through the launcher."""

    def __init__(self, v, form, monkeypatch):
        self.v, self.form, self.mp = v, form, monkeypatch
        self.fam = registry.get_family(v.family)
        self.io = self.fam.passes[v.pass_]
        shape, why = contract_shape(v, form)
        if shape is None:
            pytest.skip(why)
        self.shape = shape
        self.args = cpu_inputs(self.fam, v.pass_, shape, form)
        self.names = arg_names(self.fam, v.pass_)
        assert len(self.args) <= len(self.names), (
            f"{self.fam.name} {v.pass_}: make_inputs gives {len(self.args)} arguments, validate "
            f"takes {self.names}")
        self.tensor_idx = [i for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)]
        assert self.tensor_idx, f"{self.fam.name} {v.pass_}: make_inputs gives no tensor"
        # the launch of the variant raises; the device check (CPU tensors) passes
        monkeypatch.setattr(v.load(), "launch", self._launched)
        monkeypatch.setattr(launcher, "check_device", _no_op)
        monkeypatch.setattr(launcher, "_prepared", _launch_of)
        monkeypatch.setattr(torch.cuda, "device", _no_cuda_device)

    def _launched(self, *args, **kwargs):
        raise Launched(f"launched {self.v.name}")

    def run(self, args, **kw):
        return launcher.run(self.fam.name, self.v.pass_, *args, variant=self.v.name, **kw)

    def replaced(self, i: int, value) -> tuple:
        return self.args[:i] + (value,) + self.args[i + 1:]

    def check_refused(self, i: int, value, kinds: tuple, what: str) -> str | None:
        """None when the call with argument i replaced by `value` raises one of `kinds` naming
        the argument, from the pass's validate, before any launch; else what went wrong."""
        name, args = self.names[i], self.replaced(i, value)
        label = f"{name} = {what}"
        try:
            self.run(args)
        except Launched:
            return f"{label}: launched (no error before the launch)"
        except kinds as e:
            if not names_word(name, str(e)):
                return f"{label}: {type(e).__name__} does not name {name!r}: {e}"
            try:
                self.io.validate(*args)
            except Exception as direct:  # noqa: BLE001 - compared below
                if type(direct) is not type(e) or str(direct) != str(e):
                    return (f"{label}: the launcher's {type(e).__name__}({e}) is not validate's "
                            f"{type(direct).__name__}({direct})")
                return None
            return f"{label}: validate alone accepts it; the launcher raised {e!r} later"
        except Exception as e:  # noqa: BLE001 - reported as a failure
            return f"{label}: {type(e).__name__} (expected {'/'.join(k.__name__ for k in kinds)}): {e}"
        return f"{label}: accepted"


@pytest.fixture
def case(request, monkeypatch):
    v, form = request.param
    return Case(v, form, monkeypatch)


def _report(failures: list[str], c: Case) -> None:
    assert not failures, (f"{c.fam.name} {c.v.pass_} {c.v.name} at {c.shape.short()}:\n  "
                          + "\n  ".join(failures))


def _case_params():
    return [pytest.param(p.values, id=p.id) for p in VARIANTS]


# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", _case_params(), indirect=True)
def test_clean_inputs_reach_the_launch_of_the_variant_named(case):
    """The control: the CPU arguments are valid, so the call passes validation and selection and
    reaches the launch stub of the variant named (the stub the other tests rely on)."""
    with pytest.raises(Launched, match=rf"^launched {re.escape(case.v.name)}$"):
        case.run(case.args)


@pytest.mark.parametrize("case", _case_params(), indirect=True)
def test_cpu_tensors_refused_by_the_device_check_before_launch(case):
    case.mp.setattr(launcher, "check_device", checks.check_device)
    with pytest.raises((ValueError, RuntimeError)) as err:
        case.run(case.args)
    assert names_word(case.v.name, str(err.value)), str(err.value)


_NON_TENSORS = {
    "None": None,
    "list": [[0.5, 1.5], [2.5, 3.5]],
    "ndarray": np.zeros((2, 2), dtype=np.float32),
}


@pytest.mark.parametrize("kind", list(_NON_TENSORS))
@pytest.mark.parametrize("case", _case_params(), indirect=True)
def test_non_tensor_argument_is_a_type_error_naming_it(case, kind):
    """Every tensor argument as None, a list or a numpy array; every other argument as a list or
    a numpy array (None may be a valid value of an optional scalar): TypeError naming it."""
    where = case.tensor_idx if kind == "None" else range(len(case.args))
    failures = [case.check_refused(i, _NON_TENSORS[kind], (TypeError,), kind) for i in where]
    _report([f for f in failures if f], case)


def _rank_up(t):
    return t.unsqueeze(0)


def _rank_down(t):
    return t.flatten(0, 1) if t.dim() >= 2 else t.reshape(())


_BAD_TENSORS = {
    "rank+1": _rank_up,
    "rank-1": _rank_down,
    "int32": lambda t: t.to(torch.int32),
    "meta_device": lambda t: t.to("meta"),
}


@pytest.mark.parametrize("kind", list(_BAD_TENSORS))
@pytest.mark.parametrize("case", _case_params(), indirect=True)
def test_bad_tensor_is_refused_naming_it(case, kind):
    """A tensor argument of another rank, of dtype int32, or on another device than the rest:
    TypeError or ValueError naming it, from validate, before any launch."""
    failures = []
    for i in case.tensor_idx:
        bad = _BAD_TENSORS[kind](case.args[i])
        failures.append(case.check_refused(i, bad, (TypeError, ValueError),
                                           f"{kind} {tuple(bad.shape)} {bad.dtype} {bad.device}"))
    _report([f for f in failures if f], case)


@pytest.mark.parametrize("case", _case_params(), indirect=True)
def test_bad_outputs_are_refused_naming_them(case):
    """`outputs=` entries of the wrong shape, dtype, layout or device: ValueError naming the
    output, before any launch. The right ones are what the pass allocates itself."""
    case.mp.setattr(case.v.load(), "launch", _no_op)
    names = tuple(case.io.outputs)
    result = case.run(case.args)
    assert len(result) == len(names), f"result has {len(result)} tensors, outputs {names}"
    given = dict(zip(names, result))
    # with the right ones given, they are the tensors returned
    again = case.run(case.args, outputs=given)
    for name, a, b in zip(names, again, result):
        assert a is b or a.data_ptr() == b.data_ptr(), f"outputs[{name!r}] not the one returned"
    case.mp.setattr(case.v.load(), "launch", case._launched)
    failures = []
    for name, good in given.items():
        bads = {"shape": good.new_empty((*good.shape, 2)),
                "dtype": torch.empty(good.shape, dtype=torch.int32),
                "device": torch.empty(good.shape, dtype=good.dtype, device="meta")}
        if good.dim() >= 2 and good.shape[0] > 1 and good.shape[-1] > 1:
            bads["layout"] = good.new_empty(tuple(reversed(good.shape))).transpose(0, -1)
        for what, bad in bads.items():
            try:
                case.run(case.args, outputs={**given, name: bad})
            except Launched:
                failures.append(f"outputs[{name!r}] of the wrong {what}: launched")
            except ValueError as e:
                if not names_word(name, str(e)):
                    failures.append(f"outputs[{name!r}] of the wrong {what}: not named in {e}")
            except Exception as e:  # noqa: BLE001
                failures.append(f"outputs[{name!r}] of the wrong {what}: {type(e).__name__}: {e}")
            else:
                failures.append(f"outputs[{name!r}] of the wrong {what}: accepted")
    _report(failures, case)


@pytest.mark.parametrize("case", _case_params(), indirect=True)
def test_deterministic_true_refuses_a_nondeterministic_variant(case):
    if case.v.deterministic:
        with pytest.raises(Launched):
            case.run(case.args, deterministic=True)
        return
    with pytest.raises(ValueError) as err:
        case.run(case.args, deterministic=True)
    assert names_word(case.v.name, str(err.value)) and "determin" in str(err.value), err.value


@pytest.mark.parametrize("case", _case_params(), indirect=True)
def test_variant_of_another_pass_is_refused_saying_so(case):
    """The variant's name given to a pass it does not implement: ValueError naming the pass it
    belongs to (before any launch of either)."""
    fam, v = case.fam, case.v
    others = [p for p in fam.passes if p != v.pass_
              and not any(o.name == v.name and o.pass_ == p for o in fam.variants)]
    if not others:
        pytest.skip(f"{v.name!r} names a variant of every pass of {fam.name}")
    for p in others:
        for o in fam.variants:  # whatever the other pass would launch: refused
            case.mp.setattr(o.load(), "launch", case._launched)
        args = cpu_inputs(fam, p, case.shape, case.form)
        with pytest.raises(ValueError) as err:
            launcher.run(fam.name, p, *args, variant=v.name)
        msg = str(err.value)
        assert names_word(v.name, msg) and re.search(rf"\b{re.escape(v.pass_)}\b", msg), msg


@pytest.mark.parametrize("family, pass_", PASS_PARAMS)
def test_unknown_variant_lists_the_known_ones(family, pass_, monkeypatch):
    fam = registry.get_family(family)
    known = [v.name for v in fam.variants if v.pass_ == pass_]
    for v in fam.variants:
        monkeypatch.setattr(v.load(), "launch", _launched)
    monkeypatch.setattr(launcher, "check_device", _no_op)
    monkeypatch.setattr(launcher, "_prepared", _launch_of)
    monkeypatch.setattr(torch.cuda, "device", _no_cuda_device)
    v0 = next(v for v in fam.variants if v.pass_ == pass_)
    form = tuple(v0.accepted("form"))[0] if "form" in fam.accepts else None
    shape, why = contract_shape(v0, form)
    if shape is None:
        pytest.skip(why)
    args = cpu_inputs(fam, pass_, shape, form)
    with pytest.raises(ValueError) as err:
        launcher.run(family, pass_, *args, variant="no_such_variant")
    msg = str(err.value)
    assert "no_such_variant" in msg, msg
    missing = [n for n in known if not names_word(n, msg)]
    assert not missing, f"{missing} not listed in: {msg}"


def test_every_pass_has_variants_and_named_outputs():
    """What the generated tests read from each record: per pass, a validate with named
    parameters, output names, and at least one variant."""
    for fam in registry.families():
        for p, io in fam.passes.items():
            assert arg_names(fam, p), f"{fam.name} {p}: validate has no positional parameters"
            assert tuple(io.outputs), f"{fam.name} {p}: no output names"
            assert any(v.pass_ == p for v in fam.variants), f"{fam.name} {p}: no variant"


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values, contiguous, one element into its storage (not 16-byte aligned)."""
    x = t.new_empty(t.numel() + 1)[1:].view(t.shape)
    x.copy_(t)
    return x


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """t's values as a non-contiguous view (first and last dims of size > 1 exchanged in memory)."""
    dims = [d for d in range(t.dim()) if t.shape[d] > 1]
    return t if len(dims) < 2 else t.transpose(dims[0], dims[-1]).contiguous().transpose(
        dims[0], dims[-1])


def _capture_launches(case) -> list:
    """Replace the variant's launch by one that records its tensor arguments [(index, tensor)]."""
    seen = []

    def capture(spec, *kernel_args, profile=False):
        seen.append([(i, a) for i, a in enumerate(kernel_args) if isinstance(a, torch.Tensor)])

    case.mp.setattr(case.v.load(), "launch", capture)
    return seen


def _not_dense_aligned(seen: list, label: str) -> list[str]:
    assert len(seen) == 1, f"{label}: {len(seen)} launches"
    return [f"{label}: launch argument {i} {tuple(t.shape)} "
            + ("not contiguous" if not t.is_contiguous() else f"data_ptr % 16 = {t.data_ptr() % 16}")
            for i, t in seen[0] if not t.is_contiguous() or t.data_ptr() % 16]


@pytest.mark.parametrize("case", _case_params(), indirect=True)
def test_launch_gets_dense_aligned_inputs(case):
    """What the launcher promises the kernels (registry.CompileConfig.source: Triton specializes
    on it, TMA needs it): every tensor handed to `launch` is contiguous with a 16-byte aligned
    start, whatever the layout of the inputs."""
    seen = _capture_launches(case)
    failures = []
    for label, relayout in (("misaligned inputs", _misaligned), ("transposed inputs", _transposed)):
        seen.clear()
        case.run(tuple(relayout(a) if isinstance(a, torch.Tensor) and a.numel() > 1 else a
                       for a in case.args))
        failures += _not_dense_aligned(seen, label)
    _report(failures, case)


@pytest.mark.parametrize("case", _case_params(), indirect=True)
def test_misaligned_outputs_are_refused_or_realigned(case):
    """An `outputs=` entry one element into its storage: ValueError naming it, or the kernel gets
    a contiguous 16-byte aligned tensor all the same."""
    seen = _capture_launches(case)
    allocated = dict(zip(case.io.outputs, case.run(case.args)))
    failures = []
    for name, good in allocated.items():
        if good.numel() <= 1:
            continue
        seen.clear()
        try:
            case.run(case.args, outputs={name: _misaligned(good)})
        except ValueError as e:
            if not names_word(name, str(e)):
                failures.append(f"misaligned outputs[{name!r}] refused without naming it: {e}")
            continue
        failures += _not_dense_aligned(seen, f"misaligned outputs[{name!r}]")
    _report(failures, case)

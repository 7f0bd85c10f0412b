"""The one way every family's variants run, either pass: validate -> the problem's launch plan
(the variant picked and the device checked once, its module's `prepare(spec)` made once) ->
allocate the outputs -> launch -> the outputs.

A family's record (registry.Family) gives, per pass, the object that knows its arguments:
    validate(*args, **options) -> Call     # every check, before any device work
    allocate(call, outputs) -> dict        # the outputs, new or the caller's (checked)
    kernel_args(call, outs) -> tuple|None  # what the module's launch takes after the spec
                                           # (dense, aligned, reordered); None: nothing to launch
    result(call, outs) -> tuple            # what the caller gets back
and, to make plans for the ops' eager path, `bind(spec, *args) -> Call` (no checks), and where a
pass has tensors that may be None, `optional` (their names: a backward's unused incoming
gradients, an optional input). The public APIs (e.g.
altattn.simplicial.forward), bench, the trace tool and the GPU tests all call `run`; the ops
(altattn/ops.py) call `plan` and `run_call`; `select` is the pick-and-device-check step alone,
for callers that must know before launching whether a variant can run (a benchmark row's note,
a command line's error).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import registry
from .checks import check_bool, check_device, check_str


@dataclass
class Call:
    """One validated call: its spec, device and tensors (a pass's `validate` makes it)."""

    spec: object
    device: torch.device
    tensors: dict[str, torch.Tensor | None]
    extra: dict = field(default_factory=dict)   # whatever else the pass's steps need


def pick(spec, variant: str, hopper: bool = True, pass_: str = "fwd",
         deterministic: bool = False, *, family: str) -> registry.Variant:
    """Resolve `variant` ("auto" or a name of (family, pass_)) to a registry entry that can run
    `spec`, or raise ValueError (NotImplementedError when no variant of the pass computes a value
    the spec asks for, e.g. form "det"). `hopper=False` makes "auto" skip the sm_90-only
    variants; `deterministic=True` makes it skip the variants that are not bitwise repeatable,
    and refuses one named."""
    fam = registry.get_family(family)
    v = fam.variant(variant, pass_) if variant != "auto" else None  # an unknown name first
    if v is not None and deterministic:
        registry.refuse_nondeterministic(v)
    candidates = registry.all_variants(pass_, family)
    for key in fam.accepts:
        value = getattr(spec, key)
        if not any(value in o.accepted(key) for o in candidates):
            raise NotImplementedError(
                f"no {pass_} kernel of {fam.title} computes {key}={value!r} yet; on CPU tensors "
                f"the fp64 reference computes it")
    if v is not None:
        why = v.cannot_take(spec)
        if why is not None:
            able = [o.name for o in candidates if o.name != v.name and o.cannot_take(spec) is None]
            hint = f"; variants that can: {', '.join(able)}" if able else ""
            raise ValueError(f"variant {variant!r} cannot take {spec.short()}: {why}{hint}")
        return v
    reasons = []
    for v in sorted(candidates, key=lambda v: -v.rank_for(spec)):
        if v.needs_hopper and not hopper:
            reasons.append(f"{v.name}: needs sm_90")
            continue
        if deterministic and not v.deterministic:
            reasons.append(f"{v.name}: not deterministic")
            continue
        why = v.cannot_take(spec)
        if why is None:
            return v
        reasons.append(f"{v.name}: {why}")
    raise ValueError(f"no variant can take {spec.short()}: " + "; ".join(reasons))


def select(spec, variant: str, device: torch.device | str, pass_: str = "fwd",
           deterministic: bool = False, *, family: str) -> registry.Variant:
    """The variant that runs `spec` on `device`: `pick` (shape errors first, on any device; on a
    GPU other than sm_90 "auto" skips the Hopper-only variants), then the device check
    (`checks.check_device`). Raises ValueError or RuntimeError."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    cap = torch.cuda.get_device_capability(device) if on_gpu else None
    hopper = cap is not None and cap[0] == 9
    try:
        v = pick(spec, variant, hopper or not on_gpu, pass_, deterministic, family=family)
    except ValueError:
        if variant != "auto" or hopper or not on_gpu:
            raise
        try:  # not Hopper: is the shape or the GPU the problem?
            pick(spec, "auto", True, pass_, deterministic, family=family)
        except ValueError as shape_error:
            raise shape_error from None
        raise RuntimeError(
            f"no variant runs on this GPU (sm_{cap[0]}{cap[1]}): the variants that take "
            f"{spec.short()} need a Hopper GPU (sm_90: TMA, wgmma)") from None
    check_device(device, needs_hopper=v.needs_hopper, variant=v.name)
    return v


def check_variant_names(family: str, variant, bwd_variant, deterministic=False) -> None:
    """The names an op or layer of `family` is given, checked on every device (a misspelt name
    fails on the CPU too, not first on the GPU): TypeError unless both are str and deterministic
    a bool; ValueError naming the known ones for a name no variant of its pass has, or a
    non-deterministic `bwd_variant` with deterministic=True."""
    check_str("variant", variant)
    check_str("bwd_variant", bwd_variant)
    check_bool("deterministic", deterministic)
    for v, pass_ in ((variant, "fwd"), (bwd_variant, "bwd")):
        if v != "auto":
            registry.get(v, pass_, family)
    if deterministic and bwd_variant != "auto":
        registry.refuse_nondeterministic(registry.get(bwd_variant, "bwd", family), "bwd_variant")


@dataclass(frozen=True)
class Plan:
    """What one problem needs decided once: the variant, its pass's steps and the prepared launch
    (the module's `prepare(spec)`: config, grid, constexprs, compiled kernels; `launch`'s
    arguments after the spec). `execute(call)` is steps 3 to 5 of `run`."""

    variant: registry.Variant
    io: object
    launch: Callable
    device: torch.device

    def execute(self, call: Call, outputs: dict | None = None) -> tuple:
        """Allocate (or check `outputs`), launch, and return the pass's outputs for `call` (its
        spec this plan's)."""
        io = self.io
        outs = io.allocate(call, outputs or {})
        kernel_args = io.kernel_args(call, outs)
        if kernel_args is not None:
            on_device(self.device, self.launch, *kernel_args)
        return io.result(call, outs)


def on_device(device: torch.device, fn: Callable, *args, **kwargs) -> None:
    """fn(*args, **kwargs) with `device` current (Triton launches on the current device): a
    context switch only where another device is current."""
    if device.index is None or device.index == _current_device():
        fn(*args, **kwargs)
    else:
        with torch.cuda.device(device):
            fn(*args, **kwargs)


_PLANS: dict[tuple, Plan] = {}
MAX_PLANS = 4096  # problems kept; the oldest go first (a plan holds no tensor)


def _current_device() -> int:
    return torch.cuda.current_device()


def _prepared(module, spec, profile: bool | str) -> Callable:
    """The module's launch of `spec` made once: `prepare(spec, profile)` where it has one, else
    its `launch` with the spec bound."""
    if hasattr(module, "prepare"):
        return module.prepare(spec, profile=profile)
    return functools.partial(module.launch, spec, profile=profile)


def plan(family: str, pass_: str, spec, variant: str = "auto", deterministic: bool = False,
         device: torch.device | str = "cuda", optional: tuple = (), io=None) -> Plan:
    """The launch plan of (family, pass_, spec, variant, deterministic, device): `select`'s
    variant (every check that `select` makes, made once) and its module's prepared launch,
    cached on these arguments for CUDA devices. `optional`: which optional tensors of the pass
    are None (they change what kernels are compiled). `io`: the pass's record where it is not
    the family's (another calling convention of the same kernels: packed sequences)."""
    io = io or registry.get_family(family).passes[pass_]
    key = (family, pass_, spec, variant, deterministic, device, optional, io)
    found = _PLANS.get(key)
    if found is not None:
        return found
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", _current_device())
    v = choose(spec, variant, device, pass_, deterministic, family=family)
    on_gpu = device.type == "cuda"
    with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():  # prepare may ask it
        made = Plan(v, io, _prepared(v.load(), spec, False), device)
    if on_gpu:  # CPU plans only run in tests that stub the device out
        if len(_PLANS) >= MAX_PLANS:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[key] = made
    return made


def clear_plans() -> None:
    """Forget every cached plan and choice (tests that replace a kernel module's functions)."""
    _PLANS.clear()
    _CHOSEN.clear()


_CHOSEN: dict[tuple, registry.Variant] = {}


def choose(spec, variant: str, device: torch.device, pass_: str = "fwd",
           deterministic: bool = False, *, family: str) -> registry.Variant:
    """`select`, remembered for CUDA devices (an op checks its backward's variant at every
    forward with grad: once per problem)."""
    key = (family, pass_, spec, variant, deterministic, device)
    found = _CHOSEN.get(key)
    if found is None:
        found = select(spec, variant, device, pass_, deterministic, family=family)
        if device.type == "cuda" and len(_CHOSEN) < MAX_PLANS:
            _CHOSEN[key] = found
    return found


def missing(io, call: Call) -> tuple:
    """Which of the pass's optional tensors (`io.optional`) `call` leaves None: `plan`'s
    `optional`."""
    return tuple(call.tensors[n] is None for n in getattr(io, "optional", ()))


def run_call(family: str, pass_: str, call: Call, variant: str = "auto",
             deterministic: bool = False, outputs: dict | None = None, io=None) -> tuple:
    """Steps 2 to 5 of `run` for a call already validated (or bound from a validated spec):
    the plan of its spec and the None-ness of the pass's optional tensors, executed. `io`: the
    pass's record, where the caller has it."""
    io = io or registry.get_family(family).passes[pass_]
    return plan(family, pass_, call.spec, variant, deterministic, call.device,
                missing(io, call), io).execute(call, outputs)


def run(family: str, pass_: str, *args, variant: str = "auto", deterministic: bool = False,
        profile: bool | str = False, outputs: dict | None = None, **options) -> tuple:
    """Run pass `pass_` of `family` on `args` (the pass's own arguments, `options` its keyword
    ones): validate, plan (pick `variant`, "auto": the fastest that takes the shape;
    deterministic=True: only bitwise-repeatable ones), allocate (or check `outputs`, {name:
    tensor}), launch (profile: the Proton-scoped kernels, profiling/trace_capture.py, not
    cached), and return the pass's outputs."""
    check_str("variant", variant)
    check_bool("deterministic", deterministic)
    fam = registry.get_family(family)
    if pass_ not in fam.passes:
        raise ValueError(f"{fam.title} has no pass {pass_!r}; passes: {', '.join(fam.passes)}")
    io = fam.passes[pass_]
    call = io.validate(*args, **options)
    if not profile:
        return run_call(family, pass_, call, variant, deterministic, outputs, io)
    v = select(call.spec, variant, call.device, pass_, deterministic, family=family)
    return Plan(v, io, _prepared(v.load(), call.spec, profile), call.device).execute(call, outputs)

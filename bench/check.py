"""The pre-timing correctness check both benchmarks run, the same for every family: one call of the
pass through `altattn.launcher.run` on the shape's `check_shape()`, each output compared with the
family's reference (`Family.reference` / `reference_backward`, fp32, on the inputs' device).

Which error and which tolerance each output gets is read off the names in `Family.tolerances`:
"<output>_rel" is a relative Frobenius error ||got - ref||_F / ||ref||_F, "<output>_abs" a
max abs error, and a backward's gradients without either take "grad_rel". The reference is called
with the pass's own arguments by name (its parameters are named as the pass's `validate`'s:
q, k, v, causal, seqlens, dout, dr, ...), plus dtype.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from altattn import launcher, registry
from profiling.common import form_options

REFERENCE_DTYPE = torch.float32
DEVICE = "cuda"  # where the checks run (CPU tests stub the launcher and set "cpu")


@dataclass(frozen=True)
class Error:
    """One output's error against the reference, and the tolerance it is held to."""

    output: str     # the pass's output name ("out", "lse", "dq", ...)
    key: str        # its tolerance's name in Family.tolerances ("out_rel", "lse_abs", ...)
    value: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.value <= self.tolerance  # NaN fails

    @property
    def words(self) -> str:
        """'relative error' or 'max abs error'."""
        return "max abs error" if self.key.endswith("_abs") else "relative error"


def tolerance_key(fam: registry.Family, pass_: str, output: str) -> str:
    """The name in fam.tolerances that holds `output` of `pass_` (module docstring);
    ValueError when the family names none."""
    for key in (f"{output}_rel", f"{output}_abs"):
        if key in fam.tolerances:
            return key
    if pass_ == "bwd" and "grad_rel" in fam.tolerances:
        return "grad_rel"
    raise ValueError(f"{fam.title}: no tolerance for output {output!r} of pass {pass_!r} "
                     f"(Family.tolerances: {output}_rel, {output}_abs or grad_rel)")


def reference_outputs(fam: registry.Family, pass_: str, args: tuple,
                      dtype: torch.dtype = REFERENCE_DTYPE) -> tuple:
    """The family's reference of pass `pass_` on the pass's own arguments `args` (what
    Family.make_inputs gave), bound by name to the reference's parameters."""
    bound = inspect.signature(fam.passes[pass_].validate).bind(*args)
    bound.apply_defaults()
    ref = fam.reference if pass_ == "fwd" else fam.reference_backward
    params = inspect.signature(ref).parameters
    kwargs = {n: bound.arguments[n] for n in params if n in bound.arguments}
    if "dtype" in params:
        kwargs["dtype"] = dtype
    return tuple(ref(**kwargs))


def compare(fam: registry.Family, pass_: str, got: tuple, want: tuple) -> list[Error]:
    """One Error per output of the pass, in the pass's output order."""
    errors = []
    for name, g, r in zip(fam.passes[pass_].outputs, got, want):
        key = tolerance_key(fam, pass_, name)
        g, r = g.double(), r.double()
        if key.endswith("_abs"):
            value = float((g - r).abs().max()) if r.numel() else 0.0
        else:
            value = float(torch.linalg.norm(g - r) / torch.linalg.norm(r).clamp(min=1e-30))
        errors.append(Error(name, key, value, fam.tolerances[key]))
    return errors


def check_pass(family: str, pass_: str, variant: str, shape, seed: int = 1, form=None,
               device: str | None = None) -> list[Error]:
    """Run `variant` of (family, pass_) on `shape.check_shape()` (inputs: Family.make_inputs with
    `seed`; a backward's out and its statistics from the forward "auto") and compare every output
    with the reference in fp32. Returns the errors; the caller judges them (Error.ok)."""
    fam = registry.get_family(family)
    c = shape.check_shape()
    args = tuple(fam.make_inputs(c, pass_, seed=seed, device=device or DEVICE,
                                 **form_options(form)))
    got = launcher.run(family, pass_, *args, variant=variant)
    return compare(fam, pass_, got, reference_outputs(fam, pass_, args))


def summary(errors: list[Error], short: bool = True) -> str:
    """'out rel err 1.2e-03, lse max abs err 3.4e-03' (short) or the long form with each
    tolerance: 'out relative error 0.0012 (out_rel tolerance 0.02), ...'."""
    if short:
        return ", ".join(f"{e.output} {'max abs' if e.key.endswith('_abs') else 'rel'} err "
                         f"{e.value:.2e}" for e in errors)
    return ", ".join(f"{e.output} {e.words} {e.value:.3g} ({e.key} tolerance {e.tolerance})"
                     for e in errors)

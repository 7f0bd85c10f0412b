"""The launcher's data contract for every registered (family, pass, variant, form), on the GPU.

Generated from the registry (registry.all_variants(None, None), one case per form the variant
computes): a new variant or family is tested the day it is registered. Family-agnostic: only the
Family record and the launcher (`launcher.run(fam.name, pass_, *args, variant=v.name, ...)`).
Each case runs on one small shape, the first of the family's sanitizer shapes (group by group)
that the variant takes with B = 2 (skipped, with the reason, when it takes none), so each variant
compiles once. Results of a deterministic variant must be bitwise equal; those of one that is not
(Variant.deterministic False) equal to within the family's tightest tolerance (relative
Frobenius norm) and with NaN and inf in the same places.

  * inputs as non-contiguous views (a transposed copy) or with a misaligned start (storage offset
    one element): the same results as the contiguous inputs;
  * `outputs=` pre-filled with NaN: returned as given, every element written (no NaN where a run
    into zero-filled outputs is finite), the same results as that run;
  * two calls: bitwise equal (deterministic variants);
  * NaN or inf in every input of one batch element: the other batch element's outputs unchanged.
"""
from __future__ import annotations

import math

import pytest
import torch

from altattn import launcher, registry

from conftest import bitwise_equal, contract_inputs, contract_params, contract_shape

pytestmark = pytest.mark.gpu

BATCH = 2  # the batch-isolation test needs two; every case uses the same shape (one compile)


class GpuCase:
    def __init__(self, v, form, seed):
        self.v, self.form = v, form
        self.fam = registry.get_family(v.family)
        self.io = self.fam.passes[v.pass_]
        major, minor = torch.cuda.get_device_capability()
        if v.needs_hopper and major != 9:
            pytest.skip(f"{v.name} needs sm_90; this GPU is sm_{major}{minor}")
        shape, why = contract_shape(v, form, batch=BATCH)
        if shape is None:
            pytest.skip(why)
        self.shape = shape
        self.args = contract_inputs(self.fam, v.pass_, shape, form, seed=seed, device="cuda")
        self.names = tuple(self.io.outputs)
        self.tol = min(self.fam.tolerances.values())
        self.label = (f"{self.fam.name} {v.pass_} {v.name} at {shape.short()}"
                      + (f" form={form}" if form else ""))

    def run(self, args=None, **kw) -> dict:
        res = launcher.run(self.fam.name, self.v.pass_, *(self.args if args is None else args),
                           variant=self.v.name, **kw)
        assert len(res) == len(self.names), f"{self.label}: {len(res)} results, {self.names}"
        return dict(zip(self.names, res))

    def mismatch(self, a: torch.Tensor, b: torch.Tensor, what: str) -> str | None:
        """None when b is a's result again (bitwise for a deterministic variant), else why not."""
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{what}: {b.dtype} {tuple(b.shape)} vs {a.dtype} {tuple(a.shape)}"
        if bitwise_equal(a, b):
            return None
        if self.v.deterministic:
            diff = (a.float() - b.float()).abs().nan_to_num(nan=math.inf)
            return (f"{what}: not bitwise equal ({int((diff != 0).sum())} of {a.numel()} "
                    f"elements differ, max |diff| {diff.max().item():.3g})")
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        if not torch.equal(fa, fb):
            return f"{what}: non-finite in different places ({int((fa != fb).sum())} elements)"
        a64, b64 = a[fa].double(), b[fb].double()
        rel = ((a64 - b64).norm() / a64.norm().clamp_min(1e-30)).item()
        return None if rel <= self.tol else f"{what}: relative difference {rel:.3g} > {self.tol}"

    def report(self, failures) -> None:
        failures = [f for f in failures if f]
        assert not failures, f"{self.label}:\n  " + "\n  ".join(failures)


@pytest.fixture
def case(request, seed):
    v, form = request.param
    return GpuCase(v, form, seed)


CASES = [pytest.param(p.values, id=p.id) for p in contract_params(per_form=True)]


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view: the first and last dims of size > 1 exchanged in
    memory (a strided view of a padded buffer where fewer than two dims have size > 1)."""
    dims = [d for d in range(t.dim()) if t.shape[d] > 1]
    if len(dims) >= 2:
        a, b = dims[0], dims[-1]
        x = t.transpose(a, b).contiguous().transpose(a, b)
    else:
        x = t.new_empty((*t.shape, 2))[..., 0]
        x.copy_(t)
    return x


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values, contiguous, starting one element into its storage (not 16-byte aligned)."""
    x = t.new_empty(t.numel() + 1)[1:].view(t.shape)
    x.copy_(t)
    return x


@pytest.mark.parametrize("layout", ["transposed", "misaligned"])
@pytest.mark.parametrize("case", CASES, indirect=True)
def test_strided_and_misaligned_inputs_give_the_same_results(case, layout):
    relayout = _transposed if layout == "transposed" else _misaligned
    args, changed = [], 0
    for a in case.args:
        if isinstance(a, torch.Tensor) and a.numel() > 1:
            a = relayout(a)
            changed += 1
            assert (not a.is_contiguous() if layout == "transposed" else a.data_ptr() % 16 != 0)
        args.append(a)
    assert changed, f"{case.label}: no tensor argument to lay out otherwise"
    base = case.run()
    other = case.run(tuple(args))
    case.report(case.mismatch(base[n], other[n], f"{n} ({layout} inputs)") for n in case.names)


@pytest.mark.parametrize("case", CASES, indirect=True)
def test_nan_prefilled_outputs_are_fully_written(case):
    zeros = {n: torch.zeros_like(t) for n, t in case.run().items()}
    ref = case.run(outputs=zeros)
    nans = {n: torch.full_like(t, math.nan) for n, t in zeros.items()}
    got = case.run(outputs=nans)
    failures = []
    for n in case.names:
        if got[n].data_ptr() != nans[n].data_ptr() or ref[n].data_ptr() != zeros[n].data_ptr():
            failures.append(f"{n}: outputs[{n!r}] given but another tensor returned")
            continue
        left = torch.isnan(got[n]) & torch.isfinite(ref[n])
        if left.any():
            failures.append(f"{n}: {int(left.sum())} of {left.numel()} elements left NaN "
                            f"(first at {tuple(left.nonzero()[0].tolist())})")
            continue
        failures.append(case.mismatch(ref[n], got[n], f"{n} (NaN- vs zero-filled outputs)"))
    case.report(failures)


@pytest.mark.parametrize("case", CASES, indirect=True)
def test_two_calls_are_bitwise_equal_when_deterministic(case):
    """Bitwise for a deterministic variant; within tolerance for the others (which say so)."""
    first, second = case.run(), case.run()
    case.report(case.mismatch(first[n], second[n], f"{n} (second call)") for n in case.names)


@pytest.mark.parametrize("poison", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("case", CASES, indirect=True)
def test_poison_in_one_batch_element_stays_there(case, poison):
    """NaN or inf in every floating input of batch element b: the other one's outputs are the
    clean call's (bitwise for a deterministic variant)."""
    batched = [isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 1
               and a.shape[0] == BATCH for a in case.args]
    assert any(batched), f"{case.label}: no input with a leading batch dim of {BATCH}"
    clean = case.run()
    outs = [n for n in case.names if clean[n].dim() >= 1 and clean[n].shape[0] == BATCH]
    assert outs, f"{case.label}: no output with a leading batch dim of {BATCH}"
    failures = []
    for b in range(BATCH):
        args = []
        for a, is_b in zip(case.args, batched):
            if is_b:
                a = a.clone()
                a[b] = poison
            args.append(a)
        got = case.run(tuple(args))
        for other in range(BATCH):
            if other != b:
                failures += [case.mismatch(clean[n][other], got[n][other],
                                           f"{n}[{other}] with {poison} in batch {b}")
                             for n in outs]
    case.report(failures)

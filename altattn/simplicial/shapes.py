"""2-simplicial attention's shape record for the tools (bench, trace, sanitizers, tests), its
presets and the one input maker."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from .flops import flops
from .spec import ProblemSpec, check_form, validate_shape


@dataclass(frozen=True)
class Shape:
    """One problem: q [B, N, Hq, D], k1/k2/v1/v2 [B, N, Hk, D], windows w1 and w2."""

    B: int
    N: int
    Hq: int
    Hk: int
    D: int
    w1: int = field(metadata={"help": "window of K1/V1"})  # the tools' --w1 (profiling.common)
    w2: int = field(metadata={"help": "window of K2/V2"})

    def short(self) -> str:
        """Compact form for tables, e.g. 'B4 N16384 H128/1 D128 w32x512' (H = Hq/Hk)."""
        return (f"B{self.B} N{self.N} H{self.Hq}/{self.Hk} D{self.D} "
                f"w{self.w1}x{self.w2}")

    def fields(self) -> dict:
        return asdict(self)

    def spec(self, form: str = "trilinear") -> ProblemSpec:
        """The library's own checks of this shape, on meta tensors (no memory, no device), for the
        logits' `form` (one of spec.FORMS)."""
        spec = validate_shape(self.B, self.N, self.Hq, self.Hk, self.D, self.w1, self.w2)
        return spec if form == "trilinear" else replace(spec, form=check_form(form))

    def check_shape(self) -> Shape:
        """The reduced shape a benchmark checks a variant on before timing it: B = 1, N long
        enough to pass both windows."""
        return replace(self, B=1, N=min(self.N, 2 * max(self.w1, self.w2) + 37))


# S*: the shape the README's numbers are at (docs/DESIGN.md, glossary)
PRESETS: dict[str, Shape] = {
    "star": Shape(B=4, N=16384, Hq=128, Hk=1, D=128, w1=32, w2=512),
    "star64": Shape(B=4, N=16384, Hq=64, Hk=1, D=128, w1=32, w2=512),
    "small": Shape(B=1, N=2048, Hq=64, Hk=1, D=128, w1=32, w2=256),
}
SWEEP = {"N": (1024, 2048, 4096, 8192, 16384), "w2": (256, 512, 1024)}  # bench --sweep

# FlashAttention's convention: the backward counts 2.5 forward FLOPs (docs/MATH.md §1)
USEFUL_FLOPS_PER_F = {"fwd": 1.0, "bwd": 2.5}


def pass_flops(s: Shape, pass_: str = "fwd") -> float:
    """Useful FLOPs of one call of pass `pass_` on `s` (flops x the pass's factor)."""
    return USEFUL_FLOPS_PER_F[pass_] * flops(s.B, s.N, s.Hq, s.D, s.w1, s.w2)


def make_inputs(B: int, N: int, Hq: int, Hk: int, D: int, device: str | torch.device = "cuda",
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random (q, k1, k2, v1, v2) in bf16: q [B, N, Hq, D], the others [B, N, Hk, D], all N(0, 1).

    Score spread: with N(0, 1) entries and sm_scale = 1/sqrt(D), a score
    s = sm_scale * sum_d q k1 k2 has mean 0 and standard deviation 1 (D terms of variance 1, scaled
    by 1/D in variance). Measured on CPU for D = 128, w1 x w2 = 32 x 512 (16384 scores per query):
    score std 1.00, max - min about 8.3 (so exp() spans ~4000x), largest softmax weight ~0.25%,
    effective count 1/sum(p^2) ~5700 of 16384: neither flat (uniform would give 16384) nor one-hot.
    (q scaled by 2 gives ~350, by 3 gives ~40.) Deterministic for a given seed and device.
    """
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    q = randn(B, N, Hq, D)
    k1, k2, v1, v2 = (randn(B, N, Hk, D) for _ in range(4))
    return q, k1, k2, v1, v2


def pass_inputs(s: Shape, pass_: str = "fwd", seed: int = 0, form: str = "trilinear",
                device: str = "cuda") -> tuple[torch.Tensor | None, ...]:
    """The arguments one call of pass `pass_` takes, tensors first (launcher.run): the forward's
    (q, k1, k2, v1, v2, w1, w2, sm_scale, form); the backward's (dout, dlse, q, k1, k2, v1, v2,
    out, lse, w1, w2, sm_scale, form), with out and lse from a plain forward ("auto") in the
    logits' `form`, a random dout and dlse None (what autograd passes when LSE is not used)."""
    from .passes import forward

    x = make_inputs(s.B, s.N, s.Hq, s.Hk, s.D, device=device, seed=seed)
    rest = (s.w1, s.w2, None, form)
    if pass_ == "fwd":
        return (*x, *rest)
    out, lse = forward(*x, s.w1, s.w2, form=form)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=gen, device=device, dtype=torch.bfloat16)
    return (dout, None, *x, out, lse, *rest)

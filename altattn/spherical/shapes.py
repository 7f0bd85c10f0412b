"""Spherical attention's shape record for the tools (bench, trace, sanitizers, tests), its presets,
the FLOP model and the one input maker."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from .spec import SphericalSpec

# FlashAttention's convention: the backward counts 2.5 forward FLOPs (5 GEMMs to the forward's 2)
USEFUL_FLOPS_PER_F = {"fwd": 1.0, "bwd": 2.5}


@dataclass(frozen=True)
class Shape:
    """One self-attention problem: q [B, N, Hq, D], k and v [B, N, Hk, D]; causal or not; `pad`:
    the batch's padding fraction, 0 for none (`seqlens`: sequence b has lengths(b) real tokens)."""

    B: int
    N: int
    Hq: int
    Hk: int
    D: int
    causal: bool = False
    pad: float = field(default=0.0, metadata={"help": "padding fraction in [0, 0.5): sequence b "
                                                      "holds N (1 - 2 pad b / (B - 1)) tokens"})

    def __post_init__(self):
        if not 0 <= self.pad < 0.5:
            raise ValueError(f"pad must be in [0, 0.5) (the shortest sequence holds N (1 - 2 pad) "
                             f"tokens), got {self.pad}")

    def short(self) -> str:
        """Compact form for tables, e.g. 'B4 N16384 H128/128 D128 causal'."""
        s = f"B{self.B} N{self.N} H{self.Hq}/{self.Hk} D{self.D}"
        return s + (" causal" if self.causal else "") + (f" pad{self.pad:g}" if self.pad else "")

    def fields(self) -> dict:
        return asdict(self)

    def lengths(self) -> list[int] | None:
        """Real tokens per sequence when padded (None when pad = 0): spread evenly from N down to
        N * (1 - 2 pad), so that the batch holds N * (1 - pad) tokens per sequence on average."""
        if not self.pad:
            return None
        if self.B == 1:
            return [round(self.N * (1 - self.pad))]
        return [round(self.N * (1 - 2 * self.pad * b / (self.B - 1))) for b in range(self.B)]

    def spec(self, **_) -> SphericalSpec:
        """The spec a call on this shape makes (sm_scale 1/sqrt(D))."""
        return SphericalSpec(self.B, self.N, self.N, self.Hq, self.Hk, self.D, self.causal,
                             self.D ** -0.5, varlen=bool(self.pad))

    def check_shape(self) -> Shape:
        """The reduced shape a benchmark checks a variant on before timing it (the fp64 reference
        holds B*Hq*N*N scores): B <= 2, Hq <= 8 (Hk as G allows), N <= 1031 (ragged)."""
        hq = min(self.Hq, 8)
        return replace(self, B=min(self.B, 2), N=min(self.N, 1031), Hq=hq,
                       Hk=max(1, hq * self.Hk // self.Hq))


PRESETS: dict[str, Shape] = {
    "p1": Shape(B=4, N=16384, Hq=128, Hk=128, D=128),           # the speed shape
    "p1_causal": Shape(B=4, N=16384, Hq=128, Hk=128, D=128, causal=True),
    "p1_pad": Shape(B=4, N=16384, Hq=128, Hk=128, D=128, pad=0.25),
    "p2": Shape(B=1, N=50688, Hq=1, Hk=1, D=128),               # one head, the paper's kind
    "short": Shape(B=4, N=2048, Hq=128, Hk=128, D=128),
    "small": Shape(B=2, N=2048, Hq=16, Hk=4, D=128),
}
SWEEP = {"N": (1024, 2048, 4096, 8192, 16384), "causal": (False, True)}  # bench --sweep


def visible_pairs(s: Shape) -> int:
    """(query, key) pairs that count, summed over the batch, per head."""
    lens = s.lengths() or [s.N] * s.B
    return sum(n * (n + 1) // 2 if s.causal else n * n for n in lens)


def pass_flops(s: Shape, pass_: str = "fwd") -> float:
    """Useful FLOPs of one call of pass `pass_`: 4 Hq D per visible pair forward (QK^T and PV),
    2.5x that backward; the square-add is not counted."""
    return USEFUL_FLOPS_PER_F[pass_] * 4 * s.Hq * s.D * visible_pairs(s)


def make_inputs(s: Shape, device: str | torch.device = "cuda", seed: int = 0):
    """Random (q, k, v, seqlens) in bf16, all N(0, 1): with sm_scale = 1/sqrt(D) a score has
    standard deviation 1. seqlens is None unless s.pad (int32 [B], Shape.lengths)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    q = randn(s.B, s.N, s.Hq, s.D)
    k, v = (randn(s.B, s.N, s.Hk, s.D) for _ in range(2))
    lens = s.lengths()
    seqlens = None if lens is None else torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k, v, seqlens


def pass_inputs(s: Shape, pass_: str = "fwd", seed: int = 0, device: str = "cuda", **_):
    """The arguments one call of pass `pass_` takes (launcher.run): the forward's (q, k, v, causal,
    sm_scale, eps, seqlens); the backward's (dout, dr, q, k, v, out, r, causal, sm_scale, eps,
    seqlens) with out and r from a forward ("auto"), a random dout and dr None (r unused)."""
    from .passes import forward

    q, k, v, seqlens = make_inputs(s, device, seed)
    if pass_ == "fwd":
        return q, k, v, s.causal, None, 1e-6, seqlens
    out, r = forward(q, k, v, causal=s.causal, seqlens=seqlens)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=gen, device=device, dtype=torch.bfloat16)
    return dout, None, q, k, v, out, r, s.causal, None, 1e-6, seqlens

"""Triple attention's shape record for the tools (bench, trace, sanitizers, tests), its presets,
the FLOP model and the one input maker."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from .spec import TripleSpec, check_dims, default_scale

# FAMILIES.md §2: the forward is two GEMM phases (state build, state read), the backward four
USEFUL_FLOPS_PER_F = {"fwd": 1.0, "bwd": 2.0}


@dataclass(frozen=True)
class Shape:
    """One problem: q1, q2, k1, k2 [B, N, H, Dq], v [B, N, H, Dv]; causal or not. Flags of the
    tools: --B --N --h --dq --dv --causal/--no-causal (profiling.common.add_shape_args)."""

    B: int
    N: int
    H: int = field(metadata={"flag": "--h", "help": "heads H"})
    Dq: int = field(metadata={"flag": "--dq", "help": "query/key head dim Dq"})
    Dv: int = field(metadata={"flag": "--dv", "help": "value head dim Dv"})
    causal: bool = False

    def short(self) -> str:
        """Compact form for tables, e.g. 'B1 N524288 H8 Dq64 Dv64 causal'."""
        return f"B{self.B} N{self.N} H{self.H} Dq{self.Dq} Dv{self.Dv}" + (
            " causal" if self.causal else "")

    def fields(self) -> dict:
        return asdict(self)

    def spec(self, **_) -> TripleSpec:
        """The spec a call on this shape makes (scale 1/N); ValueError for a head dim no kernel
        takes (Dq, Dv in spec.SUPPORTED_DIMS)."""
        check_dims(self.Dq, self.Dv)
        return TripleSpec(self.B, self.N, self.H, self.Dq, self.Dv, self.causal,
                          default_scale(self.N))

    def check_shape(self) -> Shape:
        """The reduced shape a benchmark checks a variant on before timing it: B <= 1, H <= 2,
        N <= 8191 (a ragged tail: 8191 is no multiple of a tile), Dq, Dv and causal kept."""
        return replace(self, B=min(self.B, 1), H=min(self.H, 2), N=min(self.N, 8191))


PRESETS: dict[str, Shape] = {
    "t1": Shape(B=1, N=524288, H=8, Dq=32, Dv=32),    # FAMILIES.md's T1
    "t2": Shape(B=1, N=524288, H=8, Dq=64, Dv=64),    # ... and T2
    "t1_causal": Shape(B=1, N=524288, H=8, Dq=32, Dv=32, causal=True),
    "t2_causal": Shape(B=1, N=524288, H=8, Dq=64, Dv=64, causal=True),
    "small": Shape(B=2, N=8192, H=4, Dq=64, Dv=64),
}
SWEEP = {"N": (65536, 131072, 262144, 524288), "causal": (False, True)}  # bench --sweep


def pass_flops(s: Shape, pass_: str = "fwd") -> float:
    """Useful FLOPs of one call of pass `pass_`: F = 4 B H N Dq^2 Dv forward (the state build
    and the state read, 2 N Dq^2 Dv each), 2F backward (four such contractions); the outer
    products are not counted, and a causal call counts the same (the linear form's work)."""
    return USEFUL_FLOPS_PER_F[pass_] * 4 * s.B * s.H * s.N * s.Dq * s.Dq * s.Dv


def make_inputs(s: Shape, device: str | torch.device = "cuda", seed: int = 0):
    """Random (q1, q2, k1, k2, v) in bf16, all N(0, 1): with the default scale 1/N the state is a
    mean of k1 (x) v (x) k2 (entries O(1/sqrt(N))) and out stays O(Dq / sqrt(N)) (non-causal)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    q1, q2, k1, k2 = (randn(s.B, s.N, s.H, s.Dq) for _ in range(4))
    return q1, q2, k1, k2, randn(s.B, s.N, s.H, s.Dv)


def pass_inputs(s: Shape, pass_: str = "fwd", seed: int = 0, device: str = "cuda", **_):
    """The arguments one call of pass `pass_` takes (launcher.run): the forward's (q1, q2, k1, k2,
    v, scale, causal); the backward's (dout, dstate, q1, q2, k1, k2, v, state, scale, causal)
    with state from a forward ("auto"), a random dout and dstate None (the state unused, as in a
    model that reads only out)."""
    from .passes import forward

    x = make_inputs(s, device, seed)
    if pass_ == "fwd":
        return (*x, None, s.causal)
    _, state = forward(*x, causal=s.causal)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    dout = torch.randn(s.B, s.N, s.H, s.Dv, generator=gen, device=device, dtype=torch.bfloat16)
    return (dout, None, *x, state, None, s.causal)

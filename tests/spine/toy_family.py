"""A second family in a few lines, to hold the spine to its promise (tests/spine/test_spine.py): plain
softmax attention, one forward "kernel" written in torch. Registering it takes one line,
`registry.FAMILIES["toy"] = "toy_family"`; nothing generic learns its name."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from altattn.checks import check_tensors, dense_aligned, output
from altattn.launcher import Call
from altattn.registry import Family, Peer, Variant


@dataclass(frozen=True)
class Spec:
    B: int
    N: int
    H: int
    D: int

    def short(self) -> str:
        return f"B={self.B} N={self.N} H={self.H} D={self.D}"


def reference(q, k, v):
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / math.sqrt(q.shape[-1])
    return (torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v.double()),)


class Forward:
    outputs = ("out",)

    @staticmethod
    def validate(q, k, v) -> Call:
        check_tensors(("q", "k", "v"), (q, k, v))
        for name, t in (("k", k), ("v", v)):
            if t.shape != q.shape:
                raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got "
                                 f"{tuple(t.shape)}")
        return Call(Spec(*q.shape), q.device, {"q": q, "k": k, "v": v})

    @staticmethod
    def allocate(call, given):
        return {"out": output(given.get("out"), "out", tuple(call.tensors["q"].shape),
                              call.tensors["q"].dtype, call.device)}

    @staticmethod
    def kernel_args(call, outs):
        return (*(dense_aligned(call.tensors[n]) for n in ("q", "k", "v")), outs["out"])

    @staticmethod
    def result(call, outs):
        return (outs["out"],)


# the "kernel module" of the one variant is this file
def supports(spec: Spec) -> str | None:
    return None if spec.D <= 256 else f"D = {spec.D}: at most 256"


def launch(spec, q, k, v, out, profile=False):
    out.copy_(reference(q, k, v)[0])


def compile_configs():
    return []


FAMILY = Family(
    name="toy", title="softmax attention (a test family)", shape_type=Spec, spec_type=Spec,
    passes={"fwd": Forward}, reference=reference, reference_backward=None,
    flops=lambda s, pass_: 4 * s.B * s.H * s.N * s.N * s.D, make_inputs=None,
    presets={"small": Spec(1, 8, 2, 16)}, default_preset="small", sweep={"N": (8, 16)},
    peers=(Peer(name="cudnn_sdpa", rule="itself", dense=lambda s: {"B": s.B, "H": s.H, "Nq": s.N,
                                                                   "Nk": s.N, "D": s.D}),),
    scopes={"qk": "gemm"}, sanitizer_shapes=((Spec(1, 8, 2, 16),),), tolerances={"out_rel": 0},
    accepts={}, traits=frozenset(),
    variants=(Variant(name="torch", family="toy", pass_="fwd", module="toy_family",
                      needs_hopper=False, rank=1, supports="D <= 256", warps=4, scopes=("qk",)),))

"""The 2-simplicial problem a call describes, and the checks that turn bad input into a clear
Python error (the shared ones are altattn.checks). Every check runs before any device work, so CI
exercises all of them on CPU tensors.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from ..checks import cached_validate, check_group, positive_float, positive_int

SUPPORTED_DTYPES = (torch.bfloat16,)
# the plain-PyTorch reference (and the op on CPU tensors, which runs it) also takes these
REFERENCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_GPU_HEAD_RATIO = 128  # the kernels take G = Hq/Hk a power of two up to this
NAMES = ("q", "k1", "k2", "v1", "v2")
# the logits' form: the plain trilinear sum, or the determinant form
# (altattn/simplicial/reference.py)
FORMS = ("trilinear", "det")


@dataclass(frozen=True)
class ProblemSpec:
    """Shape of one forward call. Windows are already ordered so that w1 <= w2 (see `swapped`).

    With form "det", exchanging the pairs negates every 3x3 determinant (two of its rows swap)
    and leaves the leftover dims' trilinear term: whoever computes a swapped spec negates the
    chunk dims of q (or the determinants) as well."""

    B: int
    N: int
    Hq: int
    Hk: int
    D: int
    w1: int
    w2: int
    sm_scale: float
    swapped: bool = False  # True when the caller's (k1, v1, w1) and (k2, v2, w2) were exchanged
    form: str = "trilinear"  # one of FORMS
    # packed sequences (altattn/simplicial/varlen.py): B = 1, N = the packed query tokens, each
    # window cut at its own sequence's start; the kernels get the token maps beside the spec
    varlen: bool = False

    @property
    def G(self) -> int:
        """Query heads per KV head."""
        return self.Hq // self.Hk

    def short(self) -> str:
        s = (f"B={self.B} N={self.N} Hq={self.Hq} Hk={self.Hk} D={self.D} "
             f"w1={self.w1} w2={self.w2}")
        s = s if self.form == "trilinear" else f"{s} form={self.form}"
        return f"{s} packed" if self.varlen else s


def _check_window(name: str, w) -> int:
    return positive_int(name, w, "a window of at least one token")


def check_form(form) -> str:
    """`form` itself when it is one of FORMS, else TypeError (not a str) or ValueError naming it."""
    if not isinstance(form, str):
        raise TypeError(f"form must be a str, got {type(form).__name__} {form!r}")
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
    return form


@cached_validate
def validate(q, k1, k2, v1, v2, w1, w2, sm_scale=None, form="trilinear", *,
             dtypes: tuple | None = None, cpu_reference: bool = False) -> ProblemSpec:
    """Check arguments, dtypes and shapes (that the tensors share one device, not which: see
    `check_device`) and return the problem spec.

    q: [B, N, Hq, D]; k1, k2, v1, v2: [B, N, Hk, D]; all of one dtype, on one device; `form` one
    of FORMS, of a dtype in `dtypes` (default: bfloat16, the kernels'; with cpu_reference=True,
    CPU tensors, which the fp64 reference computes, may have any dtype in REFERENCE_DTYPES).
    The returned spec has w1 <= w2;
    `spec.swapped` says whether the caller's pairs must be exchanged.
    """
    tensors = (q, k1, k2, v1, v2)
    if dtypes is None:
        on_cpu = cpu_reference and isinstance(q, torch.Tensor) and q.device.type == "cpu"
        dtypes = REFERENCE_DTYPES if on_cpu else SUPPORTED_DTYPES
    check_group(NAMES, tensors, 4, "[B, N, H, D]", dtypes, SUPPORTED_DTYPES)
    B, N, Hq, D = q.shape
    Hk = k1.shape[2]
    for name, t in zip(NAMES[1:], tensors[1:]):
        b, n, h, d = t.shape
        for what, got, want in (("B (dim 0)", b, B), ("N (dim 1)", n, N), ("D (dim 3)", d, D)):
            if got != want:
                raise ValueError(f"{name} has {what} = {got} but q has {want}: shapes "
                                 f"q{tuple(q.shape)} vs {name}{tuple(t.shape)}")
        if h != Hk:
            raise ValueError(f"{name} has Hk (dim 2) = {h} but k1 has {Hk}: k1, k2, v1, v2 must "
                             f"share one KV head count")
    if Hk < 1 or Hq < 1:
        raise ValueError(f"head counts must be >= 1, got Hq={Hq} Hk={Hk}")
    if Hq % Hk != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hk={Hk} (grouped-query heads)")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D={D} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    G = Hq // Hk
    if q.device.type == "cpu" and (G & (G - 1) or G > MAX_GPU_HEAD_RATIO):  # no kernel takes it
        warnings.warn(f"Hq/Hk = {Hq}/{Hk} = {G} runs on the CPU (the fp64 reference), but no GPU "
                      f"kernel takes it: the kernels need Hq/Hk a power of two up to "
                      f"{MAX_GPU_HEAD_RATIO}", stacklevel=3)
    w1 = _check_window("w1", w1)
    w2 = _check_window("w2", w2)
    sm_scale = (1.0 / math.sqrt(D) if sm_scale is None
                else positive_float("sm_scale", sm_scale, "a float or None"))
    form = check_form(form)
    # a window longer than the sequence sees the same keys as one of length N: clamp (same function,
    # 32-bit kernel arguments, bounded reference memory)
    w1, w2 = min(w1, max(N, 1)), min(w2, max(N, 1))
    swapped = w1 > w2
    if swapped:
        w1, w2 = w2, w1
    return ProblemSpec(B, N, Hq, Hk, D, w1, w2, sm_scale, swapped, form)


def validate_shape(B, N, Hq, Hk, D, w1, w2, sm_scale=None) -> ProblemSpec:
    """`validate` for a shape alone: the same checks on meta tensors (no memory, no device)."""
    q = torch.empty(B, N, Hq, D, dtype=torch.bfloat16, device="meta")
    kv = [torch.empty(B, N, Hk, D, dtype=torch.bfloat16, device="meta") for _ in range(4)]
    return validate(q, *kv, w1, w2, sm_scale)

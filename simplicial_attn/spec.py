"""The problem a call describes, and the checks that turn bad input into a clear Python error.

Every check here runs before any device work, so CI exercises all of them on CPU tensors.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.bfloat16,)
# the plain-PyTorch reference (and the op on CPU tensors, which runs it) also takes these
REFERENCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
SUPPORTED_HEAD_DIMS = (64, 128)
NAMES = ("q", "k1", "k2", "v1", "v2")


@dataclass(frozen=True)
class ProblemSpec:
    """Shape of one forward call. Windows are already ordered so that w1 <= w2 (see `swapped`)."""

    B: int
    N: int
    Hq: int
    Hk: int
    D: int
    w1: int
    w2: int
    sm_scale: float
    swapped: bool = False  # True when the caller's (k1, v1, w1) and (k2, v2, w2) were exchanged

    @property
    def G(self) -> int:
        """Query heads per KV head."""
        return self.Hq // self.Hk

    def short(self) -> str:
        return (f"B={self.B} N={self.N} Hq={self.Hq} Hk={self.Hk} D={self.D} "
                f"w1={self.w1} w2={self.w2}")


def _check_window(name: str, w) -> int:
    if isinstance(w, (bool, torch.Tensor)):
        raise TypeError(f"{name} must be a positive int, got {type(w).__name__} {w!r}")
    try:
        w = operator.index(w)  # int and numpy integers
    except TypeError:
        raise TypeError(f"{name} must be a positive int, got {type(w).__name__} {w!r}") from None
    if w < 1:
        raise ValueError(f"{name} must be a positive int (a window of at least one token), got {w}")
    return w


def validate(q, k1, k2, v1, v2, w1, w2, sm_scale=None,
             dtypes=SUPPORTED_DTYPES) -> ProblemSpec:
    """Check arguments, dtypes and shapes (not the device) and return the problem spec.

    q: [B, N, Hq, D]; k1, k2, v1, v2: [B, N, Hk, D]; all of one dtype in `dtypes` (bfloat16 for
    the kernels), on one device.
    The returned spec has w1 <= w2; `spec.swapped` says whether the caller's pairs must be exchanged.
    """
    tensors = (q, k1, k2, v1, v2)
    for name, t in zip(NAMES, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in zip(NAMES, tensors):
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 [B, N, H, D], got shape {tuple(t.shape)}")
    for name, t in zip(NAMES, tensors):
        if t.dtype not in dtypes:
            if dtypes == SUPPORTED_DTYPES:
                raise TypeError(f"{name} must be torch.bfloat16 (the only supported dtype), got "
                                f"{t.dtype}")
            raise TypeError(f"{name} must have a dtype in {dtypes}, got {t.dtype}")
    if len({t.dtype for t in tensors}) != 1:
        raise TypeError("q, k1, k2, v1, v2 must share one dtype, got "
                        + ", ".join(f"{n}:{t.dtype}" for n, t in zip(NAMES, tensors)))
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
    w1 = _check_window("w1", w1)
    w2 = _check_window("w2", w2)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    else:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
            raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
        try:
            sm_scale = float(sm_scale)
        except OverflowError:
            raise ValueError(f"sm_scale must be a finite positive float, got {sm_scale}") from None
        if not math.isfinite(sm_scale) or sm_scale <= 0:
            raise ValueError(f"sm_scale must be a finite positive float, got {sm_scale}")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError("q, k1, k2, v1, v2 must be on one device, got "
                         + ", ".join(f"{n}:{t.device}" for n, t in zip(NAMES, tensors)))
    # a window longer than the sequence sees the same keys as one of length N: clamp (same function,
    # 32-bit kernel arguments, bounded reference memory)
    w1, w2 = min(w1, max(N, 1)), min(w2, max(N, 1))
    swapped = w1 > w2
    if swapped:
        w1, w2 = w2, w1
    return ProblemSpec(B, N, Hq, Hk, D, w1, w2, sm_scale, swapped)


def validate_shape(B, N, Hq, Hk, D, w1, w2, sm_scale=None) -> ProblemSpec:
    """`validate` for a shape alone: the same checks on meta tensors (no memory, no device)."""
    q = torch.empty(B, N, Hq, D, dtype=torch.bfloat16, device="meta")
    kv = [torch.empty(B, N, Hk, D, dtype=torch.bfloat16, device="meta") for _ in range(4)]
    return validate(q, *kv, w1, w2, sm_scale)


def check_device(device: torch.device, *, needs_hopper: bool, variant: str) -> None:
    """Raise a clear error when `device` (the tensors') is not a GPU this variant can run on."""
    if device.type != "cuda":
        raise ValueError(f"variant {variant!r} needs the tensors on a CUDA GPU "
                         f"({'sm_90 Hopper' if needs_hopper else 'sm_80 or newer'}); "
                         f"they are on {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if needs_hopper and major != 9:
        raise RuntimeError(f"variant {variant!r} needs a Hopper GPU (sm_90: TMA, wgmma); this GPU "
                           f"is sm_{major}{minor}")
    if major < 8:
        raise RuntimeError(f"variant {variant!r} needs sm_80 or newer; this GPU is sm_{major}{minor}")

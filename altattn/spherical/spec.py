"""The spherical-attention problem a call describes, and the checks that turn bad input into a clear
Python error before any device work (the shared ones are altattn.checks)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..checks import cached_validate, check_bool, check_group, positive_float

NAMES = ("q", "k", "v")
SUPPORTED_DTYPES = (torch.bfloat16,)
# the plain-PyTorch reference (and the op on CPU tensors, which runs it) also takes these
REFERENCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
SUPPORTED_HEAD_DIMS = (64, 128)
DEFAULT_EPS = 1e-6  # FlashSign's (docs/MATH.md §2)


@dataclass(frozen=True)
class SphericalSpec:
    """One call: q [B, N, Hq, D], k and v [B, Nk, Hk, D]; causal (N == Nk); scale c = sm_scale;
    eps; varlen when a `seqlens` tensor gives each sequence's real length; packed: B = 1 over
    the N (Nk) packed tokens of sequences cut by cu_seqlens (altattn/spherical/varlen.py)."""

    B: int
    N: int
    Nk: int
    Hq: int
    Hk: int
    D: int
    causal: bool = False
    sm_scale: float = 1.0
    eps: float = DEFAULT_EPS
    varlen: bool = False
    packed: bool = False

    @property
    def G(self) -> int:
        """Query heads per KV head."""
        return self.Hq // self.Hk

    def short(self) -> str:
        s = f"B={self.B} N={self.N} Hq={self.Hq} Hk={self.Hk} D={self.D}"
        if self.Nk != self.N:
            s += f" Nk={self.Nk}"
        return (s + (" causal" if self.causal else "") + (" seqlens" if self.varlen else "")
                + (" packed" if self.packed else ""))


def _check_eps(eps) -> float:
    """`eps` as a finite float >= 0 (0 allowed: a row of zero scores then gives NaN, as 0/0)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a float >= 0, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite float >= 0, got {eps}")
    return float(eps)


def check_seqlens(seqlens, B: int, device: torch.device) -> torch.Tensor | None:
    """None, or `seqlens` as a contiguous int32 [B] tensor on `device` (TypeError / ValueError
    naming it otherwise). Its values are not read here (that would wait for the GPU): every path,
    the kernels and the reference, clamps them to [0, N] for queries and [0, Nk] for keys."""
    if seqlens is None:
        return None
    if not isinstance(seqlens, torch.Tensor):
        raise TypeError(f"seqlens must be a torch.Tensor or None, got {type(seqlens).__name__}")
    if seqlens.dtype not in (torch.int32, torch.int64) or seqlens.dim() != 1:
        raise TypeError(f"seqlens must be a 1-D int32 (or int64) tensor [B], got "
                        f"{seqlens.dtype} of shape {tuple(seqlens.shape)}")
    if seqlens.shape[0] != B:
        raise ValueError(f"seqlens must have B = {B} entries (one length per sequence), got "
                         f"{seqlens.shape[0]}")
    if seqlens.device != device:
        raise ValueError(f"seqlens is on {seqlens.device} but q, k, v are on {device}")
    return seqlens.to(torch.int32).contiguous()


@cached_validate
def validate(q, k, v, causal=False, sm_scale=None, eps=DEFAULT_EPS, seqlens=None, *,
             cpu_reference: bool = False) -> SphericalSpec:
    """Check arguments, dtypes and shapes (that the tensors share one device, not which: see
    checks.check_device) and return the spec. q [B, N, Hq, D]; k, v [B, Nk, Hk, D]; one dtype,
    bfloat16 (with cpu_reference=True, CPU tensors may have any dtype of REFERENCE_DTYPES)."""
    tensors = (q, k, v)
    on_cpu = cpu_reference and isinstance(q, torch.Tensor) and q.device.type == "cpu"
    check_group(NAMES, tensors, 4, "[B, N, H, D]", REFERENCE_DTYPES if on_cpu else SUPPORTED_DTYPES,
                SUPPORTED_DTYPES)
    causal = check_bool("causal", causal)
    B, N, Hq, D = q.shape
    Bk, Nk, Hk, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)} [B, Nk, Hk, D], got "
                         f"{tuple(v.shape)}")
    for what, got, want in (("B (dim 0)", Bk, B), ("D (dim 3)", Dk, D)):
        if got != want:
            raise ValueError(f"k has {what} = {got} but q has {want}: shapes q{tuple(q.shape)} "
                             f"vs k{tuple(k.shape)}")
    if Hk < 1 or Hq < 1:
        raise ValueError(f"head counts must be >= 1, got Hq={Hq} Hk={Hk}")
    if Hq % Hk:
        raise ValueError(f"Hq={Hq} must be a multiple of Hk={Hk} (grouped-query heads)")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D={D} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if causal and N != Nk:
        raise ValueError(f"causal=True needs as many keys as queries (query y sees keys x <= y), "
                         f"got N={N} queries and Nk={Nk} keys")
    sm_scale = (1.0 / math.sqrt(D) if sm_scale is None
                else positive_float("sm_scale", sm_scale, "a float or None"))
    eps = _check_eps(eps)
    seqlens = check_seqlens(seqlens, B, q.device)
    return SphericalSpec(B, N, Nk, Hq, Hk, D, causal, sm_scale, eps, seqlens is not None)

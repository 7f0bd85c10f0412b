"""The triple-attention problem a call describes, and the checks that turn bad input into a clear
Python error before any device work (the shared ones are altattn.checks)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import cached_validate, check_bool, check_floating, check_group, positive_float

NAMES = ("q1", "q2", "k1", "k2", "v")
STATE_LAYOUT = "[B, H, Dq, Dv, Dq]"  # the state S[b, h, i, j, k], fp32
SUPPORTED_DTYPES = (torch.bfloat16,)
# the plain-PyTorch reference (and the op on CPU tensors, which runs it) also takes these
REFERENCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
SUPPORTED_DIMS = (32, 64, 128)  # Dq and Dv, each
SCALE_WORDS = "a finite float > 0, or None (1/N)"


@dataclass(frozen=True)
class TripleSpec:
    """One call: q1, q2, k1, k2 [B, N, H, Dq], v [B, N, H, Dv]; the state [B, H, Dq, Dv, Dq];
    causal (token n reads the state of tokens m <= n); scale c (validate resolves None to 1/N)."""

    B: int
    N: int
    H: int
    Dq: int
    Dv: int
    causal: bool = False
    scale: float = 1.0

    def short(self) -> str:
        return (f"B={self.B} N={self.N} H={self.H} Dq={self.Dq} Dv={self.Dv}"
                + (" causal" if self.causal else ""))


def default_scale(N: int) -> float:
    """c = 1/N (the state is a mean over the sequence); 1 for an empty sequence."""
    return 1.0 / max(N, 1)


def check_scale(scale, N: int, with_state: bool = False) -> float:
    """`scale` as a finite float > 0, 1/N for None; TypeError / ValueError naming it. with_state
    (an initial_state is given): None is refused, since 1/N is the mean over this call's tokens
    only and the state holds earlier ones."""
    if scale is None and with_state:
        raise ValueError("scale=None (1/N, the mean over this call's N tokens) cannot go with an "
                         "initial_state, whose tokens are not counted in N: pass scale "
                         "explicitly, the one that built initial_state")
    return default_scale(N) if scale is None else positive_float("scale", scale, SCALE_WORDS)


def check_dims(Dq: int, Dv: int, q_where: str = "", v_where: str = "") -> None:
    """ValueError unless Dq and Dv are each in SUPPORTED_DIMS (`*_where`: which argument holds
    it, for the message)."""
    for name, d, where in (("Dq", Dq, q_where), ("Dv", Dv, v_where)):
        if d not in SUPPORTED_DIMS:
            raise ValueError(f"head dim {name}={d}{f' ({where})' if where else ''} is not "
                             f"supported; supported: {SUPPORTED_DIMS}")


def state_dtypes(on_cpu: bool) -> tuple:
    """The dtypes an initial_state may have: float32 (the state's), float64 too on the CPU
    (the reference's state for fp64 inputs)."""
    return (torch.float32, torch.float64) if on_cpu else (torch.float32,)


def check_initial_state(initial_state, shape: tuple, device: torch.device, on_cpu: bool,
                        name: str = "initial_state") -> None:
    """TypeError / ValueError naming `name` unless initial_state is None or a tensor of the
    state's `shape` [B, H, Dq, Dv, Dq], a dtype of state_dtypes(on_cpu), on `device` (q1's)."""
    if initial_state is None:
        return
    check_floating(name, initial_state)
    if initial_state.dtype not in state_dtypes(on_cpu):
        raise TypeError(f"{name} must have a dtype in {state_dtypes(on_cpu)} (the "
                        f"state's), got {initial_state.dtype}")
    if tuple(initial_state.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} {STATE_LAYOUT}, got "
                         f"{tuple(initial_state.shape)}")
    if initial_state.device != device:
        raise ValueError(f"{name} is on {initial_state.device} but q1, q2, k1, k2, v are "
                         f"on {device}")


@cached_validate
def validate(q1, q2, k1, k2, v, scale=None, causal=False, initial_state=None, *,
             cpu_reference: bool = False) -> TripleSpec:
    """Check arguments, dtypes and shapes (that the tensors share one device, not which: see
    checks.check_device) and return the spec. q1, q2, k1, k2 [B, N, H, Dq], v [B, N, H, Dv]
    (Dq, Dv in SUPPORTED_DIMS); one dtype, bfloat16 (with cpu_reference=True, CPU tensors may
    have any dtype of REFERENCE_DTYPES); scale a finite float > 0 or None (1/N; not with an
    initial_state); causal a bool; initial_state None or the state [B, H, Dq, Dv, Dq] fp32
    (check_initial_state)."""
    tensors = (q1, q2, k1, k2, v)
    on_cpu = cpu_reference and isinstance(q1, torch.Tensor) and q1.device.type == "cpu"
    check_group(NAMES, tensors, 4, "[B, N, H, Dq] ([B, N, H, Dv] for v)",
                REFERENCE_DTYPES if on_cpu else SUPPORTED_DTYPES, SUPPORTED_DTYPES)
    causal = check_bool("causal", causal)
    B, N, H, Dq = q1.shape
    for name, t in zip(NAMES[1:4], tensors[1:4]):
        if tuple(t.shape) != tuple(q1.shape):
            raise ValueError(f"{name} must have q1's shape {tuple(q1.shape)} [B, N, H, Dq], got "
                             f"{tuple(t.shape)}")
    if tuple(v.shape[:3]) != (B, N, H):
        raise ValueError(f"v must be [B, N, H, Dv] with q1's B, N, H = {(B, N, H)}, got shape "
                         f"{tuple(v.shape)}")
    Dv = v.shape[3]
    check_dims(Dq, Dv, "dim 3 of q1, q2, k1, k2", "dim 3 of v")
    check_initial_state(initial_state, (B, H, Dq, Dv, Dq), q1.device, on_cpu)
    return TripleSpec(B, N, H, Dq, Dv, causal, check_scale(scale, N, initial_state is not None))

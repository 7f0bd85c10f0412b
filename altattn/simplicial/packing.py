"""Packed sequences on the kernels: the token maps a packed launch reads, the checks of
`cu_seqlens`, and one pass over packed sequences (`run_packed`), which `varlen.py` (prefill,
training) and `kvcache.py` (decoding) share.

A packed launch sees B = 1: q [1, Tq, Hq, D] and keys [1, Tk, Hk, D], each sequence a run of
rows. The kernels that take it (`accepts` "varlen" in family.py) read, per query token, its row
among the keys and its sequence's first key row (`Packed.seq`; the backward: each token's
sequence start and end, `Packed.bounds`), and cut every window there. Other variants run the
dense kernels sequence by sequence (`per_sequence`): correct, one launch per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import launcher
from ..launcher import Call
from .passes import FAMILY
from .spec import ProblemSpec

Tensor = torch.Tensor


@dataclass(frozen=True)
class Packed:
    """What a packed launch reads beside its spec (int32 on the tensors' device)."""

    seq: Tensor | None = None      # [Tq, 2]: each query token's key row, its sequence's first
    bounds: Tensor | None = None   # [T, 2]: each token's sequence start and end (the backward)
    n_split: int = 1               # the forward's shares of each token's j window (kvcache.py)
    # decoding (kvcache.py): the keys are caches [B, R, Hk, D]; lens [B] the cached lengths, the
    # query token b * tokens + t at position lens[b] + shift + t
    lens: Tensor | None = None
    tokens: int = 1
    shift: int = 0


def values_checkable(t: Tensor) -> bool:
    """Whether reading t's values on the host is allowed here: not while torch.compile traces
    or a CUDA graph is captured (the checks that need them are then skipped)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_cu_seqlens(cu_seqlens, T: int, device: torch.device, max_seqlen=None,
                     values: bool = True) -> list | None:
    """cu_seqlens: an int32 tensor [n + 1] on `device`, 0 first, non-decreasing, T last (the
    packed token count); max_seqlen, if given, at least the longest sequence. TypeError /
    ValueError naming the argument. Returns the offsets as a list, or None where the values
    may not be read (`values_checkable`) or are not to be (values=False: its kind only)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32 (FlashAttention's convention), got "
                        f"{cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [n_sequences + 1], got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if not values or not values_checkable(cu_seqlens):
        return None
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens must run from 0 to the packed token count T = {T}, got "
                         f"{cu[0]} .. {cu[-1]}")
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(n < 0 for n in lens):
        raise ValueError("cu_seqlens must be non-decreasing (sequence lengths >= 0), got "
                         f"lengths {lens[:8]}{' ...' if len(lens) > 8 else ''}")
    if max_seqlen is not None and lens and max(lens) > max_seqlen:
        raise ValueError(f"max_seqlen = {max_seqlen} but the longest sequence has {max(lens)} "
                         f"tokens")
    return cu


def token_maps(cu_seqlens: Tensor, T: int) -> Packed:
    """The maps of packed sequences whose queries are their keys (prefill, training), from
    cu_seqlens alone on the device (no host copy: a torch.compile graph or a CUDA graph may
    hold it)."""
    cu = cu_seqlens.long()
    seq_of = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device),
                                     cu[1:] - cu[:-1], output_size=T)
    start, end = cu[seq_of], cu[seq_of + 1]
    rows = torch.arange(T, device=cu.device)
    return Packed(seq=torch.stack((rows, start), 1).int().contiguous(),
                  bounds=torch.stack((start, end), 1).int().contiguous())


def packed_variant(spec: ProblemSpec, variant: str, device, pass_: str,
                   deterministic: bool = False):
    """The variant that runs packed `spec` in one launch ("auto": the fastest that takes it),
    or None: no packed variant takes it ("auto") or the one named runs batches only."""
    packed = replace(spec, varlen=True)
    if variant != "auto":
        v = launcher.select(replace(spec, varlen=False), variant, device, pass_, deterministic,
                            family=FAMILY)
        return v if True in v.accepted("varlen") and v.cannot_take(packed) is None else None
    try:
        return launcher.select(packed, "auto", device, pass_, deterministic, family=FAMILY)
    except (ValueError, NotImplementedError):
        return None


def launch(pass_io, v, spec: ProblemSpec, packed: Packed, tensors: dict, outs: dict) -> None:
    """One packed launch of variant v through its pass's steps (`pass_io`: passes.Forward or
    Backward): `tensors` and `outs` as those steps name them, B = 1 views of the packed tensors
    (forward: q [1, Tq, Hq, D], keys [1, Tk, Hk, D], out [n_split, Tq, Hq, D] and lse
    [n_split, Hq, Tq])."""
    spec = spec if spec.varlen else replace(spec, varlen=True)
    device = tensors["q"].device
    args = pass_io.kernel_args(Call(spec, device, tensors), outs)
    if args is None:
        return
    launcher.on_device(device, v.load().launch, spec, *args, packed=packed)


def per_sequence(cu: list, fn, *packed: Tensor | None) -> list:
    """fn(*slices) for each sequence, `packed` cut at the offsets `cu` along dim 0 (None stays
    None); the sequences' results in order."""
    return [fn(*(None if t is None else t[a:b] for t in packed)) for a, b in zip(cu, cu[1:])]

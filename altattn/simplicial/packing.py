"""Packed sequences on the kernels: the token maps a packed launch reads, the checks of
`cu_seqlens` and the loop over sequences (altattn/packing.py, shared with the other families,
re-exported here), and one packed launch (`launch`), which `varlen.py` (prefill, training) and
`kvcache.py` (decoding) share.

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
from ..packing import check_cu_seqlens, per_sequence, values_checkable  # noqa: F401 (shared)
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

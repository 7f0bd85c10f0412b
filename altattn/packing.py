"""Packed variable-length sequences, the pieces every family shares (FlashAttention's `varlen`
convention): the checks of `cu_seqlens`, whether its values may be read on the host, a loop over
the sequences (the CPU reference paths), and the tile map a packed kernel launch reads.

Packed tensors hold the sequences one after another along dim 0 ([T, H, D]); sequence s holds
rows cu_seqlens[s] .. cu_seqlens[s + 1] - 1 (int32 offsets, 0 first, T last; empty sequences
allowed). The 2-simplicial family's token maps and launch are in altattn/simplicial/packing.py;
the spherical family's packed launch reads `tile_map`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

Tensor = torch.Tensor

# the columns of a tile map row (tile_map): the sequence's first query row and first key row (in
# the packed tensors), its query and key lengths, the tile's first row (or key) in the sequence,
# the head the tile's program computes, the sequence's index
MAP_COLUMNS = ("q_start", "k_start", "len_q", "len_k", "first", "head", "seq")


class PackedSeqs(NamedTuple):
    """What a packed kernel launch takes beside the tensors: the query and key offsets (int32
    [n + 1] each, on the device; the same tensor twice for self-attention)."""

    cu_q: Tensor
    cu_k: Tensor


def values_checkable(t: Tensor) -> bool:
    """Whether reading t's values on the host is allowed here: not while torch.compile traces
    or a CUDA graph is captured (the checks that need them are then skipped)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_cu_seqlens(cu_seqlens, T: int, device: torch.device, max_seqlen=None,
                     name: str = "cu_seqlens", max_name: str = "max_seqlen",
                     values: bool = True) -> list | None:
    """`name`: an int32 tensor [n + 1] on `device`, 0 first, non-decreasing, T last (the
    packed token count); `max_name` (max_seqlen), if given, at least the longest sequence.
    TypeError / ValueError naming the argument. Returns the offsets as a list, or None where
    the values may not be read (`values_checkable`) or are not to be (values=False: its kind
    only)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (FlashAttention's convention), got "
                        f"{cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be 1-D [n_sequences + 1], got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} is on {cu_seqlens.device} but q is on {device}")
    if not values or not values_checkable(cu_seqlens):
        return None
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"{name} must run from 0 to the packed token count T = {T}, got "
                         f"{cu[0]} .. {cu[-1]}")
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0), got "
                         f"lengths {lens[:8]}{' ...' if len(lens) > 8 else ''}")
    if max_seqlen is not None and lens and max(lens) > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} but the longest sequence has {max(lens)} "
                         f"tokens")
    return cu


def check_max_seqlen(name: str, value) -> int | None:
    """`value` as an int >= 0, or None (TypeError naming `name` otherwise)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{name} must be an int >= 0 (or None), got {value!r}")
    return value


def per_sequence(cu: list, fn, *packed: Tensor | None) -> list:
    """fn(*slices) for each sequence, `packed` cut at the offsets `cu` along dim 0 (None stays
    None); the sequences' results in order."""
    return [fn(*(None if t is None else t[a:b] for t in packed)) for a, b in zip(cu, cu[1:])]


def max_tiles(T: int, n: int, block: int) -> int:
    """An upper bound on the tiles of `block` rows that n sequences of T rows in all make:
    sum_s cdiv(len_s, block) <= cdiv(T, block) + n (each sequence wastes less than one tile).
    A launch's grid, known without reading the lengths."""
    return -(-T // block) + n if n else 0


def tile_map(cu_q: Tensor, cu_k: Tensor, block: int, n_tiles: int, *, heads: int = 1,
             causal: bool = False, keys: bool = False) -> Tensor:
    """int32 [heads * n_tiles, 7] (MAP_COLUMNS): one row per head and tile of `block` query rows
    (keys=True: of `block` keys) of each sequence, built on the device from the offsets alone (no
    host read: a torch.compile graph or a CUDA graph may hold it); a launch runs one program (or
    one turn of a persistent program) per row. n_tiles: max_tiles(...) of the packed rows (or
    keys). Order: the sequences by their largest tile's work, largest first (the long tiles start
    first and the short ones fill the end of the launch); within a sequence head by head, and a
    head's tiles by their work, largest first (ties in the sequence's order). So the programs
    running at once read one head's rows and keys, as a batch's (b, head)-major grid does, and
    those stay in L2 while the head's tiles pass over them. Rows past the real tiles come last,
    with lengths 0 (a kernel does nothing for them). Work: a query tile's visible keys (causal:
    up to its last row), a key tile's visible rows (causal: from its first key)."""
    dev = cu_q.device
    cq, ck = cu_q.long(), cu_k.long()
    n = cq.numel() - 1
    if n_tiles == 0 or n == 0:
        return torch.zeros(heads * n_tiles, len(MAP_COLUMNS), dtype=torch.int32, device=dev)
    len_q, len_k = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    per = ((len_k if keys else len_q) + block - 1) // block  # tiles of each sequence
    end = per.cumsum(0)
    i = torch.arange(n_tiles, device=dev)
    s = torch.searchsorted(end, i, right=True)
    real = s < n
    s = s.clamp(max=n - 1)
    first = (i - (end[s] - per[s])) * block
    lq = torch.where(real, len_q[s], 0)
    lk = torch.where(real, len_k[s], 0)
    if keys:  # (0 on the rows past the real tiles, whose lengths are 0)
        work = (lq - first).clamp(min=0) if causal else lq
    else:
        work = torch.minimum(lk, first + block) if causal else lk
    # sort key: the sequence's rank by its largest tile's work (its query count for key tiles,
    # its key count for query tiles, causal too: causal sequences have both equal), largest
    # first, unreal tiles after every sequence; the head; the tile's work, largest first. span
    # (a device scalar: no host read) bounds a work
    top = len_q if keys else len_k
    rank = torch.argsort(torch.argsort(top, descending=True, stable=True))
    span = top.max() + 1
    seq_key = torch.where(real, rank[s], n)[:, None] * heads + torch.arange(heads, device=dev)
    key = seq_key * span + (span - 1 - work)[:, None]  # [n_tiles, heads]
    order = torch.argsort(key.flatten(), stable=True)
    rows = torch.stack((cq[s], ck[s], lq, lk, torch.where(real, first, 0)), 1)
    tile, head = order // heads, order % heads
    return torch.cat((rows[tile], head[:, None], s[tile, None]), 1).to(torch.int32).contiguous()

"""Decoding with a KV cache: `attention_with_kvcache`, FlashAttention's `flash_attn_with_kvcache`
convention for 2-simplicial attention (forward only).

A cache is [B, R, Hk, D] per sequence and tensor; the token at position p lives in slot p mod R.
So a cache of R >= (the longest sequence) slots is a plain linear cache, and one of R >= w + T - 1
slots (w its window, T the new tokens per call) is a ring buffer: constant memory per sequence,
however long the context, since only the last w1 tokens of K1/V1 and the last w2 of K2/V2 are
ever read. (Softmax attention must keep every past token.)

On CUDA, at G = Hq/Hk = 128 (the variants that take packed sequences, packing.py), a call is
three launches and no host work (a CUDA graph replays it): the new keys and values written into
their slots (kernels_triton/simplicial/decode.py), one forward over the B * T new tokens that
reads the caches where they lie (the kernel's CACHE mode, kernels_tlx/simplicial/hadamard.py:
cache_tile), each token's j window split in n_split shares so that a few tokens still fill the
GPU (flash-decoding), and the merge of the shares by their LSE. What a call's shapes decide is
made once per shape (`_Step`, the step plan: validation, the three prepared launches, the pairs'
order, the sizes), so an eager call of contiguous tensors is a key lookup, two checks per tensor
(contiguous, aligned), the shares' scratch (kept by the thread between calls) and the launches
before the forward's launch. Form "det" and D = 64 (which have no CACHE mode) gather each
sequence's window into packed keys first. Elsewhere (other G, CPU) the window of each sequence
runs through the dense forward (CPU: the fp64 reference), the queries at its last T positions.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace

import torch

from ..checks import (
    MAX_REMEMBERED,
    _on_cuda,
    check_cache_seqlens,
    check_group,
    dense_aligned,
    is_int,
    positive_int,
)
from . import packing
from .ops import _lse_dtype
from .passes import Forward
from .passes import forward as dense_forward
from .reference import reference
from .spec import NAMES, REFERENCE_DTYPES, SUPPORTED_DTYPES, validate_shape

Tensor = torch.Tensor
CACHES = ("k1_cache", "k2_cache", "v1_cache", "v2_cache")
NEW = ("k1", "k2", "v1", "v2")


def _check(q, caches, cache_seqlens, new, w1, w2):
    """Shapes, dtypes, devices; returns (B, T, R1, R2)."""
    on_cpu = isinstance(q, Tensor) and q.device.type == "cpu"
    dtypes = REFERENCE_DTYPES if on_cpu else SUPPORTED_DTYPES
    check_group(("q", *CACHES), (q, *caches), 4, "[B, *, H, D]", dtypes, SUPPORTED_DTYPES)
    B, T, Hq, D = q.shape
    Hk = caches[0].shape[2]
    for name, c in zip(CACHES, caches):
        if c.shape[0] != B or c.shape[2] != Hk or c.shape[3] != D:
            raise ValueError(f"{name} must be [B={B}, slots, Hk={Hk}, D={D}], got "
                             f"{tuple(c.shape)}")
    for a, b in ((0, 2), (1, 3)):
        if caches[a].shape[1] != caches[b].shape[1]:
            raise ValueError(f"{CACHES[a]} and {CACHES[b]} must have as many slots, got "
                             f"{caches[a].shape[1]} and {caches[b].shape[1]}")
    R1, R2 = caches[0].shape[1], caches[1].shape[1]
    given = [t is not None for t in new]
    if any(given) and not all(given):
        raise ValueError("k1, k2, v1, v2: give all four new keys and values, or none")
    if all(given):
        check_group(NEW, new, 4, "[B, T, Hk, D]", (q.dtype,), SUPPORTED_DTYPES)
        for name, t in zip(NEW, new):
            if tuple(t.shape) != (B, T, Hk, D) or t.device != q.device:
                raise ValueError(f"{name} must be [B, T, Hk, D] = {(B, T, Hk, D)} on {q.device}, "
                                 f"got {tuple(t.shape)} on {t.device}")
        for name, r in (("k1_cache", R1), ("k2_cache", R2)):
            if r < T:
                raise ValueError(f"{name} has {r} slots, fewer than the T = {T} new tokens")
    check_cache_seqlens(cache_seqlens, B, q.device)
    positive_int("w1", w1, "a window of at least one token")
    positive_int("w2", w2, "a window of at least one token")
    return B, T, R1, R2


@dataclass(frozen=True)
class _Setup:
    """What a call's shapes and arguments decide (`_setup`): sizes, the spec of one sequence's
    window, the packed variant (None: each sequence through the dense forward), the split."""

    B: int
    T: int
    R1: int
    R2: int
    spec: object
    appended: bool
    variant: object = None
    n_split: int = 1
    cache_mode: bool = False   # the kernel reads the caches (trilinear, D 128)
    launch_spec: object = None  # the packed launch's spec (N = B * T query tokens)


def _setup(q, k1_cache, k2_cache, v1_cache, v2_cache, cache_seqlens, k1, k2, v1, v2, w1, w2,
           sm_scale, variant, form) -> _Setup:
    """Every check of a call that its tensors' shapes, dtypes and devices and its other
    arguments decide, and what they decide (remembered for CUDA calls: `_remembered_setup`;
    an int cache_seqlens comes as 0, its value no part of it)."""
    caches, new = (k1_cache, k2_cache, v1_cache, v2_cache), (k1, k2, v1, v2)
    B, T, R1, R2 = _check(q, caches, cache_seqlens, new, w1, w2)
    Hq, D, Hk = q.shape[2], q.shape[3], k1_cache.shape[2]
    spec = validate_shape(1, max(w1, w2) + T - 1, Hq, Hk, D, w1, w2, sm_scale)
    spec = replace(spec, form=form) if form != "trilinear" else spec
    appended = k1 is not None
    v = (packing.packed_variant(spec, variant, q.device, "fwd") if q.device.type == "cuda"
         and B * T > 0 else None)
    if v is None:
        return _Setup(B, T, R1, R2, spec, appended)
    return _Setup(B, T, R1, R2, spec, appended, v, _split(B * T * Hk, spec.w1, q.device),
                  form == "trilinear" and D == 128, replace(spec, N=B * T, varlen=True))


class _Step:
    """The step plan: a decoding call in the caches' own layout (the kernel's CACHE mode) with
    everything its shapes decide made once (`_planned`): the append's, the forward's and the
    merge's prepared launches, the pairs' order, the shares' sizes. A call is then the checks
    that read the tensors themselves (`takes`), one allocation and the launches: the general
    path's kernels, in its order, on the same values (so the same bits), without its per-call
    `Packed`, `Call`, `kernel_args`, variant lookup and reshapes. The shares' out and LSE are
    scratch the merge reads (never returned): one allocation, which the thread keeps for its
    next call of the same sizes on the same stream (`_shares`); the merged out and LSE two
    allocations (what the caller gets; made after the forward's launch, while the GPU runs
    it)."""

    __slots__ = ("append", "forward", "merge", "swapped", "n_out", "n_lse", "rows", "lses")

    def __init__(self, s: _Setup, q: Tensor, caches):
        from kernels_triton.simplicial.decode import prepare_append, prepare_merge
        B, T, Hq, D, Hk = s.B, s.T, q.shape[2], q.shape[3], caches[0].shape[2]
        spec = s.launch_spec
        self.swapped = spec.swapped
        k1, k2, v1, v2 = (caches[1], caches[0], caches[3], caches[2]) if self.swapped else caches
        cache = (T, 0 if s.appended else -T, k1.shape[1], k2.shape[1])
        self.forward = s.variant.load().launch.prepared_packed(
            spec, False, s.n_split, cache, tuple(k2.shape), tuple(v2.shape))
        self.append = prepare_append(B, T, Hk, D, s.R1, s.R2) if s.appended else None
        self.merge = prepare_merge(s.n_split, B * T, Hq, D, T) if s.n_split > 1 else None
        self.n_out, self.n_lse = s.n_split * B * T * Hq * D, s.n_split * Hq * B * T
        self.rows, self.lses = (B, T, Hq, D), (Hq, B, T)

    @staticmethod
    def able(s: _Setup) -> bool:
        """A plan runs this setup: the caches read in place, the variant's packed launch made
        by host.entry_points (it keeps `prepared_packed`)."""
        return (s.cache_mode and s.variant is not None
                and hasattr(s.variant.load().launch, "prepared_packed"))

    def takes(self, q: Tensor, caches, new, lengths: Tensor) -> bool:
        """Every tensor the launches read is contiguous with a 16-byte aligned start (else the
        general path, which copies or indexes)."""
        for t in (q, *caches, lengths, *new) if self.append is not None else (q, *caches,
                                                                             lengths):
            if not t.is_contiguous() or t.data_ptr() % 16:
                return False
        return True

    def __call__(self, q: Tensor, caches, new, lengths: Tensor):
        if self.append is not None:  # the new keys in their slots, before the forward reads
            self.append(caches, new, lengths)
        if self.merge is None:
            B, T, Hq, D = self.rows
            out = q.new_empty(1, B * T, Hq, D)
            lse = q.new_empty(1, Hq, B * T, dtype=torch.float32)
        else:
            out, lse = self._shares(q)
        k1, k2, v1, v2 = caches
        if self.swapped:
            k1, k2, v1, v2 = k2, k1, v2, v1
        self.forward(q, k1, k2, v1, v2, out, lse, lengths)
        if self.merge is not None:  # the shares merged by their LSEs
            return self.merge(out, lse)
        return out[0].view(self.rows), lse[0].view(self.lses).transpose(0, 1)

    def _shares(self, q: Tensor):
        """The shares' out [S, B*T, Hq, D] bf16, then their LSE [S, Hq, B*T] fp32, in one
        allocation: this thread's last call's where that call had the same sizes, device and
        stream (the GPU runs this call's forward after that call's merge, the scratch's last
        reader: one stream orders them; a thread keeps its own, since two threads' launches on
        one stream may interleave), else a new one, which the thread keeps instead (one
        scratch a thread, freed with it). While a CUDA graph is captured: a new one from the
        graph's pool, not kept. The forward writes every share of every row before the merge
        reads it, so the bits are a fresh allocation's."""
        owner = _scratch_owner(q.get_device(), self.n_out, self.n_lse)
        held = getattr(_LOCAL, "scratch", None)
        if owner is not None and held is not None and held[0] == owner:
            return held[1], held[2]
        out = q.new_empty(self.n_out + 2 * self.n_lse)
        lse = out.narrow(0, self.n_out, 2 * self.n_lse).view(torch.float32)
        if owner is not None:
            _LOCAL.scratch = (owner, out, lse)
        return out, lse


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU builds
_LOCAL = threading.local()  # .scratch: (owner, out, lse), this thread's last shares (`_shares`)


def _scratch_owner(device: int, n_out: int, n_lse: int):
    """What a kept scratch must match to be reused (`_Step._shares`): the device, its current
    stream, the sizes; None while a CUDA graph is captured (nothing kept or reused)."""
    if torch.cuda.is_current_stream_capturing():
        return None
    return device, _raw_stream(device), n_out, n_lse


_PLANS: dict = {}  # a CUDA call's key (`_planned`) -> (its _Setup, its _Step or None)
_remember = _on_cuda  # the calls `_planned` remembers: q a CUDA torch.Tensor


def _call_key(q, caches, seqlens, new, w1, w2, sm_scale, variant, form) -> tuple:
    """What `_setup` reads of a call: each tensor's type, shape, dtype and device, the other
    arguments' types and values (as checks.cached_validate's key, flat and inline: half its
    cost). AttributeError where a tensor argument is none, TypeError (hashing) where one is
    unhashable."""
    a, b, c, d = caches  # never None in a valid call (None: AttributeError, `_setup` says)
    e, f, g, h = new     # all four or none in a valid call
    given = e is not None and f is not None and g is not None and h is not None
    return (type(q), q.shape, q.dtype, q.device, type(a), a.shape, a.dtype, a.device, type(b),
            b.shape, b.dtype, b.device, type(c), c.shape, c.dtype, c.device, type(d), d.shape,
            d.dtype, d.device,
            (int, seqlens) if type(seqlens) is int else (type(seqlens), seqlens.shape,
                                                         seqlens.dtype, seqlens.device),
            (type(e), e.shape, e.dtype, e.device, type(f), f.shape, f.dtype, f.device, type(g),
             g.shape, g.dtype, g.device, type(h), h.shape, h.dtype, h.device) if given
            else (e is None, f is None, g is None, h is None),
            type(w1), w1, type(w2), w2, type(sm_scale), sm_scale, type(variant), variant,
            type(form), form)


def _planned(q, caches, seqlens, new, w1, w2, sm_scale, variant, form):
    """(`_setup`'s result, the call's `_Step` or None), remembered for CUDA calls by
    `_call_key`. Other calls, and calls whose key cannot be made (a non-tensor, an unhashable
    argument), run `_setup`, which raises what is wrong before any launch."""
    key = None
    if _remember(q):
        try:
            key = _call_key(q, caches, seqlens, new, w1, w2, sm_scale, variant, form)
            hit = _PLANS.get(key)
        except (TypeError, AttributeError):
            key = None
        else:
            if hit is not None:
                return hit
    s = _setup(q, *caches, seqlens, *new, w1, w2, sm_scale, variant, form)
    if key is None:
        return s, None
    hit = s, (_Step(s, q, caches) if _Step.able(s) else None)
    if len(_PLANS) < MAX_REMEMBERED:
        _PLANS[key] = hit
    return hit


def _check_lengths(lengths: Tensor, T: int, appended: bool, R1: int, R2: int, w1: int, w2: int):
    """The values of cache_seqlens, where they may be read (`values_checkable`) and a check
    needs them (a host sync, which a decode step that appends to ring caches does not pay: it
    has none): >= 0 (>= T when the queries' keys are already cached), and no position past a
    cache shorter than a ring that holds every window (R < w + T - 1)."""
    if appended and R1 >= w1 + T - 1 and R2 >= w2 + T - 1:
        return
    if not packing.values_checkable(lengths) or lengths.numel() == 0:
        return
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < (0 if appended else T):
        raise ValueError(f"cache_seqlens must be >= {0 if appended else T} (the cached tokens"
                         f"{'' if appended else ', the T queries among them'}), got {lo}")
    end = hi + (T if appended else 0)  # one past the last position
    for name, r, w in (("k1_cache", R1, w1), ("k2_cache", R2, w2)):
        if r < w + T - 1 and end > r:
            raise ValueError(
                f"cache_seqlens runs past {name}: a sequence reaches position {end - 1}, but "
                f"{name} has {r} slots, too short for the window w = {w} (a ring buffer needs "
                f">= w + T - 1 = {w + T - 1} slots; a linear cache one per position)")


def _append(caches, new, lengths, T):
    """Write the new keys and values at positions lengths[b] + t, slot (position mod R): one
    kernel on CUDA (contiguous caches, 16-byte aligned), indexing elsewhere."""
    if lengths.is_cuda and all(c.is_contiguous() and c.data_ptr() % 16 == 0 for c in caches):
        from kernels_triton.simplicial.decode import append
        append(caches, new, lengths)
        return
    B = lengths.numel()
    rows = torch.arange(B, device=lengths.device)[:, None]
    for c, t in zip(caches, new):
        c[rows, (lengths.long()[:, None] + torch.arange(T, device=c.device)) % c.shape[1]] = t


def _windows(caches, last, L: int, short: tuple[int, int], n_short: int):
    """Each sequence's last L positions (ending at position `last`[b]) gathered from the caches
    in position order, [B, L, Hk, D] each; of the caches `short` (the pair with the smaller
    window) only the last n_short rows, the only ones its window reads (the rest is left
    unwritten on the GPU)."""
    pos = last.long()[:, None] - L + 1 + torch.arange(L, device=last.device)
    rows = torch.arange(last.numel(), device=last.device)[:, None]
    out = []
    for i, c in enumerate(caches):
        n = n_short if i in short else L
        w = (c.new_zeros if c.device.type == "cpu" else c.new_empty)((c.shape[0], L,
                                                                      *c.shape[2:]))
        w[:, L - n:] = c[rows, pos[:, L - n:].clamp(min=0) % c.shape[1]]
        out.append(w)
    return out


def _split(tiles: int, w_small: int, device) -> int:
    """Shares of each token's j window: the fewest that fill the GPU's waves best (ceil(tiles *
    S / SMs) / S least), at most the window."""
    from kernels_triton.launch import sm_count
    sms = sm_count(torch.device(device).index)
    return min(range(1, w_small + 1), key=lambda s: (math.ceil(tiles * s / sms) / s, s))


def attention_with_kvcache(q, k1_cache, k2_cache, v1_cache, v2_cache, cache_seqlens, w1, w2, *,
                           k1=None, k2=None, v1=None, v2=None, sm_scale=None,
                           variant: str = "auto", form: str = "trilinear"):
    """2-simplicial attention of T new tokens per sequence against KV caches (forward only).

    q [B, T, Hq, D]; k1_cache, v1_cache [B, R1, Hk, D] and k2_cache, v2_cache [B, R2, Hk, D],
    position p in slot p mod R (module docstring: linear caches and ring buffers);
    cache_seqlens (int32 [B], or an int) the tokens each sequence has cached. With k1, k2, v1,
    v2 ([B, T, Hk, D]) given, they are written into the caches in place first, at positions
    cache_seqlens[b] + t, and query token t sits there; without, the queries are the last T
    cached tokens. cache_seqlens is not advanced (FlashAttention's convention). Returns out
    [B, T, Hq, D] and lse [B, Hq, T], as `attention` would for those tokens of the whole
    sequence. A cache that cannot hold what the windows read raises ValueError naming it (a
    check of cache_seqlens' values, skipped while torch.compile traces or a CUDA graph is
    captured). Inputs that require grad are refused: this is the inference path."""
    caches = (k1_cache, k2_cache, v1_cache, v2_cache)
    new = (k1, k2, v1, v2)
    as_int = is_int(cache_seqlens)
    s, step = _planned(q, caches, 0 if as_int else cache_seqlens, new, w1, w2, sm_scale,
                       variant, form)
    B, T = s.B, s.T
    lengths = (torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device) if as_int
               else cache_seqlens)
    if torch.is_grad_enabled() and (q.requires_grad or s.appended and (
            k1.requires_grad or k2.requires_grad or v1.requires_grad or v2.requires_grad)):
        raise ValueError("attention_with_kvcache is forward-only and its inputs require grad: "
                         "call it under torch.no_grad() or with detached tensors")
    _check_lengths(lengths, T, s.appended, s.R1, s.R2, w1, w2)
    if step is not None and step.takes(q, caches, new, lengths):
        if q.get_device() == torch.cuda.current_device():
            return step(q, caches, new, lengths)
        with torch.cuda.device(q.device):
            return step(q, caches, new, lengths)
    if s.appended:
        _append(caches, new, lengths, T)
    spec, Hq, D = s.spec, q.shape[2], q.shape[3]
    last = None if s.cache_mode else (
        lengths + (T - 1 if s.appended else -1))  # each sequence's last position (no CACHE mode)
    if s.variant is None:
        return _per_sequence(q, _windows_of(caches, last, spec, T), last, w1, w2, spec.sm_scale,
                             variant, form)
    n_split = s.n_split
    out = q.new_empty(n_split, B * T, Hq, D)
    lse = q.new_empty(n_split, Hq, B * T, dtype=torch.float32)
    if last is None:  # the kernel reads the caches (its CACHE mode)
        packed = packing.Packed(lens=dense_aligned(lengths), tokens=T,
                                shift=0 if s.appended else -T, n_split=n_split)
        keys = caches
    else:  # the windows gathered into packed keys, one sequence after the other
        L = spec.w2 + T - 1
        Hk = k1_cache.shape[2]
        t = torch.arange(T, device=q.device)
        base = torch.arange(B, device=q.device)[:, None] * L
        first = base + (L - 1 - last.long()[:, None]).clamp(min=0)
        seq = torch.stack(((base + L - T + t).flatten(), first.expand(B, T).flatten()), 1)
        packed = packing.Packed(seq=seq.int().contiguous(), n_split=n_split)
        keys = [w.reshape(1, B * L, Hk, D) for w in _windows_of(caches, last, spec, T)]
    packing.launch(Forward, s.variant, s.launch_spec, packed,
                   dict(zip(NAMES, (q.reshape(1, B * T, Hq, D), *keys))), {"out": out, "lse": lse})
    if n_split > 1:  # the shares merged by their LSEs
        from kernels_triton.simplicial.decode import merge
        return merge(out, lse, T)
    return out[0].view(B, T, Hq, D), lse[0].view(Hq, B, T).transpose(0, 1)


def _windows_of(caches, last, spec, T: int):
    """_windows of what a call's queries read: the larger window's positions, of the pair with
    the smaller window only its own."""
    return _windows(caches, last, spec.w2 + T - 1, (1, 3) if spec.swapped else (0, 2),
                    spec.w1 + T - 1)


def _per_sequence(q, windows, last, w1, w2, sm_scale, variant, form):
    """Each sequence's window through the dense forward (the fp64 reference on CPU), its queries
    at the last T of its positions 0 .. last[b]."""
    B, T, Hq, D = q.shape
    L = windows[0].shape[1]
    outs, lses = [], []
    for b, p in enumerate(last.tolist()):
        n = min(L, p + 1)  # the window's positions >= 0
        x = [w[b, L - n:][None] for w in windows]
        qb = q.new_zeros(1, n, Hq, D)
        qb[0, n - T:] = q[b]
        if q.device.type == "cpu":
            o, lse = reference(qb, *x, w1, w2, sm_scale=sm_scale, form=form)
            o, lse = o.to(q.dtype), lse.to(_lse_dtype(q))
        else:
            o, lse = dense_forward(qb, *x, w1, w2, sm_scale=sm_scale, variant=variant,
                                   form=form)
        outs.append(o[0, n - T:])
        lses.append(lse[0, :, n - T:])
    if not outs:
        return q.new_empty(q.shape), q.new_empty(B, Hq, T, dtype=_lse_dtype(q))
    return torch.stack(outs), torch.stack(lses)

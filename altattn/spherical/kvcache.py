"""Decoding with a KV cache: `attention_with_kvcache`, FlashAttention's `flash_attn_with_kvcache`
convention for spherical attention (inference only: no autograd).

    out, r = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k, v=v)

q [B, T, Hq, D] (T >= 1 new tokens per sequence); k_cache, v_cache [B, R, Hk, D], row x of
sequence b holding position x (a linear cache); cache_seqlens int32 [B] (or an int): the tokens
each sequence has cached. With k, v [B, T, Hk, D] given, they are written into the caches in
place first, at rows cache_seqlens[b] + t. cache_seqlens is not advanced (the caller does it).

Visible rows, exactly as FlashAttention: the sequence's length is L = cache_seqlens[b] (+ T with
k, v given) and the T queries are its last T positions, so causal token t sees rows
x < L - T + 1 + t (with k, v: x < cache_seqlens[b] + t + 1; without, for T = 1: x <
cache_seqlens[b]); non-causal, every token sees x < L. A token that sees no row gets out = 0 and
r = 0. So a causal prefill through `attention(causal=True)` (or through this function with an
empty cache) followed by steps of any size gives the rows of one causal call.

Returns out [B, T, Hq, D] (q's dtype) and r [B, Hq, T] (fp32; fp64 for fp64 inputs), the row
norm `attention` returns. CUDA: bf16, D in {64, 128}, caches contiguous with 16-byte aligned
starts (they are written in place, so never copied); kernels_triton/spherical/decode.py, split-K
over the cached rows merged by sums, a step of at most three launches and no host work (a CUDA
graph captures it; an int cache_seqlens is then fixed in the graph: pass a tensor to change it
between replays). CPU: plain PyTorch in fp64 (bf16, fp16, fp32, fp64 tensors).

Checks: shapes, dtypes, devices, heads and arguments raise TypeError / ValueError naming them
before any work. The values of cache_seqlens are checked where that costs no host sync (an int, a
CPU tensor): >= 0, and L <= R. A CUDA tensor's values are not read (as FlashAttention): lengths
past the cache are clamped to R and nothing outside the cache is read or written, but the result
is then not attention over the sequence. Inputs that require grad are refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import (
    cached_validate,
    check_bool,
    check_cache_seqlens,
    check_group,
    dense_aligned,
    is_int,
    positive_float,
)
from ..launcher import on_device
from .spec import (
    DEFAULT_EPS,
    REFERENCE_DTYPES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    _check_eps,
)

Tensor = torch.Tensor


@dataclass(frozen=True)
class Setup:
    """What a call's shapes and arguments decide (`setup`)."""

    B: int
    T: int
    R: int
    Hq: int
    Hk: int
    D: int
    appended: bool
    causal: bool
    sm_scale: float
    eps: float


def setup(q, k_cache, v_cache, cache_seqlens, k, v, causal, sm_scale, eps) -> Setup:
    """Every check that the tensors' shapes, dtypes and devices and the other arguments decide
    (remembered for CUDA calls: `_remembered`; an int cache_seqlens comes as 0)."""
    on_cpu = isinstance(q, Tensor) and q.device.type == "cpu"
    names = ("q", "k_cache", "v_cache")
    check_group(names, (q, k_cache, v_cache), 4, "[B, *, H, D]",
                REFERENCE_DTYPES if on_cpu else SUPPORTED_DTYPES, SUPPORTED_DTYPES)
    B, T, Hq, D = q.shape
    _, R, Hk, _ = k_cache.shape
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"k_cache must be [B={B}, R, Hk, D={D}], got {tuple(k_cache.shape)}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got "
                         f"{tuple(v_cache.shape)}")
    if T < 1:
        raise ValueError(f"q must hold T >= 1 new tokens [B, T, Hq, D], got {tuple(q.shape)}")
    if Hk < 1 or Hq % Hk:
        raise ValueError(f"Hq={Hq} must be a multiple of the caches' Hk={Hk} (grouped-query "
                         f"heads)")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D={D} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if (k is None) != (v is None):
        raise ValueError("k, v: give both new keys and values, or neither")
    if k is not None:
        check_group(("k", "v"), (k, v), 4, "[B, T, Hk, D]", (q.dtype,), SUPPORTED_DTYPES)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != (B, T, Hk, D) or t.device != q.device:
                raise ValueError(f"{name} must be [B, T, Hk, D] = {(B, T, Hk, D)} on "
                                 f"{q.device}, got {tuple(t.shape)} on {t.device}")
        if R < T:
            raise ValueError(f"k_cache has R = {R} rows, fewer than the T = {T} new tokens")
    check_cache_seqlens(cache_seqlens, B, q.device)
    causal = check_bool("causal", causal)
    sm_scale = (1.0 / math.sqrt(D) if sm_scale is None
                else positive_float("sm_scale", sm_scale, "a float or None"))
    return Setup(B, T, R, Hq, Hk, D, k is not None, causal, sm_scale, _check_eps(eps))


_remembered = cached_validate(setup)


def check_lengths(cache_seqlens, s: Setup) -> None:
    """The values of cache_seqlens where reading them costs no host sync (an int, a CPU tensor):
    >= 0 and the sequence's L (cache_seqlens + T with new keys) at most the cache's R rows."""
    if is_int(cache_seqlens):
        lo = hi = cache_seqlens
    elif cache_seqlens.device.type == "cpu" and cache_seqlens.numel():
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
    else:
        return
    if lo < 0:
        raise ValueError(f"cache_seqlens must be >= 0 (the tokens cached), got {lo}")
    end = hi + (s.T if s.appended else 0)
    if end > s.R:
        raise ValueError(
            f"cache_seqlens runs past the cache: a sequence reaches {end} tokens"
            f"{f' with the T = {s.T} new ones' if s.appended else ''}, but k_cache has R = "
            f"{s.R} rows")


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None,
                           causal: bool = True, sm_scale=None, eps: float = DEFAULT_EPS):
    """Spherical attention of T new tokens per sequence against KV caches (the module
    docstring: shapes, the visible rows, what is checked). k, v given: written into the caches
    in place first, at rows cache_seqlens[b] + t. Returns (out [B, T, Hq, D], r [B, Hq, T]).
    Inference only: inputs that require grad (with grad enabled) raise ValueError."""
    as_int = is_int(cache_seqlens)
    s = _remembered(q, k_cache, v_cache, 0 if as_int else cache_seqlens, k, v, causal,
                    sm_scale, eps)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k_cache, v_cache, k, v)):
        raise ValueError("attention_with_kvcache is inference only and its inputs require grad: "
                         "call it under torch.no_grad() or with detached tensors (the "
                         "differentiable path is altattn.spherical.attention)")
    check_lengths(cache_seqlens, s)
    if q.device.type != "cpu":  # not part of `setup`: no function of the shapes
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not c.is_contiguous() or c.data_ptr() % 16:
                raise ValueError(f"{name} must be contiguous with a 16-byte aligned start: it "
                                 f"is written in place, so it cannot be copied into shape")
    lens = (torch.full((s.B,), cache_seqlens, dtype=torch.int32, device=q.device) if as_int
            else cache_seqlens)
    if q.device.type == "cpu":
        return _reference_step(q, k_cache, v_cache, lens, k, v, s)
    out = torch.empty(s.B, s.T, s.Hq, s.D, dtype=torch.bfloat16, device=q.device)
    r = torch.empty(s.B, s.Hq, s.T, dtype=torch.float32, device=q.device)
    if s.B == 0:
        return out, r
    from kernels_triton.spherical.decode import prepare
    run = prepare(s.B, s.T, s.Hq, s.Hk, s.D, s.R, s.appended, s.causal, q.device.index)
    new = (dense_aligned(k), dense_aligned(v)) if s.appended else (None, None)
    on_device(q.device, run, dense_aligned(q), k_cache, v_cache, dense_aligned(lens), *new,
              out, r, s.sm_scale, s.eps)
    if s.appended:  # written by a kernel, behind autograd's back (as copy_ would show)
        for c in (k_cache, v_cache):
            torch.autograd.graph.increment_version(c)
    return out, r


def visible_rows(lens: Tensor, T: int, R: int, appended: bool, causal: bool) -> Tensor:
    """bool [B, T, R]: may new token t of sequence b see cache row x (the module docstring)."""
    L = (lens.long() + (T if appended else 0)).clamp(0, R)[:, None, None]
    t = torch.arange(T, device=lens.device)[None, :, None]
    x = torch.arange(R, device=lens.device)[None, None, :]
    return (x < L - T + 1 + t) & (x < L) if causal else (x < L).expand(-1, T, -1)


def reference_with_kvcache(q, k_cache, v_cache, lens: Tensor, appended: bool, causal: bool,
                           sm_scale: float, eps: float, dtype=torch.float64):
    """(out [B, T, Hq, D], r [B, Hq, T]) in `dtype`, the math over the visible cache rows:
    s = c q . k, r = ||s||, out = sum s v / (r + eps)."""
    B, T, Hq, D = q.shape
    R, Hk = k_cache.shape[1], k_cache.shape[2]
    qg = q.to(dtype).view(B, T, Hk, Hq // Hk, D)        # query head h = kv head * G + g
    s = sm_scale * torch.einsum("btkgd,bxkd->bkgtx", qg, k_cache.to(dtype))
    s = s.masked_fill(~visible_rows(lens, T, R, appended, causal)[:, None, None], 0.0)
    r = s.square().sum(-1).sqrt()                                   # [B, Hk, G, T]
    out = torch.einsum("bkgtx,bxkd->btkgd", s, v_cache.to(dtype)) / (
        r + eps).permute(0, 3, 1, 2)[..., None]
    return out.reshape(B, T, Hq, D), r.reshape(B, Hq, T)


def _reference_step(q, k_cache, v_cache, lens, k, v, s: Setup):
    """The CPU path: the new rows written into the caches (positions inside the cache), then
    the fp64 reference; out in q's dtype, r fp32 (fp64 for fp64 inputs)."""
    if s.appended:
        pos = lens.long()[:, None] + torch.arange(s.T)
        ok = (pos >= 0) & (pos < s.R)
        b = torch.arange(s.B)[:, None].expand_as(pos)
        k_cache[b[ok], pos[ok]] = k[ok].to(k_cache.dtype)
        v_cache[b[ok], pos[ok]] = v[ok].to(v_cache.dtype)
    out, r = reference_with_kvcache(q, k_cache, v_cache, lens, s.appended, s.causal,
                                    s.sm_scale, s.eps)
    return out.to(q.dtype), r.to(torch.promote_types(q.dtype, torch.float32))


__all__ = ["attention_with_kvcache", "reference_with_kvcache", "visible_rows"]

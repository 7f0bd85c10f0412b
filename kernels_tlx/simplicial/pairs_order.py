"""`tlx_pairs_ordered`'s order (`tlx_pairs`' kernel with ORDERED: kernels_tlx/simplicial/
bwd_pairs.py's `variant`): every program reduce-adds its share of a 64-row dQ box after the
programs before it in launch order have added theirs, so the fp32 sums are bitwise repeatable
with the same bytes as the unordered adds (integer sums in any order would double them, and the
unordered adds already move about half of what L2 reduces at its rate: docs/perf-bwd-ordered.md);
and the end's dK/dV sums in int64 fixed point (`end_scale`), which commute.

The order is the launch order: programs of one (b, g) as key block m, then j (fastest), then the
remainder launch's groups. A program visits its tokens from the last down (`visit`), so the next
in order (j + 1, one launch later) reaches a token one launch gap plus a token's time after this
one (ascending visits would bring it first). Each box and consumer half has a counter (zeroed per
call); a program's rank at a box is the number of programs before it there. A consumer spins
until the counter holds its rank (`acquire_at`), issues its reduce-add, and counts up once the
add has landed (`release`, one tile later: the bulk group's wait then finds it complete).
No memory fences (with them it ran 0.62x of `tlx_pairs` at S*, without 0.90x): the order is
causal. The count is written after the bulk group's wait returned, the add performed in L2, and
the next program issues its add only after its load saw the count (behind a branch on it); both
adds are performed at the same L2 slice.

Ranks come from two host tables per (N, w1, w2, key blocks, pack) (`order_tables`): base[r, i]
(r: a full program's key block m, or n_kb for the remainder launch) and off[m, j], with
rank = base[r, i] + off[m, j] (a remainder group q's off is q)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels_tlx.simplicial.common import bulk_wait, fresh


@triton.jit
def visit(u, n_tiles, ORDERED: tl.constexpr):
    """The tile a program takes u-th: its tiles from the last down (ORDERED), else in order."""
    if ORDERED:
        return n_tiles - 1 - u
    else:
        return u


@triton.jit
def rank_of(Base, Off, j, i, N, n_kb, PACK: tl.constexpr):
    """This program's rank at token i's boxes, from the tables read per tile (from a volatile
    copy of the program id: hoisted out of the tile loop, its offset was held there and spilled)."""
    if PACK:
        return tl.load(Base + n_kb * N + i) + j // PACK
    else:
        mj = fresh(tl.program_id(0)) % (n_kb * N)  # m * N + j (`pair_program`'s ORDERED grid)
        return tl.load(Base + (mj - j) + i) + tl.load(Off + mj)


@triton.jit
def acquire_at(Flags, row, cid, Base, Off, j, i, N, n_kb, PACK: tl.constexpr):
    """Spin until consumer cid's counter of the dQ box at `row` (its first row of [B * N * HQ])
    holds this program's rank (`rank_of`, read again at each poll: held, it spilled). No fence
    after it (module docstring: the order is causal)."""
    while tl.load(box_flag(Flags, row, cid), volatile=True) < rank_of(Base, Off, j, i, N, n_kb,
                                                                       PACK):
        pass


@triton.jit
def release(flag, PENDING: tl.constexpr):
    """Count `flag` up (thread 0 of the warp group) once every bulk group but the last PENDING
    has landed (the TMA issuer's wait, then its warp's barrier: the issuer is in warp 0)."""
    bulk_wait(PENDING)
    tl.inline_asm_elementwise("bar.warp.sync -1; mov.b32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)
    tl.atomic_add(flag, 1, sem="relaxed", scope="gpu")


@triton.jit
def box_flag(Flags, row, cid):
    """Consumer cid's counter of the 64-row dQ box from `row` (its first row of [B * N * HQ], the
    TMA box's int32 row; G >= 64)."""
    return Flags + (row // 64) * 2 + cid


def _tables(N: int, w1: int, w2: int, n_kb: int, pack: int, device) -> tuple:
    """The rank tables (module docstring) as int32 tensors on `device`, built there by torch
    ops (no copy from the host, so a CUDA graph may capture them)."""
    j = torch.arange(N, device=device)
    k_lo = torch.clamp(j + 1, min=w2) - w2
    k_hi = torch.clamp(j + w1, max=N) - 1
    lo = torch.clamp(j - w1 + 1, min=0)  # token i's first j (i = j here as an index)
    base = torch.zeros((n_kb + 1, N), dtype=torch.int64, device=device)
    off = torch.zeros((max(n_kb, 1), N), dtype=torch.int64, device=device)
    before = torch.zeros(N, dtype=torch.int64, device=device)  # from the key blocks before
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    for m in range(n_kb):
        live = (k_lo + 128 * m <= k_hi).long()  # pair_program's `live`
        prefix = torch.cat([zero, torch.cumsum(live, 0)])  # live j' < t
        off[m] = prefix[:N]
        base[m] = before - prefix[lo]
        before = before + prefix[j + 1] - prefix[lo]
    if pack:  # group q: tokens q * pack .. min(min(q * pack + pack - 1, N - 1) + w1, N) - 1
        q = torch.arange(triton.cdiv(N, pack), device=device)
        tok_end = torch.clamp(torch.clamp(q * pack + pack - 1, max=N - 1) + w1, max=N)
        # the first group whose tokens reach token i
        base[n_kb] = before - torch.searchsorted(tok_end, j, right=True)
    return base.int(), off.int()


_TABLES: dict = {}


def order_tables(N: int, w1: int, w2: int, n_kb: int, pack: int, device) -> tuple:
    """`_tables`, built on the first call and kept (never freed: a CUDA graph may read them at
    every replay); a first call under CUDA-graph capture builds them in the graph and does not
    keep them (kernels_triton/simplicial/det.py's rule for its tables)."""
    key = (N, w1, w2, n_kb, pack, torch.device(device))
    tables = _TABLES.get(key)
    if tables is None:
        with torch.inference_mode(False):
            tables = _tables(*key)
        if not (key[-1].type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _TABLES[key] = tables
    return tables


def order_args(spec, n_kb: int, pack: int, q, k1, k2, v1, v2, dout, lse, dlse) -> dict:
    """The ORDERED kernel's arguments of one call: the dQ boxes' counters (two per 64 rows,
    zeroed), the rank tables (n_kb full key blocks, remainder groups of `pack`) and the end's
    scale (`end_scale`)."""
    base, off = order_tables(spec.N, spec.w1, spec.w2, n_kb, pack, q.device)
    flags = torch.zeros(spec.B * spec.N * spec.Hq // 32, dtype=torch.int32, device=q.device)
    return dict(Flags=flags, Base=base, Off=off,
                Scale=end_scale(spec, q, k1, k2, v1, v2, dout, lse, dlse))


SCALE_BITS = 61  # a bound maps to at most 2**61: two bits below int64's range
SCALE_EXP = 100  # scales from 2**-100 to 2**100 (fp32)


def _amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| per batch element (dim 0) in float64 (no |t| copy); NaN where one holds a NaN."""
    lo, hi = torch.aminmax(t.flatten(1), dim=1)
    return torch.maximum(hi.double(), -lo.double())


def end_scale(spec, q, k1, k2, v1, v2, dout, lse, dlse) -> torch.Tensor:
    """[s, 1 / s per batch element] (fp32, B + 1 values on the inputs' device; no host sync): the
    power of two the end's dK/dV sums are taken in, as int64 llrint(s * value), so that every
    sum and partial sum stays within 2**SCALE_BITS; s from the bounds of the batch elements
    whose inputs are finite. 1 / s is NaN for a batch element with a non-finite input (LSE and
    dLSE too; its int64 sums are then garbage, in its own rows only) or a bound over
    2**(SCALE_BITS + SCALE_EXP): its dK and dV come out NaN, the other elements' as they would
    alone. The bounds (D the head dim, G = Hq / Hk, sums before sm_scale): |dP| = |dO . C| <=
    D max|dO| 2 max|V1| max|V2| (C = bf16(V1[j] V2[k])); a dK1 or dK2 row sums K times dS^T Q
    over at most G max(w1, w2) rows, each row's P summing to 1 and |dP - Delta| <= 2 max|dP| +
    max|dLSE| (Delta = rowsum(dO * O) - dLSE); dV likewise with P dO; each doubled once for the
    roundings; and at least max|K|, max|V| times 2**-64, so that s times a K1 or V1 row (the
    kernel's first product) stays below 2**125."""
    mq, mk1, mk2, mv1, mv2, mdo = m = [_amax(t) for t in (q, k1, k2, v1, v2, dout)]
    m += [_amax(t) for t in (lse, dlse) if t is not None]
    mdlse = _amax(dlse) if dlse is not None else 0.0
    dp = spec.D * mdo * (2 * mv1 * mv2)
    rows = spec.G * max(spec.w1, spec.w2)
    keys, values = torch.maximum(mk1, mk2), torch.maximum(mv1, mv2)
    bound = 2 * torch.maximum(rows * keys * mq * (2 * dp + mdlse), rows * values * mdo)  # [B]
    # (not below the K1 and V1 rows' 2**-64: the kernel multiplies them by s first)
    bound = torch.maximum(bound, torch.maximum(keys, values) * 2.0 ** -64)
    finite = torch.isfinite(torch.stack(m)).all(0) & torch.isfinite(bound)
    top = torch.where(finite, bound, 0.0).max()
    s = torch.exp2((SCALE_BITS - torch.ceil(torch.log2(top))).clamp(-SCALE_EXP, SCALE_EXP))
    ok = finite & (bound * s <= 2.0 ** SCALE_BITS)
    return torch.cat([s.view(1), torch.where(ok, 1 / s, math.nan)]).float()


def from_fixed(acc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An int64 sum [B, ...] of `end_scale`'s fixed point back to fp32: acc / s (NaN for a batch
    element whose inputs were not finite)."""
    inv = scale[1:].double().view(-1, *([1] * (acc.dim() - 1)))
    return (acc.double() * inv).float()

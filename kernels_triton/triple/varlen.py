"""Triple attention over packed sequences on the kernels: one pass over all the sequences (B = 1,
T tokens, [1, T, H, D] views of the packed [T, H, D] tensors), no state crossing a sequence's
start, no host read of cu_seqlens (a CUDA graph can capture a call).

The dense passes (fwd.py, bwd.py, causal.py) with three changes, each a small device-side map made
from cu_seqlens by a few torch ops per call (`build_maps`):
- `partials` programs take splits of one sequence each (`Maps.splits`: start, end and, for the
  TLX kernel's padded copy of X1, pstart), longest first (a grid of cdiv(T, L) + n splits per
  head; those past the last have no tokens and write zeros). Non-causal, a split is at most L
  tokens (`split_len`: the fewest that still give about one CTA per multiprocessor); causal, L
  is causal.CHUNK, the intra tiles' chunk, so chunks start at each sequence's start.
- core.scan_kernel (host.prepare_scan, with Seg and Slot) sums each sequence's splits in order
  (the state, dS), or walks them as exclusive prefix sums (causal: the state each chunk reads,
  from initial_state / c) or suffix sums (dS of later chunks, from dstate), and writes the bf16
  slabs `apply` reads in the same pass: bitwise repeatable, no atomics.
- `apply` and the intra kernels take tiles of rows of one sequence (`Maps.tiles`: row0, chunk
  start, end, slab, sequence; grid (tiles, H), cdiv(T, 128) + n tiles a head at most), read
  their sequence's (or chunk's) slab and scale c by their sequence's (`Maps.scale`: 1/length
  for scale=None), and store only rows of their sequence.
Every other kernel and all tile configs are the dense ones. Extra memory as the dense passes',
with P [1, H, C, Dq, Dv, Dq] fp32 over C = cdiv(T, L) + n splits.

Isolation: rows of a neighbouring sequence that a tile or a TMA box reads past a sequence's end
are masked out or multiplied by exact zeros, so finite values never mix; an inf or NaN in one
sequence's inputs may reach its neighbours' outputs (0 * inf) where the kernels read it so.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from kernels_triton.launch import Kernel, sm_count
from kernels_triton.triple import host, intra
from kernels_triton.triple.causal import CHUNK

BN = 64                       # the unit of a split's padded length (partials' step)
ROWS = host.BLOCK_M           # rows per tile of `apply`, and of the intra row owners
Tensor = torch.Tensor


@dataclass
class Maps:
    """The device maps of one call (int32 unless said; module docstring)."""

    splits: Tensor          # [C, 3] (start, end, pstart), in launch order (longest first)
    seg: Tensor             # [n + 1]: sequence s's splits are seg[s] .. seg[s+1] - 1 in order
    slot: Tensor            # [C]: the launch position (P's split index) of each in-order split
    runs: Tensor            # [NP / BN]: the split whose padded runs hold each run (TLX copy)
    scale: Tensor           # fp32 [n]: each sequence's c
    tiles: dict             # name -> [G, 5] (row0, chunk start, end, slab, sequence)


def _cdiv(a, b):
    return (a + b - 1) // b


def _tiles(cu, lens, seg, slot, n: int, block: int, G: int, L: int, order: str | None):
    """[G, 5] int32 tiles of `block` rows of one sequence (and of one chunk of L rows; L = 0: the
    whole sequence, slab = the sequence; else slab = the chunk's split), in order of their rows
    (the tiles of a chunk together: they read one slab, one chunk's keys, from L2), or for
    order "rows" each chunk's last tile first (the most key blocks, as intra._row_tile);
    unused tiles are zeros, last."""
    nt = _cdiv(lens, block)
    inc = nt.cumsum(0)
    t = torch.arange(G, device=cu.device)
    seq = torch.searchsorted(inc, t, right=True).clamp_(max=n - 1)
    valid = t < inc[-1]
    row0 = cu[seq] + (t - inc[seq] + nt[seq]) * block
    off = row0 - cu[seq]
    if L:
        c0 = row0 - off % L
        hi = torch.minimum(c0 + L, cu[seq + 1])
        slab = slot[(seg[seq] + off // L).clamp_(max=slot.numel() - 1)]
    else:
        c0, hi, slab = cu[seq], cu[seq + 1], seq
    out = torch.stack((row0, c0, hi, slab, seq), 1) * valid[:, None]
    if order == "rows":  # by chunk, then by decreasing row; unused ones last
        key = torch.where(valid, c0 * (2 * L) + L - (row0 - c0), torch.iinfo(torch.int64).max)
        out = out[torch.argsort(key, stable=True)]
    return out.int().contiguous()


def build_maps(cu_seqlens: Tensor, scale: float | None, T: int, n: int, L: int, C: int, R: int,
               tiles: dict) -> Maps:
    """The maps of packed sequences at cu_seqlens (int32 [n + 1], on the device; n >= 1, T >= 1)
    cut in splits of at most L tokens (C >= cdiv(T, L) + n rows), R runs of the padded copy of
    X1 (0: none), c = scale or each sequence's 1/length, and tiles {name: (block, G, chunked,
    order)} (`_tiles`)."""
    dev = cu_seqlens.device
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    nc = _cdiv(lens, L)
    inc = nc.cumsum(0)
    seg = torch.cat((inc.new_zeros(1), inc))
    g = torch.arange(C, device=dev)
    seq = torch.searchsorted(inc, g, right=True).clamp_(max=n - 1)
    valid = g < inc[-1]
    start = cu[seq] + (g - seg[seq]) * L
    end = torch.minimum(start + L, cu[seq + 1])
    start, end = start * valid, end * valid
    order = torch.argsort(end - start, descending=True, stable=True)
    slot = torch.empty_like(order)
    slot[order] = g
    plen = _cdiv(end[order] - start[order], BN) * BN
    pend = plen.cumsum(0)
    splits = torch.stack((start[order], end[order], pend - plen), 1).int().contiguous()
    runs = torch.searchsorted(pend, torch.arange(R, device=dev) * BN, right=True)
    if scale is None:
        c = (1.0 / lens.clamp(min=1).double()).float()
    else:
        c = torch.full((n,), scale, dtype=torch.float32, device=dev)
    made = {name: _tiles(cu, lens, seg, slot, n, block, G, L if chunked else 0, how)
            for name, (block, G, chunked, how) in tiles.items()}
    return Maps(splits, seg.int(), slot.int(), runs.clamp_(max=C - 1).int(), c, made)


def split_len(T: int, H: int, d1: int, dy: int, d2: int, impl, causal: bool) -> int:
    """L: tokens per split. Causal: causal.CHUNK. Otherwise the fewest tokens (a multiple of BN)
    that still make about one `partials` CTA per multiprocessor if all T were one sequence; with
    many sequences that is each sequence whole (as a dense batch: no more partials than it)."""
    if causal:
        return CHUNK
    ctas = H * impl.split_blocks(d1, dy, d2)
    return max(BN, _cdiv(_cdiv(T * ctas, sm_count()), BN) * BN)


class Plan:
    """The launches of packed problems of one (T, n, H, Dq, Dv, causal, impl), made once
    (`plan`): forward(...) and backward(...), module docstring."""

    def __init__(self, T: int, n: int, H: int, Dq: int, Dv: int, causal: bool, impl):
        self.T, self.n, self.H, self.Dq, self.Dv, self.causal = T, n, H, Dq, Dv, causal
        self.L = L = split_len(T, H, Dq, Dv, Dq, impl, causal)
        self.C = C = _cdiv(T, L) + n
        NP = impl.padded_varlen(T, C) if hasattr(impl, "padded_varlen") else 0
        self.R = NP // BN
        self.partials = impl.prepare_partials_varlen(T, H, Dq, Dv, Dq, C)
        G = _cdiv(T, ROWS) + n
        self.tile_specs = {"apply": (ROWS, G, causal, None)}
        # slabs: causal [1, H, C] (one per split), else [n, H]; (w_head, w_chunk) in slabs
        slabs, (w_head, w_chunk) = (H * C, (C, 1)) if causal else (n * H, (1, H))

        def apply(dx, dy, do):
            return impl.prepare_apply_varlen(T, H, dx, dy, do, 1.0, G, slabs * dy * dx, w_head,
                                             w_chunk)
        (fwd_dims,) = host.apply_dims(Dq, Dv, "fwd")
        self.apply_fwd = apply(*fwd_dims)
        self.apply_bwd = [apply(*d) for d in host.apply_dims(Dq, Dv, "bwd")]
        self.scans = {m: host.prepare_scan(n * H, Dq, Dv, Dq, m, H)
                      for m in (host.SUM, host.PREFIX, host.SUFFIX)}
        self.slabs_of = host.prepare_slabs(n, H, Dq, Dv, Dq, ("jki", "ijk"))  # of a state
        if causal:
            self._prepare_intra(T, n, H, Dq, Dv)

    def _prepare_intra(self, T, n, H, Dq, Dv) -> None:
        cfg = intra.config(Dq, Dv)
        assert cfg["fwd"]["BLOCK_M"] == ROWS == cfg["dq"]["BLOCK_M"], cfg
        keys = cfg["dkdv"]["BLOCK_N"]
        self.tile_specs["rows"] = (ROWS, _cdiv(T, ROWS) + n, True, "rows")
        self.tile_specs["keys"] = (keys, _cdiv(T, keys) + n, True, None)
        self.intra = {}
        # descriptors: Q1, Q2, K1, K2, V (and DO), the forward's inter tensor; the backward's
        # inter gradients by pointer (PTR: fbtriton's C dispatcher takes at most 8 descriptors
        # and 62 parameters, a 3-D descriptor being 7: launch.py)
        for name, (fn, widths, ptr) in {"fwd": (intra._fwd_kernel, "qqQQVv", False),
                                        "dq": (intra._dq_kernel, "qqQQVv", True),
                                        "dkdv": (intra._dkdv_kernel, "qqQQVv", True)}.items():
            f = cfg[name]
            tiles = self.tile_specs["keys" if name == "dkdv" else "rows"]
            kernel = Kernel(fn, (tiles[1], H), DQ=Dq, DV=Dv, **({"PTR": True} if ptr else {}),
                            **intra._launch_args(f))
            descs = [intra.layout(1, T, H, Dq if w in "qQ" else Dv,
                                  f["BLOCK_M"] if w.islower() else f["BLOCK_N"]) for w in widths]
            self.intra[name] = (kernel, descs)

    def maps(self, cu_seqlens: Tensor, scale: float | None) -> Maps:
        return build_maps(cu_seqlens, scale, self.T, self.n, self.L, self.C, self.R,
                          self.tile_specs)

    def _scan(self, mode, P, maps, S=None, slabs=None, S0=None, cs=None) -> None:
        self.scans[mode](P, self.C, 1.0, S, slabs, S0, cs, maps.seg, maps.slot)

    def _slabs(self, lead, orders, like: Tensor) -> dict:
        return host.new_slabs(lead, orders, self.Dq, self.Dv, self.Dq, like.device)

    def _state(self, like: Tensor) -> Tensor:
        return torch.empty((self.n, self.H, self.Dq, self.Dv, self.Dq), device=like.device,
                           dtype=torch.float32)

    def _run_intra(self, name, tensors, outs, tiles, cs) -> None:
        kernel, descs = self.intra[name]
        kernel(*[d(t) for d, t in zip(descs, tensors)], *tensors[len(descs):], *outs, self.T,
               self.H, CHUNK, 1.0, Tiles=tiles, CS=cs)

    def forward(self, q1, q2, k1, k2, v, maps: Maps, initial_state=None):
        """(out [1, T, H, Dv] bf16, state [n, H, Dq, Dv, Dq] fp32) of [1, T, H, D] bf16 inputs
        (contiguous) cut as `maps` says (self.maps(cu_seqlens, scale)); initial_state [n, H,
        Dq, Dv, Dq] fp32 or None."""
        tiles = maps.tiles["apply"]
        out = torch.empty((1, self.T, self.H, self.Dv), device=q1.device, dtype=torch.bfloat16)
        state = self._state(q1)
        P = self.partials(k1, v, k2, maps)
        if not self.causal:
            W = self._slabs((self.n, self.H), ("ikj",), q1)
            self._scan(host.SUM, P, maps, state, W, initial_state, maps.scale)
            del P
            self.apply_fwd(q2, q1, W["ikj"], out, tiles)
            return out, state
        W = self._slabs((1, self.H, self.C), ("ikj",), q1)  # each chunk's exclusive prefix
        self._scan(host.PREFIX, P, maps, state, W, initial_state, maps.scale)
        del P
        inter = torch.empty(out.shape, device=out.device, dtype=torch.float32)
        self.apply_fwd(q2, q1, W.pop("ikj"), inter, tiles, maps.scale)
        self._run_intra("fwd", (q1, q2, k1, k2, v, inter), (out,), maps.tiles["rows"],
                        maps.scale)
        return out, state

    def backward(self, q1, q2, k1, k2, v, maps: Maps, state, dout, dstate=None,
                 initial_state=None):
        """(dq1, dq2, dk1, dk2, dv) bf16 [1, T, H, D], and initial_state's gradient [n, H, Dq,
        Dv, Dq] fp32 as a sixth where initial_state is given; dout [1, T, H, Dv] bf16, dstate
        fp32 or None, state the forward's (non-causal: read; causal: made again)."""
        grads = [torch.empty(t.shape, device=t.device, dtype=torch.bfloat16)
                 for t in (q1, q2, k1, k2, v)]
        dinit = None if initial_state is None else self._state(q1)
        xs, ys = (q2, dout, k2, v, k2), (dout, q1, v, k1, k1)
        orders = ("jki", "ijk", "jki", "ijk", "ikj")
        tiles = maps.tiles["apply"]
        if not self.causal:
            dS = dinit if dinit is not None else self._state(q1)
            dW = self._slabs((self.n, self.H), orders[2:], q1)
            self._scan(host.SUM, self.partials(q1, dout, q2, maps), maps, dS, dW, dstate)
            W = self.slabs_of(state)
            slabs = [W["jki"], W["ijk"], dW["jki"], dW["ijk"], dW["ikj"]]
            for i, (apply, x, y, w, g) in enumerate(zip(self.apply_bwd, xs, ys, slabs, grads)):
                apply(x, y, w, g, tiles, None if i < 2 else maps.scale)
            return (*grads, dinit) if dinit is not None else tuple(grads)
        inter = [torch.empty(g.shape, device=g.device, dtype=torch.float32) for g in grads]
        W = self._slabs((1, self.H, self.C), orders[:2], q1)  # the prefixes: dQ1's, dQ2's
        P = self.partials(k1, v, k2, maps)
        self._scan(host.PREFIX, P, maps, None, W, initial_state, maps.scale)
        del P
        for i in range(2):
            self.apply_bwd[i](xs[i], ys[i], W.pop(orders[i]), inter[i], tiles, maps.scale)
        W = self._slabs((1, self.H, self.C), orders[2:], q1)  # the suffixes: dK1's, dK2's, dV's
        dP = self.partials(q1, dout, q2, maps)
        self._scan(host.SUFFIX, dP, maps, dinit, W, dstate)
        del dP
        for i in range(2, 5):
            self.apply_bwd[i](xs[i], ys[i], W.pop(orders[i]), inter[i], tiles, maps.scale)
        x = (q1, q2, k1, k2, v, dout)
        self._run_intra("dkdv", (*x, *inter[2:]), grads[2:], maps.tiles["keys"], maps.scale)
        self._run_intra("dq", (*x, *inter[:2]), grads[:2], maps.tiles["rows"], maps.scale)
        return (*grads, dinit) if dinit is not None else tuple(grads)


@functools.lru_cache(maxsize=256)
def plan(T: int, n: int, H: int, Dq: int, Dv: int, causal: bool, impl_name: str,
         device_index: int) -> Plan:
    """The Plan of these shapes for the kernels of `impl_name` ("kernels_triton.triple.host":
    Triton, "kernels_tlx.triple.contractions": TLX), made once per device."""
    import importlib
    with torch.cuda.device(device_index):
        return Plan(T, n, H, Dq, Dv, causal, importlib.import_module(impl_name))


# ---- compile configs (tools.resources; CI compiles them for sm_90a without a GPU) ----------

def _meta_maps(plan: Plan) -> Maps:
    """Maps of the plan's sizes as meta tensors (a recorded run reads none)."""
    from kernels_triton.launch import meta
    i32 = torch.int32
    return Maps(meta(plan.C, 3, dtype=i32), meta(plan.n + 1, dtype=i32), meta(plan.C, dtype=i32),
                meta(max(plan.R, 1), dtype=i32), meta(plan.n, dtype=torch.float32),
                {k: meta(G, 5, dtype=i32) for k, (_, G, _, _) in plan.tile_specs.items()})


def compile_configs(impl) -> list:
    """Each distinct kernel launch of a packed forward and backward with an initial state and a
    dstate (recorded on meta tensors), causal and not, at Dq = Dv = 32, 64, 128 and Dq 64 Dv 32,
    for the kernels of `impl` (host: Triton; kernels_tlx.triple.contractions: TLX)."""
    from kernels_triton.launch import compile_configs as configs_of
    from kernels_triton.launch import meta
    T, H, n, out, seen = host.COMPILE_N, host.COMPILE_H, 4, [], set()
    for Dq, Dv in ((32, 32), (64, 64), (128, 128), (64, 32)):
        for causal in (False, True):
            def run(plan):
                x = [meta(1, T, H, d) for d in (Dq, Dq, Dq, Dq, Dv)]
                maps, state = _meta_maps(plan), meta(n, H, Dq, Dv, Dq, dtype=torch.float32)
                plan.forward(*x, maps, state)
                plan.backward(*x, maps, state, meta(1, T, H, Dv), state, state)

            tag = f"D{Dq}x{Dv}{'_causal' if causal else ''}"
            for c in configs_of(lambda: functools.partial(run, Plan(T, n, H, Dq, Dv, causal, impl)),
                                (), lambda launch: f"varlen_{launch.fn.__name__}_{tag}"):
                if c.key() not in seen:
                    seen.add(c.key())
                    out.append(c)
    names: dict = {}  # one kernel's launches of a tag numbered: _2, _3, ...
    for i, c in enumerate(out):
        names[c.name] = names.get(c.name, 0) + 1
        if names[c.name] > 1:
            out[i] = dataclasses.replace(c, name=f"{c.name}_{names[c.name]}")
    return out

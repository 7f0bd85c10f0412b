"""The host side of the plain-Triton triple-attention kernels: `supports`, the tile configs, the
launches of core.py (`prepare_partials`, `prepare_apply`: made once per shape, run per call; the
passes take them from an `impl`, this module or kernels_tlx/triple/contractions.py; and
`prepare_scan`, one pass over the partials or causal chunk states that writes the state and the
bf16 slabs `apply` reads; `prepare_state`, the forward's), `slab` (a torch copy, the pieces'),
and the compile configs tools.resources compiles for sm_90a.

Extra memory (beyond inputs and outputs): the split-N partials, n_splits * B * H * Dq^2 * Dv fp32
(n_splits fills the GPU: 4 at T2), and bf16 copies of the state in the layouts `apply` reads,
B * H * Dq^2 * Dv each. Causal passes keep one state per chunk instead (causal.py).
"""
from __future__ import annotations

import sys

import torch
import triton

from altattn.registry import CompileConfig
from kernels_triton.launch import Desc, Kernel, meta, sm_count
from kernels_triton.launch import compile_configs as compile_configs_of
from kernels_triton.proton import profiled
from kernels_triton.triple.core import (
    PREFIX,
    SUFFIX,
    SUM,
    apply_kernel,
    partials_kernel,
    scan_kernel,
)

SUPPORTED_DIMS = (32, 64, 128)
BLOCK_N = 64      # tokens per step of `partials` (the GEMM's K)
BLOCK_M = 128     # tokens per tile of `apply`
WAVES = 4         # `partials` programs per multiprocessor the split count aims at
KERNELS = ("partials", "apply")  # a pass's Proton-scoped kernels, by the name `profile` takes


def supports(spec) -> str | None:
    """Shapes every triple kernel takes: Dq and Dv in SUPPORTED_DIMS; any B, N, H; causal."""
    for name, d in (("Dq", spec.Dq), ("Dv", spec.Dv)):
        if d not in SUPPORTED_DIMS:
            return f"{name} = {d} not in {SUPPORTED_DIMS}"
    return None


def partials_config(d1: int, dy: int, d2: int) -> dict:
    """BI values of i per program: A has BI * DY rows, B = X2; the accumulator [BI * DY, D2] at
    most 128 fp32 registers per thread over 8 warps, BI <= 8 (the best measured at T1 and T2,
    docs/perf-triple.md)."""
    return {"BI": max(1, min(d1, 8, 32768 // (dy * d2))), "BN": BLOCK_N, "num_warps": 8,
            "num_stages": 4 if dy * d2 <= 64 * 64 else 3}


def apply_config(dx: int, dy: int, do: int) -> dict:
    """One warp group of 128 rows (two at D = 128: 4 warps spill), W by TMA two slabs ahead
    (pointer loads of W gave wrong results under Triton's software pipeline: docs/perf-triple.md)."""
    return {"BM": BLOCK_M, "num_warps": 8 if dx * do > 64 * 128 else 4, "num_stages": 2}


def split_blocks(d1: int, dy: int, d2: int) -> int:
    """`partials` programs per split and head (blocks of BI values of i)."""
    return d1 // partials_config(d1, dy, d2)["BI"]


def partials_warps(d1: int, dy: int, d2: int) -> int:
    return partials_config(d1, dy, d2)["num_warps"]


def apply_warps(dx: int, dy: int, do: int, chunk: int) -> int:
    return apply_config(dx, dy, do)["num_warps"]


def apply_dims(Dq: int, Dv: int, pass_: str) -> tuple[tuple[int, int, int], ...]:
    """(dx, dy, do) of each `apply` a pass launches: the forward's out from (Q2, Q1, S); the
    backward's dQ1, dQ2, dK1, dK2, dV (bwd.prepare_gradients, in that order)."""
    if pass_ == "fwd":
        return ((Dq, Dq, Dv),)
    return ((Dq, Dv, Dq), (Dv, Dq, Dq), (Dq, Dv, Dq), (Dv, Dq, Dq), (Dq, Dq, Dv))


def profiled_kernels(spec, pass_: str, impl=None) -> dict[str, int]:
    """The pass's Proton-scoped kernels, by the name `profile` takes (one Proton session each,
    sampling its warps), with their warps per CTA: `partials`, and the pass's applies (the
    fewest warps among them: every apply must have the warps sampled). impl: the module whose
    kernels run (fwd.prepare's; default this one)."""
    impl = impl or sys.modules[__name__]
    chunk = 1 if spec.causal else 0  # causal: chunked slabs (causal.py)
    from kernels_triton.triple import short
    # short.py's one-launch state: this module's `partials` whatever the impl
    mine = pass_ == "fwd" and short.takes(spec) and spec.N <= short.ONE_PASS_N
    return {"partials": (partials_warps if mine else impl.partials_warps)(spec.Dq, spec.Dv,
                                                                        spec.Dq),
            "apply": min(impl.apply_warps(dx, dy, do, chunk)
                         for dx, dy, do in apply_dims(spec.Dq, spec.Dv, pass_))}


def scoped(profile: bool | str, kernel: str) -> bool:
    """Whether `kernel` ("partials" or "apply") runs its Proton-scoped copy under `profile`."""
    return profiled(profile, kernel, KERNELS)


def n_splits(B: int, N: int, H: int, d1: int, dy: int, d2: int) -> int:
    """Splits of N for `partials`: about WAVES programs per multiprocessor of the current GPU, each
    at least one BLOCK_N step. A function of the shape and the device only (results are bitwise
    repeatable)."""
    tiles = B * H * (d1 // partials_config(d1, dy, d2)["BI"])
    want = triton.cdiv(WAVES * sm_count(), max(tiles, 1))
    return max(1, min(want, triton.cdiv(N, BLOCK_N)))


def partials_launch(programs: int, H: int, d1: int, dy: int, d2: int,
                    profile: bool = False) -> Kernel:
    """core.partials_kernel's launch over `programs` (splits x heads x blocks of i) with its
    config (`partials_config`)."""
    cfg = partials_config(d1, dy, d2)
    return Kernel(partials_kernel, (programs,), H=H, D1=d1, DY=dy, D2=d2, BI=cfg["BI"],
                  BN=cfg["BN"], PROFILE=bool(profile), num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])


def prepare_partials(B: int, N: int, H: int, d1: int, dy: int, d2: int, splits: int,
                     split_len: int | None = None, profile: bool = False):
    """The `partials` launch of these shapes, made once: run(x1, y, x2) -> P [B, H, splits, D1,
    DY, D2] fp32, P[..., s, i, j, k] = sum over split s of x1[n, i] y[n, j] x2[n, k] (core.py),
    from x1 [B, N, H, D1], y [B, N, H, DY], x2 [B, N, H, D2] bf16 (contiguous). split_len: tokens
    per split (a multiple of BLOCK_N; default N / splits rounded up)."""
    if split_len is None:
        split_len = triton.cdiv(triton.cdiv(N, splits), BLOCK_N) * BLOCK_N
    shape = (B, H, splits, d1, dy, d2)
    kernel = partials_launch(B * H * splits * split_blocks(d1, dy, d2), H, d1, dy, d2, profile)

    def run(x1, y, x2) -> torch.Tensor:
        P = torch.empty(shape, device=x1.device, dtype=torch.float32)
        kernel(x1, y, x2, P, N, split_len, splits)
        return P

    return run


def partials(x1, y, x2, splits: int, split_len: int | None = None, profile: bool = False,
             prepare=None):
    """`prepare_partials` (or `prepare`, an impl's) of these tensors' shapes, run once on them
    (tests)."""
    B, N, H, d1 = x1.shape
    return (prepare or prepare_partials)(B, N, H, d1, y.shape[-1], x2.shape[-1], splits,
                                         split_len, profile)(x1, y, x2)


def prepare_apply(B: int, N: int, H: int, dx: int, dy: int, do: int, c: float, chunk: int = 0,
                  profile: bool = False):
    """The `apply` launch of these shapes, made once: run(x, y, w, out) writes
    out[n, o] = c sum_p sum_x x[n, x] y[n, p] w[p, x, o] (core.py) from x [B, N, H, DX] and
    y [B, N, H, DY] bf16 into out [B, N, H, DO] (bf16, or fp32: the first call's dtype is every
    call's); w [B, H, DY, DX, DO] bf16 contiguous, or with chunk > 0 [B, H, chunks, DY, DX, DO],
    one slab per `chunk` tokens (chunks = cdiv(N, chunk), at least 1)."""
    cfg = apply_config(dx, dy, do)
    if chunk:
        assert chunk % cfg["BM"] == 0, (chunk, cfg["BM"])
    head_rows = (max(1, triton.cdiv(N, chunk)) if chunk else 1) * dy * dx
    w_layout = Desc([B * H * head_rows, do], [do, 1], [dx, do])
    kernel = Kernel(apply_kernel, (B * H * triton.cdiv(N, cfg["BM"]),), H=H, DX=dx, DY=dy, DO=do,
                    BM=cfg["BM"], CHUNK=chunk, PROFILE=bool(profile),
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    c = float(c)

    def run(x, y, w, out) -> None:
        kernel(x, y, w_layout(w), out, N, c, head_rows, dy * dx)

    return run


def apply(x, y, w, out, c: float, chunk: int = 0, profile: bool = False) -> None:
    """`prepare_apply` of these tensors' shapes, run once on them (tests)."""
    assert w.is_contiguous() and w.dtype == torch.bfloat16
    B, N, H, dx = x.shape
    prepare_apply(B, N, H, dx, y.shape[-1], out.shape[-1], c, chunk, profile)(x, y, w, out)


def prepare_partials_varlen(T: int, H: int, d1: int, dy: int, d2: int, C: int,
                            profile: bool = False):
    """`prepare_partials` for packed sequences (B = 1, T tokens; kernels_triton/triple/varlen.py):
    run(x1, y, x2, maps) -> P [1, H, C, D1, DY, D2] fp32, split s the tokens maps.splits[s]
    (within one sequence; a split of no tokens gives zeros)."""
    kernel = partials_launch(H * C * split_blocks(d1, dy, d2), H, d1, dy, d2, profile)

    def run(x1, y, x2, maps) -> torch.Tensor:
        P = torch.empty((1, H, C, d1, dy, d2), device=x1.device, dtype=torch.float32)
        kernel(x1, y, x2, P, T, 0, C, Splits=maps.splits)
        return P

    return run


def prepare_apply_varlen(T: int, H: int, dx: int, dy: int, do: int, c: float, tiles: int,
                         w_rows: int, w_head: int, w_chunk: int, profile: bool = False):
    """`prepare_apply` for packed sequences (B = 1, T tokens): run(x, y, w, out, tile_map,
    cs=None) writes out's rows of each tile of tile_map (int32 [tiles, 5], core.apply_kernel)
    from the slab it names: w rows [w_rows, DO] (w_rows = w.numel() / DO), a slab's first row
    h * w_head + slab * w_chunk (in units of DY * DX rows); c scaled per sequence by cs (fp32
    [n]) where given. A launch made per use of cs (None or not)."""
    cfg = apply_config(dx, dy, do)
    w_layout = Desc([w_rows, do], [do, 1], [dx, do])
    opts = dict(H=H, DX=dx, DY=dy, DO=do, BM=cfg["BM"], CHUNK=0, PROFILE=bool(profile),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    kernels = {False: Kernel(apply_kernel, (tiles, H), **opts),
               True: Kernel(apply_kernel, (tiles, H), **opts)}
    c, w_head, w_chunk = float(c), w_head * dy * dx, w_chunk * dy * dx

    def run(x, y, w, out, tile_map, cs=None) -> None:
        args = (x, y, w_layout(w), out, T, c, w_head, w_chunk)
        if cs is None:
            kernels[False](*args, Tiles=tile_map)
        else:
            kernels[True](*args, Tiles=tile_map, CS=cs)

    return run


def scan_config(d1: int, dy: int, d2: int) -> dict:
    """core.scan_kernel's block of (i, j, k) per program: 16 each (a bf16 slab's run along any
    axis one 32-byte sector), 8 warps (16 fp32 a thread per tile)."""
    return {"BI": min(d1, 16), "BJ": min(dy, 16), "BK": min(d2, 16), "num_warps": 8}


def slab_shape(lead: tuple, order: str, d1: int, dy: int, d2: int) -> tuple:
    """The shape of a bf16 slab of [*lead, d1, dy, d2] states in `order` (e.g. "ikj": [*lead,
    d1, d2, dy])."""
    dims = {"i": d1, "j": dy, "k": d2}
    return (*lead, *(dims[a] for a in order))


def new_slabs(lead: tuple, orders, d1: int, dy: int, d2: int, device) -> dict:
    """{order: an empty bf16 slab (`slab_shape`)} for a scan to write."""
    return {o: torch.empty(slab_shape(lead, o, d1, dy, d2), device=device, dtype=torch.bfloat16)
            for o in orders}


_SLAB_ARG = {o: f"W_{o.upper()}" for o in ("ijk", "ikj", "jki")}  # scan_kernel's slab arguments


def prepare_scan(heads: int, d1: int, dy: int, d2: int, mode: int, H: int = 1):
    """core.scan_kernel's launches for `heads` heads of [d1, dy, d2] states in `mode` (SUM,
    PREFIX or SUFFIX), made once: run(P, n_splits, c, S=None, slabs={}, S0=None, CS=None,
    Seg=None, Slot=None) makes one pass over P [heads, n_splits, d1, dy, d2] fp32 (or the
    packed form, H heads a sequence: Seg and Slot, kernels_triton/triple/varlen.py) and writes
    S (fp32, or None) and slabs {order: bf16} (orders "ijk", "ikj", "jki"; `new_slabs`). A
    kernel per set of the optional tensors given (a None is compiled out)."""
    cfg = scan_config(d1, dy, d2)
    tiles = (d1 // cfg["BI"]) * (dy // cfg["BJ"]) * (d2 // cfg["BK"])
    kernels: dict = {}

    def run(P, n_splits: int, c: float, S=None, slabs: dict | None = None, S0=None, CS=None,
            Seg=None, Slot=None) -> None:
        # per call: the kernel's optional arguments by name (their set picks the kernel), no
        # string work (a call's slabs come in its caller's fixed order)
        kw = {_SLAB_ARG[o]: w for o, w in slabs.items()} if slabs else {}
        if S0 is not None:
            kw["S0"] = S0
        if CS is not None:
            kw["CS"] = CS
        if Seg is not None:
            kw["Seg"] = Seg
        if Slot is not None:
            kw["Slot"] = Slot
        key = (S is None, *kw)
        kernel = kernels.get(key)
        if kernel is None:
            kernel = kernels[key] = Kernel(scan_kernel, (heads, tiles), H=H, D1=d1, DY=dy,
                                           D2=d2, MODE=int(mode), **cfg)
        if heads:
            kernel(P, S, n_splits, float(c), **kw)

    return run


def prepare_state(B: int, H: int, d1: int, dy: int, d2: int, splits: int, c: float,
                  orders=("ikj",)):
    """The state from the partials, made once: run(P, S, S0=None) writes S [B, H, D1, DY, D2]
    fp32 = S0 + c * the sum of P's splits (S0 the initial state, same shape, or None; the
    splits in order: bitwise repeatable) and returns its bf16 slab in order "ikj" (as
    `slab(S, "ikj")`, without the copy pass), or with several `orders` {order: slab}, or with
    none None; one pass (core.scan_kernel)."""
    scan = prepare_scan(B * H, d1, dy, d2, SUM)

    def run(P, S, S0=None):
        slabs = new_slabs((B, H), orders, d1, dy, d2, S.device)
        scan(P, splits, c, S, slabs, S0)
        return slabs if len(orders) > 1 else slabs[orders[0]] if orders else None

    return run


def prepare_split_state(spec, impl, profile=False, orders=("ikj",)):
    """A forward's state by `impl`'s split partials and one scan of their sum, made once:
    run(x1, y, x2, S, S0=None) writes S = S0 + spec.scale * sum_n x1 (x) y (x) x2 and returns
    prepare_state's slab(s) in `orders` (none: None). profile: the partials' (scoped)."""
    B, N, H, Dq, Dv = spec.B, spec.N, spec.H, spec.Dq, spec.Dv
    splits = impl.n_splits(B, N, H, Dq, Dv, Dq)
    partials = impl.prepare_partials(B, N, H, Dq, Dv, Dq, splits, profile=profile)
    state = prepare_state(B, H, Dq, Dv, Dq, splits, spec.scale, orders)

    def run(x1, y, x2, S, S0=None):
        return state(partials(x1, y, x2), S, S0)

    return run

def prepare_slabs(B: int, H: int, d1: int, dy: int, d2: int, orders):
    """The bf16 slabs of a state in `orders`, one pass (`slab`'s copies, without a pass each):
    run(S) -> {order: slab} of S [B, H, D1, DY, D2] fp32 (a scan of one split, c = 1: exact)."""
    scan = prepare_scan(B * H, d1, dy, d2, SUM)

    def run(S) -> dict:
        slabs = new_slabs((B, H), orders, d1, dy, d2, S.device)
        scan(S, 1, 1.0, None, slabs)
        return slabs

    return run


def slab(state, order: str) -> torch.Tensor:
    """The bf16 copy of state [..., i, j, k] (fp32) that `apply` reads as W[p, x, o], the axes in
    `order` (e.g. "ikj": W[i, k, j] = state[i, j, k]); one torch copy pass (the passes write
    theirs in their scans: `prepare_scan`)."""
    perm = [state.dim() - 3 + "ijk".index(a) for a in order]
    view = state.permute(*range(state.dim() - 3), *perm)
    return torch.empty(view.shape, device=state.device, dtype=torch.bfloat16).copy_(view)


# ---- compile configs (tools.resources; CI compiles them for sm_90a without a GPU) ----------

COMPILE_N, COMPILE_H = 4096, 8  # the compile configs' tokens and heads (H is a constexpr)
COMPILE_SPLITS = 4


def tokens(d: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A [1, COMPILE_N, COMPILE_H, d] meta tensor (compile configs)."""
    return meta(1, COMPILE_N, COMPILE_H, d, dtype=dtype)


def recorded_config(name: str, kernel, prepare, *args) -> CompileConfig:
    """The compile config, named `name`, of `kernel`'s launch among those `prepare()(*args)`
    makes (recorded on meta tensors: kernels_triton/launch.py)."""
    (found,) = compile_configs_of(prepare, args, lambda launch: name if launch.fn is kernel
                                  else None)
    return found


def compile_configs(causal_chunk: int = 0) -> list[CompileConfig]:
    """The default configs at Dq = Dv = 32, 64 and 128 (and Dq 64, Dv 32): partials, the state
    and apply in every operand order the passes use (and, with causal_chunk, apply's chunked
    fp32 form and the causal passes' scans)."""
    out, N, H, S = [], COMPILE_N, COMPILE_H, COMPILE_SPLITS
    f32 = torch.float32
    for dq, dv in ((32, 32), (64, 64), (128, 128), (64, 32)):
        bi = partials_config(dq, dv, dq)["BI"]
        out.append(recorded_config(
            f"partials_D{dq}x{dv}x{dq}_BI{bi}", partials_kernel,
            lambda: prepare_partials(1, N, H, dq, dv, dq, S), tokens(dq), tokens(dv), tokens(dq)))
        state = meta(1, H, dq, dv, dq, dtype=f32)
        for s0, tag in ((None, ""), (state, "_S0")):  # without and with an initial state
            out.append(recorded_config(
                f"scan_sum_D{dq}x{dv}x{dq}{tag}", scan_kernel,
                lambda: prepare_state(1, H, dq, dv, dq, S, 1.0),
                meta(1, H, S, dq, dv, dq, dtype=f32), state, s0))
        if causal_chunk:  # the causal passes' prefix and suffix scans (causal.py)
            chunks = meta(1, H, triton.cdiv(N, causal_chunk), dq, dv, dq, dtype=f32)
            for name, mode, S_, orders in (("prefix_fwd", PREFIX, state, ("ikj",)),
                                           ("prefix_bwd", PREFIX, None, ("jki", "ijk")),
                                           ("suffix", SUFFIX, state, ("jki", "ijk", "ikj"))):
                slabs = new_slabs((1, H, 1), orders, dq, dv, dq, "meta")
                out.append(recorded_config(
                    f"scan_{name}_D{dq}x{dv}x{dq}_S0", scan_kernel,
                    lambda: prepare_scan(H, dq, dv, dq, mode), chunks, chunks.shape[2], 1.0,
                    S_, slabs, state))
        for dx, dy, do in {(dq, dq, dv), (dq, dv, dq), (dv, dq, dq)}:
            xy = (tokens(dx), tokens(dy))
            out.append(recorded_config(
                f"apply_D{dx}x{dy}x{do}", apply_kernel,
                lambda: prepare_apply(1, N, H, dx, dy, do, 1.0), *xy, meta(1, H, dy, dx, do),
                tokens(do)))
            if causal_chunk:
                w = meta(1, H, triton.cdiv(N, causal_chunk), dy, dx, do)
                out.append(recorded_config(
                    f"apply_D{dx}x{dy}x{do}_chunk{causal_chunk}_fp32", apply_kernel,
                    lambda: prepare_apply(1, N, H, dx, dy, do, 1.0, causal_chunk), *xy, w,
                    tokens(do, f32)))
    return out

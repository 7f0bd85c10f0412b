"""The spherical-attention family's record: everything the launcher, bench, profiling and the
contract tests know about it, and one `Variant(...)` line per kernel variant (ranked by
measurements: docs/perf-spherical.md)."""
from __future__ import annotations

from ..registry import DISPATCH_DOC, TMA_INIT_DOC, Family, Peer, SanitizerAllowance, Variant
from .passes import Backward, Forward
from .reference import reference, reference_backward
from .shapes import PRESETS, SWEEP, Shape, pass_flops, pass_inputs
from .spec import SphericalSpec

# Proton scopes, in kernel order, and the role each plays (registry.SCOPE_ROLES). "square" is the
# per-score step that replaces softmax: z += t*t and the bf16 convert (backward: the ds line).
SCOPES = {"load_kv": "load", "wait_kv": "wait", "qk_gemm": "gemm", "square": "softmax",
          "pv_gemm": "gemm", "epilogue": "epilogue"}
TRITON_SCOPES = ("load_kv", "qk_gemm", "square", "pv_gemm", "epilogue")
WS_SCOPES = ("load_kv", "wait_kv", "qk_gemm", "square", "pv_gemm", "epilogue")

_ANY = "any B, N, Nk, Hq, Hk (Hq a multiple of Hk); D in {64, 128}; causal; seqlens"
_PACKED_TOO = _ANY + "; packed sequences (cu_seqlens)"
_TLX = "kernels_tlx.spherical."
# `accepts` "packed": the variants that run packed sequences (varlen.py) in one launch; the family
# default (False only) keeps "auto" off the others for a packed call
PACKED = {"packed": (False, True)}
# Forward ranks: the speed order on an H200 (docs/perf-spherical.md has the runs): tlx_pingpong
# first at P1 and P2, level with the others causal; tlx_pipelined a little ahead at N 2048.
FWD = (
    Variant(name="tlx_pingpong", family="spherical", pass_="fwd", module=_TLX + "fwd_common",
            switches=(("pipeline", True), ("pingpong", True)), needs_hopper=True, rank=4,
            supports=_PACKED_TOO, warps=12, scopes=WS_SCOPES, accepts=PACKED, pipelined=True),
    Variant(name="tlx_pipelined", family="spherical", pass_="fwd", module=_TLX + "fwd_common",
            switches=(("pipeline", True), ("pingpong", False)), needs_hopper=True, rank=3,
            supports=_PACKED_TOO, warps=12, scopes=WS_SCOPES, accepts=PACKED, pipelined=True),
    Variant(name="tlx_ws", family="spherical", pass_="fwd", module=_TLX + "fwd_common",
            switches=(("pipeline", False), ("pingpong", False)), needs_hopper=True, rank=2,
            supports=_PACKED_TOO, warps=12, scopes=WS_SCOPES, accepts=PACKED),
    Variant(name="triton", family="spherical", pass_="fwd",
            module="kernels_triton.spherical.fwd", needs_hopper=True, rank=1,
            supports=_PACKED_TOO, warps=8, scopes=TRITON_SCOPES, accepts=PACKED),
)


BWD = (
    Variant(name="tlx_ws", family="spherical", pass_="bwd", module=_TLX + "bwd_ws",
            needs_hopper=True, rank=3, supports=_PACKED_TOO, warps=12, scopes=WS_SCOPES,
            deterministic=False, accepts=PACKED),
    Variant(name="tlx_ws_det", family="spherical", pass_="bwd", module=_TLX + "bwd_ws_det",
            needs_hopper=True, rank=2, supports=_ANY + "; not packed sequences", warps=12,
            scopes=WS_SCOPES),
    Variant(name="triton", family="spherical", pass_="bwd",
            module="kernels_triton.spherical.bwd", needs_hopper=True, rank=1,
            supports=_PACKED_TOO, warps=8, scopes=TRITON_SCOPES, accepts=PACKED),
)

# Small shapes compute-sanitizer runs each variant on (tools/sanitize.py)
SANITIZER_SHAPES = (
    (Shape(1, 256, 8, 2, 64, causal=True),),
    (Shape(2, 333, 4, 4, 128),),
    (Shape(2, 333, 8, 2, 128, pad=0.25),),
)

# The findings of those runs that docs/sanitizers.md explains, by (tool, pass, variant): the only
# ones tools/sanitize.py lets pass
SANITIZER_ALLOWED = {
    # Triton's TMA loads of Q, K, V (forward) and of Q, dO, K, V (backward's two kernels)
    ("racecheck", "fwd", "triton"): SanitizerAllowance(TMA_INIT_DOC, 3, "spherical_fwd_kernel",
                                                       "mbarrier_init"),
    ("racecheck", "bwd", "triton"): SanitizerAllowance(TMA_INIT_DOC, 8, None, "mbarrier_init"),
    # the warp-specialization dispatch of the key-block kernel (and tlx_ws_det's dQ kernel)
    ("racecheck", "bwd", "tlx_ws"): SanitizerAllowance(DISPATCH_DOC, 1, "_dkv_kernel",
                                                       "dispatch"),
    ("racecheck", "bwd", "tlx_ws_det"): SanitizerAllowance(DISPATCH_DOC, 2, None, "dispatch"),
}

# Checks against the reference, named once (bench's pre-timing checks; tests/spherical/test_gpu_spherical.py)
TOLERANCES = {
    "out_rel": 1e-2,    # ||out - ref||_F / ||ref||_F, bf16 kernel vs fp64 (the bound)
    "r_rel": 1e-3,      # ||r - ref||_F / ||ref||_F
    "grad_rel": 1e-2,   # each gradient, ||g - ref||_F / ||ref||_F
    # ... and at most this many times the error of a bf16 emulation of the same computation
    # (tests/spherical/test_gpu_spherical.py)
    "vs_emulation": 2.0,
}


def _layer(s: Shape, dim: int, bwd_variant: str):
    """One SphericalAttention of width `dim` on the shape's heads (bench --layer)."""
    from .layer import SphericalAttention
    return SphericalAttention(dim, s.Hq, s.Hk, s.D, causal=s.causal, bwd_variant=bwd_variant)


def _softmax_same_shape(s: Shape) -> dict:
    """Softmax attention at the same B, H, N, D (causal when it is): the speed peer."""
    return {"B": s.B, "H": s.Hq, "Nq": s.N, "Nk": s.N, "D": s.D, "causal": s.causal}


FAMILY = Family(
    name="spherical", title="spherical attention", shape_type=Shape, spec_type=SphericalSpec,
    passes={"fwd": Forward, "bwd": Backward},
    reference=reference, reference_backward=reference_backward, flops=pass_flops,
    make_inputs=pass_inputs, presets=PRESETS, default_preset="p1", sweep=SWEEP,
    peers=(Peer(name="cudnn_sdpa", rule="softmax attention at the same B, H, N, D (and causal)",
                dense=_softmax_same_shape),
           Peer(name="torch_bf16", rule="plain PyTorch spherical attention at the same shape "
                "(bf16 matmuls, S materialised)", runs="altattn.spherical.peers:torch_bf16"),
           Peer(name="triton_sigmoid", rule="triton-sigmoid's sigmoid attention at the same "
                "shape (optional: PyPI triton-sigmoid)", runs="altattn.spherical.peers:triton_sigmoid")),
    scopes=SCOPES, sanitizer_shapes=SANITIZER_SHAPES, sanitizer_allowed=SANITIZER_ALLOWED,
    tolerances=TOLERANCES, accepts={"packed": (False,)}, traits=frozenset(), variants=FWD + BWD,
    layer=_layer)

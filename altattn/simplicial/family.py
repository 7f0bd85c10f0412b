"""The 2-simplicial attention family's record: everything the launcher, bench, profiling and the
contract tests know about it, and one `Variant(...)` line per kernel variant (ranked by
measurements: docs/perf.md, docs/perf-bwd.md)."""
from __future__ import annotations

from ..registry import (DISPATCH_DOC, RELEASE_DOC, TMA_INIT_DOC, Family, Peer,
                        SanitizerAllowance, Variant)
from .passes import Backward, Forward
from .reference import reference, reference_backward
from .shapes import PRESETS, SWEEP, Shape, pass_flops, pass_inputs
from .spec import FORMS, ProblemSpec

# Proton scopes, in kernel order, and the role each plays (registry.SCOPE_ROLES). A consumer step
# of every kernel is a QK GEMM, the softmax and a PV GEMM.
SCOPES = {"load_kv": "load", "build_a": "build", "build_b": "build", "build_c": "build",
          "wait_kv": "wait", "qk_gemm": "gemm", "softmax": "softmax", "pv_gemm": "gemm",
          "v1_mul": "scale", "epilogue": "epilogue"}
_STEP = ("qk_gemm", "softmax", "pv_gemm")
TRITON_SCOPES = ("load_kv", *_STEP, "v1_mul", "epilogue")         # one warp group does it all
WS_SCOPES = ("load_kv", "wait_kv", *_STEP, "v1_mul", "epilogue")  # a producer; consumers wait
KEYS_SCOPES = ("load_kv", "build_b", *WS_SCOPES[1:])  # the producer builds B_j = K1[j] * K2
# producers build B_j and C_j = V1[j] * V2: consumers wait for no K2/V2 slot, multiply by no V1 row
KV_SCOPES = ("load_kv", "build_b", "build_c", *_STEP, "epilogue")
BWD_SCOPES = ("load_kv", *_STEP, "epilogue")  # backward: recompute S (qk), dS (softmax), dK/dV/X/Z
BWD_WS_SCOPES = ("load_kv", "build_a", *_STEP, "epilogue")  # a producer builds A_j and dO_j

# Variant.traits: it rounds K1[j] * K2 to bf16 (instead of Q * K1[j]) / V1[j] * V2 (instead of
# multiplying P @ V2 by V1[j]); the GPU tests' bf16 yardstick emulates the same roundings
KEYS_SIDE, VALUES_SIDE = "rounds_keys_side", "rounds_values_side"
BOTH_SIDES = frozenset({KEYS_SIDE, VALUES_SIDE})
DET = {"form": FORMS}
PACKED = (False, True)  # `accepts` "varlen": runs packed sequences in one launch (varlen.py)

# Forward ranks: the speed order at S* (G = 128, D = 128) and Hq = 64 on the lent H100 and H200
# (docs/perf.md). tlx_ws is ahead of triton at 7 of 8 shapes timed with G from 16 to 128 and D =
# 64 or 128; at D = 64 it is also ahead of tlx_pipelined_kv (450 vs 417 at G = 128).
# tlx_pipelined_pingpong is on par with tlx_pipelined_kv in the trilinear form: it stays below the
# rest there. In form "det" at D = 128 it is the fastest (575.4 against tlx_pipelined_kv's 545.6
# and triton's 490.9 at S*, H100), so "auto" takes it for det; det at D = 64 (G = 128) is
# tlx_pipelined_kv's (383.0 against triton's 352.1; pingpong not timed there).
_G128 = "G = Hq/Hk = 128; any B, N, Hk, w1, w2; D in {64, 128}"
_G16 = "any B, N, Hk, w1, w2; G = Hq/Hk in {16, 32, 64, 128}; D in {64, 128}"
_ANY = "any B, N, Hk, w1, w2; G = Hq/Hk a power of two <= 128; D in {64, 128}"
_TLX = "kernels_tlx.simplicial."
FWD = (
    Variant(name="tlx_pipelined_kv", family="simplicial", pass_="fwd", module=_TLX + "ws_kv",
            switches=(("pipelined", True),), needs_hopper=True,
            rank=lambda spec: 8 if spec.D == 128 else 6, supports=_G128, warps=16,
            scopes=KV_SCOPES, traits=BOTH_SIDES, pipelined=True,
            accepts={**DET, "varlen": PACKED}),
    Variant(name="tlx_ws", family="simplicial", pass_="fwd", module=_TLX + "ws",
            needs_hopper=True, rank=7, supports=_G16, warps=12, scopes=WS_SCOPES),
    Variant(name="tlx_ws_kv", family="simplicial", pass_="fwd", module=_TLX + "ws_kv",
            needs_hopper=True, rank=5, supports=_G128, warps=16, scopes=KV_SCOPES,
            traits=BOTH_SIDES, accepts={"varlen": PACKED}),
    Variant(name="tlx_ws_keys", family="simplicial", pass_="fwd", module=_TLX + "ws_keys",
            needs_hopper=True, rank=4, supports=_G128, warps=12, scopes=KEYS_SCOPES,
            traits=frozenset({KEYS_SIDE})),
    Variant(name="tlx_pingpong", family="simplicial", pass_="fwd", module=_TLX + "ws",
            switches=(("pingpong", True),), needs_hopper=True, rank=3, supports=_G16, warps=12,
            scopes=WS_SCOPES),
    Variant(name="triton", family="simplicial", pass_="fwd",
            module="kernels_triton.simplicial.fwd", needs_hopper=True, rank=2, supports=_ANY,
            warps=4, scopes=TRITON_SCOPES, accepts=DET),
    Variant(name="tlx_pipelined_pingpong", family="simplicial", pass_="fwd",
            module=_TLX + "ws_kv", switches=(("pipelined", True), ("pingpong", True)),
            needs_hopper=True,
            rank=lambda spec: 9 if spec.form == "det" and spec.D == 128 else -3,
            supports=_G128, warps=16, scopes=KV_SCOPES, traits=BOTH_SIDES, pipelined=True,
            accepts={**DET, "varlen": PACKED}),
)
# Backward ranks: "auto" takes the highest that supports the shape.
BWD = (
    Variant(name="triton", family="simplicial", pass_="bwd",
            module="kernels_triton.simplicial.bwd", needs_hopper=True, rank=1, supports=_ANY,
            warps=8, scopes=BWD_SCOPES, accepts=DET),
    Variant(name="tlx_ws", family="simplicial", pass_="bwd", module=_TLX + "bwd_ws",
            needs_hopper=True,
            rank=lambda s: 2 if s.D == 128 else 0,  # measured: ahead at D = 128 only
            supports="as `triton`, with G = Hq/Hk in {64, 128}", warps=12,
            scopes=BWD_WS_SCOPES, pipelined=True),
    Variant(name="tlx_pairs", family="simplicial", pass_="bwd", module=_TLX + "bwd_pairs",
            needs_hopper=True, rank=3,
            supports="G = Hq/Hk >= 16; D in {64, 128}", warps=12,
            scopes=BWD_WS_SCOPES, pipelined=True, traits=BOTH_SIDES, deterministic=False,
            accepts={**DET, "varlen": PACKED}),
    # bitwise repeatable; measured faster than `tlx_ws` at S* (G 128, D 128) only
    Variant(name="tlx_pairs_ordered", family="simplicial", pass_="bwd",
            module=_TLX + "bwd_pairs", switches=(("ordered", True),), needs_hopper=True,
            rank=lambda s: 2.5 if s.G >= 128 and s.D == 128 else 0,
            supports="G = Hq/Hk >= 64, Hk = 1; D in {64, 128}; form trilinear", warps=12,
            scopes=BWD_WS_SCOPES, pipelined=True, traits=BOTH_SIDES),
)

# Small shapes compute-sanitizer runs each variant on: the first it takes of each group
# (tools/sanitize.py)
SANITIZER_SHAPES = (
    (Shape(1, 256, 8, 1, 64, 32, 64),      # G = 8: triton
     Shape(1, 256, 64, 2, 128, 32, 64),    # G = 32: tlx_ws, tlx_pingpong
     Shape(1, 256, 128, 2, 128, 32, 64),   # G = 64: the tlx_ws backward
     Shape(1, 256, 256, 2, 128, 32, 64),   # G = 128 only
     Shape(1, 256, 128, 1, 128, 32, 64)),  # G = 128 at Hk = 1: tlx_pairs_ordered (Hk = 1 only)
    (Shape(2, 333, 128, 1, 128, 32, 96),),  # ragged N, G = 128: every variant today
)

# The findings of those runs that docs/sanitizers.md explains, by (tool, pass, variant): the only
# ones tools/sanitize.py lets pass
SANITIZER_ALLOWED = {
    # the compiler's warp-specialization dispatch: the exit-code store against a worker's load
    ("racecheck", "fwd", "tlx_ws"): SanitizerAllowance(DISPATCH_DOC, 1,
                                                       "simplicial_fwd_ws_kernel", "dispatch"),
    ("racecheck", "fwd", "tlx_pingpong"): SanitizerAllowance(
        DISPATCH_DOC, 1, "simplicial_fwd_ws_kernel", "dispatch"),
    # the same in the pipelined tlx_ws_kv kernels, reported in their form "det" runs only
    ("racecheck", "fwd", "tlx_pipelined_kv"): SanitizerAllowance(
        DISPATCH_DOC, 1, "simplicial_fwd_ws_kv_kernel", "dispatch"),
    ("racecheck", "fwd", "tlx_pipelined_pingpong"): SanitizerAllowance(
        DISPATCH_DOC, 1, "simplicial_fwd_ws_kv_kernel", "dispatch"),
    # tlx_ws's backward: its k-owner's dispatch (its row-owner is clean); tlx_pairs's
    ("racecheck", "bwd", "tlx_ws"): SanitizerAllowance(DISPATCH_DOC, 1, "_dkv2_ws_kernel",
                                                       "dispatch"),
    ("racecheck", "bwd", "tlx_pairs"): SanitizerAllowance(DISPATCH_DOC, 1, "_pairs_kernel",
                                                          "dispatch"),
    # Triton's TMA load: warp 0 inits an mbarrier, then thread 0 arrives on it (in SASS order)
    ("racecheck", "fwd", "triton"): SanitizerAllowance(TMA_INIT_DOC, 2, "simplicial_fwd_kernel",
                                                       "mbarrier_init"),
    ("racecheck", "bwd", "triton"): SanitizerAllowance(TMA_INIT_DOC, 1, "_dq_kernel",
                                                       "mbarrier_init"),
    # a producer's store into a slot whose last reads (plain loads of a consumer warp group)
    # are released by one thread's mbarrier arrive (seen once in three runs)
    ("racecheck", "fwd", "tlx_ws_keys"): SanitizerAllowance(
        RELEASE_DOC, 1, "simplicial_fwd_ws_keys_kernel", "released_read"),
}

# Checks against the reference, named once (bench's pre-timing checks; tests/simplicial/test_gpu*.py)
TOLERANCES = {
    "out_rel": 2e-2,    # bench: ||out - ref||_F / ||ref||_F, bf16 kernel vs fp32 reference
    "lse_abs": 2e-2,    # bench: max |lse - ref_lse|
    "grad_rel": 3e-2,   # bench: ||grad - ref||_F / ||ref||_F, each gradient
}


def _dense_equal_work(s: Shape) -> dict:
    """Dense attention with the same useful FLOPs at N = w1*w2: every query sees Lkv = w1*w2
    keys (non-causal)."""
    return {"B": s.B, "H": s.Hq, "Nq": s.N, "Nk": s.w1 * s.w2, "D": s.D}


def _layer(s: Shape, dim: int, bwd_variant: str, form: str = "trilinear"):
    """One SimplicialAttention of width `dim` on the shape's heads and windows (bench --layer)."""
    from .layer import SimplicialAttention
    return SimplicialAttention(dim, s.Hq, s.Hk, s.D, s.w1, s.w2, bwd_variant=bwd_variant,
                               form=form)


FAMILY = Family(
    name="simplicial", title="2-simplicial attention", shape_type=Shape, spec_type=ProblemSpec,
    passes={"fwd": Forward, "bwd": Backward},
    reference=reference, reference_backward=reference_backward, flops=pass_flops,
    make_inputs=pass_inputs, presets=PRESETS, default_preset="star", sweep=SWEEP,
    peers=(Peer(name="cudnn_sdpa", rule="dense attention, Lkv = w1*w2 keys per query",
                dense=_dense_equal_work),),
    scopes=SCOPES, sanitizer_shapes=SANITIZER_SHAPES, sanitizer_allowed=SANITIZER_ALLOWED,
    tolerances=TOLERANCES, accepts={"form": ("trilinear",), "varlen": (False,)}, traits=BOTH_SIDES, variants=FWD + BWD,
    layer=_layer)

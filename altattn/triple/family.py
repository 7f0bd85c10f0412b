"""The triple-attention family's record: everything the launcher, bench, profiling and the contract
tests know about it, and one `Variant(...)` line per kernel variant."""
from __future__ import annotations

from ..registry import TMA_INIT_DOC, TRIPLE_TLX_DOC, Family, Peer, SanitizerAllowance, Variant
from .passes import Backward, Forward
from .reference import reference, reference_backward
from .shapes import PRESETS, SWEEP, Shape, pass_flops, pass_inputs
from .spec import TripleSpec

# Proton scopes, in kernel order, and the role each plays (registry.SCOPE_ROLES): "build" is the
# outer product (K1 (x) V, or Q1 (x) Q2) a GEMM phase reads as one operand; the TLX kernels'
# consumers also "wait" for a producer's slot
SCOPES = {"load": "load", "wait": "wait", "build": "build", "gemm": "gemm", "epilogue": "epilogue"}
TRITON_SCOPES = ("load", "build", "gemm", "epilogue")

_ANY = "any B, N, H; Dq, Dv in {32, 64, 128}; causal"
# Ranks: the speed order on an H200 (docs/perf-triple.md)
FWD = (
    Variant(name="tlx", family="triple", pass_="fwd", module="kernels_tlx.triple.contractions",
            switches=(("pass_", "fwd"),), needs_hopper=True, rank=2, supports=_ANY, warps=16,
            scopes=tuple(SCOPES)),
    Variant(name="triton", family="triple", pass_="fwd", module="kernels_triton.triple.fwd",
            needs_hopper=True, rank=1, supports=_ANY, warps=8, scopes=TRITON_SCOPES),
)
BWD = (
    Variant(name="tlx", family="triple", pass_="bwd", module="kernels_tlx.triple.contractions",
            switches=(("pass_", "bwd"),), needs_hopper=True, rank=2, supports=_ANY, warps=16,
            scopes=tuple(SCOPES)),
    Variant(name="triton", family="triple", pass_="bwd", module="kernels_triton.triple.bwd",
            needs_hopper=True, rank=1, supports=_ANY, warps=8, scopes=TRITON_SCOPES),
)

# Small shapes compute-sanitizer runs each variant on (tools/sanitize.py): ragged N, both
# modes, Dq != Dv
SANITIZER_SHAPES = (
    (Shape(1, 1000, 2, 64, 64),),
    (Shape(2, 333, 2, 32, 32, causal=True),),
    (Shape(1, 200, 2, 128, 64, causal=True),),
)

# The findings of those runs that docs/sanitizers.md explains, by (tool, pass, variant): the only
# ones tools/sanitize.py lets pass
SANITIZER_ALLOWED = {
    # Triton's TMA loads: `apply`'s slabs of W, and (causal) intra.py's tiles in its three
    # kernels; one finding per load site a run reaches (1 non-causal forward, 6 causal; 6
    # and 26 backward)
    ("racecheck", "fwd", "triton"): SanitizerAllowance(TMA_INIT_DOC, 6, None, "mbarrier_init"),
    # (+1: the forward run before the backward is `auto`'s, the `tlx` forward, whose
    # partials kernel may add its dispatch finding)
    ("racecheck", "bwd", "triton"): SanitizerAllowance(TRIPLE_TLX_DOC, 27, None,
                                                       ("mbarrier_init", "dispatch")),
    # `tlx` runs the same Triton kernels, and its TLX partials kernel adds at most one
    # warp-specialization dispatch finding per launch (1 forward; 3 in a causal backward run,
    # the forward's launch included)
    ("racecheck", "fwd", "tlx"): SanitizerAllowance(TRIPLE_TLX_DOC, 7, None,
                                                    ("mbarrier_init", "dispatch")),
    ("racecheck", "bwd", "tlx"): SanitizerAllowance(TRIPLE_TLX_DOC, 29, None,
                                                    ("mbarrier_init", "dispatch")),
}

# Checks against the reference, named once (bench's pre-timing checks; the GPU tests)
TOLERANCES = {
    "out_rel": 1e-2,     # ||out - ref||_F / ||ref||_F, bf16 kernel vs fp64
    "state_rel": 1e-2,   # ||state - ref||_F / ||ref||_F
    "grad_rel": 1e-2,    # each gradient, ||g - ref||_F / ||ref||_F
    # ... and at most this many times the error of a bf16 emulation of the same computation
    "vs_emulation": 2.0,
}


def _layer(s: Shape, dim: int, bwd_variant: str):
    """One TripleAttention of width `dim` on the shape's heads (bench --layer)."""
    from .layer import TripleAttention
    return TripleAttention(dim, s.H, s.Dq, s.Dv, causal=s.causal, bwd_variant=bwd_variant)


FAMILY = Family(
    name="triple", title="triple attention", shape_type=Shape, spec_type=TripleSpec,
    passes={"fwd": Forward, "bwd": Backward},
    reference=reference, reference_backward=reference_backward, flops=pass_flops,
    make_inputs=pass_inputs, presets=PRESETS, default_preset="t2", sweep=SWEEP,
    peers=(Peer(name="materialised", rule="cuBLAS bf16 on the two GEMM phases at the same shape, "
                "the outer products K1 (x) V and Q1 (x) Q2 built beforehand and not timed "
                "(forward only; non-causal)", runs="altattn.triple.peers:materialised"),
           Peer(name="torch_einsum", rule="plain PyTorch triple attention at the same shape "
                "(bf16 einsums chunked over N, fp32 state; backward by autograd)",
                runs="altattn.triple.peers:torch_einsum")),
    scopes=SCOPES, sanitizer_shapes=SANITIZER_SHAPES, sanitizer_allowed=SANITIZER_ALLOWED,
    tolerances=TOLERANCES, accepts={}, traits=frozenset(), variants=FWD + BWD, layer=_layer)

"""Packed variable-length sequences: `attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, max_seqlen_k)`, FlashAttention's `flash_attn_varlen_func` convention for spherical
attention.

Sequences are concatenated along dim 0: q [Tq, Hq, D], k and v [Tk, Hk, D]; sequence s holds
queries cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1 and keys cu_seqlens_k[s] ..
cu_seqlens_k[s + 1] - 1, and its queries see its own keys only (causal: query i of a sequence
sees its keys j <= i; causal needs each sequence's query and key lengths equal, so
cu_seqlens_q == cu_seqlens_k: FlashAttention's bottom-right alignment for unequal lengths is not
offered). Empty sequences and sequences without keys (out = 0, r = 0) are allowed.

One op pair `altattn::spherical_varlen_fwd` / `_bwd`, generated (altattn/ops.py) from the
declaration below with its own pass records (`PackedForward`, `PackedBackward`): differentiable,
`torch.compile`-able (fake implementations, opcheck). On CUDA every pass is one launch of a
variant that takes packed sequences (family.py: `accepts` "packed"; kernels_triton/spherical/
host.py: a tile map built on the device, no host read in the launch); on CPU the fp64 reference
runs sequence by sequence. Values in one sequence must be finite for the others to be exact
(as `seqlens` padding must be): a tile that runs past its sequence end multiplies the next
sequence's rows by exact zeros, and 0 * inf is NaN.
"""
from __future__ import annotations

import torch

from ..checks import check_group, dense_aligned, output
from ..launcher import Call, run_call
from ..ops import OpDecl, make_op
from ..packing import PackedSeqs, check_cu_seqlens, check_max_seqlen
from .ops import check_variant_names
from .passes import FAMILY, Backward, Forward, backward_args, forward_args, validate_saved
from .reference import reference, reference_backward
from .spec import DEFAULT_EPS, NAMES, REFERENCE_DTYPES, SUPPORTED_DTYPES, SphericalSpec, validate

Tensor = torch.Tensor


def validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                    causal=False, sm_scale=None, eps=DEFAULT_EPS, *,
                    cpu_reference: bool = False) -> SphericalSpec:
    """The checks of `spec.validate` for packed tensors (q [Tq, Hq, D], k and v [Tk, Hk, D]),
    naming packed dims, and of the offsets (altattn.packing.check_cu_seqlens; their values are
    read on the host unless torch.compile traces or a CUDA graph is captured). Returns the
    packed spec: B = 1, N = Tq, Nk = Tk."""
    tensors = (q, k, v)
    on_cpu = cpu_reference and isinstance(q, Tensor) and q.device.type == "cpu"
    check_group(NAMES, tensors, 3, "[T, H, D]", REFERENCE_DTYPES if on_cpu else SUPPORTED_DTYPES,
                SUPPORTED_DTYPES)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)} [Tk, Hk, D], got "
                         f"{tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k has D (dim 2) = {k.shape[2]} but q has {q.shape[2]}: shapes "
                         f"q{tuple(q.shape)} vs k{tuple(k.shape)}")
    spec = validate(q[None], k[None], v[None], causal, sm_scale, eps, None,
                    cpu_reference=cpu_reference)
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    cu_q = check_cu_seqlens(cu_seqlens_q, spec.N, q.device, max_q, "cu_seqlens_q", "max_seqlen_q")
    cu_k = check_cu_seqlens(cu_seqlens_k, spec.Nk, q.device, max_k, "cu_seqlens_k",
                            "max_seqlen_k")
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.numel()} offsets but cu_seqlens_q has "
                         f"{cu_seqlens_q.numel()}: both hold n_sequences + 1")
    if spec.causal and cu_q is not None and cu_k is not None and cu_q != cu_k:
        raise ValueError("causal=True needs each sequence's query and key lengths equal "
                         "(cu_seqlens_q == cu_seqlens_k; query i sees its sequence's keys "
                         "j <= i)")
    return SphericalSpec(1, spec.N, spec.Nk, spec.Hq, spec.Hk, spec.D, spec.causal,
                         spec.sm_scale, spec.eps, packed=True)


def _batch_of_one(t: Tensor) -> Tensor:
    return t[None]


def _seqs(cu_q: Tensor, cu_k: Tensor) -> PackedSeqs:
    return PackedSeqs(dense_aligned(cu_q), dense_aligned(cu_k))


class PackedForward(Forward):
    """The forward's record for packed sequences (launcher steps: altattn/launcher.py):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sm_scale, eps) ->
    out [Tq, Hq, D] bf16, r [Hq, Tq] fp32. Outputs and result: the dense record's."""

    @staticmethod
    def validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                 causal=False, sm_scale=None, eps=DEFAULT_EPS) -> Call:
        spec = validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, sm_scale, eps)
        return PackedForward.bind(spec, q, k, v, cu_seqlens_q, cu_seqlens_k)

    @staticmethod
    def bind(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, *_) -> Call:
        """The call of arguments `spec` was validated from (no checks)."""
        return Call(spec, q.device, {"q": q, "k": k, "v": v, "cu_q": cu_seqlens_q,
                                     "cu_k": cu_seqlens_k})

    @staticmethod
    def allocate(call: Call, given: dict) -> dict:
        s, dev = call.spec, call.device
        return {"out": output(given.get("out"), "out", (s.N, s.Hq, s.D), torch.bfloat16, dev),
                "r": output(given.get("r"), "r", (s.Hq, s.N), torch.float32, dev)}

    @staticmethod
    def kernel_args(call: Call, outs: dict):
        t = call.tensors
        return forward_args(call, outs, _seqs(t["cu_q"], t["cu_k"]), _batch_of_one)


class PackedBackward(Backward):
    """The backward's record for packed sequences: (dout, dr, q, k, v, out, r, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sm_scale, eps) -> (dq, dk, dv) bf16.
    Outputs, allocation and result: the dense record's (`passes.Backward`)."""

    @staticmethod
    def validate(dout, dr, q, k, v, out, r, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                 max_seqlen_k=None, causal=False, sm_scale=None, eps=DEFAULT_EPS) -> Call:
        spec = validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, sm_scale, eps)
        validate_saved(dout, dr, out, r, (spec.N, spec.Hq, spec.D), (spec.Hq, spec.N),
                       "[Tq, Hq, D]", "[Hq, Tq]", q.device)
        return PackedBackward.bind(spec, dout, dr, q, k, v, out, r, cu_seqlens_q, cu_seqlens_k)

    @staticmethod
    def bind(spec, dout, dr, q, k, v, out, r, cu_seqlens_q, cu_seqlens_k, *_) -> Call:
        """The call of arguments `spec` was validated from (no checks)."""
        return Call(spec, q.device, {"q": q, "k": k, "v": v, "out": out, "r": r, "dout": dout,
                                     "dr": dr, "cu_q": cu_seqlens_q, "cu_k": cu_seqlens_k})

    @staticmethod
    def kernel_args(call: Call, outs: dict):
        t = call.tensors
        return backward_args(call, outs, _seqs(t["cu_q"], t["cu_k"]), _batch_of_one)


# ---- the CPU path: the fp64 reference, sequence by sequence --------------------------------

def _pairs(cu_q: Tensor, cu_k: Tensor) -> list[tuple[int, int, int, int]]:
    """(q start, q end, k start, k end) of each sequence."""
    a, b = cu_q.tolist(), cu_k.tolist()
    return [(a[i], a[i + 1], b[i], b[i + 1]) for i in range(len(a) - 1)]


def _reference(q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, eps):
    """(out [Tq, Hq, D], r [Hq, Tq]) in fp64: `reference` on each sequence alone."""
    out = q.new_zeros(q.shape, dtype=torch.float64)
    r = q.new_zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    for q0, q1, k0, k1 in _pairs(cu_q, cu_k):
        if q1 > q0:
            o, rr = reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, sm_scale,
                              eps)
            out[q0:q1], r[:, q0:q1] = o[0], rr[0]
    return out, r


def _reference_backward(grads, x, params):
    """(dq, dk, dv) in fp64: `reference_backward` on each sequence alone."""
    (dout, dr), (q, k, v) = grads, x
    cu_q, cu_k, _, _, causal, sm_scale, eps = params
    dq, dk, dv = (t.new_zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    if dout is None:
        dout = torch.zeros_like(q)
    for q0, q1, k0, k1 in _pairs(cu_q, cu_k):
        if q1 == q0 or k1 == k0:
            continue
        g = reference_backward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                               dout[None, q0:q1], None if dr is None else dr[None, :, q0:q1],
                               causal, sm_scale, eps)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (t[0] for t in g)
    return dq, dk, dv


def _fake(q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, eps):
    """out [Tq, Hq, D] in q's dtype, r [Hq, Tq] fp32 (fp64 for fp64 inputs)."""
    T, Hq, D = q.shape
    return q.new_empty(T, Hq, D), q.new_empty(Hq, T, dtype=torch.promote_types(q.dtype,
                                                                               torch.float32))


OP = make_op(OpDecl(
    family=FAMILY, name="spherical_varlen", inputs=("q", "k", "v"),
    params=(("cu_seqlens_q", "Tensor"), ("cu_seqlens_k", "Tensor"), ("max_seqlen_q", "int?"),
            ("max_seqlen_k", "int?"), ("causal", "bool"), ("sm_scale", "float"), ("eps", "float")),
    outputs=("out", "r"), saved=("out", "r"), fake=_fake, cpu_forward=_reference,
    cpu_backward=_reference_backward, passes=(PackedForward, PackedBackward)))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     *, causal: bool = False, sm_scale=None, eps: float = DEFAULT_EPS,
                     variant: str = "auto", bwd_variant: str = "auto",
                     deterministic: bool = False):
    """Differentiable spherical attention over packed sequences (the module docstring).

    q [Tq, Hq, D], k and v [Tk, Hk, D]: the sequences concatenated; cu_seqlens_q,
    cu_seqlens_k int32 [n + 1], their offsets (0 first, Tq / Tk last, non-decreasing; the same
    tensor twice for self-attention); max_seqlen_q, max_seqlen_k: the longest sequence's
    lengths (FlashAttention's arguments: checked when given, never needed: a launch's grid
    comes from Tq, Tk and n). causal: query i of a sequence sees its keys j <= i (equal lengths
    per sequence). Returns out [Tq, Hq, D] (the inputs' dtype) and r [Hq, Tq] (each row's score
    norm; fp32, fp64 for fp64 inputs), both differentiable. Every other argument as
    `altattn.spherical.attention`'s. The offsets are read on the host to check them (skipped
    while torch.compile traces or a CUDA graph is captured)."""
    check_variant_names(variant, bwd_variant, deterministic)
    spec = validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal, sm_scale, eps, cpu_reference=True)
    return OP(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              spec.causal, spec.sm_scale, spec.eps, variant=variant, bwd_variant=bwd_variant,
              deterministic=deterministic)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                   *, causal: bool = False, sm_scale=None, eps: float = DEFAULT_EPS,
                   variant: str = "auto", out=None, r=None):
    """The packed forward on the GPU, no autograd: (out [Tq, Hq, D] bf16, r [Hq, Tq] fp32),
    into `out` / `r` when given. Arguments as `attention_varlen`'s."""
    call = PackedForward.validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, causal, sm_scale, eps)
    return run_call(FAMILY, "fwd", call, variant, outputs={"out": out, "r": r},
                    io=PackedForward)


def backward_varlen(dout, dr, q, k, v, out, r, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                    max_seqlen_k=None, *, causal: bool = False, sm_scale=None,
                    eps: float = DEFAULT_EPS, variant: str = "auto",
                    deterministic: bool = False):
    """The packed backward on the GPU: (dq, dk, dv) bf16, the inputs' shapes, given dout
    [Tq, Hq, D], dr [Hq, Tq] (or None: r unused) and the forward's out and r."""
    call = PackedBackward.validate(dout, dr, q, k, v, out, r, cu_seqlens_q, cu_seqlens_k,
                                   max_seqlen_q, max_seqlen_k, causal, sm_scale, eps)
    return run_call(FAMILY, "bwd", call, variant, deterministic, io=PackedBackward)


__all__ = ["attention_varlen", "forward_varlen", "backward_varlen", "validate_packed",
           "PackedForward", "PackedBackward"]

"""Triple attention over packed sequences: `attention_varlen(q1, q2, k1, k2, v, cu_seqlens,
max_seqlen, ...)`, FlashAttention's varlen convention (`flash_attn_varlen_func`).

Sequences are concatenated along dim 0 (q1, q2, k1, k2 [T, H, Dq], v [T, H, Dv]); sequence s holds
tokens cu_seqlens[s] .. cu_seqlens[s + 1] - 1 and is its own triple-attention problem: its own
state (one per sequence, returned as [n, H, Dq, Dv, Dq]), its own scale (scale=None: 1/its
length), its own initial state. No state crosses a sequence's start.

Two `torch.library.custom_op`s (`altattn::triple_varlen_fwd` / `_bwd`) joined by
`register_autograd`: differentiable (the five inputs and initial_state), `torch.compile`-able.
On CUDA the kernels run all sequences in one pass each (kernels_triton/triple/varlen.py: splits,
tiles and segment sums from device-side maps, no host read of cu_seqlens); on the CPU the fp64
reference runs sequence by sequence.
"""
from __future__ import annotations

import weakref

import torch

from .. import launcher
from ..checks import check_bool, check_group, dense_aligned, validate_aux
from ..packing import check_cu_seqlens, values_checkable
from .ops import check_variant_names
from .reference import reference, reference_backward
from .spec import (
    NAMES,
    REFERENCE_DTYPES,
    STATE_LAYOUT,
    SUPPORTED_DTYPES,
    TripleSpec,
    check_dims,
    check_initial_state,
    check_scale,
)

Tensor = torch.Tensor
# the kernels each registered variant of the dense passes runs (its `impl`)
IMPLS = {"tlx": "kernels_tlx.triple.contractions", "triton": "kernels_triton.triple.host"}
PACKED = "[T, H, Dq] ([T, H, Dv] for v)"


def validate_packed(q1, q2, k1, k2, v, cu_seqlens, scale=None, causal=False, initial_state=None,
                    cpu_reference: bool = False, max_seqlen=None,
                    values: bool = False) -> tuple[TripleSpec, int]:
    """The checks of `spec.validate` for packed tensors (q1, q2, k1, k2 [T, H, Dq], v
    [T, H, Dv]), then cu_seqlens' (`check_offsets`; its values only with values=True), then
    initial_state's [n, H, Dq, Dv, Dq]. Returns the B = 1 spec of the packed tokens (scale 1.0
    where scale is None: each sequence's own 1/length) and n."""
    tensors = (q1, q2, k1, k2, v)
    on_cpu = cpu_reference and isinstance(q1, Tensor) and q1.device.type == "cpu"
    check_group(NAMES, tensors, 3, PACKED, REFERENCE_DTYPES if on_cpu else SUPPORTED_DTYPES,
                SUPPORTED_DTYPES)
    causal = check_bool("causal", causal)
    T, H, Dq = q1.shape
    for name, t in zip(NAMES[1:4], tensors[1:4]):
        if tuple(t.shape) != tuple(q1.shape):
            raise ValueError(f"{name} must have q1's shape {tuple(q1.shape)} [T, H, Dq], got "
                             f"{tuple(t.shape)}")
    if tuple(v.shape[:2]) != (T, H):
        raise ValueError(f"v must be [T, H, Dv] with q1's T, H = {(T, H)}, got shape "
                         f"{tuple(v.shape)}")
    Dv = v.shape[2]
    check_dims(Dq, Dv, "dim 2 of q1, q2, k1, k2", "dim 2 of v")
    check_offsets(cu_seqlens, T, q1.device, max_seqlen, values)
    n = cu_seqlens.shape[0] - 1
    check_initial_state(initial_state, (n, H, Dq, Dv, Dq), q1.device, on_cpu)
    c = check_scale(scale, 1, initial_state is not None)
    return TripleSpec(1, T, H, Dq, Dv, causal, 1.0 if scale is None else c), n


# cu_seqlens tensors whose values were checked (by id, with a weak reference, the version and
# T then, and the longest length): a model's layers pass one tensor, read on the host (a sync)
# once, not once a layer
_CHECKED: dict[int, tuple] = {}


def check_offsets(cu_seqlens, T: int, device, max_seqlen=None, values: bool = True) -> None:
    """packing.check_cu_seqlens: its kind always; with values=True its values on the host (a
    sync; skipped while torch.compile traces or a CUDA graph is captured), read once per tensor
    and in-place version."""
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)
                                   or max_seqlen < 0):
        raise TypeError(f"max_seqlen must be an int >= 0 (or None), got {max_seqlen!r}")
    check_cu_seqlens(cu_seqlens, T, device, max_seqlen, values=False)
    if not values or not values_checkable(cu_seqlens):
        return
    key = (cu_seqlens._version, T)
    seen = _CHECKED.get(id(cu_seqlens))
    if (seen is not None and seen[0]() is cu_seqlens and seen[1] == key
            and (max_seqlen is None or max_seqlen >= seen[2])):
        return
    cu = check_cu_seqlens(cu_seqlens, T, device, max_seqlen)
    if cu is not None:
        if len(_CHECKED) >= 64:  # forget the tensors that are gone
            for k in [k for k, v in _CHECKED.items() if v[0]() is None]:
                del _CHECKED[k]
            if len(_CHECKED) >= 64:
                _CHECKED.clear()
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        _CHECKED[id(cu_seqlens)] = (weakref.ref(cu_seqlens), key, longest)


def _impl(spec, variant: str, device, pass_: str, deterministic: bool = False) -> str:
    return IMPLS[launcher.choose(spec, variant, device, pass_, deterministic,
                                 family="triple").name]


def _plan(spec, n: int, impl: str, device):
    from kernels_triton.triple import varlen as kernels
    return kernels.plan(spec.N, n, spec.H, spec.Dq, spec.Dv, spec.causal, impl,
                        device.index if device.index is not None else torch.cuda.current_device())


def _nothing_to_launch(spec, n: int) -> bool:
    return spec.N * spec.H * n == 0


def forward_varlen(q1, q2, k1, k2, v, cu_seqlens, *, scale=None, causal: bool = False,
                   initial_state=None, variant: str = "auto"):
    """The packed forward on the GPU, no autograd: (out [T, H, Dv] bf16, state [n, H, Dq, Dv,
    Dq] fp32). cu_seqlens is not read on the host (attention_varlen checks it)."""
    spec, n = validate_packed(q1, q2, k1, k2, v, cu_seqlens, scale, causal, initial_state)
    T, H, Dv = spec.N, spec.H, spec.Dv
    init = None if initial_state is None else dense_aligned(initial_state.float())
    if _nothing_to_launch(spec, n):
        state = (init.clone() if init is not None else
                 q1.new_zeros((n, H, spec.Dq, Dv, spec.Dq), dtype=torch.float32))
        return q1.new_empty((T, H, Dv)), state
    plan = _plan(spec, n, _impl(spec, variant, q1.device, "fwd"), q1.device)
    x = [dense_aligned(t)[None] for t in (q1, q2, k1, k2, v)]
    with torch.cuda.device(q1.device):
        maps = plan.maps(cu_seqlens, None if scale is None else spec.scale)
        out, state = plan.forward(*x, maps, init)
    return out[0], state


def backward_varlen(dout, dstate, q1, q2, k1, k2, v, state, cu_seqlens, *, scale=None,
                    causal: bool = False, initial_state=None, variant: str = "auto",
                    deterministic: bool = False):
    """The packed backward on the GPU: (dq1, dq2, dk1, dk2, dv) bf16 of the inputs' shapes, and
    with an initial_state its gradient [n, H, Dq, Dv, Dq] fp32 as a sixth; dout [T, H, Dv],
    dstate [n, H, Dq, Dv, Dq] or None, state the forward's."""
    spec, n = validate_packed(q1, q2, k1, k2, v, cu_seqlens, scale, causal, initial_state)
    shape = (n, spec.H, spec.Dq, spec.Dv, spec.Dq)
    for name, t, want, layout in (("dout", dout, (spec.N, spec.H, spec.Dv), "[T, H, Dv]"),
                                  ("state", state, shape, STATE_LAYOUT)) + (
            () if dstate is None else (("dstate", dstate, shape, STATE_LAYOUT),)):
        validate_aux(name, t, want, layout, q1.device, ", ".join(NAMES))
    f32 = [None if t is None else dense_aligned(t.float()) for t in (dstate, initial_state)]
    if _nothing_to_launch(spec, n):
        grads = tuple(torch.zeros_like(t, dtype=torch.bfloat16) for t in (q1, q2, k1, k2, v))
        if initial_state is None:
            return grads
        return (*grads, f32[0].clone() if f32[0] is not None else q1.new_zeros(
            shape, dtype=torch.float32))
    plan = _plan(spec, n, _impl(spec, variant, q1.device, "bwd", deterministic), q1.device)
    x = [dense_aligned(t)[None] for t in (q1, q2, k1, k2, v)]
    with torch.cuda.device(q1.device):
        maps = plan.maps(cu_seqlens, None if scale is None else spec.scale)
        grads = plan.backward(*x, maps, dense_aligned(state.float()),
                              dense_aligned(dout.to(torch.bfloat16))[None], *f32)
    return (*(g[0] for g in grads[:5]), *grads[5:])


# ---- the ops -------------------------------------------------------------------------------

def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _cpu_forward(q1, q2, k1, k2, v, cu_seqlens, initial_state, scale, causal):
    """The fp64 reference, sequence by sequence, in the inputs' dtype (state fp32 or fp64)."""
    cu = cu_seqlens.tolist()
    inits = [None if initial_state is None else initial_state[s:s + 1]
             for s in range(len(cu) - 1)]
    outs = [reference(*(t[a:b][None] for t in (q1, q2, k1, k2, v)), scale, causal, i0)
            for a, b, i0 in zip(cu, cu[1:], inits)]
    out = torch.cat([o[0] for o, _ in outs]) if outs else q1.new_empty(0, *v.shape[1:])
    T, H, Dq = q1.shape
    state = (torch.cat([s for _, s in outs]) if outs
             else q1.new_empty(0, H, Dq, v.shape[2], Dq))
    return out.to(q1.dtype).contiguous(), state.to(_state_dtype(q1)).contiguous()


_SIG = ("Tensor q1, Tensor q2, Tensor k1, Tensor k2, Tensor v, Tensor cu_seqlens, "
        "Tensor? initial_state, float? scale, bool causal")


def _fwd_impl(q1, q2, k1, k2, v, cu_seqlens, initial_state, scale, causal, variant,
              bwd_variant, deterministic):
    if q1.device.type == "cpu":
        return _cpu_forward(q1, q2, k1, k2, v, cu_seqlens, initial_state, scale, causal)
    out, state = forward_varlen(q1, q2, k1, k2, v, cu_seqlens, scale=scale, causal=causal,
                                initial_state=initial_state, variant=variant)
    return out.to(q1.dtype), state


_fwd = torch.library.custom_op(
    "altattn::triple_varlen_fwd", _fwd_impl, mutates_args=(),
    schema=f"({_SIG}, str variant, str bwd_variant, bool deterministic) -> (Tensor, Tensor)")


@_fwd.register_fake
def _(q1, q2, k1, k2, v, cu_seqlens, initial_state, scale, causal, variant, bwd_variant,
      deterministic):
    T, H, Dq = q1.shape
    n = cu_seqlens.shape[0] - 1
    return (q1.new_empty(T, H, v.shape[2]),
            q1.new_empty(n, H, Dq, v.shape[2], Dq, dtype=_state_dtype(q1)))


def _cpu_backward(dout, dstate, q1, q2, k1, k2, v, cu_seqlens, initial_state, scale, causal):
    """The fp64 reference's gradients, sequence by sequence, in the inputs' dtypes."""
    cu = cu_seqlens.tolist()
    parts = [reference_backward(*(t[a:b][None] for t in (q1, q2, k1, k2, v)), dout[a:b][None],
                                None if dstate is None else dstate[s:s + 1], scale, causal,
                                None if initial_state is None else initial_state[s:s + 1])
             for s, (a, b) in enumerate(zip(cu, cu[1:]))]
    grads = [torch.cat([p[i][0] for p in parts]).to(t.dtype).contiguous() if parts
             else torch.zeros_like(t) for i, t in enumerate((q1, q2, k1, k2, v))]
    if initial_state is None:
        return (*grads, None)
    dinit = torch.cat([p[5] for p in parts]) if parts else torch.zeros_like(initial_state)
    return (*grads, dinit.to(initial_state.dtype).contiguous())


def _bwd_impl(dout, dstate, state, q1, q2, k1, k2, v, cu_seqlens, initial_state, scale, causal,
              variant, deterministic):
    if q1.device.type == "cpu":
        return _cpu_backward(dout, dstate, q1, q2, k1, k2, v, cu_seqlens, initial_state, scale,
                             causal)
    grads = backward_varlen(dout, dstate, q1, q2, k1, k2, v, state, cu_seqlens, scale=scale,
                            causal=causal, initial_state=initial_state, variant=variant,
                            deterministic=deterministic)
    dx = tuple(g.to(t.dtype) for g, t in zip(grads, (q1, q2, k1, k2, v)))
    return (*dx, grads[5] if len(grads) > 5 else None)


_bwd = torch.library.custom_op(
    "altattn::triple_varlen_bwd", _bwd_impl, mutates_args=(),
    schema=f"(Tensor dout, Tensor? dstate, Tensor state, {_SIG}, str variant, "
           "bool deterministic) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor?)")


@_bwd.register_fake
def _(dout, dstate, state, q1, q2, k1, k2, v, cu_seqlens, initial_state, scale, causal,
      variant, deterministic):
    dense = torch.contiguous_format
    return (*(torch.empty_like(t, memory_format=dense) for t in (q1, q2, k1, k2, v)),
            None if initial_state is None else torch.empty_like(initial_state,
                                                                memory_format=dense))


def _setup_context(ctx, inputs, output):
    q1, q2, k1, k2, v, cu_seqlens, initial_state, scale, causal, _, bwd_variant, det = inputs
    ctx.save_for_backward(q1, q2, k1, k2, v, cu_seqlens, initial_state, output[1])
    ctx.args = (scale, causal, bwd_variant, det)


def _backward(ctx, dout, dstate):
    q1, q2, k1, k2, v, cu_seqlens, initial_state, state = ctx.saved_tensors
    scale, causal, bwd_variant, det = ctx.args
    if dout is None:
        dout = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    *dx, dinit = torch.ops.altattn.triple_varlen_bwd(dout, dstate, state, q1, q2, k1, k2, v,
                                                     cu_seqlens, initial_state, scale, causal,
                                                     bwd_variant, det)
    return (*dx, None, dinit, None, None, None, None, None)


_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_varlen(q1, q2, k1, k2, v, cu_seqlens, max_seqlen, *, scale=None,
                     causal: bool = False, initial_state=None, variant: str = "auto",
                     bwd_variant: str = "auto", deterministic: bool = False):
    """Differentiable triple attention over packed sequences.

    q1, q2, k1, k2 [T, H, Dq], v [T, H, Dv]: the sequences concatenated; cu_seqlens int32
    [n + 1], their offsets (0 first, T last; empty and one-token sequences allowed); max_seqlen,
    the longest one's length (FlashAttention's argument: checked, not needed). Each sequence is
    one `altattn.triple.attention` call: scale=None is each sequence's own 1/length;
    initial_state [n, H, Dq, Dv, Dq] (fp32; fp64 too on the CPU) starts each sequence's sums
    (scale must then be given); causal: token n reads the tokens m <= n of its sequence.
    Returns out [T, H, Dv] (the inputs' dtype) and state [n, H, Dq, Dv, Dq] (each sequence's
    final state, its initial state for an empty one; fp32, fp64 for fp64 inputs), both
    differentiable. variant, bwd_variant, deterministic as `attention`'s.
    cu_seqlens is read on the host once per tensor (and in-place version) to check it: a sync,
    skipped while torch.compile traces or a CUDA graph is captured; the kernels never read it
    on the host."""
    check_variant_names(variant, bwd_variant, deterministic)
    spec, _ = validate_packed(q1, q2, k1, k2, v, cu_seqlens, scale, causal, initial_state,
                              cpu_reference=True, max_seqlen=max_seqlen, values=True)
    scale = None if scale is None else spec.scale
    return torch.ops.altattn.triple_varlen_fwd(q1, q2, k1, k2, v, cu_seqlens, initial_state,
                                               scale, spec.causal, variant, bwd_variant,
                                               deterministic)

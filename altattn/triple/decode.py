"""Triple attention's decoding step: T new tokens of each sequence read and advance a state in
place (flash-linear-attention's recurrent step, FlashAttention's in-place cache convention).

    out = step(q1, q2, k1, k2, v, state, *, scale)

q1, q2, k1, k2 [B, T, H, Dq], v [B, T, H, Dv]; state [B, H, Dq, Dv, Dq], the state of the tokens
before (a causal `triple_attention` call's returned state, or an earlier step's; already scaled).
For each token t in order: state += scale * K1[t] (x) V[t] (x) K2[t], then out[t, j] =
sum_{i,k} Q1[t, i] state[i, j, k] Q2[t, k]. So steps of any sizes give the rows and the final
state of one causal call with that initial_state, and a sequence's memory is its state
(Dq^2 Dv H fp32) whatever its length. Returns out [B, T, H, Dv] in the queries' dtype. The
state's version counter moves (autograd refuses a backward through a graph that saved it).
CUDA: bf16 inputs, the state fp32 and contiguous; one pass of kernels_triton/triple/step.py over
the state (no host sync, no allocation but out: a step captures in a CUDA graph). CPU: the same
math in fp64 (any dtype the reference takes; the state fp32 or fp64). Forward only.
"""
from __future__ import annotations

import torch

from ..checks import dense_aligned
from ..launcher import on_device
from .spec import check_initial_state, validate


def step(q1, q2, k1, k2, v, state, *, scale) -> torch.Tensor:
    """The module docstring's step: state advanced in place by the T tokens, their out
    returned. Bad input raises TypeError / ValueError naming the argument before any work."""
    if scale is None:
        raise ValueError("step needs scale explicitly (the one the state was built with): a "
                         "state holds earlier tokens, so no 1/N of this call's tokens is its "
                         "mean")
    spec = validate(q1, q2, k1, k2, v, scale, True, None, cpu_reference=True)
    on_cpu = q1.device.type == "cpu"
    shape = (spec.B, spec.H, spec.Dq, spec.Dv, spec.Dq)
    if state is None:
        raise TypeError("state must be a torch.Tensor (the state to advance), got None")
    check_initial_state(state, shape, q1.device, on_cpu, name="state")
    if not state.is_contiguous() or (not on_cpu and state.data_ptr() % 16):
        raise ValueError("state must be contiguous and (on the GPU) start 16-byte aligned: "
                         "step updates it in place, so it cannot be copied into shape")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q1, q2, k1, k2, v, state)):
        raise ValueError("altattn.triple.step is the inference path and its inputs require "
                         "grad: call it under torch.no_grad() or with detached tensors (the "
                         "differentiable path is triple_attention with initial_state)")
    if on_cpu:
        return _step_reference(q1, q2, k1, k2, v, state, spec.scale)
    from kernels_triton.triple.step import prepare_step
    out = torch.empty(spec.B, spec.N, spec.H, spec.Dv, dtype=q1.dtype, device=q1.device)
    if spec.N:
        device = q1.device if q1.device.index is not None else torch.device(
            "cuda", torch.cuda.current_device())
        run = prepare_step(spec.B, spec.N, spec.H, spec.Dq, spec.Dv, device.index)
        on_device(device, run, *[dense_aligned(t) for t in (q1, q2, k1, k2, v)], state, out,
                  spec.scale)
        # written by the kernel, behind autograd's back: a graph that saved state (a
        # differentiable call's returned state) must see it changed, as copy_ on the CPU shows
        torch.autograd.graph.increment_version(state)
    return out


def _step_reference(q1, q2, k1, k2, v, state, c: float) -> torch.Tensor:
    """The step in fp64, token by token (CPU); state written back in its dtype."""
    S = state.double()
    outs = []
    for t in range(q1.shape[1]):
        x1, x2, y1, y2, vv = (x[:, t].double() for x in (k1, k2, q1, q2, v))
        S = S + c * torch.einsum("bhi,bhj,bhk->bhijk", x1, vv, x2)
        outs.append(torch.einsum("bhi,bhijk,bhk->bhj", y1, S, y2))
    state.copy_(S)
    if not outs:
        return q1.new_empty(*q1.shape[:3], v.shape[3])
    return torch.stack(outs, 1).to(q1.dtype)


__all__ = ["step"]

"""The one entry point: validate -> problem spec -> pick the variant -> launch -> (out, lse)."""
from __future__ import annotations

import torch

from . import registry
from .spec import ProblemSpec, check_device, validate


def _unsupported(v: registry.Variant, spec: ProblemSpec) -> str | None:
    return v.load().supports(spec)


def pick(spec: ProblemSpec, variant: str, hopper: bool = True) -> registry.Variant:
    """Resolve `variant` ("auto" or a name) to a registry entry that can run `spec`, or raise.
    `hopper=False` makes "auto" skip the sm_90-only variants."""
    if variant != "auto":
        v = registry.get(variant)
        why = _unsupported(v, spec)
        if why is not None:
            able = [o.name for o in registry.all_variants() if o.name != v.name
                    and _unsupported(o, spec) is None]
            hint = f"; variants that can: {', '.join(able)}" if able else ""
            raise ValueError(f"variant {variant!r} cannot take {spec.short()}: {why}{hint}")
        return v
    reasons = []
    for v in sorted(registry.all_variants(), key=lambda v: -v.rank_for(spec)):
        if v.needs_hopper and not hopper:
            reasons.append(f"{v.name}: needs sm_90")
            continue
        why = _unsupported(v, spec)
        if why is None:
            return v
        reasons.append(f"{v.name}: {why}")
    raise ValueError(f"no variant can take {spec.short()}: " + "; ".join(reasons))


def _shape_error(spec: ProblemSpec) -> ValueError | None:
    """What "auto" says about `spec` on an sm_90 GPU: None when some variant takes it there."""
    try:
        pick(spec, "auto", True)
    except ValueError as e:
        return e
    return None


def _dense_aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself when contiguous with a 16-byte aligned start (TMA needs both), else a copy."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def forward(q, k1, k2, v1, v2, w1, w2, *, variant: str = "auto", sm_scale=None):
    """2-simplicial attention forward.

    q: [B, N, Hq, D], k1, k2, v1, v2: [B, N, Hk, D], bfloat16 CUDA tensors; w1, w2 >= 1 window sizes
    (w1 > w2 allowed). Non-contiguous inputs, or ones whose start is not 16-byte aligned, are
    copied first (correct, costs a copy).
    Returns out [B, N, Hq, D] bfloat16 and lse [B, Hq, N] float32 (natural log). Forward only:
    inputs that require grad (with grad mode on) are refused rather than silently cut off.
    """
    if not isinstance(variant, str):
        raise TypeError(f"variant must be a str, got {type(variant).__name__}")
    spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k1, k2, v1, v2)):
        raise ValueError("simplicial_attn.forward is forward-only (no backward yet) and the inputs "
                         "require grad: call it under torch.no_grad() or pass detached tensors")
    on_gpu = q.device.type == "cuda"
    cap = torch.cuda.get_device_capability(q.device) if on_gpu else None
    hopper = cap is not None and cap[0] == 9
    try:
        v = pick(spec, variant, hopper or not on_gpu)  # shape errors first, on any device
    except ValueError:
        if variant != "auto" or hopper or not on_gpu:
            raise
        err = _shape_error(spec)  # on a GPU other than Hopper: is the shape or the GPU the problem?
        raise err or RuntimeError(f"no variant runs on this GPU (sm_{cap[0]}{cap[1]}): the "
                                  f"variants that take {spec.short()} need a Hopper GPU "
                                  "(sm_90: TMA, wgmma)") from None
    check_device(q, needs_hopper=v.needs_hopper, variant=v.name)
    out = torch.empty(spec.B, spec.N, spec.Hq, spec.D, dtype=q.dtype, device=q.device)
    lse = torch.empty(spec.B, spec.Hq, spec.N, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if spec.swapped:
        k1, v1, k2, v2 = k2, v2, k1, v1
    q, k1, k2, v1, v2 = (_dense_aligned(t) for t in (q, k1, k2, v1, v2))
    with torch.cuda.device(q.device):
        v.load().launch(spec, q, k1, k2, v1, v2, out, lse)
    return out, lse

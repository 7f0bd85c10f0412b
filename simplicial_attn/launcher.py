"""The one way a variant runs: validate -> problem spec -> pick the variant -> check the device ->
outputs, pair swap, dense inputs -> launch -> (out, lse).

`forward` (the public API), the benchmark, the trace tool and the GPU tests all call `run`;
`select` is its pick-and-device-check step alone, for callers that must know before launching
whether a variant can run (a benchmark row's note, a command line's error).
"""
from __future__ import annotations

import torch

from . import registry
from .spec import ProblemSpec, check_device, validate


def pick(spec: ProblemSpec, variant: str, hopper: bool = True,
         pass_: str = "fwd", deterministic: bool = False) -> registry.Variant:
    """Resolve `variant` ("auto" or a name of pass `pass_`) to a registry entry that can run
    `spec`, or raise ValueError (NotImplementedError when no variant of the pass computes
    `spec.form`). `hopper=False` makes "auto" skip the sm_90-only variants; `deterministic=True`
    makes it skip the variants that are not bitwise repeatable, and refuses one named."""
    v = registry.get(variant, pass_) if variant != "auto" else None  # an unknown name first
    if v is not None and deterministic:
        registry.refuse_nondeterministic(v)
    if not any(spec.form in o.forms for o in registry.all_variants(pass_)):
        raise NotImplementedError(
            f"no {pass_} kernel computes form={spec.form!r} yet; on CPU tensors "
            f"simplicial_attn.attention and reference compute it (the fp64 reference)")
    if v is not None:
        why = v.cannot_take(spec)
        if why is not None:
            able = [o.name for o in registry.all_variants(pass_) if o.name != v.name
                    and o.cannot_take(spec) is None]
            hint = f"; variants that can: {', '.join(able)}" if able else ""
            raise ValueError(f"variant {variant!r} cannot take {spec.short()}: {why}{hint}")
        return v
    reasons = []
    for v in sorted(registry.all_variants(pass_), key=lambda v: -v.rank_for(spec)):
        if v.needs_hopper and not hopper:
            reasons.append(f"{v.name}: needs sm_90")
            continue
        if deterministic and not v.deterministic:
            reasons.append(f"{v.name}: not deterministic")
            continue
        why = v.cannot_take(spec)
        if why is None:
            return v
        reasons.append(f"{v.name}: {why}")
    raise ValueError(f"no variant can take {spec.short()}: " + "; ".join(reasons))


def _shape_error(spec: ProblemSpec, pass_: str) -> ValueError | None:
    """What "auto" says about `spec` on an sm_90 GPU: None when some variant takes it there."""
    try:
        pick(spec, "auto", True, pass_)
    except ValueError as e:
        return e
    return None


def select(spec: ProblemSpec, variant: str, device: torch.device | str,
           pass_: str = "fwd", deterministic: bool = False) -> registry.Variant:
    """The variant that runs `spec` on `device`: `pick` (shape errors first, on any device; on a
    GPU other than sm_90 "auto" skips the Hopper-only variants; `deterministic` as `pick`'s),
    then the device check (`spec.check_device`). Raises ValueError or RuntimeError as `forward`
    does."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    cap = torch.cuda.get_device_capability(device) if on_gpu else None
    hopper = cap is not None and cap[0] == 9
    try:
        v = pick(spec, variant, hopper or not on_gpu, pass_, deterministic)  # shape errors first
    except ValueError:
        if variant != "auto" or hopper or not on_gpu:
            raise
        shape_error = _shape_error(spec, pass_)  # not Hopper: is the shape or the GPU the problem?
        raise shape_error or RuntimeError(
            f"no variant runs on this GPU (sm_{cap[0]}{cap[1]}): the variants that take "
            f"{spec.short()} need a Hopper GPU (sm_90: TMA, wgmma)") from None
    check_device(device, needs_hopper=v.needs_hopper, variant=v.name)
    return v


def _dense_aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself when contiguous with a 16-byte aligned start (TMA needs both), else a copy."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _output(given: torch.Tensor | None, name: str, shape: tuple, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """`given` when it is a contiguous tensor of this shape, dtype and device, else raise; a new
    tensor when None."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (tuple(given.shape) != shape or given.dtype != dtype or given.device != device
            or not given.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape} on "
                         f"{device}, got {given.dtype} {tuple(given.shape)} on {given.device}")
    return given


def run(q, k1, k2, v1, v2, w1, w2, *, variant: str = "auto", sm_scale=None,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
        profile: bool = False, form: str = "trilinear") -> tuple[torch.Tensor, torch.Tensor]:
    """Run a forward variant: the steps of `forward` (same arguments, checks and errors), plus
    out / lse to write into (contiguous [B, N, Hq, D] bf16 and [B, Hq, N] fp32 on the inputs'
    device; new tensors when None) and profile=True to run the kernel's Proton-scoped copy
    (profiling/trace_capture.py). Returns (out, lse)."""
    if not isinstance(variant, str):
        raise TypeError(f"variant must be a str, got {type(variant).__name__}")
    spec = validate(q, k1, k2, v1, v2, w1, w2, sm_scale, form=form)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k1, k2, v1, v2)):
        raise ValueError("simplicial_attn.forward is forward-only and the inputs require grad: use "
                         "simplicial_attn.attention (differentiable), or call forward under "
                         "torch.no_grad() or with detached tensors")
    v = select(spec, variant, q.device)
    out = _output(out, "out", (spec.B, spec.N, spec.Hq, spec.D), q.dtype, q.device)
    lse = _output(lse, "lse", (spec.B, spec.Hq, spec.N), torch.float32, q.device)
    if out.numel() == 0:
        return out, lse
    if spec.swapped:
        k1, v1, k2, v2 = k2, v2, k1, v1
    q, k1, k2, v1, v2 = (_dense_aligned(t) for t in (q, k1, k2, v1, v2))
    with torch.cuda.device(q.device):
        v.load().launch(spec, q, k1, k2, v1, v2, out, lse, profile=profile)
    return out, lse


def forward(q, k1, k2, v1, v2, w1, w2, *, variant: str = "auto", sm_scale=None,
            form: str = "trilinear"):
    """2-simplicial attention forward.

    q: [B, N, Hq, D], k1, k2, v1, v2: [B, N, Hk, D], bfloat16 CUDA tensors; w1, w2 >= 1 window sizes
    (w1 > w2 allowed). Non-contiguous inputs, or ones whose start is not 16-byte aligned, are
    copied first (correct, costs a copy).
    Returns out [B, N, Hq, D] bfloat16 and lse [B, Hq, N] float32 (natural log). Forward only:
    inputs that require grad (with grad mode on) are refused rather than silently cut off; use
    `simplicial_attn.attention` for gradients. form: "trilinear" or "det" (the determinant form,
    `simplicial_attn.reference` states it; `triton` computes it, and `tlx_pipelined_kv` and
    `tlx_pipelined_pingpong` at G = 128; "auto" takes the fastest measured of them, and a named
    variant that does not compute it refuses it with ValueError).
    """
    return run(q, k1, k2, v1, v2, w1, w2, variant=variant, sm_scale=sm_scale, form=form)

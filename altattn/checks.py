"""Checks every family shares: arguments that are no positive number, tensors of the wrong kind,
shape or device, devices no kernel runs on. Each raises TypeError or ValueError naming the
argument, before any device work (so CI exercises them on CPU tensors)."""
from __future__ import annotations

import functools
import math
import numbers
import operator

import torch


def positive_int(name: str, value, meaning: str = "") -> int:
    """`value` as an int >= 1, or TypeError (not an integer: float, bool, tensor, str, None) or
    ValueError (< 1) naming `name`. Python and numpy integers pass; bool and 0-dim tensors do not,
    though `operator.index` takes them: True is no window size, and a tensor would be read on
    the host at every call. `meaning` (e.g. "a window of at least one token") goes into the
    ValueError."""
    if isinstance(value, (bool, torch.Tensor)):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    try:
        value = operator.index(value)  # int and numpy integers
    except TypeError:
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} "
                        f"{value!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be a positive int{f' ({meaning})' if meaning else ''}, "
                         f"got {value}")
    return value


def positive_float(name: str, value, kind: str = "a float") -> float:
    """`value` as a finite float > 0, or TypeError (no real number: bool, str, tensor, None; the
    message says `name` must be `kind`) or ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite positive float, got {value}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive float, got {value}")
    return value


def check_floating(name: str, t) -> None:
    """TypeError naming `name` unless t is a floating-point torch.Tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_bool(name: str, value) -> bool:
    """`value` itself when it is a bool, else TypeError naming `name`."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def validate_aux(name: str, t, shape: tuple, layout: str, device: torch.device,
                 inputs: str) -> None:
    """Check a tensor that comes with the inputs (`inputs` names them, e.g. "q, k, v"): the
    forward's out and lse, the incoming gradients dout and dlse: a
    floating-point torch.Tensor of `shape` (`layout` names its dims, e.g. "[B, Hq, N]") on
    `device`. Its dtype is the caller's to cast; a shape that only has the right element count
    (dlse as [B, N, Hq]) is refused, since a reshape would take it silently."""
    check_floating(name, t)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} {layout}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but {inputs} are on {device}")


def check_device(device: torch.device, *, needs_hopper: bool, variant: str) -> None:
    """Raise a clear error when `device` (the tensors') is not a GPU this variant can run on."""
    if device.type != "cuda":
        raise ValueError(f"variant {variant!r} needs the tensors on a CUDA GPU "
                         f"({'sm_90 Hopper' if needs_hopper else 'sm_80 or newer'}); "
                         f"they are on {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if needs_hopper and major != 9:
        raise RuntimeError(f"variant {variant!r} needs a Hopper GPU (sm_90: TMA, wgmma); this GPU "
                           f"is sm_{major}{minor}")
    if major < 8:
        raise RuntimeError(f"variant {variant!r} needs sm_80 or newer; this GPU is "
                           f"sm_{major}{minor}")


def check_tensors(names, tensors) -> None:
    """TypeError naming the first of `tensors` that is no torch.Tensor (a numpy array, a list or
    None), before anything reads an attribute of it."""
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_str(name: str, value) -> str:
    """`value` itself when it is a str, else TypeError naming `name`."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def dense_aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself when contiguous with a 16-byte aligned start (TMA needs both), else a copy."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def output(given: torch.Tensor | None, name: str, shape: tuple, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """`given` when it is a contiguous tensor of this shape, dtype and device whose start is 16-byte
    aligned (the kernels store through TMA), else ValueError; a new tensor when None."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (tuple(given.shape) != shape or given.dtype != dtype or given.device != device
            or not given.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape} on "
                         f"{device}, got {given.dtype} {tuple(given.shape)} on {given.device}")
    if given.device.type != "meta" and given.data_ptr() % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary (the kernels store through "
                         f"TMA); its start is {given.data_ptr() % 16} bytes past one")
    return given


def check_group(names, tensors, rank: int, dims: str, dtypes: tuple, supported: tuple) -> None:
    """The checks a family's inputs share, in this order: torch.Tensors (TypeError), on one device,
    each of rank `rank` (`dims` names them, e.g. "[B, N, H, D]"), each of a dtype in `dtypes`
    (`supported`: the kernels' dtypes, named in the message when `dtypes` is them), all of one
    dtype. Devices come before dtypes: the dtypes a call may use depend on the device, so with q
    on one device and k on another, "k must be bf16" would blame the wrong thing."""
    check_tensors(names, tensors)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{', '.join(names)} must be on one device, got "
                         + ", ".join(f"{n}:{t.device}" for n, t in zip(names, tensors)))
    for name, t in zip(names, tensors):
        if t.dim() != rank:
            raise ValueError(f"{name} must have rank {rank} {dims}, got shape {tuple(t.shape)}")
    for name, t in zip(names, tensors):
        if t.dtype not in dtypes:
            if dtypes == supported:
                raise TypeError(f"{name} must be torch.bfloat16 (the only supported dtype), got "
                                f"{t.dtype}")
            raise TypeError(f"{name} must have a dtype in {dtypes}, got {t.dtype}")
    if len({t.dtype for t in tensors}) != 1:
        raise TypeError(f"{', '.join(names)} must share one dtype, got "
                        + ", ".join(f"{n}:{t.dtype}" for n, t in zip(names, tensors)))


def check_layer_input(x, dim: int) -> None:
    """A layer's input: a torch.Tensor [B, N, dim], else TypeError / ValueError naming x."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"x must be [B, N, dim] with dim = {dim}, got shape {tuple(x.shape)}")


def is_int(x) -> bool:
    """An int, not a bool (a decoding call's cache_seqlens may be one)."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_cache_seqlens(cache_seqlens, B: int, device: torch.device) -> None:
    """A decoding call's cache_seqlens: an int, or an int32 tensor [B] on `device` (TypeError /
    ValueError naming it). Its values are not read here."""
    if is_int(cache_seqlens):
        return
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor [B], got "
                        f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)}")
    if tuple(cache_seqlens.shape) != (B,) or cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens must be [B] = [{B}] on {device}, got "
                         f"{tuple(cache_seqlens.shape)} on {cache_seqlens.device}")


MAX_REMEMBERED = 4096  # specs a cached_validate keeps (a spec holds no tensor)


def _on_cuda(x) -> bool:
    return type(x) is torch.Tensor and x.is_cuda


def cached_validate(validate, remember=_on_cuda):
    """`validate` remembered for calls whose first argument `remember` takes (CUDA tensors):
    what it checks (types, ranks, shapes, dtypes, devices, the other arguments' types and
    values) is a function of each tensor's (shape, dtype, device) and the other arguments, so a
    call that matches an earlier valid one on all of them is valid and has its spec. Other calls
    (CPU: the reference path, the tests; tensor subclasses such as fake tensors) and any call
    with an unhashable argument always run `validate`, so every error is still raised, with its
    message, before any launch."""
    cache: dict = {}

    @functools.wraps(validate)
    def cached(*args, **kwargs):
        if not (args and remember(args[0])):
            return validate(*args, **kwargs)
        try:
            key = (*[(a.shape, a.dtype, a.device) if type(a) is torch.Tensor else (type(a), a)
                     for a in args], *[(k, type(v), v) for k, v in kwargs.items()])
            spec = cache.get(key)
        except TypeError:  # an unhashable argument: validate names what is wrong with it
            return validate(*args, **kwargs)
        if spec is None:
            spec = validate(*args, **kwargs)
            if len(cache) < MAX_REMEMBERED:
                cache[key] = spec
        return spec

    cached.cache_clear = cache.clear
    return cached

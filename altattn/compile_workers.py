"""`torch.compile` of a whole model on the GPU: inductor's compile workers must see the GPU.

Inductor compiles the Triton kernels it generates (a model's norms, MLPs, pointwise ops) in worker
processes. By default a sidecar process starts them, and it forks them after it has initialized
CUDA (to cache the device's properties). fbtriton's NVIDIA backend decides whether it is active by
calling `cuInit` in the calling process, which fails in a child forked after CUDA was initialized;
so every worker finds no active backend and the compile dies with `InductorError: RuntimeError:
Could not find an active GPU backend` (torch 2.11 with fbtriton 3.7.4; newer torch falls back to
its own device check in one of the two places that ask). `TORCHINDUCTOR_COMPILE_THREADS=1` avoids
it by compiling in the main process, serially.

`spawn_compile_workers()` makes the sidecar start its workers by spawn instead of fork: fresh
processes, in which `cuInit` works. It changes only the default of the sidecar pool's own `kind`
argument, which torch itself offers (SubprocKind.SPAWN); the sidecar's main module is torch's and
guarded, so spawning re-runs nothing of the user's script. `altattn` calls it on import when a CUDA
GPU is present and the installed Triton probes the driver that way. It does nothing when the user
chose a start method (TORCHINDUCTOR_WORKER_START) or set ALTATTN_FORK_COMPILE_WORKERS=1.
"""
from __future__ import annotations

import functools
import importlib
import os

OPT_OUT = "ALTATTN_FORK_COMPILE_WORKERS"


def needed() -> bool:
    """Whether compile workers forked after CUDA's initialization would find no GPU here: a CUDA
    GPU is present and Triton's NVIDIA backend probes the driver with cuInit in-process."""
    if os.environ.get(OPT_OUT) == "1":
        return False
    if os.environ.get("TORCHINDUCTOR_WORKER_START", "subprocess") != "subprocess":
        return False  # the user chose how workers start
    import torch
    if torch.version.cuda is None or not torch.cuda.is_available():
        return False
    try:
        driver = importlib.import_module("triton.backends.nvidia.driver")
    except ImportError:
        return False
    return hasattr(driver, "_cuda_driver_is_active")  # the in-process cuInit probe


def spawn_compile_workers() -> bool:
    """Make inductor's sidecar pool start its compile workers by spawn (see the module's
    docstring). Returns True when it changed the default now; False when it had already, or
    when this torch has no such pool (nothing to change)."""
    try:
        from torch._inductor.compile_worker import subproc_pool as sp
    except ImportError:
        return False
    pool = getattr(sp, "SubprocPool", None)
    kind = getattr(getattr(sp, "SubprocKind", None), "SPAWN", None)
    if pool is None or kind is None or getattr(pool, "_altattn_spawn", False):
        return False
    init = pool.__init__

    @functools.wraps(init)
    def __init__(self, nprocs, *args, **kwargs):
        if not args[1:2]:  # (pickler, kind, ...) positionally: kind not given that way
            kwargs.setdefault("kind", kind)
        init(self, nprocs, *args, **kwargs)

    pool.__init__ = __init__
    pool._altattn_spawn = True
    return True


def configure() -> bool:
    """On import of altattn: spawn_compile_workers() where needed(); True when it changed it."""
    try:
        return needed() and spawn_compile_workers()
    except Exception:  # never break an import over this; compiling then fails as before
        return False
